"""Recalibrating a ResNet probe's new blocks with ``set_batchnorm_stats(..., replace=True)``
(fused_stats/api/growth/batchnorm.py): the calibration becomes exactly the new statistics, and a
candidate left out calibrates on the next batch, not keeping the old one.

Reference: each new BatchNorm's input captured from the block (a deep copy in fp64, train mode:
on the calibration batch it normalises by the batch statistics, as the calibrated eval block
does), its per-channel mean and biased variance computed by hand.
"""

from __future__ import annotations

import copy

import torch

import fused_stats as fs
from tests.test_resnet_origin import batch, build

F64 = torch.float64
POINTS = ["layer1.1", "layer3.0"]


def point_output(model, point, x):
    seen = {}
    handle = model.get_submodule(point).register_forward_hook(lambda m, a, out: seen.setdefault("z", out))
    try:
        with torch.no_grad():
            model.eval()(x)
    finally:
        handle.remove()
    return seen["z"]


def hand_stats(block, z):
    """name -> (mean, biased var) of each BatchNorm's input, the block run in train mode on ``z``."""
    block = copy.deepcopy(block).double().train()
    inputs, handles = {}, []
    for name, m in block.named_modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            handles.append(
                m.register_forward_pre_hook(lambda mod, a, name=name: inputs.setdefault(name, a[0]))
            )
    with torch.no_grad():
        block(z.to(F64))
    for h in handles:
        h.remove()
    out = {}
    for name, x in inputs.items():
        mean = x.mean(dim=(0, 2, 3))
        var = ((x - mean[None, :, None, None]) ** 2).mean(dim=(0, 2, 3))
        out[name] = (mean, var)
    return out


def assert_stats(got, want):
    assert set(got) == set(want) and want
    for name, (mean, var) in want.items():
        torch.testing.assert_close(got[name][0], mean, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got[name][1], var, rtol=1e-10, atol=1e-12)


def test_replace_makes_the_calibration_exactly_the_new_statistics():
    model, side, _ = build("basic")
    protocol = fs.GrowthProtocol(POINTS, seed=4)
    probe = fs.Probe(model, points=POINTS, cross=protocol)
    first, second = batch(5, side, 70), batch(6, side, 71)
    probe.step(first, fs.classification_loss)
    old = {p: probe.cross.batchnorm_stats[p] for p in POINTS}
    kept, left_out = POINTS
    new_stats = hand_stats(probe.cross.block(kept), point_output(model, kept, second[0]))
    probe.cross.set_batchnorm_stats({kept: new_stats}, replace=True)
    # exactly the given statistics; the candidate left out holds none until its next batch
    assert set(probe.cross.batchnorm_stats) == {kept}
    assert_stats(probe.cross.batchnorm_stats[kept], new_stats)
    probe.step(second, fs.classification_loss)
    want = hand_stats(probe.cross.block(left_out), point_output(model, left_out, second[0]))
    assert_stats(probe.cross.batchnorm_stats[left_out], want)
    # the statistics changed: batch 2's are not batch 1's
    assert not torch.allclose(old[left_out]["bn1"][0], want["bn1"][0])
