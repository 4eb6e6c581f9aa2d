"""Direct interventions: the measured test-loss change of one gradient step on
an inserted zero bias / zero-output block against its first-order prediction.

Set-up: a residual MLP (``x + fc2(tanh(fc1 x))`` blocks) trained here in fp64 for 200 Adam steps
on a synthetic 4-class task (tanh-teacher logits, sampled labels), 512 train and 256 held-out
samples. ``fs.intervene`` at the middle block, both kinds, η from 1 down to 1e-3.

Checked against independent references:

* a hand reference (``hand_reference``, no package code): a forward hook written here adds the
  zero bias / ``W_out φ(W_in z)`` (the test's own ``W_in``, φ from its formula) to the point's
  output; autograd gives the gradients of the MEAN train and test losses w.r.t. the inserted
  parameter (one backward each) in eval mode; the inner product behind the prediction
  (``μ_Mᵀg_K`` or ``<C_M, C_K>_F``) is their dot product (rel 1e-9); the mean test loss with the
  parameter set to the step ``Δ = −η g_M`` and to its mirror ``−Δ`` gives every row's ``measured``
  as the central difference ``(L(Δ) − L(−Δ))/2`` and its ``one_sided`` as ``L(Δ) − L(0)``
  (rel 1e-9), and ``predicted`` must be ``−η · inner``;
* the base loss against the unmodified model's mean test loss;
* measured and predicted agree in sign at every η, ``|ratio − 1|`` shrinks with η, the ratio is
  in [0.95, 1.05] at the smallest η and ``|ratio − 1| > 1e-6`` at η = 1 (the measurement is not
  trivially first order);
* the zero-state Adam step's rows against a real ``torch.optim.Adam`` step and its mirror; at a
  step where the curvature term makes the one-sided ratio miss 1 by far, the central one is
  within a few % of 1;
* the model is left exactly as it was (state dict, module tree, hooks, training and requires_grad
  flags), also when the loss function fails half-way.

A conv net (CIFAR ResNet, untrained, random batch-norm statistics) checks the NCHW wiring
(channels as features) of both kinds against the same hand reference.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.networks.resnet import cifar_resnet20

F64 = torch.float64
ETAS = [1.0, 0.3, 0.1, 0.03, 0.01, 1e-3]


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class ResMLP(nn.Module):
    def __init__(self, din=8, d=16, h=32, depth=3, classes=4):
        super().__init__()
        self.embed = nn.Linear(din, d)
        self.blocks = nn.Sequential(*[Block(d, h) for _ in range(depth)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


def loss_fn(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")


@pytest.fixture(scope="module")
def trained():
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(8, 4, generator=g, dtype=F64)

    def data(n):
        x = torch.randn(n, 8, generator=g, dtype=F64)
        probs = torch.softmax(2 * torch.tanh(x) @ teacher, dim=1)
        return x, torch.multinomial(probs, 1, generator=g).squeeze(1)

    xtr, ytr = data(512)
    xte, yte = data(256)
    torch.manual_seed(0)
    model = ResMLP().double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
        idx = torch.randint(0, 512, (64,), generator=g)
        loss = loss_fn(model, (xtr[idx], ytr[idx])).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    train = [(xtr[i : i + 128], ytr[i : i + 128]) for i in range(0, 512, 128)]
    test = [(xte[i : i + 100], yte[i : i + 100]) for i in range(0, 256, 100)]
    return model, train, test


def state(model):
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [n for n, _ in model.named_modules()],
        [(m.training, len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()],
        [p.requires_grad for p in model.parameters()],
    )


def assert_unchanged(model, before):
    sd, names, flags, req = before
    now = model.state_dict()
    assert list(now) == list(sd) and all(torch.equal(now[k], v) for k, v in sd.items())
    assert [n for n, _ in model.named_modules()] == names
    assert [(m.training, len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()] == flags
    assert [p.requires_grad for p in model.parameters()] == req


PHI = {"gelu": lambda x: 0.5 * x * (1 + torch.erf(x / 2**0.5)), "relu": lambda x: x.clamp(min=0)}


def adding_hook(theta, kind, w_in, activation, feature_dim):
    """A forward hook adding ``θ`` (bias) or ``θ φ(W_in z)`` (block, features on ``feature_dim``)
    to a module's output."""
    d = w_in.shape[1]

    def hook(module, args, out):
        if kind == "bias":
            shape = [1] * out.dim()
            shape[feature_dim] = d
            return out + theta.view(shape)
        zz = out.movedim(feature_dim, -1)
        return out + (PHI[activation](zz @ w_in.T) @ theta.T).movedim(-1, feature_dim)

    return hook


def hand_reference(model, point, train, test, kind, w_in, activation, etas, feature_dim):
    """Everything behind ``fs.intervene`` redone by hand (no package code): a forward hook adds
    ``b`` or ``W_out φ(W_in z)`` (features on ``feature_dim``) to the point's output, with the
    parameter θ a plain zero tensor; in eval mode the gradients of the MEAN train and test losses
    w.r.t. θ (one backward each) give ``g_M``, ``g_K`` and ``inner = <g_M, g_K>``; the base loss is
    the mean test loss at θ = 0, and for each η the mean test losses at θ = ±η g_M give the central
    difference and the one-sided change. Returns ``(inner, base, [(central, one_sided) per η])``."""
    d = w_in.shape[1]
    theta = torch.zeros(d if kind == "bias" else (d, w_in.shape[0]), dtype=F64, requires_grad=True)

    hook = adding_hook(theta, kind, w_in, activation, feature_dim)

    def mean_loss(batches):
        return sum(loss_fn(model, b).sum() for b in batches) / sum(b[1].shape[0] for b in batches)

    handle = model.get_submodule(point).register_forward_hook(hook)
    was = model.training
    model.eval()
    try:
        g_m = torch.autograd.grad(mean_loss(train), theta)[0]
        g_k = torch.autograd.grad(mean_loss(test), theta)[0]
        with torch.no_grad():
            base = float(mean_loss(test))
            measured = []
            for eta in etas:
                theta.copy_(-eta * g_m)
                after = float(mean_loss(test))
                theta.copy_(eta * g_m)
                mirror = float(mean_loss(test))
                measured.append(((after - mirror) / 2, after - base))
    finally:
        handle.remove()
        model.train(was)
    return float((g_m * g_k).sum()), base, measured


def hand_adam_reference(model, point, train, test, kind, w_in, activation, etas, feature_dim):
    """One step ``Δ`` of a fresh torch.optim.Adam (lr = η) on a hooked zero θ per η, on the
    gradient of the mean train loss: ``(<Δ/(−η), g_K>, [(central, one_sided) per η])`` with the
    mean test loss at θ = Δ and at its mirror θ = −Δ (as :func:`hand_reference`)."""
    d = w_in.shape[1]
    theta = torch.zeros(d if kind == "bias" else (d, w_in.shape[0]), dtype=F64, requires_grad=True)

    hook = adding_hook(theta, kind, w_in, activation, feature_dim)

    def mean_loss(batches):
        return sum(loss_fn(model, b).sum() for b in batches) / sum(b[1].shape[0] for b in batches)

    handle = model.get_submodule(point).register_forward_hook(hook)
    was = model.training
    model.eval()
    try:
        g_m = torch.autograd.grad(mean_loss(train), theta)[0]
        g_k = torch.autograd.grad(mean_loss(test), theta)[0]
        with torch.no_grad():
            base = float(mean_loss(test))
        measured, inner = [], None
        for eta in etas:
            with torch.no_grad():
                theta.zero_()
            opt = torch.optim.Adam([theta], lr=eta)
            theta.grad = g_m.clone()
            opt.step()
            with torch.no_grad():
                if inner is None:
                    inner = float((theta / -eta * g_k).sum())
                after = float(mean_loss(test))
                theta.neg_()
                mirror = float(mean_loss(test))
                measured.append(((after - mirror) / 2, after - base))
    finally:
        handle.remove()
        model.train(was)
    return inner, measured


@pytest.mark.parametrize("kind", ["bias", "block"])
def test_adam_table_against_real_adam_steps(trained, kind):
    model, train, test = trained
    w_in = torch.randn(8, 16, generator=torch.Generator().manual_seed(3), dtype=F64) / 4
    spec = fs.CrossSpec(w_in=w_in, activation="gelu")
    etas = [1e-2, 1e-3, 1e-4]
    result = fs.intervene(model, "blocks.1", train, test, etas, kind=kind, loss_fn=loss_fn, spec=spec)
    inner, measured = hand_adam_reference(model, "blocks.1", train, test, kind, w_in, "gelu", etas, -1)
    assert result.adam_inner == pytest.approx(inner, rel=1e-9) and result.adam_eps == 1e-8
    errors = []
    for r, (central, one_sided) in zip(result.adam_rows, measured):
        assert r.predicted == pytest.approx(-r.eta * inner, rel=1e-9)
        assert r.measured == pytest.approx(central, rel=1e-8, abs=1e-15)
        assert r.one_sided == pytest.approx(one_sided, rel=1e-8, abs=1e-15)
        errors.append(abs(r.ratio - 1))
    assert errors[-1] < 1e-2 and all(b < a for a, b in itertools.pairwise(errors)), errors
    assert "Zero-state Adam/AdamW first step" in result.to_markdown()
    assert len(result.to_dict()["adam_rows"]) == 3
    assert result.to_dict()["adam_rows"][0]["one_sided"] == result.adam_rows[0].one_sided


@pytest.mark.parametrize("kind", ["bias", "block"])
def test_adam_central_difference_removes_the_curvature(trained, kind):
    """Zero-state Adam steps η in every coordinate, so at η = 0.03 the curvature term ½ΔᵀHΔ is a
    large part of the one-sided change: its ratio misses 1 by > 20 %, while the central difference
    (the step against its mirror) is within 2 % of the prediction. The gap between the two is the
    curvature term, checked against a Hessian-vector product of the test loss at θ = 0."""
    model, train, test = trained
    w_in = torch.randn(8, 16, generator=torch.Generator().manual_seed(3), dtype=F64) / 4
    spec = fs.CrossSpec(w_in=w_in, activation="gelu")
    eta = 0.03
    result = fs.intervene(model, "blocks.1", train, test, eta, kind=kind, loss_fn=loss_fn, spec=spec)
    (row,) = result.adam_rows
    _, [(central, one_sided)] = hand_adam_reference(
        model, "blocks.1", train, test, kind, w_in, "gelu", [eta], -1
    )
    assert (row.measured, row.one_sided) == (
        pytest.approx(central, rel=1e-9),
        pytest.approx(one_sided, rel=1e-9),
    )
    assert abs(row.ratio - 1) < 0.02, row
    assert abs(row.one_sided / row.predicted - 1) > 0.2, row

    # one_sided − central = (L(Δ) + L(−Δ))/2 − L(0) = ½ΔᵀHΔ + O(η⁴): the curvature it removes
    d = w_in.shape[1]
    theta = torch.zeros(d if kind == "bias" else (d, w_in.shape[0]), dtype=F64, requires_grad=True)
    handle = model.get_submodule("blocks.1").register_forward_hook(adding_hook(theta, kind, w_in, "gelu", -1))
    was = model.training
    model.eval()
    try:
        losses = torch.cat([loss_fn(model, b) for b in train])
        g_m = torch.autograd.grad(losses.mean(), theta)[0]
        step = -eta * g_m / (g_m.abs() + 1e-8)  # Adam's first step from a zero state
        g_k = torch.autograd.grad(
            torch.cat([loss_fn(model, b) for b in test]).mean(), theta, create_graph=True
        )[0]
        hvp = torch.autograd.grad((g_k * step).sum(), theta)[0]
    finally:
        handle.remove()
        model.train(was)
    half_curvature = 0.5 * float((step * hvp).sum())
    assert row.one_sided - row.measured == pytest.approx(half_curvature, rel=0.02)


def plain_test_loss(model, test):
    was = model.training
    model.eval()
    with torch.no_grad():
        losses = torch.cat([loss_fn(model, b) for b in test])
    model.train(was)
    return float(losses.mean())


def check_rows(result, context, measured_ref):
    """``measured_ref``: the hand reference's (central, one-sided) change per η (same order as the
    rows)."""
    rows = result.rows
    assert [r.eta for r in rows] == sorted((r.eta for r in rows), reverse=True)
    assert len(measured_ref) == len(rows)
    for r, (central, one_sided) in zip(rows, measured_ref):
        assert r.predicted == pytest.approx(-r.eta * result.inner, rel=1e-15, abs=0), f"{context}: {r}"
        assert r.measured == pytest.approx(central, rel=1e-9, abs=0), f"{context}: measured {r} vs {central}"
        assert r.one_sided == pytest.approx(one_sided, rel=1e-9, abs=0), f"{context}: {r} vs {one_sided}"
        assert r.measured != 0 and (r.measured > 0) == (r.predicted > 0), (
            f"{context}: sign at eta={r.eta}: {r}"
        )
        assert r.ratio == pytest.approx(r.measured / r.predicted, rel=1e-15)
    errs = [abs(r.ratio - 1) for r in rows]
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(errs)), (
        f"{context}: |ratio-1| not shrinking: {errs}"
    )
    assert 0.95 <= rows[-1].ratio <= 1.05, f"{context}: ratio {rows[-1].ratio} at eta={rows[-1].eta}"
    # the largest step is visibly beyond first order: the measurement is not a copy of the prediction
    assert abs(rows[0].ratio - 1) > 1e-6, f"{context}: ratio {rows[0].ratio} at eta={rows[0].eta}"


@pytest.mark.parametrize("kind", ["bias", "block"])
def test_trained_resmlp_ratio_tends_to_one(trained, kind):
    model, train, test = trained
    model.train()
    model.head.bias.requires_grad_(False)  # flags of any kind must come back as they were
    before = state(model)
    w_in = torch.randn(8, 16, generator=torch.Generator().manual_seed(3), dtype=F64) / 4
    spec = fs.CrossSpec(w_in=w_in, activation="gelu")
    result = fs.intervene(model, "blocks.1", train, test, ETAS, kind=kind, loss_fn=loss_fn, spec=spec)
    assert_unchanged(model, before)
    model.head.bias.requires_grad_(True)
    assert (result.M, result.K, result.kind, result.point) == (512, 256, kind, "blocks.1")
    assert result.base_loss == pytest.approx(plain_test_loss(model, test), rel=1e-13)
    want, base, measured = hand_reference(model, "blocks.1", train, test, kind, w_in, "gelu", ETAS, -1)
    assert base == pytest.approx(plain_test_loss(model, test), rel=1e-13)  # the hook adds zeros
    assert result.inner == pytest.approx(want, rel=1e-9), (result.inner, want)
    assert abs(result.inner) > 1e-5  # a real signal
    check_rows(result, f"resmlp {kind}", measured)
    table = result.to_markdown()
    assert "| eta | predicted | measured (central) | ratio | one-sided step |" in table and table.count(
        "\n|"
    ) == 2 * (len(ETAS) + 2)  # header rule + rows, for SGD and for Adam
    assert result.to_dict()["rows"][0]["eta"] == 1.0


@pytest.mark.parametrize("kind", ["bias", "block"])
def test_resnet_conv_point(kind, gen):
    model = cifar_resnet20(width=4, seed=2, random_batchnorm=True).double()
    x = torch.randn(24, 3, 8, 8, generator=gen, dtype=F64)
    y = torch.randint(0, 10, (24,), generator=gen)
    train = [(x[:8], y[:8]), (x[8:16], y[8:16])]
    test = [(x[16:], y[16:])]
    before = state(model)
    channels = model.layer2[1].conv2.out_channels  # the stream's width at layer2.1
    w_in = torch.randn(3, channels, generator=gen, dtype=F64) / channels**0.5
    spec = fs.CrossSpec(w_in=w_in, activation="relu")
    etas = [1e-1, 1e-2, 1e-3]
    result = fs.intervene(
        model, "layer2.1", train, test, etas, kind=kind, loss_fn=fs.classification_loss, spec=spec
    )
    assert_unchanged(model, before)
    want, base, measured = hand_reference(model, "layer2.1", train, test, kind, w_in, "relu", etas, 1)
    assert result.inner == pytest.approx(want, rel=1e-9)
    assert result.base_loss == pytest.approx(base, rel=1e-13)
    for r, (central, one_sided) in zip(result.rows, measured):
        assert r.predicted == pytest.approx(-r.eta * result.inner, rel=1e-15, abs=0), r
        assert r.measured == pytest.approx(central, rel=1e-9, abs=0), (r, central)
        assert r.one_sided == pytest.approx(one_sided, rel=1e-9, abs=0), (r, one_sided)
    assert 0.95 <= result.rows[-1].ratio <= 1.05, result.to_markdown()
    assert (result.rows[-1].measured > 0) == (result.rows[-1].predicted > 0)


def test_bad_input_and_failure_leave_model_intact(trained):
    model, train, test = trained
    before = state(model)
    with pytest.raises(fs.FusedStatsError, match="kind"):
        fs.intervene(model, "blocks.1", train, test, 0.1, kind="mlp", loss_fn=loss_fn)
    for eta in (-0.1, [], [0.1, float("nan")], "big"):
        with pytest.raises(fs.FusedStatsError, match="eta"):
            fs.intervene(model, "blocks.1", train, test, eta, loss_fn=loss_fn)
    with pytest.raises(fs.FusedStatsError, match="loss_fn"):
        fs.intervene(model, "blocks.1", train, test, 0.1)
    calls = {"n": 0}

    def flaky(m, b):
        calls["n"] += 1
        if calls["n"] > len(train) + len(test) + 1:  # fails while the block is inserted
            raise RuntimeError("boom")
        return loss_fn(m, b)

    with pytest.raises(RuntimeError, match="boom"):
        fs.intervene(
            model, "blocks.1", train, test, 0.1, kind="block", loss_fn=flaky, spec=fs.CrossSpec(rank=2)
        )
    assert_unchanged(model, before)
    one = fs.intervene(model, "blocks.1", train, test, 0.01, loss_fn=loss_fn)
    assert len(one.rows) == 1 and one.rows[0].eta == 0.01


def test_demo_intervention_and_saturation_lines():
    """The demo's additions (fused_stats.demo.experiment): both intervention tables on an fp64 copy
    (the fp32 model untouched), and one saturation line per run with |C|^2 ± SE."""
    pytest.importorskip("transformers")
    from fused_stats.demo.experiment import DemoConfig, intervention_lines, probe_model, saturation_lines
    from fused_stats.demo.models import build_llama

    class Corpus:  # the two probe streams of the demo's corpus interface, random bytes
        def probe_batches(self, split, B, count):
            g = torch.Generator().manual_seed(0 if split == "train" else 1)
            return [torch.randint(0, 256, (B, 12), generator=g) for _ in range(count)]

    cfg = DemoConfig.quick(batch_size=4, probe_batches=2, seq_len=12, split=2, cross_rank=4)
    model = build_llama(16, 2, 12, seed=0)
    before = state(model)
    lines, dicts = intervention_lines(model, Corpus(), cfg, etas=(0.1, 0.01))
    assert_unchanged(model, before)
    assert [d["kind"] for d in dicts] == ["bias", "block"]
    for d in dicts:
        assert d["point"] == "model.layers.1" and d["M"] == d["K"] == 8
        assert [r["eta"] for r in d["rows"]] == [0.1, 0.01]
        assert all((r["measured"] > 0) == (r["predicted"] > 0) for r in d["rows"])
    header = "| eta | predicted | measured (central) | ratio | one-sided step |"
    assert sum(line.count(header) for line in lines) == 4  # SGD and Adam for both kinds
    report, probe = probe_model(model, Corpus(), cfg, {"width": 16, "depth": 2, "seed": 0})
    (line,) = saturation_lines([report])
    sat = probe.saturation("model.layers.1")
    # a negative plug-in variance (possible at this n) has no SE to print
    se = "SE not estimable at this n" if sat.cross_frob2_se is None else f"{sat.cross_frob2_se:.2g}"
    assert f"|C|_F^2 = {sat.cross_frob2:.3g} ± {se}" in line


def test_zero_prediction_has_no_ratio(gen):
    """A point whose output the loss ignores (multiplied by 0 downstream): every gradient there is
    exactly 0, so the prediction is 0 and the ratio is None (not NaN), shown as not estimable."""

    class Ignored(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x):
            return self.head(0 * self.inner(x) + x)

    model = Ignored().double()
    x = torch.randn(12, 4, generator=gen, dtype=F64)
    y = torch.randint(0, 3, (12,), generator=gen)
    result = fs.intervene(model, "inner", [(x[:6], y[:6])], [(x[6:], y[6:])], 0.1, loss_fn=loss_fn)
    for row in (*result.rows, *result.adam_rows):
        assert row.predicted == 0 and row.measured == 0 and row.ratio is None, row
    assert "nan" not in result.to_markdown().lower() and "not estimable" in result.to_markdown()
    assert result.to_dict()["rows"][0]["ratio"] is None
