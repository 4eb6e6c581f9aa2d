"""The points of a probe prepared together (``GradStats.prepare_many``, ``CrossStats.prepare_many``:
unmasked ``unit="sample"`` batches of one shape share batched calls) against explicit references.

* every point's GradStats sums (centred at its own centre) against a loop over the samples;
* every point's cross sums (n, ``Σ c_i``, ``Σ |c_i|²`` and the within-group tuple sums of
  ``k_ij = <c_i, c_j>_F``) against ``c_i`` built per sample and loops over ordered distinct tuples;
* ``Probe.fold`` through that path stays all or nothing: a non-finite activation at one point
  (which only the cross statistics see), or a non-finite gradient at one point, raises, or is
  skipped and counted, with every accumulator of every point left bit-identical; a pool that one
  point's batch would overfill raises before anything changes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats import FusedStatsError
from fused_stats.accumulators.cross_stats import CrossStats
from fused_stats.accumulators.grad_stats import GradStats
from fused_stats.ops import cross_twin

F64 = torch.float64


def gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def explicit(grad, act, w_in):
    """Per-sample ``c_i = Σ_t q_t φ(W z_t)ᵀ`` and the sums of a batch that is one group."""
    cs = [
        sum(
            torch.outer(grad[b, t].to(F64), gelu(w_in.to(F64) @ act[b, t].to(F64)))
            for t in range(grad.shape[1])
        )
        for b in range(grad.shape[0])
    ]
    k = [[float((x * y).sum()) for y in cs] for x in cs]
    idx = range(len(cs))
    u2 = sum(k[i][j] ** 2 for i, j in itertools.permutations(idx, 2))
    u3 = sum(k[i][j] * k[j][h] for i, j, h in itertools.permutations(idx, 3))
    u4 = sum(k[i][j] * k[h][o] for i, j, h, o in itertools.permutations(idx, 4))
    return sum(cs), sum(k[i][i] for i in idx), (u2, u3, u4)


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_prepare_many_matches_explicit_sums(T, dtype):
    gen = torch.Generator().manual_seed(11 + T)
    B, d, din, r = 6, 8, 4, 8
    accs = [
        CrossStats(d, torch.randn(r, din, generator=gen, dtype=F64).to(dtype), name=f"p{i}") for i in range(3)
    ]
    grads = [(torch.randn(B, T, d, generator=gen, dtype=F64) + 0.4).to(dtype) for _ in accs]
    acts = [torch.randn(B, T, din, generator=gen, dtype=F64).to(dtype) for _ in accs]
    assert cross_twin.stacks(B, T, d, r, "sample", accs[0].group_size)  # the batched path is taken
    prepared = CrossStats.prepare_many(accs, grads, acts, [None] * 3, unit="sample")
    for acc, p, g, a in zip(accs, prepared, grads, acts):
        c_sum, sq, us = explicit(g, a, acc.w_in)
        batch = p.batch
        assert p.finite and batch.n == B and p.base_n == 0
        assert [batch.p2, batch.p3, batch.p4] == [
            B * (B - 1),
            B * (B - 1) * (B - 2),
            B * (B - 1) * (B - 2) * (B - 3),
        ]
        torch.testing.assert_close(batch.c_sum, c_sum, rtol=1e-12, atol=1e-12)
        assert float(batch.sq_norm_sum) == pytest.approx(sq, rel=1e-12)
        scale = sum(abs(u) for u in us)
        for got, want in zip((batch.u2, batch.u3, batch.u4), us):
            assert abs(float(got) - want) <= 1e-11 * scale
        acc.commit(p)
        assert acc.n == B and acc.cross_frob2() == pytest.approx(
            (float((c_sum * c_sum).sum()) - sq) / (B * (B - 1)), rel=1e-10
        )


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_grad_prepare_many_matches_explicit_sums(dtype):
    gen = torch.Generator().manual_seed(3)
    B, d = 7, 5
    accs = [GradStats(d, second_moment="dense", name=f"p{i}") for i in range(3)]
    for acc in accs:  # past the first batch: each has its own centre
        acc.update((torch.randn(4, d, generator=gen, dtype=F64) + 1).to(dtype))
    grads = [(torch.randn(B, d, generator=gen, dtype=F64) * 2 - 0.5).to(dtype) for _ in accs]
    prepared = GradStats.prepare_many(accs, grads, [None] * 3, "sample", [-1] * 3)
    for acc, p, g in zip(accs, prepared, grads):
        q = g.to(F64)
        y = [q[b] - acc.centre for b in range(B)]
        sq = [float(v @ v) for v in y]
        batch = p.batch
        assert p.finite and batch.n == B and p.base_n == 4 and torch.equal(p.centre, acc.centre)
        torch.testing.assert_close(batch.s, sum(y), rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(batch.t, sum(w * v for w, v in zip(sq, y)), rtol=1e-13, atol=1e-12)
        assert float(batch.a1) == pytest.approx(sum(sq), rel=1e-13)
        assert float(batch.a2) == pytest.approx(sum(w * w for w in sq), rel=1e-13)
        norms = [float(q[b].norm()) for b in range(B)]
        assert float(batch.norm_max) == pytest.approx(max(norms), rel=1e-14)
        assert float(batch.norm_sum) == pytest.approx(sum(norms), rel=1e-13)
        torch.testing.assert_close(batch.rows[batch.valid], torch.stack(y), rtol=0, atol=0)


def test_grad_prepare_many_pool_overflow_raises():
    gen = torch.Generator().manual_seed(4)
    accs = [GradStats(3, second_moment="pool", pool_capacity=cap) for cap in (100, 9)]
    for acc in accs:
        acc.update(torch.randn(5, 3, generator=gen, dtype=F64))
    with pytest.raises(FusedStatsError, match="pool_capacity=9"):
        GradStats.prepare_many(
            accs, [torch.randn(5, 3, generator=gen, dtype=F64)] * 2, [None] * 2, "sample", [-1] * 2
        )


def state(probe, points):
    out = {}
    for p in points:
        c, g = probe.cross_stats[p], probe.stats[p]
        out[p] = (c.n, c.c_sum.clone(), c.u.clone(), c.sq_norm_sum.clone(), g.n, g.s.clone(), g.a2.clone())
    return out


@pytest.mark.parametrize("where", ["act", "grad"])
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_fold_all_or_nothing_through_the_batched_path(policy, where):
    gen = torch.Generator().manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    points = ["0", "1", "2"]
    probe = fs.Probe(model, points=points, unit="sample", cross=fs.CrossSpec(rank=3), nonfinite=policy)

    def batch():
        acts = {p: torch.randn(8, 4, generator=gen) for p in points}
        grads = {p: torch.randn(8, 4, generator=gen) + 0.2 for p in points}
        return acts, grads

    assert probe.fold("train", *batch())
    before = state(probe, points)
    acts, grads = batch()
    if where == "act":
        acts["1"][3, 2] = float("nan")  # only the cross statistics of point 1 read it
        message = "cross-gradient sums at point '1'"
    else:
        grads["2"][5, 0] = float("inf")
        message = "activation gradient at point '2'"
    if policy == "raise":
        with pytest.raises(FusedStatsError, match=message):
            probe.fold("train", acts, grads)
    else:
        assert not probe.fold("train", acts, grads)
        assert probe.skipped_steps["train"] == 1
    after = state(probe, points)
    for p in points:
        for x, y in zip(before[p], after[p]):
            assert torch.equal(torch.as_tensor(x), torch.as_tensor(y)), p
    assert probe.steps["train"] == 1
