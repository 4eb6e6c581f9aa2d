"""CrossStats and the torch twin against explicit references (no Triton needed).

* ``|C|_F²`` against the U-statistic written out: the mean of ``<c_i, c_j>_F`` over every ordered
  pair of distinct samples, with ``c_i`` built by a loop over the sample's unmasked positions
  (``unit="sample"``) or one ``q_t φ_tᵀ`` per unmasked position (``"position"``), fp64;
* the twin's within-group tuple sums against loops over ordered distinct pairs / triples / pairs
  of disjoint pairs;
* streaming: several batches, and two accumulators merged, equal one stream;
* bad input (shapes, mask, non-finite values, too few samples, alpha) raises FusedStatsError naming
  what was seen, and leaves the state bit-identical.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fused_stats import FusedStatsError
from fused_stats.accumulators import state_differences
from fused_stats.accumulators.cross_stats import CrossStats
from fused_stats.ops import cross_twin

F64 = torch.float64


def explicit_cs(grad, act, mask, w_in, unit):
    phi = lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))  # noqa: E731  gelu
    out = []
    for b in range(grad.shape[0]):
        outers = [
            torch.outer(grad[b, t].to(F64), phi(w_in.to(F64) @ act[b, t].to(F64)))
            for t in range(grad.shape[1])
            if mask is None or mask[b, t]
        ]
        if unit == "sample" and outers:
            out.append(sum(outers))
        elif unit == "position":
            out.extend(outers)
    return out


def u_stat(cs):
    n = len(cs)
    return sum(float((cs[i] * cs[j]).sum()) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))


def batches(gen, sizes, T=4, d=5, din=6):
    out = []
    for B in sizes:
        grad = torch.randn(B, T, d, generator=gen, dtype=F64) + 0.3
        act = torch.randn(B, T, din, generator=gen, dtype=F64)
        mask = torch.rand(B, T, generator=gen) > 0.3
        out.append((grad, act, mask))
    return out


@pytest.mark.parametrize("unit", ["sample", "position"])
def test_frob2_equals_u_statistic_over_batches_and_merge(unit, gen):
    w_in = torch.randn(3, 6, generator=gen, dtype=F64) / 2
    data = batches(gen, [4, 1, 5, 3])
    one = CrossStats(5, w_in, "gelu", backend="torch", group_size=3)
    a = CrossStats(5, w_in, "gelu", backend="torch", group_size=3)
    b = CrossStats(5, w_in, "gelu", backend="torch", group_size=3)
    cs = []
    for k, (g, z, m) in enumerate(data):
        one.update(g, z, m, unit=unit)
        (a if k < 2 else b).update(g, z, m, unit=unit)
        cs.extend(explicit_cs(g, z, m, w_in, unit))
    want = u_stat(cs)
    assert one.n == len(cs)
    assert one.cross_frob2() == pytest.approx(want, rel=1e-10)
    a.merge(b)
    assert a.n == one.n and a.p == one.p
    assert a.cross_frob2() == pytest.approx(want, rel=1e-10)
    torch.testing.assert_close(a.c_sum, one.c_sum, rtol=1e-13, atol=1e-13)


def test_twin_tuple_sums_by_loops(gen):
    w_in = torch.randn(2, 6, generator=gen, dtype=F64)
    g, z, m = batches(gen, [9])[0]
    m[3] = False
    out = cross_twin.cross_reduce(g, z, m, w_in, "gelu", "sample", group_size=5)
    cs = explicit_cs(g, z, m, w_in, "sample")
    u2 = u3 = u4 = 0.0
    counts = [0, 0, 0]
    for start in range(0, len(cs), 5):
        grp = cs[start : start + 5]
        k = [[float((x * y).sum()) for y in grp] for x in grp]
        idx = range(len(grp))
        for i, j in itertools.permutations(idx, 2):
            u2 += k[i][j] ** 2
            counts[0] += 1
        for i, j, h in itertools.permutations(idx, 3):
            u3 += k[i][j] * k[j][h]
            counts[1] += 1
        for i, j, h, o in itertools.permutations(idx, 4):
            u4 += k[i][j] * k[h][o]
            counts[2] += 1
    assert out.n == len(cs) == 8
    assert [out.p2, out.p3, out.p4] == counts
    scale = sum(abs(x) for x in (u2, u3, u4))
    for got, want in ((out.u2, u2), (out.u3, u3), (out.u4, u4)):
        assert abs(float(got) - want) <= 1e-11 * scale
    assert float(out.sq_norm_sum) == pytest.approx(sum(float((c * c).sum()) for c in cs), rel=1e-13)


def snapshot(acc):
    return acc.state_dict()


def assert_same(acc, snap):
    assert acc.same_state(snap), state_differences(acc.state_dict(), snap)


def test_bad_input_leaves_state_unchanged(gen):
    w_in = torch.randn(3, 6, generator=gen, dtype=F64)
    acc = CrossStats(5, w_in, "gelu", backend="torch", name="layers.3")
    with pytest.raises(FusedStatsError, match="needs at least 2 samples"):
        acc.cross_frob2()
    g, z, m = batches(gen, [4])[0]
    acc.update(g, z, m)
    snap = snapshot(acc)
    with pytest.raises(FusedStatsError, match=r"layers\.3.*grad has shape \(4, 4, 7\)"):
        acc.update(torch.randn(4, 4, 7, dtype=F64), z, m)
    with pytest.raises(FusedStatsError, match="activation has shape"):
        acc.update(g, z[:, :, :5], m)
    with pytest.raises(FusedStatsError, match="mask has shape"):
        acc.update(g, z, m[:, :2])
    bad = g.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(FusedStatsError, match="non-finite"):
        acc.update(bad, z, torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(FusedStatsError, match="alpha"):
        acc.saturation(alpha=1.5)
    with pytest.raises(FusedStatsError, match="different block"):
        acc.merge(CrossStats(5, w_in * 2, "gelu", backend="torch"))
    assert_same(acc, snap)
    with pytest.raises(FusedStatsError, match="activation must be one of"):
        CrossStats(5, w_in, "softplus")


def test_given_features_are_zero_where_the_mask_is_zero_even_if_not_finite(gen):
    """Features-given mode (w_in=None): ``features(x, mask)`` is x at counted positions and 0
    elsewhere, also where x is NaN or Inf there (``torch.where``, not a product with the mask)."""
    acc = CrossStats(3, None, "identity", rank=4, dtype=torch.float64)
    x = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 3:] = False
    mask[1, 0] = False
    x[0, 4, 1] = float("nan")
    x[1, 0, 2] = float("inf")
    got = acc.features(x, mask)
    want = x.clone()
    want[~mask] = 0.0
    assert torch.equal(got, want)
    assert torch.equal(acc.features(x[1:, 1:], None), x[1:, 1:])


@pytest.mark.parametrize("unit", ["sample", "position"])
def test_prepare_from_features_is_prepare_from_the_activation_bit_for_bit(unit, gen):
    """``prepare(grad, mask=, unit=, features=features(act, mask))`` (what the in-backward probe
    keeps) folds the same state as ``prepare(grad, act, mask, unit)``, and matches the U-statistic
    written out; passing both or neither of the activation and ``features=`` is refused with the
    state unchanged."""
    w_in = torch.randn(4, 3, generator=gen, dtype=F64)
    from_act = CrossStats(5, w_in, "gelu", backend="torch", group_size=2)
    from_phi = CrossStats(5, w_in, "gelu", backend="torch", group_size=2)
    cs = []
    for _ in range(2):
        grad = torch.randn(4, 3, 5, generator=gen, dtype=F64)
        act = torch.randn(4, 3, 3, generator=gen, dtype=F64)
        mask = torch.ones(4, 3, dtype=torch.bool)
        mask[1, 2] = mask[3, 0] = False
        from_act.commit(from_act.prepare(grad, act, mask, unit))
        phi = from_phi.features(act, mask)
        from_phi.commit(from_phi.prepare(grad, mask=mask, unit=unit, features=phi))
        cs.extend(explicit_cs(grad, act, mask, w_in, unit))
    assert state_differences(from_act.state_dict(), from_phi.state_dict()) == []
    assert from_phi.n == len(cs) == (8 if unit == "sample" else 20)
    assert from_phi.cross_frob2() == pytest.approx(u_stat(cs), rel=1e-10)
    snap = from_phi.state_dict()
    with pytest.raises(FusedStatsError, match="exactly one of the activation and features="):
        from_phi.prepare(grad, act, mask, unit, features=phi)
    with pytest.raises(FusedStatsError, match="exactly one of the activation and features="):
        from_phi.prepare(grad, mask=mask, unit=unit)
    with pytest.raises(FusedStatsError, match=r"features of shape \(4, 3, 2\)"):
        from_phi.prepare(grad, mask=mask, unit=unit, features=phi[..., :2])
    assert state_differences(snap, from_phi.state_dict()) == []


def test_features_given_mode_takes_the_features_as_the_activation(gen):
    """Features-given mode (w_in=None): ``prepare(grad, x, mask)`` reads ``x`` as the features,
    the same as ``prepare(grad, mask=mask, features=x)``, with ``c_i = Σ_t q_t x_tᵀ`` over the
    sample's counted positions (the U-statistic written out)."""
    positional = CrossStats(3, None, "identity", rank=4, dtype=F64)
    keyword = CrossStats(3, None, "identity", rank=4, dtype=F64)
    cs = []
    for _ in range(2):
        grad = torch.randn(5, 2, 3, generator=gen, dtype=F64)
        x = torch.randn(5, 2, 4, generator=gen, dtype=F64)
        mask = torch.ones(5, 2, dtype=torch.bool)
        mask[2, 1] = False
        positional.commit(positional.prepare(grad, x, mask))
        keyword.commit(keyword.prepare(grad, mask=mask, features=x))
        cs += [sum(torch.outer(grad[b, t], x[b, t]) for t in range(2) if mask[b, t]) for b in range(5)]
    assert state_differences(positional.state_dict(), keyword.state_dict()) == []
    assert positional.n == len(cs)
    assert positional.cross_frob2() == pytest.approx(u_stat(cs), rel=1e-10)
