"""One gradient sink per point and step (fused_stats/api/probe/sink.py), for Probe.step and observe.

References: a per-sample loop with one ``torch.autograd.grad`` per sample
(tests/per_sample_reference.py: hooks that only record the outputs, parameters left trainable) and
the staged fold (a probe with a callback, whose step takes one ``autograd.grad`` with respect to
every point's output and folds the whole gradients afterwards). The cases are those the
in-backward fold once got wrong: two parallel branches fed by a model input that requires grad,
and a loss that calls ``torch.autograd.grad`` through the graph itself (a gradient penalty).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.api.probe.sink import GradientSink

from per_sample_reference import assert_estimate_matches, point_grads_one_sample
from tiny_models import TanhBlock

F64 = torch.float64
B, T, D = 6, 5, 4


class TwoBranches(nn.Module):
    """``x -> a(x), b(x) -> head(a * b)``: neither branch's output depends on the other's."""

    def __init__(self, d):
        super().__init__()
        self.a, self.b = TanhBlock(d), TanhBlock(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.a(x) * self.b(x)).squeeze(-1)


class Stack(nn.Module):
    def __init__(self, d, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(TanhBlock(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def branch_loss(model, batch):
    """Per-sample losses of the branch model; the input requires grad (a saliency setting)."""
    x = batch["x"].clone().requires_grad_()
    return (model(x) ** 2).sum(dim=-1)


def penalty_loss(model, batch):
    """Per-sample squared output plus a gradient penalty ``|∂(Σ_t out_t)/∂h_1|²`` of the sample,
    ``h_1`` the first block's output, taken with the loss's own ``torch.autograd.grad``."""
    seen = {}
    handle = model.blocks[0].register_forward_hook(lambda m, a, out: seen.setdefault("h", out))
    try:
        out = model(batch["x"])
    finally:
        handle.remove()
    (g,) = torch.autograd.grad(out.sum(), seen["h"], create_graph=True)
    return (out**2).sum(dim=-1) + 0.3 * (g**2).sum(dim=(1, 2))


def models_and_batch(kind):
    torch.manual_seed(11)
    model = (TwoBranches(D) if kind == "branches" else Stack(D)).to(F64)
    gen = torch.Generator().manual_seed(12)
    batch = {"x": torch.randn(B, T, D, generator=gen, dtype=F64)}
    points = ["a", "b"] if kind == "branches" else ["blocks.0", "blocks.1", "blocks.2"]
    loss = branch_loss if kind == "branches" else penalty_loss
    return model, batch, points, loss


def per_sample_rows(model, batch, points, loss):
    rows = {p: [] for p in points}
    for b in range(B):
        one = {k: v[b : b + 1] for k, v in batch.items()}
        grads = point_grads_one_sample(model, points, lambda m, one=one: loss(m, one)[0])
        for p in points:
            rows[p].append(grads[p][0].sum(0, keepdim=True))
    return {p: torch.cat(r) for p, r in rows.items()}


def staged_probe(model, points):
    probe = fs.Probe(model, points=points, second_moment="dense")
    probe.add_callback(lambda capture: None)  # a callback makes the step stage the gradients
    return probe


@pytest.mark.parametrize("kind", ["branches", "penalty"])
@pytest.mark.parametrize("atomic", [True, False])
def test_step_gives_the_per_sample_and_staged_values(kind, atomic):
    model, batch, points, loss = models_and_batch(kind)
    probe = fs.Probe(model, points=points, second_moment="dense")
    probe.step(batch, loss, atomic=atomic)
    staged = staged_probe(model, points)
    staged.step(batch, loss)
    rows = per_sample_rows(model, batch, points, loss)
    for p in points:
        assert_estimate_matches(probe.estimate(p), rows[p], rel=1e-10, context=f"{kind} {p}")
        got, want = probe.estimate(p), staged.estimate(p)
        for key in ("trace_sigma", "mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2"):
            assert getattr(got, key) == pytest.approx(getattr(want, key), rel=1e-10, abs=1e-300), (p, key)


def test_a_parallel_branch_becomes_a_leaf_of_its_own():
    model, batch, points, _ = models_and_batch("branches")
    capture = fs.api.probe.hooks.ActivationCapture(model, points)
    x = batch["x"].clone().requires_grad_()
    with capture:
        model(x)
    assert [t.grad_fn for t in capture.leaves] == [None, None]
    assert set(capture.captured) == {"a", "b"}


def test_a_branch_without_grad_is_a_leaf_too():
    """The input does not require grad: ``b``'s output does not either, and must become a leaf
    (else no gradient would reach it)."""
    model, batch, points, _ = models_and_batch("branches")

    def loss(m, batch):
        return (m(batch["x"]) ** 2).sum(dim=-1)

    probe = fs.Probe(model, points=points, second_moment="dense")
    probe.step(batch, loss)
    rows = per_sample_rows(model, batch, points, loss)
    for p in points:
        assert_estimate_matches(probe.estimate(p), rows[p], rel=1e-10, context=p)


def _observe(model, points, batch, loss):
    probe = fs.Probe(model, points=points, second_moment="dense")
    with probe.observe(loss_reduction="sum"):
        loss(model, batch).sum().backward()
    model.zero_grad(set_to_none=True)
    return probe


def test_observe_shares_the_sink_on_parallel_branches():
    model, batch, points, loss = models_and_batch("branches")
    observed = _observe(model, points, batch, loss)
    rows = per_sample_rows(model, batch, points, loss)
    for p in points:
        assert_estimate_matches(observed.estimate(p), rows[p], rel=1e-10, context=p)


def test_observe_refuses_the_loss_s_own_autograd_grad():
    """observe cannot tell the training step's backward from a ``torch.autograd.grad`` inside the
    loss: the second arrival is refused, and nothing is accumulated."""
    model, batch, points, loss = models_and_batch("penalty")
    probe = fs.Probe(model, points=points, second_moment="dense")
    with (
        pytest.raises(fs.FusedStatsError, match="more than one gradient"),
        probe.observe(loss_reduction="sum"),
    ):
        loss(model, batch).sum().backward()
    assert probe.table == {} and probe.steps["train"] == 0


def test_observe_refuses_a_point_the_backward_skipped():
    """A backward with ``inputs=`` that stops above a point: its output is in the loss's graph
    but no gradient reached it; refused (a zero would be wrong), nothing accumulated."""
    model, batch, points, _ = models_and_batch("penalty")
    probe = fs.Probe(model, points=points, second_moment="dense")
    with (
        pytest.raises(fs.FusedStatsError, match="no gradient reached them"),
        probe.observe(loss_reduction="sum"),
    ):
        out = model(batch["x"])
        (out**2).sum().backward(inputs=[model.blocks[2].lin.weight])
    assert probe.table == {} and probe.steps["train"] == 0


def test_the_sink_counts_arrivals():
    """The sink's rules on their own: arrivals outside the own backward are not counted, a second
    arrival is refused, a point in the graph without an arrival is refused, one outside it is a
    zero gradient."""
    x = torch.randn(3, requires_grad=True)
    used, unused = x * 2, x * 3
    total = (used**2).sum()
    sink = GradientSink(["used", "unused"], own_backward=True)

    def hook(name):
        def count(grad):
            sink.accept(name)

        return count

    for name, t in (("used", used), ("unused", unused)):
        sink.watch(name, t)
        t.register_hook(hook(name))
    torch.autograd.grad(total, x, retain_graph=True)  # not the sink's backward
    assert sink.arrivals == {"used": 0, "unused": 0}
    with sink.own_backward_of(total):
        torch.autograd.grad(total, x, retain_graph=True)
    assert sink.arrivals == {"used": 1, "unused": 0}
    assert sink.check(total.grad_fn) == ["unused"]  # no path from the loss: exactly zero
    # a backward run inside the sink's own one (a custom Function's, here a hook's) is not its
    nested = GradientSink(["used"], own_backward=True)
    used.register_hook(lambda g: (nested.accept("used"), None)[1])

    def inner_backward(grad):
        with torch.enable_grad():
            torch.autograd.grad((used**3).sum(), x, retain_graph=True)

    with nested.own_backward_of(total):
        total.register_hook(inner_backward)
        torch.autograd.grad(total, x, retain_graph=True)
    assert nested.arrivals == {"used": 1}
    with sink.own_backward_of(total):
        torch.autograd.grad(total, x, retain_graph=True)
    with pytest.raises(fs.FusedStatsError, match="more than one gradient"):
        sink.check(total.grad_fn)
    pruned = GradientSink(["used"], own_backward=False)
    pruned.watch("used", used)
    with pytest.raises(fs.FusedStatsError, match="no gradient reached them"):
        pruned.check(total.grad_fn)


# ---------------------------------------------------------------------------- a probe's layout
def test_a_probe_made_before_growth_refuses_to_step():
    """After growing at the input boundary ``model.layers.0`` is the new block: the probe names
    the point, and no accumulator, counter or parameter changes (observe too)."""
    from test_growth_tangent import make_model, padded_batch, per_sample_loss

    model, stack = make_model("llama", seed=1)
    points = [f"{stack}.0", f"{stack}.1"]
    probe = fs.Probe(model, points=points, second_moment="dense")
    batch = padded_batch(5, 6, seed=3)
    probe.step(batch, per_sample_loss)
    before = {k: a.copy() for k, a in probe.table.items()}
    fs.grow(model, fs.GrowthProtocol(candidates=["model.embed_tokens"], seed=2))
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(fs.FusedStatsError, match=r"point 'model\.layers\.0' now names"):
        probe.step(batch, per_sample_loss)
    stale = r"point 'model\.layers\.0' now names"
    with pytest.raises(fs.FusedStatsError, match=stale), probe.observe(loss_reduction="sum"):
        per_sample_loss(model, batch).sum().backward()
    assert probe.steps["train"] == 1 and set(probe.table) == set(before)
    for key, acc in probe.table.items():
        assert acc.n == before[key].n and torch.equal(acc.s, before[key].s)
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    fs.Probe(model, points=points, second_moment="dense").step(batch, per_sample_loss)  # a new one steps


def test_a_protocol_probe_measures_the_protocol_s_candidates_by_default():
    from test_growth_tangent import make_model, padded_batch, per_sample_loss

    from fused_stats.api.growth.architecture import describe

    model, stack = make_model("llama", seed=1)
    candidates = [describe(model).input_point, f"{stack}.0", f"{stack}.1"]
    probe = fs.Probe(model, cross=fs.GrowthProtocol(candidates, seed=1))
    assert probe.points == candidates
    probe.step(padded_batch(5, 6, seed=3), per_sample_loss)
    assert set(probe.cross_stats) == set(candidates)
    assert fs.Probe(model).points == [f"{stack}.0", f"{stack}.1"]  # without a protocol: residual


# ---------------------------------------------------------------------------- pinned behaviours
class Mlp(nn.Module):
    """(B, d) points: ``blocks.i`` are tanh residual blocks on a (B, d) stream."""

    def __init__(self, d, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(TanhBlock(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


class Poison(nn.Module):
    """Identity in the forward; the gradient passing back through it gets an Inf."""

    def forward(self, x):
        return _PoisonFn.apply(x)


class _PoisonFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[0, 0] = float("inf")
        return g


def test_per_point_mode_on_one_row_per_sample_points_commits_the_points_above_a_failure():
    """atomic=False on (B, d) points is the per-point mode too (not the staged step): the Inf
    made below ``blocks.2`` reaches ``blocks.1`` and ``blocks.0``; ``blocks.2`` keeps the batch."""
    torch.manual_seed(3)
    model = Mlp(D).to(F64)
    model.blocks[2].lin = nn.Sequential(Poison(), model.blocks[2].lin)
    x = torch.randn(8, D, dtype=F64, generator=torch.Generator().manual_seed(4))

    def loss(m, x):
        return m(x) ** 2

    probe = fs.Probe(model, points=["blocks.0", "blocks.1", "blocks.2"], nonfinite="skip")
    probe.step(x, loss, atomic=False)
    assert probe.stats["blocks.2"].n == 8
    assert ("grad", "train", "blocks.1") not in probe.table and (
        "grad",
        "train",
        "blocks.0",
    ) not in probe.table
    assert probe.skipped_steps["train"] == 1 and probe.steps["train"] == 0


def test_an_in_place_change_of_the_probe_s_own_leaf_is_refused():
    """The first point's output is the probe's leaf; a module after it that changes it in place
    would make its gradient that of another tensor."""

    class InPlaceAfter(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = TanhBlock(D), TanhBlock(D)

        def forward(self, x):
            h = self.first(x)
            with torch.no_grad():  # e.g. a clamp done outside autograd: the version changes
                h.mul_(2.0)
            return self.second(h).sum(dim=(1, 2))

    model = InPlaceAfter().to(F64)
    probe = fs.Probe(model, points=["first", "second"])
    x = torch.randn(4, 3, D, dtype=F64)
    with pytest.raises(fs.FusedStatsError, match=r"points \['first'\] were modified in place"):
        probe.step(x, lambda m, x: m(x))
    assert probe.table == {}


def test_per_point_mode_with_a_growth_protocol_is_refused():
    from test_growth_tangent import make_model, padded_batch, per_sample_loss

    model, stack = make_model("llama", seed=1)
    probe = fs.Probe(model, points=[f"{stack}.0"], cross=fs.GrowthProtocol([f"{stack}.0"]))
    with pytest.raises(fs.FusedStatsError, match="atomic=False"):
        probe.step(padded_batch(4, 6, seed=3), per_sample_loss, atomic=False)
    assert probe.table == {} and probe.steps["train"] == 0


def test_a_point_the_loss_does_not_use_gets_its_exact_zero_gradient():
    """No path from the loss to ``b`` (it runs, its output is dropped): the step folds a zero
    gradient at ``b``, as the staged fold's materialised gradient, not a refusal."""

    class DroppedBranch(TwoBranches):
        def forward(self, x):
            self.b(x)
            return self.head(self.a(x)).squeeze(-1)

    torch.manual_seed(5)
    model = DroppedBranch(D).to(F64)
    batch = {"x": torch.randn(B, T, D, generator=torch.Generator().manual_seed(6), dtype=F64)}
    points = ["a", "b"]
    probe = fs.Probe(model, points=points, second_moment="dense")
    probe.step(batch, branch_loss)
    staged = staged_probe(model, points)
    staged.step(batch, branch_loss)
    assert probe.stats["b"].n == B and probe.estimate("b").trace_sigma == 0.0
    assert torch.equal(probe.stats["b"].s, staged.stats["b"].s)
    assert probe.estimate("a").mu_norm2 == pytest.approx(staged.estimate("a").mu_norm2, rel=1e-12)


def test_without_graph_task_ids_the_own_backward_window_still_excludes_the_loss_s_grad(monkeypatch):
    """On a torch without ``_current_graph_task_id`` (every id -1), only the window around the
    step's own backward tells the loss's autograd.grad apart: the values stay the per-sample ones."""
    import fused_stats.api.probe.sink as sink

    monkeypatch.setattr(sink, "graph_task_id", lambda: -1)
    model, batch, points, loss = models_and_batch("penalty")
    probe = fs.Probe(model, points=points, second_moment="dense")
    probe.step(batch, loss)
    rows = per_sample_rows(model, batch, points, loss)
    for p in points:
        assert_estimate_matches(probe.estimate(p), rows[p], rel=1e-10, context=p)


class Transposed(nn.Module):
    """A point whose feature axis is 1: (B, T, d) in, (B, d, T) out."""

    def forward(self, x):
        return x.transpose(1, 2)


class MixedAxes(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.block, self.turn, self.head = TanhBlock(d), Transposed(), nn.Linear(d, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.turn(self.block(x))).transpose(1, 2)).squeeze(-1)


def test_observe_masks_a_point_whose_feature_axis_is_not_last_as_the_step_does():
    """``turn``'s gradient is kept whole by observe's lean path (features on axis 1) and masked
    at exit; ``block``'s is summed as it arrives: both as ``Probe.step`` with the same mask."""
    torch.manual_seed(7)
    model = MixedAxes(D).to(F64)
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(8), dtype=F64)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 3:], mask[2, 1:], mask[4, :2] = 0, 0, 0
    points, axes = ["block", "turn"], {"turn": 1}

    def loss(m, x):
        return (m(x) ** 2).sum(dim=-1)

    stepped = fs.Probe(model, points=points, feature_dim=axes, second_moment="dense")
    stepped.step(x, loss, mask=mask)
    observed = fs.Probe(model, points=points, feature_dim=axes, second_moment="dense")
    with observed.observe(loss_reduction="sum", mask=mask, batch=x):
        loss(model, x).sum().backward()
    model.zero_grad(set_to_none=True)
    for p in points:
        a, b = observed.estimate(p), stepped.estimate(p)
        assert a.n == b.n == B
        for key in ("trace_sigma", "mu_norm2", "mu_norm4", "trace_sigma2"):
            assert getattr(a, key) == pytest.approx(getattr(b, key), rel=1e-12), (p, key)
