"""The cross twin's per-sample Gram from position Grams ("ghost" form, few positions per sample)
against per-sample cross-gradients built by loops and tuple sums by brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from fused_stats.ops import cross_twin

F64 = torch.float64


def _reference(grad, act, mask, w_in, group):
    """n, Σc_i, Σ|c_i|², and u2, u3, u4 over distinct ordered tuples inside groups, by loops."""
    B, T, _ = grad.shape
    cs = []
    for b in range(B):
        kept = [t for t in range(T) if mask is None or bool(mask[b, t])]
        if not kept:
            continue
        c = sum(
            torch.outer(grad[b, t].double(), torch.nn.functional.gelu(w_in.double() @ act[b, t].double()))
            for t in kept
        )
        cs.append(c)
    n = len(cs)
    u2 = u3 = u4 = 0.0
    for g0 in range(0, n, group):
        idx = range(g0, min(g0 + group, n))
        k = {(i, j): float((cs[i] * cs[j]).sum()) for i in idx for j in idx}
        u2 += sum(k[i, j] ** 2 for i, j in itertools.permutations(idx, 2))
        u3 += sum(k[i, j] * k[j, m] for i, j, m in itertools.permutations(idx, 3))
        u4 += sum(k[i, j] * k[m, o] for i, j, m, o in itertools.permutations(idx, 4))
    return n, sum(cs), sum(float((c * c).sum()) for c in cs), u2, u3, u4


@pytest.mark.parametrize("T,masked", [(1, False), (2, False), (3, True)])
def test_ghost_gram_matches_loops(T, masked):
    gen = torch.Generator().manual_seed(T)
    B, d, d_in, r, group = 9, 40, 24, 30, 4
    assert cross_twin.ghost_is_cheaper(T, d, r, group)
    grad = torch.randn(B, T, d, generator=gen)
    act = torch.randn(B, T, d_in, generator=gen)
    w_in = torch.randn(r, d_in, generator=gen) / d_in**0.5
    mask = None
    if masked:
        mask = torch.rand(B, T, generator=gen) > 0.4
        mask[2] = False  # a sample with no counted position is not a sample
        grad[~mask] = float("nan")  # masked positions must never matter
        act[~mask] = float("nan")
    got = cross_twin.cross_reduce(grad, act, mask, w_in, "gelu", "sample", group)
    n, c_sum, sq, u2, u3, u4 = _reference(grad, act, mask, w_in, group)
    assert got.n == n
    torch.testing.assert_close(got.c_sum, c_sum, rtol=1e-10, atol=1e-10)
    for value, want in ((got.sq_norm_sum, sq), (got.u2, u2), (got.u3, u3), (got.u4, u4)):
        assert abs(float(value) - want) <= 1e-9 * max(abs(want), 1.0), (float(value), want)
