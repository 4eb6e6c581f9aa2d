"""The accumulator protocol: declared state, the pure centre shift, the norm histogram (a third
statistic that is one file), the probe's table and its symmetric results.

References are independent of the code under test: sums recomputed from the raw vectors about the
new centre, numpy histograms of per-sample norms formed by explicit loops, per-sample
cross-gradients ``c_i = Σ_t q_t φ(W z_t)ᵀ`` built one sample at a time, per-sample backward passes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.accumulators import NormHistogram, shift, state_differences

from per_sample_reference import classification_sample_loss, point_grads_one_sample
from tiny_models import TanhBlock

F64 = torch.float64


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(20261201)


# ----------------------------------------------------------------------------- shift
def centred_sums(q: torch.Tensor, c: torch.Tensor) -> dict:
    """n, s, t, A1, A2, S and the pool rows of ``q`` about ``c``, straight from the definitions."""
    y = q - c
    sq = (y * y).sum(dim=1)
    return {
        "n": q.shape[0],
        "s": y.sum(0),
        "t": (sq[:, None] * y).sum(0),
        "a1": sq.sum(),
        "a2": (sq * sq).sum(),
        "S": y.T @ y,
        "pool": y,
        "gram": y @ y.T,
    }


@pytest.mark.parametrize("form", ["dense", "pool"])
def test_shift_matches_sums_recomputed_about_the_new_centre(form, gen):
    q = torch.randn(9, 5, generator=gen, dtype=F64) * 0.7 + 3.0
    old = torch.randn(5, generator=gen, dtype=F64)
    new = torch.randn(5, generator=gen, dtype=F64) + 2.0
    sums = centred_sums(q, old)
    if form == "dense":
        sums.pop("pool"), sums.pop("gram")
    else:
        sums.pop("S")
    frozen = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in sums.items()}
    moved = shift(sums, new - old)
    want = centred_sums(q, new)
    keys = ("s", "t", "a1", "a2") + (("S",) if form == "dense" else ("pool", "gram"))
    for key in keys:
        torch.testing.assert_close(moved[key], want[key], rtol=1e-11, atol=1e-9, msg=key)
    # pure: the input sums are untouched
    assert not state_differences(sums, frozen)


# ----------------------------------------------------------------------------- declared state
def test_load_state_dict_copies_into_fresh_allocations_and_checks_shapes(gen):
    acc = fs.GradStats(4, second_moment="dense", name="blocks.1")
    acc.update(torch.randn(7, 4, generator=gen, dtype=F64) + 1.0)
    state = acc.state_dict()
    # a state whose tensors are views at an odd offset of a shared buffer (as a file buffer gives)
    buffer = torch.zeros(1 + sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor)), dtype=F64)
    offset, viewed = 1, dict(state)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            view = buffer[offset : offset + value.numel()].view(value.shape)
            view.copy_(value)
            viewed[key] = view
            offset += value.numel()
    other = fs.GradStats(4, second_moment="dense", name="blocks.1")
    other.load_state_dict(viewed)
    assert other.same_state(acc)
    storages = {buffer.untyped_storage().data_ptr()}
    for f in other.FIELDS:
        value = getattr(other, f.name)
        if value is not None:
            assert value.untyped_storage().data_ptr() not in storages, f.name
            assert value.storage_offset() == 0, f.name
    buffer.add_(1.0)  # the caller's tensors change; the loaded state does not
    assert other.same_state(acc)
    bad = dict(state, S=state["S"][:3])
    with pytest.raises(fs.FusedStatsError, match=r"S has shape \(3, 4\).*\(4, 4\)"):
        other.load_state_dict(bad)
    assert other.same_state(acc)


def test_copy_is_independent_and_equal(gen):
    acc = fs.GradStats(3, second_moment="pool")
    acc.update(torch.randn(5, 3, generator=gen, dtype=F64))
    twin = acc.copy()
    assert twin.same_state(acc) and twin.config() == acc.config()
    twin.update(torch.randn(2, 3, generator=gen, dtype=F64))
    assert not twin.same_state(acc) and acc.n == 5


# ----------------------------------------------------------------------------- norm histogram
def numpy_histogram(norms: np.ndarray, low: float, high: float, bins: int) -> list[int]:
    edges = np.logspace(math.log10(low), math.log10(high), bins + 1)
    inside, _ = np.histogram(norms[(norms >= low) & (norms < high)], bins=edges)
    return [int((norms < low).sum()), *inside.tolist(), int((norms >= high).sum())]


def masked_sample_norms(g: torch.Tensor, m: torch.Tensor) -> list[float]:
    """|q_b| with q_b = Σ of the counted positions of sample b, one sample at a time."""
    out = []
    for b in range(g.shape[0]):
        rows = [g[b, t] for t in range(g.shape[1]) if bool(m[b, t])]
        if rows:
            out.append(float(torch.stack(rows).sum(0).norm()))
    return out


def test_norm_histogram_matches_numpy_and_merges_saves_and_reduces_by_declaration(tmp_path, gen):
    low, high, bins = 1e-2, 1e2, 12
    batches = []
    for B in (6, 9, 4):
        # norms spread over several decades, some outside [low, high)
        scale = torch.exp(torch.randn(B, 1, 1, generator=gen, dtype=F64) * 3.0)
        g = torch.randn(B, 3, 5, generator=gen, dtype=F64) * scale
        m = torch.rand(B, 3, generator=gen) > 0.3
        batches.append((g, m))
    norms = np.array([x for g, m in batches for x in masked_sample_norms(g, m)])
    want = numpy_histogram(norms, low, high, bins)
    assert want[0] > 0 or want[-1] > 0  # the data reach the outer bins
    one = NormHistogram(5, low=low, high=high, bins=bins, name="h")
    for g, m in batches:
        one.update(g, m)
    assert [int(v) for v in one.counts.tolist()] == want
    assert one.n == len(norms)
    d = one.to_dict()
    assert [d["underflow"], *d["counts"], d["overflow"]] == want
    # merge of two shards = one stream (plain sums of the declared field)
    a = NormHistogram(5, low=low, high=high, bins=bins, name="h")
    b = NormHistogram(5, low=low, high=high, bins=bins, name="h")
    a.update(*batches[0])
    b.update(*batches[1])
    b.update(*batches[2])
    assert a.merge(b).same_state(one)
    # save / load through the derived, checked file format
    one.save(tmp_path / "h.safetensors")
    assert NormHistogram.load(tmp_path / "h.safetensors").same_state(one)
    with pytest.raises(fs.FusedStatsError, match="bins"):
        a.merge(NormHistogram(5, low=low, high=high, bins=bins + 1))


def test_norm_histogram_norms_on_the_edges(gen):
    """A norm exactly on an edge counts in the bin it opens (``e_k ≤ |q| < e_{k+1}``: ``low`` in
    the first bin, ``high`` in the overflow); the next float below it in the bin before."""
    h = NormHistogram(4, low=0.1, high=10.0, bins=2)
    edges = h.edges()
    assert edges.tolist() == pytest.approx([0.1, 1.0, 10.0], rel=1e-15)
    below = torch.nextafter(edges, torch.zeros_like(edges))
    # scaled basis vectors with random signs and axes: each norm is that value exactly
    values = torch.cat([edges, below])
    sign = torch.randint(0, 2, values.shape, generator=gen).to(F64) * 2 - 1
    q = torch.zeros(len(values), 4, dtype=F64)
    q[torch.arange(len(values)), torch.randint(0, 4, values.shape, generator=gen)] = sign * values
    assert torch.equal(torch.linalg.vector_norm(q, dim=-1), values)
    on_edges = NormHistogram(4, low=0.1, high=10.0, bins=2)
    on_edges.update(q[:3][torch.randperm(3, generator=gen)])
    assert on_edges.counts.tolist() == [0.0, 1.0, 1.0, 1.0]
    d = on_edges.to_dict()
    assert (d["underflow"], d["counts"], d["overflow"]) == (0, [1, 1], 1)
    h.update(q[torch.randperm(len(values), generator=gen)])
    assert h.counts.tolist() == [1.0, 2.0, 2.0, 1.0] and h.n == 6


def test_norm_histogram_rejects_nonfinite_and_keeps_state(gen):
    h = NormHistogram(3, low=0.1, high=10.0, bins=4)
    h.update(torch.randn(5, 3, generator=gen, dtype=F64))
    before = h.state_dict()
    bad = torch.randn(2, 3, generator=gen, dtype=F64)
    bad[1, 2] = math.inf
    with pytest.raises(fs.FusedStatsError, match="non-finite"):
        h.update(bad)
    assert h.same_state(before)
    skip = NormHistogram(3, low=0.1, high=10.0, bins=4, nonfinite="skip")
    skip.update(bad)
    assert skip.n == 0 and skip.skipped_batches == 1


class Net(nn.Module):
    def __init__(self, d=4, classes=3):
        super().__init__()
        torch.manual_seed(3)
        self.first, self.second = TanhBlock(d), TanhBlock(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.second(self.first(x)))


def per_sample_q(model, x, y, points):
    """Per-sample activation gradients, one backward per sample."""
    out = {p: [] for p in points}
    for b in range(x.shape[0]):
        grads = point_grads_one_sample(
            model, points, lambda m, b=b: classification_sample_loss(m, x[b], int(y[b]))
        )
        for p in points:
            out[p].append(grads[p].reshape(-1))
    return {p: torch.stack(v) for p, v in out.items()}


def test_probe_table_views_histogram_and_symmetric_results(gen):
    model = Net().double()
    points = ["first", "second"]
    probe = fs.Probe(
        model, points=points, second_moment="pool", norm_histogram={"low": 1e-4, "high": 1e1, "bins": 10}
    )
    xs = [torch.randn(6, 4, generator=gen, dtype=F64) for _ in range(3)]
    ys = [torch.randint(0, 3, (6,), generator=gen) for _ in range(3)]
    for x, y in zip(xs[:2], ys[:2]):
        probe.step((x, y), fs.classification_loss)
    probe.step((xs[2], ys[2]), fs.classification_loss, stream="test")
    q_train = per_sample_q(model, torch.cat(xs[:2]), torch.cat(ys[:2]), points)
    q_test = per_sample_q(model, xs[2], ys[2], points)
    # the public names are views of the one table
    assert set(probe.table) == {
        (k, s, p) for k in ("grad", "norm_hist") for s in ("train", "test") for p in points
    }
    for p in points:
        assert probe.stats[p] is probe.table[("grad", "train", p)]
        assert probe.test_stats[p] is probe.table[("grad", "test", p)]
        # the histogram against numpy on per-sample norms from per-sample backward passes
        hist = probe.table[("norm_hist", "train", p)]
        assert [int(v) for v in hist.counts.tolist()] == numpy_histogram(
            q_train[p].norm(dim=1).numpy(), 1e-4, 1e1, 10
        )
        # estimate / certificate per stream, realized alignment as a result object
        est = probe.estimate(p, stream="test")
        assert est.n == 6 and est.mu_norm2 == probe.test_stats[p].estimate().mu_norm2
        cert = probe.certificate(p, 12, 6, stream="train")
        assert cert == probe.stats[p].estimate().certificate(12, 6)
        realized = probe.realized_alignment(p)
        want = float(q_train[p].sum(0) @ q_test[p].sum(0)) / (12 * 6)
        assert math.isclose(realized, want, rel_tol=1e-9)
        assert (realized.M, realized.K) == (12, 6) and realized.value == float(realized)
        mis = probe.misalignment(p, trials=50)
        assert set(realized.to_dict()) <= {"value", "M", "K"} and mis.value == mis.probability
    report = probe.report(misalignment_trials=0).data
    assert report["points"][0]["norm_histogram"]["n"] == 12
    probe.clear_stream("test")
    assert all(s == "train" for _, s, _ in probe.table)


# ----------------------------------------------------------------------------- cross estimate
def test_cross_estimate_plugin_and_mean_against_per_sample_c(gen):
    d, r, din = 4, 3, 4
    w_in = torch.randn(r, din, generator=gen, dtype=F64)
    acc = fs.CrossStats(d, w_in, "tanh")
    cs = []
    for B in (5, 4):
        g = torch.randn(B, 3, d, generator=gen, dtype=F64) + 0.5
        z = torch.randn(B, 3, din, generator=gen, dtype=F64)
        acc.update(g, z)
        for b in range(B):
            c = sum(torch.outer(g[b, t], torch.tanh(w_in @ z[b, t])) for t in range(3))
            cs.append(c)
    n = len(cs)
    mean = sum(cs) / n
    unbiased = sum(float((cs[i] * cs[j]).sum()) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    est = acc.estimate()
    assert est.n == n and (est.dim, est.rank) == (d, r)
    torch.testing.assert_close(est.c_mean, mean, rtol=1e-12, atol=1e-12)
    assert math.isclose(est.plugin_frob2, float(mean.square().sum()), rel_tol=1e-12)
    assert math.isclose(est.cross_frob2, unbiased, rel_tol=1e-10)
    assert math.isclose(est.mean_sq_norm, sum(float(c.square().sum()) for c in cs) / n, rel_tol=1e-12)
    # plug-in minus unbiased is the bias (Σ|c_i|² − |Σc_i|²/n)/(n(n−1)) ≥ 0
    assert est.plugin_frob2 > est.cross_frob2


def test_checkpoint_round_trip_of_a_probe_with_histograms(tmp_path, gen):
    def make(hist=True):
        return fs.Probe(
            Net().double(),
            points=["first", "second"],
            second_moment="dense",
            norm_histogram={"bins": 6} if hist else False,
        )

    probe = make()
    x, y = torch.randn(5, 4, generator=gen, dtype=F64), torch.randint(0, 3, (5,), generator=gen)
    probe.step((x, y), fs.classification_loss)
    probe.save_state(tmp_path / "ckpt")
    back = make()
    back.load_state(tmp_path / "ckpt")
    assert set(back.table) == set(probe.table)
    for key, acc in probe.table.items():
        assert back.table[key].same_state(acc), key
    # a probe that does not keep histograms refuses them; one that does refuses a checkpoint
    # without them (its histogram would miss the checkpointed batches)
    with pytest.raises(fs.FusedStatsError, match="does not keep norm_hist"):
        make(hist=False).load_state(tmp_path / "ckpt")
    plain = make(hist=False)
    plain.step((x, y), fs.classification_loss)
    plain.save_state(tmp_path / "plain")
    victim = make()
    with pytest.raises(fs.FusedStatsError, match="no norm_hist statistics"):
        victim.load_state(tmp_path / "plain")
    assert not victim.table


def test_checkpoint_of_other_settings_is_refused_by_the_declared_settings(tmp_path, gen):
    def make(**kw):
        return fs.Probe(Net().double(), points=["first", "second"], **kw)

    probe = make(second_moment="dense", norm_histogram={"bins": 6})
    x, y = torch.randn(5, 4, generator=gen, dtype=F64), torch.randint(0, 3, (5,), generator=gen)
    probe.step((x, y), fs.classification_loss)
    probe.save_state(tmp_path / "ckpt")
    for kw, words in [
        (
            dict(second_moment="pool", norm_histogram={"bins": 6}),
            ["'first' (train)", "second_moment 'pool' vs 'dense'"],
        ),
        (dict(second_moment="dense", norm_histogram={"bins": 7}), ["norm_hist", "bins 7 vs 6"]),
    ]:
        fresh = make(**kw)  # nothing stepped: compared with the accumulator it would create
        with pytest.raises(fs.FusedStatsError, match="other settings than this probe's") as info:
            fresh.load_state(tmp_path / "ckpt")
        assert all(w in str(info.value) for w in words), (words, str(info.value))
        assert not fresh.table
        stepped = make(**kw)  # stepped: compared with the accumulator it holds, kept as it was
        stepped.step((x, y), fs.classification_loss)
        before = {key: acc.state_dict() for key, acc in stepped.table.items()}
        with pytest.raises(fs.FusedStatsError, match=words[-1]):
            stepped.load_state(tmp_path / "ckpt")
        assert all(stepped.table[key].same_state(state) for key, state in before.items())
    same = make(second_moment="dense", norm_histogram={"bins": 6})
    same.load_state(tmp_path / "ckpt")
    assert all(same.table[key].same_state(acc) for key, acc in probe.table.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_finite_matches_isfinite(dtype, gen):
    from fused_stats.contracts import all_finite

    a = torch.randn(5, 7, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn(3, generator=gen, dtype=torch.float64).to(dtype)
    assert all_finite(a, b) and all_finite(a)
    big = torch.finfo(dtype).max
    # finite entries whose sum overflows: the exact check decides
    assert all_finite(torch.tensor([big, big], dtype=dtype), b)
    assert all_finite(torch.tensor([big], dtype=dtype), torch.tensor([-big, -big], dtype=dtype))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for target in (a, b):
            x = target.clone()
            x.view(-1)[int(torch.randint(x.numel(), (1,), generator=gen))] = bad
            args = (x, b) if target is a else (a, x)
            assert not all_finite(*args), (bad, tuple(target.shape))
    # +inf in one tensor and -inf in another sum to NaN: still caught
    assert not all_finite(
        torch.tensor([float("inf")], dtype=dtype), torch.tensor([-float("inf")], dtype=dtype)
    )
