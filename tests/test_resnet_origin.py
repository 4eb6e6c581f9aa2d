"""The ResNet block growth inserts is smooth at its origin, so its tangent predicts the first step.

The new block computes ``x + F(x)`` (``out_relu=False``): with ``F`` at zero it is the identity on
any stream (``z + 0 = z``), at every boundary, and it has a true derivative there; with a trailing
ReLU, ``relu(z + F)`` at the exact zeros of a ReLU output has only one-sided derivatives, and a
step along autograd's gradient would not change the loss by ``-eta |g|^2`` to first order.

References: the first SGD step's loss change (fp64, eval mode) against ``-eta |g|^2``, ``g`` from
the probe's ``C`` and, independently, from autograd of the grown model; per-sample gradients of
all new parameters (one ``autograd.grad`` per sample) through the brute force of
tests/test_growth_tangent.py; the block's explicit formula for ``init="random"``.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import fused_stats as fs
from fused_stats.api.growth.architecture import describe
from fused_stats.networks.resnet import BasicBlock, Bottleneck, cifar_resnet20, tiny_resnet
from tests.test_growth_tangent import assert_matches

F64 = torch.float64


def build(kind):
    """fp64 ResNet, side of its inputs, name of the new block's zero BatchNorm."""
    if kind == "basic":
        return cifar_resnet20(width=4, seed=3, random_batchnorm=True).double(), 8, "bn2"
    if kind == "tiny_basic":
        return tiny_resnet("basic", (2, 1, 1, 2), width=2, seed=5, random_batchnorm=True).double(), 32, "bn2"
    return tiny_resnet("bottleneck", (2, 1, 1, 2), width=2, seed=3, random_batchnorm=True).double(), 32, "bn3"


def batch(n, side, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, side, side, generator=g, dtype=F64), torch.randint(0, 10, (n,), generator=g)


def new_parameters(model, result):
    named = dict(model.named_parameters())
    return [named[n] for n in result.new_parameters]


def only_trainable(model, params):
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)


def stream_has_zeros_with_gradient(model, point, x, y):
    """The candidate's output has exact zeros where the loss gradient is not zero: the pixels at
    which a trailing ReLU's kink would matter (else the first-step test could not see one)."""
    seen = {}

    def keep(mod, args, out):
        out.retain_grad()
        seen["z"] = out

    handle = model.get_submodule(point).register_forward_hook(keep)
    try:
        F.cross_entropy(model(x), y).backward()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    z = seen["z"]
    return bool(((z == 0) & (z.grad != 0)).any())


def first_step_errors(model, point, last, etas, x, y):
    """Relative error of one SGD step's loss change against ``-eta |g|^2`` at each eta, ``g`` the
    probe's ``C`` (checked equal to autograd's gradient of the grown model's new parameters)."""
    protocol = fs.GrowthProtocol([point], seed=7)
    probe = fs.Probe(model, points=[point], cross=protocol)
    probe.step((x, y), fs.classification_loss)
    acc = probe.cross_stats[point]
    # the step is on the summed loss (its rounding is n times smaller relative to eta |g|^2 than the
    # mean's): g = n C, C = E[c_i] the probe's cross-gradient, [dγ ; dβ]
    g_probe = acc.c_sum.flatten()
    errors = {}
    for eta in etas:
        grown = copy.deepcopy(model)
        # the block with the BatchNorm statistics the probe calibrated and measured with
        result = fs.grow(grown, protocol, batchnorm_stats=probe)
        params = new_parameters(grown, result)
        only_trainable(grown, params)
        block = result.positions[point]
        loss0 = F.cross_entropy(grown(x), y, reduction="sum")
        grads = torch.autograd.grad(loss0, params)
        by_param = dict(zip(result.new_parameters, grads))
        g_autograd = torch.cat([by_param[f"{block}.{last}.{n}"] for n in ("weight", "bias")])
        # at the origin only the zero BatchNorm has a gradient, and the probe's C is that gradient
        assert all(not g.any() for n, g in by_param.items() if f".{last}." not in n)
        assert torch.allclose(g_probe, g_autograd, rtol=1e-10, atol=1e-14) and g_autograd.abs().max() > 1e-6
        predicted = -eta * float(g_probe @ g_probe)
        with torch.no_grad():
            for p, g in zip(params, grads):
                p -= eta * g
            change = float(F.cross_entropy(grown(x), y, reduction="sum") - loss0)
        errors[eta] = abs(change - predicted) / abs(predicted)
    return errors


@pytest.mark.parametrize(
    ("kind", "point", "etas"),
    [
        ("basic", "layer3.2", (1e-2, 1e-3, 1e-4, 1e-5)),
        ("bottleneck", "layer4.1", (1e-2, 1e-3, 1e-4, 1e-5)),
        ("basic", "layer1.1", (1e-4, 1e-5)),
        ("bottleneck", "layer2.0", (1e-4, 1e-5)),
    ],
)
def test_first_sgd_step_on_the_new_block_is_first_order_in_eta(kind, point, etas):
    """One SGD step of size eta on the new block's parameters (fp64, eval mode) changes the loss by
    ``-eta |g|^2 (1 + a eta + b eta^2 + ...)``: the relative error shrinks linearly with eta.

    The ratio of the errors at eta and eta/10 is ``10 (1 + 0.9 (b/a) eta)`` plus rounding
    (``~eps |loss| / (eta |g|^2)``, at most 3 % of the error here): measured 9.2-10.0, hence
    [8.5, 11.5]. A kink at the origin (a trailing ``relu(z + branch)``, with the probe's
    ReLU gate to match) leaves an error that does not shrink (5e-3 to 1e-2 here at every eta, some
    below 1e-2 at 1e-4: the ratio is what tells): ratio ~1. The etas are those below which no ReLU further down changes
    sign (the loss is piecewise smooth): from 1e-2 after the last blocks, 1e-4 earlier."""
    model, side, last = build(kind)
    model.eval()
    x, y = batch(16, side, 31)
    assert stream_has_zeros_with_gradient(model, point, x, y)
    errors = first_step_errors(model, point, last, etas, x, y)
    assert errors[1e-4] <= 1e-2, errors
    for eta in etas[:-1]:
        ratio = errors[eta] / errors[eta / 10]
        assert 8.5 <= ratio <= 11.5, (eta, ratio, errors)


@pytest.mark.parametrize("kind", ["basic", "bottleneck"])
def test_probe_matches_per_sample_gradients_of_all_new_parameters(kind):
    """``|C|^2``, SE, z and p of the probe against per-sample gradients of every new parameter of
    the fs.grow-grown fp64 ResNet (eval mode), to 1e-10; the reference knows nothing of which
    parameters are zero (the others' gradients are zero at the origin: checked)."""
    model, side, last = build(kind)
    points = list(describe(model).boundaries)[::2]
    protocol = fs.GrowthProtocol(points, seed=2)
    x, y = batch(6, side, 12)
    probe = fs.Probe(model, points=points, cross=protocol)
    probe.step((x, y), fs.classification_loss)
    for point in points:
        grown = copy.deepcopy(model).eval()
        result = fs.grow(grown, protocol, at=[point], batchnorm_stats=probe)
        params = new_parameters(grown, result)
        only_trainable(grown, params)
        rows = []
        for b in range(x.shape[0]):
            loss = F.cross_entropy(grown(x[b : b + 1]), y[b : b + 1])
            rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
        c = torch.stack(rows)
        zero_bn = [i for i, n in enumerate(result.new_parameters) if f".{last}." in n]
        assert len(zero_bn) == 2 and len(params) > 2
        assert_matches(probe.saturation(point), c, 1e-12)


@pytest.mark.parametrize("kind", ["basic", "tiny_basic", "bottleneck"])
def test_zero_growth_is_bit_identical_at_every_boundary(kind):
    """Every boundary the architecture offers (each stage's first, inner and last block, after a
    downsampling block), all at once, in eval and train mode; then again after the inserted blocks
    (trained, so their outputs are no ReLU outputs: the identity at the origin does not need one)."""
    model, side, _ = build(kind)
    x, y = batch(4, side, 3)
    points = list(describe(model).boundaries)
    reference = copy.deepcopy(model)
    grown = copy.deepcopy(model)
    result = fs.grow(grown, fs.GrowthProtocol(points, seed=1))
    for mode in ("eval", "train"):
        getattr(grown, mode)(), getattr(reference, mode)()
        with torch.no_grad():
            assert torch.equal(grown(x), reference(x)), mode
    for name in result.positions.values():
        block = grown.get_submodule(name)
        assert block.out_relu is False and block.downsample is None
    # train the new blocks a little, then grow after each of them
    params = new_parameters(grown, result)
    only_trainable(grown, params)
    grown.eval()
    opt = torch.optim.SGD(params, lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(grown(x), y).backward()
        opt.step()
    after_new = list(result.positions.values())
    with torch.no_grad():
        outputs = {}
        hooks = [
            grown.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: outputs.__setitem__(n, o))
            for n in after_new
        ]
        before = grown(x)
        for h in hooks:
            h.remove()
    assert any(bool((o < 0).any()) for o in outputs.values())
    regrown = copy.deepcopy(grown)
    fs.grow(regrown, fs.GrowthProtocol(after_new, seed=2))
    with torch.no_grad():
        assert torch.equal(regrown(x), before)


@pytest.mark.parametrize("cls", [BasicBlock, Bottleneck])
def test_zero_block_is_the_identity_on_any_stream(cls, gen):
    """The inserted form at its origin is the identity on a stream of either sign (the old
    ``relu(z + 0)`` is so only for ``z >= 0``), in eval and train mode."""
    ch = 8
    block = cls(ch, ch // cls.expansion, out_relu=False).double()
    last = block.bn2 if cls is BasicBlock else block.bn3
    with torch.no_grad():
        last.weight.zero_()
        last.bias.zero_()
    z = torch.randn(3, ch, 5, 5, generator=gen, dtype=F64)
    assert bool((z < 0).any())
    for mode in ("eval", "train"):
        getattr(block, mode)()
        with torch.no_grad():
            assert torch.equal(block(z), z), mode


def test_default_blocks_keep_the_trailing_relu_and_the_flag_is_checked(gen):
    """Existing models are unchanged (a trailing ReLU by default); a non-bool flag is refused."""
    model = build("basic")[0]
    assert all(getattr(m, "out_relu", True) for m in model.modules())
    block = model.layer1[1].eval()
    z = torch.randn(2, 4, 6, 6, generator=gen, dtype=F64)
    with torch.no_grad():
        branch = block.bn2(block.conv2(block.relu(block.bn1(block.conv1(z)))))
        assert torch.equal(block(z), torch.relu(branch + z))
    for bad in (0, 1, None, "no"):
        with pytest.raises(fs.FusedStatsError, match="out_relu must be True or False"):
            BasicBlock(4, 4, out_relu=bad)
        with pytest.raises(fs.FusedStatsError, match="out_relu must be True or False"):
            Bottleneck(8, 2, out_relu=bad)
    assert "out_relu=False" in repr(BasicBlock(4, 4, out_relu=False)) and "out_relu" not in repr(model)


def test_random_and_copy_growth_keep_their_forms(gen):
    """``init="random"``: the fresh block without zeroing, ``x + F(x)`` (checked against its
    explicit formula); ``init="copy"`` (G_stack): an exact copy of the block before the boundary,
    its own ``out_relu`` included (True after an original block, False after an inserted one)."""
    model, side, _ = build("basic")
    x = torch.randn(2, 3, side, side, generator=gen, dtype=F64)
    rand = copy.deepcopy(model).eval()
    result = fs.grow(rand, fs.GrowthProtocol(["layer1.1"], init="random", seed=3))
    block = rand.get_submodule(result.positions["layer1.1"])
    assert block.out_relu is False and bool(block.bn2.weight.any())
    z = torch.randn(2, 4, 6, 6, generator=gen, dtype=F64).relu()
    with torch.no_grad():
        branch = F.conv2d(
            block.relu(block.bn1(F.conv2d(z, block.conv1.weight, padding=1))), block.conv2.weight, padding=1
        )
        branch = F.batch_norm(
            branch, block.bn2.running_mean, block.bn2.running_var, block.bn2.weight, block.bn2.bias
        )
        assert torch.allclose(block(z), z + branch, rtol=1e-12, atol=1e-14)
        assert bool((block(z) < 0).any())  # no ReLU after the sum
    copied = copy.deepcopy(model)
    fs.grow(copied, fs.GrowthProtocol(["layer1.1"], init="copy"))
    assert copied.layer1[2].out_relu is True
    grown = copy.deepcopy(model)
    fs.grow(grown, fs.GrowthProtocol(["layer1.1"], seed=1))  # the zero block is layer1.2
    with torch.no_grad():
        grown.layer1[2].bn2.weight.normal_(generator=gen)
    fs.grow(grown, fs.GrowthProtocol(["layer1.2"], init="copy"))
    assert grown.layer1[3].out_relu is False
    for k, v in grown.layer1[2].state_dict().items():
        assert torch.equal(v, grown.layer1[3].state_dict()[k]), k
    with torch.no_grad():
        z = grown.layer1[:2](grown.relu(grown.bn1(grown.conv1(x))))
        once = grown.layer1[2](z)
        assert torch.equal(grown.layer1[3](z), once)


def test_grown_resnet_reloads_bit_identical(gen):
    """``torch.save(model)`` / ``torch.load`` keeps each block's form; a state_dict loads into the
    architecture rebuilt by replaying the growth; ``fs.stream_blocks`` runs the same blocks; a
    module pickled before the flag existed loads as the trailing-ReLU block it was."""
    model, side, _ = build("bottleneck")
    x = torch.randn(3, 3, side, side, generator=gen, dtype=F64)
    protocol = fs.GrowthProtocol(["layer1.1", "layer4.1"], seed=5)
    grown = copy.deepcopy(model)
    result = fs.grow(grown, protocol)
    with torch.no_grad():
        for name in result.positions.values():
            grown.get_submodule(name).bn3.weight.normal_(generator=gen)  # "trained": no longer zero
    grown.eval()
    with torch.no_grad():
        expected = grown(x)
    buffer = io.BytesIO()
    torch.save(grown, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False).eval()
    flags = [getattr(m, "out_relu", None) for m in loaded.modules()]
    assert flags == [getattr(m, "out_relu", None) for m in grown.modules()] and False in flags
    rebuilt = copy.deepcopy(model)
    fs.grow(rebuilt, protocol)
    rebuilt.load_state_dict(grown.state_dict())
    with torch.no_grad():
        assert torch.equal(loaded(x), expected)
        assert torch.equal(rebuilt.eval()(x), expected)
    with fs.stream_blocks(grown) as streamed, torch.no_grad():  # weights streamed block by block
        assert torch.equal(streamed.model(x), expected)
    old = copy.deepcopy(model.layer2[0]).eval()
    del old.__dict__["out_relu"]
    z = torch.randn(2, old.conv1.in_channels, 6, 6, generator=gen, dtype=F64)
    with torch.no_grad():
        assert bool((old(z) >= 0).all()) and torch.equal(old(z), model.layer2[0].eval()(z))


@pytest.mark.parametrize("kind", ["basic", "bottleneck"])
def test_places_that_are_not_block_boundaries_are_refused_with_nothing_changed(kind):
    """Only block outputs are boundaries: the stem (its conv, BatchNorm, ReLU, max-pool), a block's
    inner modules and the head are refused, naming the point, with the model unchanged."""
    model, _, _ = build(kind)
    offered = set(describe(model).boundaries)
    assert offered == set(fs.residual_points(model))
    before = copy.deepcopy(model.state_dict())
    structure = repr(model)
    stem = ["conv1", "bn1", "relu"] + (["maxpool"] if kind == "bottleneck" else [])
    for point in [*stem, "layer1.0.bn1", "layer1.0.relu", "fc"]:
        assert point not in offered
        with pytest.raises(fs.FusedStatsError, match=rf"candidate '{point}' is not a residual point"):
            fs.grow(model, fs.GrowthProtocol([point]))
    assert repr(model) == structure
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
