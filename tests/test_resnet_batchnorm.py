"""A new ResNet block is measured, and grown, with BatchNorm statistics calibrated on the probe's
first batch (fused_stats/api/growth/batchnorm.py; issue "Exact or refused, round 2", item 4).

References: the statistics against the block itself run in train mode on the candidate's output
(torch's own batch normalisation); the probe against per-sample gradients of the model grown with
``batchnorm_stats=probe`` in eval mode (one backward per sample, two batches: the calibration batch
and another); on the calibration batch, the probe's ``Σ c_i`` against the gradient of the grown
model whose new block runs in train mode (what the first training step sees); the curvature gain's
numerator against the same grown model's half gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fused_stats as fs
from fused_stats.api.growth.architecture import describe
from tests.test_growth_tangent import brute_force
from tests.test_resnet_origin import batch, build, new_parameters, only_trainable


def point_output(model, point, x):
    seen = {}
    handle = model.get_submodule(point).register_forward_hook(lambda m, a, out: seen.setdefault("z", out))
    try:
        with torch.no_grad():
            model.eval()(x)
    finally:
        handle.remove()
    return seen["z"]


def zero_bn_gradient(grown, result, point, last, x, y):
    """``[∂L/∂γ ; ∂L/∂β]`` of the summed loss at the new block's zero BatchNorm."""
    block = result.positions[point]
    named = dict(grown.named_parameters())
    params = [named[f"{block}.{last}.weight"], named[f"{block}.{last}.bias"]]
    only_trainable(grown, params)
    grads = torch.autograd.grad(F.cross_entropy(grown(x), y, reduction="sum"), params)
    return torch.cat([g.flatten() for g in grads])


@pytest.mark.parametrize("kind", ["basic", "bottleneck"])
def test_probe_matches_per_sample_gradients_of_the_calibrated_grown_model(kind):
    model, side, last = build(kind)
    points = list(describe(model).boundaries)[1::3]
    protocol = fs.GrowthProtocol(points, seed=6)
    (x1, y1), (x2, y2) = batch(6, side, 21), batch(5, side, 22)
    probe = fs.Probe(model, points=points, cross=protocol)
    probe.step((x1, y1), fs.classification_loss)
    probe.step((x2, y2), fs.classification_loss)
    for point in points:
        grown = copy.deepcopy(model).eval()
        result = fs.grow(grown, protocol, at=[point], batchnorm_stats=probe)
        block = grown.get_submodule(result.positions[point])
        # the statistics: each BatchNorm's input on the first batch, the block run in train mode
        # (batch statistics, torch's own), its mean and biased variance
        fresh = copy.deepcopy(model)
        fs.grow(fresh, protocol, at=[point])
        trained = copy.deepcopy(fresh.get_submodule(result.positions[point])).train()
        inputs: dict[str, torch.Tensor] = {}
        hooks = [
            m.register_forward_pre_hook(lambda mod, args, n=n, seen=inputs: seen.setdefault(n, args[0]))
            for n, m in trained.named_modules()
            if isinstance(m, torch.nn.BatchNorm2d)
        ]
        with torch.no_grad():
            trained(point_output(model, point, x1))
        for h in hooks:
            h.remove()
        assert len(inputs) == (2 if kind == "basic" else 3)
        for name, x in inputs.items():
            bn = block.get_submodule(name)
            torch.testing.assert_close(bn.running_mean, x.mean(dim=(0, 2, 3)), rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(
                bn.running_var, x.var(dim=(0, 2, 3), unbiased=False), rtol=1e-12, atol=1e-14
            )
            assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
        # the probe against one backward per sample of the grown model, both batches
        params = new_parameters(grown, result)
        only_trainable(grown, params)
        zero_bn = [f"{result.positions[point]}.{last}.{n}" for n in ("weight", "bias")]
        rows, others = [], []
        for x, y in ((x1, y1), (x2, y2)):
            for b in range(x.shape[0]):
                loss = F.cross_entropy(grown(x[b : b + 1]), y[b : b + 1])
                by_name = dict(zip(result.new_parameters, torch.autograd.grad(loss, params)))
                rows.append(torch.cat([by_name[n].flatten() for n in zero_bn]))
                others.append(max(float(g.abs().max()) for n, g in by_name.items() if n not in zero_bn))
        assert max(others) == 0.0  # at the origin only the zero BatchNorm has a gradient
        c = torch.stack(rows)
        acc = probe.cross_stats[point]
        torch.testing.assert_close(acc.c_sum.flatten(), c.sum(0), rtol=1e-10, atol=1e-14)
        assert float(acc.sq_norm_sum) == pytest.approx(float((c * c).sum()), rel=1e-10)
        cross2 = brute_force(c)[0]  # over distinct pairs of the 11 samples of both batches
        assert probe.saturation(point).cross_frob2 == pytest.approx(cross2, rel=1e-9, abs=1e-14)
        assert abs(cross2) > 1e-12


@pytest.mark.parametrize(("kind", "point"), [("basic", "layer2.1"), ("bottleneck", "layer3.0")])
def test_on_the_calibration_batch_eval_mode_is_the_first_training_step(kind, point):
    """The new block in train mode (batch statistics, as the first training step normalises)
    gives its zero BatchNorm the gradient the probe measured in eval mode; with the fresh
    statistics (0, 1) the eval-mode gradient was another one."""
    model, side, last = build(kind)
    protocol = fs.GrowthProtocol([point], seed=3)
    x, y = batch(8, side, 5)
    probe = fs.Probe(model, points=[point], cross=protocol)
    probe.step((x, y), fs.classification_loss)
    measured = probe.cross_stats[point].c_sum.flatten()
    grown = copy.deepcopy(model).eval()
    result = fs.grow(grown, protocol, batchnorm_stats=probe)
    grown.get_submodule(result.positions[point]).train()
    train_mode = zero_bn_gradient(grown, result, point, last, x, y)
    torch.testing.assert_close(measured, train_mode, rtol=1e-10, atol=1e-13)
    assert train_mode.abs().max() > 1e-6
    stale = copy.deepcopy(model).eval()
    stale_result = fs.grow(stale, protocol)
    uncalibrated = zero_bn_gradient(stale, stale_result, point, last, x, y)
    assert (uncalibrated - train_mode).norm() > 1e-2 * train_mode.norm()


def test_curvature_gain_on_a_resnet_uses_the_calibrated_block():
    model, side, last = build("basic")
    point = "layer1.1"
    protocol = fs.GrowthProtocol([point], seed=2)
    data = [batch(4, side, 40), batch(4, side, 41)]
    result = fs.curvature_gain(model, protocol, point, data, fs.classification_loss)
    probe = fs.Probe(model, points=[point], cross=protocol)
    probe.step(data[0], fs.classification_loss)  # calibrated on the same first batch
    grown = copy.deepcopy(model).eval()
    grown_result = fs.grow(grown, protocol, batchnorm_stats=probe)
    g_a, g_b = (zero_bn_gradient(grown, grown_result, point, last, x, y) / x.shape[0] for x, y in data)
    assert result.grad_sq == pytest.approx(float(g_a @ g_b), rel=1e-9)


def test_batchnorm_stats_refusals_leave_the_model_unchanged():
    model, side, _ = build("basic")
    protocol = fs.GrowthProtocol(["layer1.1", "layer2.1"], seed=2)
    probe = fs.Probe(model, points=["layer1.1"], cross=fs.GrowthProtocol(["layer1.1", "layer2.1"], seed=2))
    probe.step(batch(4, side, 1), fs.classification_loss)
    structure, state = repr(model), copy.deepcopy(model.state_dict())
    other = fs.GrowthProtocol(["layer1.1", "layer2.1"], seed=9)
    cases = [
        (dict(protocol=other, at=["layer1.1"], batchnorm_stats=probe), "probe of protocol"),
        (
            dict(protocol=protocol, at=["layer2.1"], batchnorm_stats=probe),
            r"no calibrated statistics.*layer2.1",
        ),
        (dict(protocol=protocol, at=["layer1.1"], init="copy", batchnorm_stats=probe), "init 'copy'"),
        (
            dict(protocol=protocol, at=["layer1.1"], batchnorm_stats={"layer1.1": {"bn2": (1, 2)}}),
            "BatchNorms are",
        ),
        (dict(protocol=protocol, at=["layer1.1"], batchnorm_stats=[1]), "must be None, a Probe"),
    ]
    stats = probe.cross.batchnorm_stats["layer1.1"]
    bad = {"layer1.1": {**stats, "bn2": (stats["bn2"][0][:1], stats["bn2"][1])}}
    cases.append((dict(protocol=protocol, at=["layer1.1"], batchnorm_stats=bad), r"'bn2'.*shape"))
    for kwargs, message in cases:
        with pytest.raises(fs.FusedStatsError, match=message):
            fs.grow(model, **kwargs)
        assert repr(model) == structure
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    llama_protocol = fs.GrowthProtocol(["model.layers.0"])
    from test_grow_surgery import llama

    lm = llama(layers=2)
    with pytest.raises(fs.FusedStatsError, match="have no BatchNorm"):
        fs.grow(lm, llama_protocol, batchnorm_stats={"model.layers.0": {}})
