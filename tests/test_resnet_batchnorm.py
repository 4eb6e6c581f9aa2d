"""A new ResNet block is measured, and grown, with BatchNorm statistics calibrated on the probe's
first batch (fused_stats/api/growth/batchnorm.py).

References: the statistics against the block itself run in train mode on the candidate's output
(torch's own batch normalisation); the probe against per-sample gradients of the model grown with
``batchnorm_stats=probe`` in eval mode (one backward per sample, two batches: the calibration batch
and another); on the calibration batch, the probe's ``Σ c_i`` against the gradient of the grown
model whose new block runs in train mode (what the first training step sees); the curvature gain's
numerator against the same grown model's half gradients.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import fused_stats as fs
from fused_stats.api.growth.architecture import describe
from fused_stats.api.state.checkpoint import merge_checkpoints
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
    data = [batch(4, side, 40), batch(4, side, 41), batch(4, side, 42)]
    result = fs.curvature_gain(model, protocol, point, data, fs.classification_loss)
    probe = fs.Probe(model, points=[point], cross=protocol)
    probe.step(data[0], fs.classification_loss)  # calibrated on the same first batch
    grown = copy.deepcopy(model).eval()
    grown_result = fs.grow(grown, protocol, batchnorm_stats=probe)
    g0, g1, g2 = (zero_bn_gradient(grown, grown_result, point, last, x, y) for x, y in data)
    # halves: batches 0 and 2 (8 samples) against batch 1 (4)
    assert result.grad_sq == pytest.approx(float((g0 + g2) @ g1) / (8 * 4), rel=1e-9)


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


# ---------------------------------------------------------------------------- checkpoints
def _stepped(model, points, protocol, batches, stats=None):
    probe = fs.Probe(model, points=points, cross=protocol)
    if stats is not None:
        probe.cross.set_batchnorm_stats(stats)
    for b in batches:
        probe.step(b, fs.classification_loss)
    return probe


def _assert_same_calibration(a, b):
    assert set(a) == set(b) and a
    for point in a:
        assert set(a[point]) == set(b[point])
        for name in a[point]:
            for x, y in zip(a[point][name], b[point][name]):
                assert torch.equal(x, y), (point, name)


def test_a_resumed_probe_keeps_its_calibration_bit_for_bit(tmp_path):
    """Saved after the calibration batch and resumed in a fresh probe, the run goes on with the
    statistics of the first batch (not the next one's): every statistic and the grown block equal
    the uninterrupted run's bit for bit."""
    model, side, _ = build("basic")
    points = ["layer1.1", "layer3.0"]
    protocol = fs.GrowthProtocol(points, seed=4)
    data = [batch(5, side, 60 + i) for i in range(3)]
    whole = _stepped(model, points, protocol, data)
    part = _stepped(model, points, protocol, data[:1])
    part.save_state(tmp_path / "ckpt")
    resumed = fs.Probe(model, points=points, cross=protocol)
    resumed.load_state(tmp_path / "ckpt")
    _assert_same_calibration(resumed.cross.batchnorm_stats, part.cross.batchnorm_stats)
    for b in data[1:]:
        resumed.step(b, fs.classification_loss)
    _assert_same_calibration(resumed.cross.batchnorm_stats, whole.cross.batchnorm_stats)
    for point in points:
        assert torch.equal(resumed.cross_stats[point].c_sum, whole.cross_stats[point].c_sum)
        assert resumed.saturation(point) == whole.saturation(point)
    # a probe calibrated on batch 1 instead (what the resume did without the saved statistics)
    # measures another block: the check above is not between equal things
    other = _stepped(model, points, protocol, data[1:])
    assert not torch.equal(
        other.cross.batchnorm_stats["layer1.1"]["bn1"][0], whole.cross.batchnorm_stats["layer1.1"]["bn1"][0]
    )
    grown = [copy.deepcopy(model) for _ in range(2)]
    for g, probe in zip(grown, (whole, resumed)):
        fs.grow(g, protocol, batchnorm_stats=probe)
    for (name, a), (_, b) in zip(grown[0].state_dict().items(), grown[1].state_dict().items()):
        assert torch.equal(a, b), name


def test_checkpoint_without_or_with_damaged_calibration_is_refused(tmp_path):
    model, side, _ = build("basic")
    points = ["layer1.1"]
    protocol = fs.GrowthProtocol(points, seed=4)
    _stepped(model, points, protocol, [batch(5, side, 70)]).save_state(tmp_path / "ckpt")
    snap = tmp_path / "ckpt" / (tmp_path / "ckpt" / "LATEST").read_text()
    manifest = json.loads((snap / "manifest.json").read_text())
    entries = [e for e in manifest["points"] if e["kind"] == "feature_source"]
    assert [e["file"] for e in entries] == ["feature-source.safetensors"]

    def fresh_refuses(match):
        probe = fs.Probe(model, points=points, cross=protocol)
        with pytest.raises(fs.FusedStatsError, match=match):
            probe.load_state(tmp_path / "ckpt")
        assert not probe.table and not probe.cross.batchnorm_stats and not probe.steps.get("train")

    # a checkpoint of samples without the statistics they were measured with (an older writer)
    stripped = dict(manifest, points=[e for e in manifest["points"] if e["kind"] != "feature_source"])
    (snap / "manifest.json").write_text(json.dumps(stripped))
    fresh_refuses(r"samples at \['layer1\.1'\] but not the BatchNorm statistics")
    (snap / "manifest.json").write_text(json.dumps(manifest))
    raw = bytearray((snap / "feature-source.safetensors").read_bytes())
    raw[-3] ^= 0xFF
    (snap / "feature-source.safetensors").write_bytes(bytes(raw))
    fresh_refuses("SHA-256")


def test_merge_refuses_jobs_calibrated_on_other_batches_and_carries_a_shared_calibration(tmp_path):
    model, side, _ = build("basic")
    points = ["layer2.1"]
    protocol = fs.GrowthProtocol(points, seed=8)
    b0, b1 = batch(5, side, 80), batch(5, side, 81)
    first = _stepped(model, points, protocol, [b0])
    first.save_state(tmp_path / "a")
    _stepped(model, points, protocol, [b1]).save_state(tmp_path / "b")
    with pytest.raises(fs.FusedStatsError, match="another feature-source state"):
        merge_checkpoints(tmp_path / "ab", [tmp_path / "a", tmp_path / "b"])
    assert not (tmp_path / "ab").exists()
    # the second job measures with the first job's statistics: the merge is one run over both
    _stepped(model, points, protocol, [b1], stats=first.cross.batchnorm_stats).save_state(tmp_path / "c")
    merge_checkpoints(tmp_path / "ac", [tmp_path / "a", tmp_path / "c"])
    merged = fs.Probe(model, points=points, cross=protocol)
    merged.load_state(tmp_path / "ac")
    whole = _stepped(model, points, protocol, [b0, b1])
    _assert_same_calibration(merged.cross.batchnorm_stats, whole.cross.batchnorm_stats)
    torch.testing.assert_close(
        merged.cross_stats["layer2.1"].c_sum, whole.cross_stats["layer2.1"].c_sum, rtol=1e-13, atol=0
    )
    assert merged.saturation("layer2.1").cross_frob2 == pytest.approx(
        whole.saturation("layer2.1").cross_frob2, rel=1e-12
    )


def test_set_batchnorm_stats_and_a_stale_probe_are_refused():
    model, side, _ = build("basic")
    points = ["layer1.1", "layer2.1"]
    protocol = fs.GrowthProtocol(points, seed=1)
    probe = _stepped(model, points, protocol, [batch(4, side, 90)])
    stats = probe.cross.batchnorm_stats
    other = _stepped(model, points, protocol, [batch(4, side, 91)]).cross.batchnorm_stats
    before = copy.deepcopy(stats)
    with pytest.raises(fs.FusedStatsError, match="calibrated with other statistics"):
        probe.cross.set_batchnorm_stats({"layer1.1": other["layer1.1"]})
    with pytest.raises(fs.FusedStatsError, match="not candidates"):
        fresh = fs.Probe(model, points=points, cross=protocol)
        fresh.cross.set_batchnorm_stats({"layer3.1": other["layer1.1"]})
    negative = {"layer1.1": {n: (m, -v) for n, (m, v) in other["layer1.1"].items()}}
    with pytest.raises(fs.FusedStatsError, match="variance is negative"):
        fresh.cross.set_batchnorm_stats(negative)
    assert not fresh.cross.batchnorm_stats
    _assert_same_calibration(probe.cross.batchnorm_stats, before)
    probe.cross.set_batchnorm_stats({"layer1.1": before["layer1.1"]})  # the same statistics: kept
    # after a growth the probe's blocks are not those of the grown model
    fs.grow(model, protocol, at=["layer2.1"], batchnorm_stats=probe)
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(fs.FusedStatsError, match="probe it again"):
        fs.grow(model, protocol, at=["layer1.1"], batchnorm_stats=probe)
    assert list(model.state_dict()) == list(state)


def test_a_schedule_grows_the_block_its_probe_calibrated():
    model, side, _ = build("basic")
    points = ["layer1.1", "layer2.1"]
    protocol = fs.GrowthProtocol(points, seed=3)
    data = [batch(6, side, 95), batch(6, side, 96)]
    reference = copy.deepcopy(model)
    schedule = fs.GrowthSchedule(
        protocol, at_steps=[1], probe_batches=data, loss_fn=fs.classification_loss, alpha=0.99
    )
    event = schedule.maybe_grow(model, 1, torch.optim.SGD(model.parameters(), lr=0.1))
    assert event["event"] == "grew"
    probe = _stepped(reference, points, protocol, data)
    fs.grow(reference, protocol, at=[event["point"]], batchnorm_stats=probe)
    grown = model.state_dict()
    assert list(grown) == list(reference.state_dict())
    for name, value in reference.state_dict().items():
        assert torch.equal(value, grown[name]), name
    new = fs.growth_history(model)[-1]["position"]
    stats = [v for n, v in grown.items() if n.startswith(f"{new}.") and n.endswith("running_var")]
    assert stats and not any(torch.equal(v, torch.ones_like(v)) for v in stats)  # not the fresh (0, 1)
