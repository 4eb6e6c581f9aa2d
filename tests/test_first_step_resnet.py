"""fs.predicted_change on ResNet growth (the new block's zero BatchNorm: γ one entry per channel,
β one per channel) and on ``family="cross_block"`` (tiny LLaMA), against realised first steps.

Reference: an fp64 copy grown with the optimizer extended by ``fs.grow`` (ResNet: with
``batchnorm_stats=probe``, so the grown block is the one the probe measured), one step of SGD or
Adam on the new parameters over the train batches' mean loss, the change of the mean test loss
(ratio to the prediction within 1e-3). ResNet in eval mode: the probe measures every batch with the calibrated statistics in
eval mode (tests/test_resnet_batchnorm.py), and with several train batches only eval mode runs the
block the probe measured on all of them. η = 1e-4, but Adam on the ResNet at 1e-5: its first step
moves every γ / β entry by about η whatever its gradient, and at 1e-4 the basic block's step
crosses ReLU kinks downstream (realised / predicted 1.0134 at 1e-4, 1.00002 at 1e-5, 1.000002 at
1e-6: the prediction is the limit, the 1e-4 gap is not first order).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

# the fp64 RMSNorm fixture (autouse), tiny LLaMA, its batches and probe of the LLaMA tests
from test_first_step_optimizers import fp64_norms, mean_loss, probed  # noqa: F401
from test_growth_scores import batches, tiny_llama

import fused_stats as fs
from tests.test_resnet_origin import batch, build

ETA = 1e-4
TOLERANCE = 1e-3
OPTIMIZERS = {
    "sgd": lambda ps, eta=ETA: torch.optim.SGD(ps, lr=eta),
    "adam": lambda ps, eta=ETA: torch.optim.Adam(ps, lr=eta),
}
RESNET_ETA = {"sgd": ETA, "adam": 1e-5}


def mean_classification_loss(model, data) -> torch.Tensor:
    return torch.cat([F.cross_entropy(model(x), y, reduction="none") for x, y in data]).mean()


def realised_change(model, protocol, point, make, loss, train, test, **grow_kwargs) -> float:
    grown = copy.deepcopy(model)
    opt = make(grown.parameters())
    result = fs.grow(grown, protocol, at=[point], optimizer=opt, **grow_kwargs)
    grown.eval()
    named = dict(grown.named_parameters())
    new = [named[n] for n in result.new_parameters]
    with torch.no_grad():
        base = float(loss(grown, test))
    for p in grown.parameters():
        p.grad = None
    for p, g in zip(new, torch.autograd.grad(loss(grown, train), new)):
        p.grad = g
    opt.step()
    with torch.no_grad():
        return float(loss(grown, test)) - base


@pytest.fixture(scope="module", params=["basic", "bottleneck"])
def resnet_setting(request):
    model, side, _ = build(request.param)
    model.eval()
    point = "layer2.1" if request.param == "basic" else "layer3.0"
    protocol = fs.GrowthProtocol([point], seed=4)
    train = [batch(6, side, 11), batch(5, side, 12), batch(6, side, 13)]
    test = [batch(6, side, 21), batch(4, side, 22)]
    probe = fs.Probe(model, points=[point], cross=protocol)
    for b in train:
        probe.step(b, fs.classification_loss)
    for b in test:
        probe.step(b, fs.classification_loss, stream="test")
    return model, protocol, point, probe, fs.advise(probe, protocol), train, test


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resnet_prediction_matches_the_realised_first_step(resnet_setting, name):
    model, protocol, point, probe, advice, train, test = resnet_setting

    def make(ps):
        return OPTIMIZERS[name](ps, RESNET_ETA[name])

    candidate = next(c for c in advice.ranked if c.point == point)
    predicted = fs.predicted_change(candidate, make(model.parameters())).change
    realised = realised_change(
        model, protocol, point, make, mean_classification_loss, train, test, batchnorm_stats=probe
    )
    print(f"resnet {point} {name}: realised/predicted = {realised / predicted:.6f}")
    assert realised != 0.0
    assert abs(realised / predicted - 1) < TOLERANCE, (realised, predicted)
    # the zero BatchNorm's γ and β: one column per channel each, so both segments span C's width
    (gamma, a, b), (beta, c, d) = candidate.first_step.segments
    assert gamma.endswith(".weight") and beta.endswith(".bias") and b - a == d - c == b and d == 2 * b


@pytest.fixture(scope="module", params=["model.layers.0", "model.layers.1"])
def cross_block_setting(request):
    model = tiny_llama()
    protocol = fs.GrowthProtocol([request.param], family="cross_block", width=3, seed=2)
    train, test = batches(0, 3), batches(1, 2)
    advice = fs.advise(probed(model, protocol, train, test), protocol)
    return model, protocol, request.param, advice, train, test


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_cross_block_prediction_matches_the_realised_first_step(cross_block_setting, name):
    model, protocol, point, advice, train, test = cross_block_setting
    make = OPTIMIZERS[name]
    candidate = next(c for c in advice.ranked if c.point == point)
    predicted = fs.predicted_change(candidate, make(model.parameters())).change
    realised = realised_change(model, protocol, point, make, mean_loss, train, test)
    print(f"cross_block {point} {name}: realised/predicted = {realised / predicted:.6f}")
    assert realised != 0.0
    assert abs(realised / predicted - 1) < TOLERANCE, (realised, predicted)
