"""The tangent self-check for every kind of tangent: cross_block, mlp_width and the ResNet block.

Each kind's check compares one sample's tangent from the feature code with autograd through an
fp64 copy of what ``fs.grow`` would produce (the cross block, the widened MLP, the ResNet block
``z + F(z)``). Exact feature code passes (its error recorded in ``check_errors``); a deliberately
wrong piece (an activation, a gate, one new unit's row, a trailing ReLU) is refused at the first
step with the point and model_type named, and nothing is accumulated.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_architecture_table import batch_for, make
from test_growth_tangent import make_model, padded_batch, per_sample_loss, resnet_model

import fused_stats as fs
from fused_stats.api.growth import architecture, blocks, tangent
from fused_stats.api.growth.architecture import describe
from fused_stats.api.growth.tangent import GrowthTangent


def resnet_batch(side):
    g = torch.Generator().manual_seed(21)
    return torch.randn(4, 3, *side, generator=g, dtype=torch.float64), torch.randint(0, 10, (4,), generator=g)


def step(source, points, batch, loss):
    probe = fs.Probe(source.model, points=points, cross=source)
    probe.step(batch, loss)
    return probe


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_exact_kinds_pass_the_self_check(kind):
    """cross_block and mlp_width on LLaMA / GPT-2, and the basic ResNet block: each candidate
    checked once, relative error at fp64 rounding."""
    model, stack = make_model(kind, seed=2)
    points = [describe(model).input_point, f"{stack}.0"]
    batch = padded_batch(4, 6, seed=3)
    for protocol in (
        fs.GrowthProtocol(points, family="cross_block", width=5, seed=1),
        fs.GrowthProtocol(points, family="mlp_width", width=3, seed=1),
    ):
        source = GrowthTangent(protocol, model)
        step(source, points, batch, per_sample_loss)
        assert set(source.check_errors) == set(points)
        assert all(e <= 1e-12 for e in source.check_errors.values()), source.check_errors
    rmodel, rpoints, side, _ = resnet_model("basic")
    source = GrowthTangent(fs.GrowthProtocol(rpoints, seed=4), rmodel.eval())
    step(source, rpoints, resnet_batch(side), fs.classification_loss)
    assert set(source.check_errors) == set(rpoints)
    assert all(e <= 1e-12 for e in source.check_errors.values()), source.check_errors


def test_granite_width_and_cross_block_pass_with_their_scales():
    """Granite (residual_multiplier 0.37, embedding_multiplier 3): the widened MLP's output is
    scaled before the residual add, the cross block sits on the point's own output."""
    model = make("granite", seed=1)
    points = fs.growth_points(model)[:2]
    batch = batch_for("granite", 4, 5, seed=3)
    for protocol in (
        fs.GrowthProtocol(points, family="mlp_width", width=3, seed=1),
        fs.GrowthProtocol(points, family="cross_block", width=4, seed=1),
    ):
        source = GrowthTangent(protocol, model)
        step(source, points, batch, per_sample_loss)
        assert set(source.check_errors) == set(points)
        assert all(e <= 1e-12 for e in source.check_errors.values()), source.check_errors


def refused(source, point, batch, loss, model_type):
    probe = fs.Probe(source.model, points=[point], cross=source)
    with pytest.raises(
        fs.FusedStatsError, match=rf"self-check failed at '{point}' \(model_type '{model_type}'\)"
    ):
        probe.step(batch, loss)
    assert not probe.table


def test_cross_block_wrong_activation_is_caught(monkeypatch):
    model, stack = make_model("llama", seed=2)
    point = f"{stack}.0"
    protocol = fs.GrowthProtocol([point], family="cross_block", width=5, seed=1)
    right = tangent.apply_activation
    monkeypatch.setattr(tangent, "apply_activation", lambda x, act: right(x, act) * 1.001)
    refused(GrowthTangent(protocol, model), point, padded_batch(4, 6, seed=3), per_sample_loss, "llama")
    off = step(
        GrowthTangent(protocol, model, self_check=False), [point], padded_batch(4, 6, seed=3), per_sample_loss
    )
    assert off.saturation(point).n == 4


def test_mlp_width_swapped_gate_is_caught(monkeypatch):
    """An adapter entry listing LLaMA's MLP inputs as (up, gate): the feature code computes
    act(up)·gate, the widened MLP act(gate)·up."""
    model, stack = make_model("llama", seed=2)
    entry = architecture.ADAPTERS["llama"]
    assert entry.mlp_inputs == ("mlp.gate_proj", "mlp.up_proj")
    monkeypatch.setitem(
        architecture.ADAPTERS,
        "llama",
        dataclasses.replace(entry, mlp_inputs=("mlp.up_proj", "mlp.gate_proj")),
    )
    point = f"{stack}.0"
    protocol = fs.GrowthProtocol([point], family="mlp_width", width=3, seed=1)
    refused(GrowthTangent(protocol, model), point, padded_batch(4, 6, seed=3), per_sample_loss, "llama")


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_mlp_width_wrong_unit_row_is_caught(kind):
    """The feature code's units differ from the widened MLP's in one row of one input map."""
    model, stack = make_model(kind, seed=2)
    point = f"{stack}.0"
    protocol = fs.GrowthProtocol([point], family="mlp_width", width=3, seed=1)
    source = GrowthTangent(protocol, model)
    units = blocks.new_units(model, protocol, point)
    name = next(iter(units.pieces))
    axis, piece = units.pieces[name]
    wrong = piece.clone()
    wrong.select(axis, 1).mul_(1.01)  # new unit 1's input row
    units.pieces[name] = (axis, wrong)
    source.units[point] = units
    refused(
        source, point, padded_batch(4, 6, seed=3), per_sample_loss, {"llama": "llama", "gpt2": "gpt2"}[kind]
    )


def test_resnet_block_with_a_trailing_relu_is_caught():
    """A block ``relu(z + F(z))`` (out_relu=True) at its origin: the feature code's tangent is the
    smooth block's, autograd's has relu'(0) = 0 at the ReLU output's exact zeros."""
    model, points, side, _ = resnet_model("basic")
    model.eval()

    def with_relu(model, protocol, point):
        block = blocks.new_block(model, protocol, point)
        block.out_relu = True
        return block

    point = points[0]
    protocol = fs.GrowthProtocol([point], seed=4)
    source = GrowthTangent(protocol, model, new_block=with_relu)
    model_type = source.adapter.model_type
    refused(source, point, resnet_batch(side), fs.classification_loss, model_type)


def test_resnet_wrong_feature_scale_is_caught(monkeypatch):
    """The feature code's x̂ off by a factor 1.001 (a wrong normalisation); the block is right."""
    model, points, side, _ = resnet_model("basic")
    model.eval()
    point = points[1]
    source = GrowthTangent(fs.GrowthProtocol([point], seed=4), model)
    right = GrowthTangent._map_features
    monkeypatch.setattr(GrowthTangent, "_map_features", lambda self, *args: right(self, *args) * 1.001)
    refused(source, point, resnet_batch(side), fs.classification_loss, source.adapter.model_type)
