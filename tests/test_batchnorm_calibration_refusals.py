"""A new ResNet block's BatchNorm calibration refuses an input with no variance to measure
with (fused_stats/api/growth/batchnorm.py): one value per channel (batch × H × W < 2), which
torch's train-mode BatchNorm refuses too, or a constant (dead) channel.

References: torch's own train-mode BatchNorm on the same input; the hand-made dead channel (a
zeroed row of the conv before the BatchNorm); the statistics accepted at the boundary against the
mean and biased variance of the BatchNorm's input, computed here.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fused_stats as fs
from fused_stats.api.growth.batchnorm import calibrate
from tests.test_resnet_origin import batch, build

SIDE = 4  # cifar_resnet20's layer3 outputs are 1x1 at this side, layer2's 2x2


def point_output(model, point, x):
    seen = []
    handle = model.get_submodule(point).register_forward_hook(lambda m, a, out: seen.append(out))
    try:
        with torch.no_grad():
            model.eval()(x)
    finally:
        handle.remove()
    return seen[0]


def new_block(model, protocol, point):
    grown = copy.deepcopy(model).eval()
    result = fs.grow(grown, protocol, at=[point])
    return grown.get_submodule(result.positions[point])


def bn_inputs(block, z):
    """Each BatchNorm's input with the block in train mode (batch statistics)."""
    seen = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, n=n: seen.setdefault(n, args[0]))
        for n, m in block.named_modules()
        if isinstance(m, torch.nn.BatchNorm2d)
    ]
    try:
        with torch.no_grad():
            copy.deepcopy(block).train()(z)
    except ValueError:
        pass
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_one_value_per_channel_is_refused_where_train_mode_refuses_it():
    model, _, _ = build("basic")
    point = "layer3.1"
    protocol = fs.GrowthProtocol([point], seed=2)
    one = batch(1, SIDE, 7)
    z = point_output(model, point, one[0])
    assert tuple(z.shape) == (1, 16, 1, 1)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        copy.deepcopy(new_block(model, protocol, point)).train()(z)
    probe = fs.Probe(model, points=[point], cross=protocol)
    with pytest.raises(fs.FusedStatsError, match=r"'bn1'.*'layer3\.1'.*\(1, 16, 1, 1\).*1 value per channel"):
        probe.step(one, fs.classification_loss)
    assert point not in probe.cross.batchnorm_stats
    more = [batch(8, SIDE, 8), batch(8, SIDE, 9)]
    with pytest.raises(fs.FusedStatsError, match=r"'layer3\.1'.*\(1, 16, 1, 1\)"):
        fs.curvature_gain(model, protocol, point, [one, *more], fs.classification_loss)


@pytest.mark.parametrize(
    ("point", "n", "shape"), [("layer3.1", 2, (2, 16, 1, 1)), ("layer2.1", 1, (1, 8, 2, 2))]
)
def test_two_values_per_channel_are_calibrated(point, n, shape):
    """The boundary: two samples of a 1x1 output, or one sample of a 2x2 one (H × W counts)."""
    model, _, _ = build("basic")
    protocol = fs.GrowthProtocol([point], seed=2)
    x, y = batch(n, SIDE, 11)
    probe = fs.Probe(model, points=[point], cross=protocol)
    probe.step((x, y), fs.classification_loss)
    z = point_output(model, point, x)
    assert tuple(z.shape) == shape
    # bn1's input does not depend on the calibration (the first BatchNorm of the block)
    x1 = bn_inputs(new_block(model, protocol, point), z)["bn1"]
    mean, var = probe.cross.batchnorm_stats[point]["bn1"]
    torch.testing.assert_close(mean, x1.mean(dim=(0, 2, 3)), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(var, x1.var(dim=(0, 2, 3), unbiased=False), rtol=1e-12, atol=1e-14)
    assert bool((var > 0).all())


@pytest.mark.parametrize(("conv", "bn"), [("conv1", "bn1"), ("conv2", "bn2")])
def test_a_dead_channel_is_refused_naming_it(conv, bn):
    """A channel constant over the calibration batch (its conv row zeroed: the BatchNorm's input
    there is exactly 0) has variance 0; calibrated, every later batch would be divided by
    sqrt(eps) there."""
    model, _, _ = build("basic")
    point = "layer2.1"
    protocol = fs.GrowthProtocol([point], seed=2)
    block = new_block(model, protocol, point)
    with torch.no_grad():
        block.get_submodule(conv).weight[3].zero_()
    z = point_output(model, point, batch(6, SIDE, 12)[0])
    seen = bn_inputs(block, z)[bn]
    assert float(seen[:, 3].abs().max()) == 0.0 and float(seen.var(dim=(0, 2, 3)).min()) == 0.0
    with pytest.raises(fs.FusedStatsError, match=rf"'{bn}'.*'layer2\.1'.*channels \[3\].*\(6, 8, 2, 2\)"):
        calibrate(block, z, point)
