"""Advice, reports and first-step predictions are bound to the model structure they measured.

A tiny fp64 LLaMA of 3 blocks is probed at the boundaries after blocks 0 and 1. After a growth
at ``model.layers.0`` the name ``model.layers.1`` is the boundary after the new block, not the one
the advice measured, so the advice is refused as evidence there (naming what changed), and so are
``fs.predicted_change`` on its tangents and an advice read back from the saved report. Growing at
both advised places in one call (the documented way) is accepted and records each row. Evidence
measured for one init is refused for a growth of another init. A plan is current for its own
model only, never for another model of the same structure.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from test_growth_scores import batches

import fused_stats as fs

POINTS = ["model.layers.0", "model.layers.1"]


def _llama(seed=3, layers=3):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=20,
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(config).double().eval()


@pytest.fixture
def measured():
    """A fresh model, its protocol, the probe's report and the advice (from the live probe: its
    first-step tangents belong to this model object)."""
    model = _llama()
    protocol = fs.GrowthProtocol(POINTS, seed=7)
    probe = fs.Probe(model, points=POINTS, cross=protocol)
    probe.run(batches(11, 3), fs.causal_lm_loss, stream="train", mask="none", progress=False)
    probe.run(batches(12, 2), fs.causal_lm_loss, stream="test", mask="none", progress=False)
    return model, protocol, probe.report(misalignment_trials=0).data, fs.advise(probe, protocol)


def _state(model):
    return [p.detach().clone() for p in model.parameters()], fs.growth_history(model)


def _unchanged(model, state) -> bool:
    params, history = state
    now = list(model.parameters())
    return (
        len(now) == len(params)
        and all(torch.equal(a, b) for a, b in zip(now, params))
        and fs.growth_history(model) == history
    )


def _row(advice, point):
    return next(c for c in advice.ranked if c.point == point)


def test_advice_and_report_record_the_measured_structure(measured):
    _, _, report, advice = measured
    # counted by hand: 3 blocks in model.layers, a model never grown
    expected = {"blocks": {"model.layers": 3}, "record_events": 0}
    assert report["growth_protocol"]["model_structure"] == expected
    assert advice.structure == expected
    assert advice.to_dict()["model_structure"] == expected
    assert fs.advise(json.loads(json.dumps(report))).structure == expected
    assert "model.layers: 3 blocks" in advice.to_markdown()


def test_advice_is_refused_after_the_model_grew_elsewhere(measured):
    model, protocol, report, advice = measured
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the normal path: advice, then one growth with it as evidence
    fs.grow(model, protocol, at=["model.layers.0"], optimizer=optimizer, evidence=advice)
    (entry,) = fs.growth_history(model)
    row = _row(advice, "model.layers.0")
    assert (entry["cross_frob2"], entry["p_value"]) == (row.cross_frob2, row.p_value)
    # model.layers.1 now names the boundary after the new block: the advice measured another place
    state = _state(model)
    with pytest.raises(fs.FusedStatsError) as refused:
        fs.grow(model, protocol, at=["model.layers.1"], optimizer=optimizer, evidence=advice)
    message = str(refused.value)
    assert "model.layers: 3 blocks then, 4 now" in message
    assert "grew at 'model.layers.0'" in message and "model.layers.1" in message
    assert _unchanged(model, state)
    # the same advice read back from the saved report is refused alike
    saved = fs.advise(json.loads(json.dumps(report)), protocol)
    with pytest.raises(fs.FusedStatsError, match="3 blocks then, 4 now"):
        fs.grow(model, protocol, at=["model.layers.1"], evidence=saved)
    assert _unchanged(model, state)
    # a first-step prediction from the pre-growth tangents is refused too, for every candidate
    with pytest.raises(fs.FusedStatsError, match="3 blocks then, 4 now"):
        fs.predicted_change(advice, optimizer)
    with pytest.raises(fs.FusedStatsError, match="measured on the model as it was"):
        fs.predicted_change(_row(advice, "model.layers.1"), optimizer)
    # without evidence the growth itself is still allowed (a new plan of the grown model)
    fs.grow(model, protocol, at=["model.layers.1"], optimizer=optimizer)
    assert len(model.model.layers) == 5


def test_a_width_growth_since_also_makes_the_advice_stale(measured):
    model, protocol, _, advice = measured
    fs.grow(model, fs.GrowthProtocol(["model.embed_tokens", *POINTS], family="mlp_width", width=2))
    state = _state(model)
    # no block was added: only the growth record tells the change
    with pytest.raises(fs.FusedStatsError, match="growth record: 0 events then, 3 now") as refused:
        fs.grow(model, protocol, at=["model.layers.0"], evidence=advice)
    assert "mlp_width" in str(refused.value)
    assert _unchanged(model, state)


def test_growth_at_several_advised_places_in_one_call_is_accepted(measured):
    model, protocol, _, advice = measured
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    predicted = fs.predicted_change(advice, optimizer)  # before the growth: accepted
    assert set(predicted) == set(POINTS)
    result = fs.grow(model, protocol, at=POINTS, optimizer=optimizer, evidence=advice)
    # the blocks were inserted after old blocks 0 and 1: at indices 1 and 3 of 5
    assert result.positions == {"model.layers.0": "model.layers.1", "model.layers.1": "model.layers.3"}
    for entry in fs.growth_history(model):
        row = _row(advice, entry["point"])
        assert (entry["cross_frob2"], entry["p_adjusted"]) == (row.cross_frob2, row.p_adjusted)


def test_advice_without_a_recorded_structure_is_refused_as_evidence(measured):
    model, protocol, report, _ = measured
    old = copy.deepcopy(report)
    del old["growth_protocol"]["model_structure"]  # a report written before structures were kept
    advice = fs.advise(old, protocol)
    assert advice.structure is None
    state = _state(model)
    with pytest.raises(fs.FusedStatsError, match="records no model structure"):
        fs.grow(model, protocol, at=["model.layers.0"], evidence=advice)
    assert _unchanged(model, state)


@pytest.mark.parametrize("init", ["copy", "random"])
def test_evidence_measured_for_another_init_is_refused(measured, init):
    model, protocol, _, advice = measured
    assert protocol.init == "zero"
    state = _state(model)
    with pytest.raises(fs.FusedStatsError) as refused:
        fs.grow(model, protocol, at=["model.layers.0"], init=init, evidence=advice)
    assert f"init {init!r}" in str(refused.value) and "init 'zero'" in str(refused.value)
    assert _unchanged(model, state)
    # the same init, named explicitly, is the normal path
    fs.grow(model, protocol, at=["model.layers.0"], init="zero", evidence=advice)
    assert fs.growth_history(model)[0]["cross_frob2"] == _row(advice, "model.layers.0").cross_frob2


def test_a_plan_is_current_only_for_its_own_model():
    protocol = fs.GrowthProtocol(POINTS)
    model, twin = _llama(seed=3), _llama(seed=3)
    # the same structure and even the same weights: still another model object
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    plan = fs.plan_growth(model, protocol)
    assert plan.is_current(model) is True
    assert plan.is_current(twin) is False
    with pytest.raises(fs.FusedStatsError, match="made for another LlamaForCausalLM"):
        plan.require_current(twin)
    # a growth of the twin leaves the plan current for its own model
    fs.grow(twin, protocol, at=["model.layers.0"])
    assert plan.is_current(model) is True and plan.is_current(twin) is False
    # a plan rebound to a deep copy is current for the copy and no longer for the original
    copied = copy.deepcopy(model)
    rebound = plan.rebound(copied)
    assert rebound.is_current(copied) is True and rebound.is_current(model) is False
    # its own model grown: stale for it as well
    fs.grow(model, protocol, at=["model.layers.1"])
    assert plan.is_current(model) is False


def test_reports_of_different_or_malformed_structures_are_not_combined(measured):
    _, protocol, report, _ = measured
    halves = []
    for point in POINTS:  # one report per candidate, as from two probe runs of one model
        half = copy.deepcopy(report)
        half["points"] = [p for p in half["points"] if p["name"] == point]
        halves.append(half)
    assert fs.advise(halves, protocol).structure == {"blocks": {"model.layers": 3}, "record_events": 0}
    unrecorded = copy.deepcopy(halves)
    del unrecorded[1]["growth_protocol"]["model_structure"]  # one report of an older version
    assert fs.advise(unrecorded, protocol).structure is None
    halves[1]["growth_protocol"]["model_structure"]["record_events"] = 1
    with pytest.raises(fs.FusedStatsError, match="models of different structure"):
        fs.advise(halves, protocol)
    halves[1]["growth_protocol"]["model_structure"] = {"blocks": [3], "record_events": 0}
    with pytest.raises(fs.FusedStatsError, match="report 1's model_structure must be"):
        fs.advise(halves, protocol)
