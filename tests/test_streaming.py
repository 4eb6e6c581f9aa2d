"""Order and batching invariance, and merges equal one stream.

The U-statistics are symmetric functions of the sample, so any split into batches, any order and
any merge of separately fed accumulators must give the estimates of one stream fed everything at
once, up to fp64 rounding: <= 1e-10 relative in every regime, also for targets whose population
value is ~0 (measured worst case ~1e-13 over several seeds). The one stream is itself anchored to
the independent two-pass fp64 reference at the same pure relative tolerance.
"""

from __future__ import annotations

import pytest
import torch

import fused_stats as fs
from fused_stats.accumulators import auto_pool_limit

from reference import REGIMES, TARGETS, assert_targets_close, draw, population, two_pass_targets

REL = 1e-10
D = 7  # auto switches to dense above auto_pool_limit(7) = 4 samples


def as_dict(est) -> dict[str, float]:
    return {key: getattr(est, key) for key in TARGETS}


def random_batches(n: int, gen: torch.Generator, largest: int = 40) -> list[slice]:
    """Random consecutive batch boundaries, including batches of a single sample."""
    cuts, start = [], 0
    while start < n:
        size = int(torch.randint(1, largest + 1, (1,), generator=gen))
        cuts.append(slice(start, min(n, start + size)))
        start += size
    return cuts


def check_same(acc: fs.GradStats, one: fs.GradStats, q: torch.Tensor, regime: str, context: str):
    est, ref = acc.estimate(), one.estimate()
    assert est.n == ref.n == q.shape[0], context
    assert_targets_close(est, as_dict(ref), REL, context=context)
    assert est.ag_max == ref.ag_max, context  # a max does not depend on order
    assert est.ag_mean == pytest.approx(ref.ag_mean, rel=1e-13), context


def one_stream(q: torch.Tensor, mode: str = "dense") -> fs.GradStats:
    acc = fs.GradStats(q.shape[1], second_moment=mode)
    acc.update(q)
    return acc


@pytest.mark.parametrize("regime", list(REGIMES))
def test_one_stream_matches_two_pass_reference(regime, gen):
    mu, L = population(D, regime, gen)
    q = draw((300,), mu, L, gen)
    assert_targets_close(
        one_stream(q).estimate(), two_pass_targets(q), REL, context=f"one stream vs two-pass, {regime}"
    )


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("mode", ["dense", "pool", "auto"])
def test_random_batches_and_order(regime, mode, gen):
    mu, L = population(D, regime, gen)
    q = draw((300,), mu, L, gen)
    one = one_stream(q)
    for trial in range(3):
        perm = torch.randperm(len(q), generator=gen) if trial else torch.arange(len(q))
        acc = fs.GradStats(D, second_moment=mode)
        for cut in random_batches(len(q), gen):
            acc.update(q[perm][cut])
        check_same(acc, one, q, regime, f"{mode}, trial {trial} (0 = original order), {regime}")


@pytest.mark.parametrize("regime", list(REGIMES))
def test_merge_of_separately_fed_accumulators(regime, gen):
    mu, L = population(D, regime, gen)
    q = draw((300,), mu, L, gen)
    one = one_stream(q)
    modes = ["dense", "pool", "auto", "dense", "auto"]
    part = torch.randint(0, len(modes), (len(q),), generator=gen)  # a random partition
    parts = []
    for k, mode in enumerate(modes):
        acc = fs.GradStats(D, second_moment=mode)
        rows = q[part == k]
        for cut in random_batches(len(rows), gen, largest=20):
            acc.update(rows[cut])
        parts.append(acc)
    parts.append(fs.GradStats(D))  # an empty accumulator merges as a no-op
    for order in range(2):
        sequence = [parts[int(i)] for i in torch.randperm(len(parts), generator=gen)]
        merged = fs.GradStats(D, second_moment="dense" if order else "auto")
        for acc in sequence:
            merged.merge(acc)
        check_same(merged, one, q, regime, f"merge order {order}, {regime}")
    # merging must not modify its argument
    again = fs.GradStats(D, second_moment="dense")
    for acc in parts:
        again.merge(acc)
    check_same(again, one, q, regime, f"second merge of the same parts, {regime}")


@pytest.mark.parametrize("regime", ["mean_like_noise", "mean_100x_noise"])
def test_merge_pool_into_dense_and_dense_into_auto(regime, gen):
    mu, L = population(D, regime, gen)
    q = draw((60,), mu, L, gen)
    one = one_stream(q)
    pool = fs.GradStats(D, second_moment="pool")
    pool.update(q[:25])
    dense = fs.GradStats(D, second_moment="dense")
    dense.update(q[25:])
    dense.merge(pool)
    check_same(dense, one, q, regime, "pool merged into dense")
    auto = fs.GradStats(D, second_moment="auto")
    auto.update(q[:3])
    assert auto.mode == "pool"
    big = fs.GradStats(D, second_moment="dense")
    big.update(q[3:])
    auto.merge(big)
    assert auto.mode == "dense"
    check_same(auto, one, q, regime, "dense merged into auto (pool)")


@pytest.mark.parametrize("regime", list(REGIMES))
def test_auto_into_auto_crossing_the_switch(regime, gen):
    limit = auto_pool_limit(D)
    mu, L = population(D, regime, gen)
    q = draw((2 * limit - 2,), mu, L, gen)  # each half fits a pool, together they do not
    a = fs.GradStats(D, second_moment="auto")
    b = fs.GradStats(D, second_moment="auto")
    a.update(q[: limit - 1])
    b.update(q[limit - 1 :])
    assert a.mode == b.mode == "pool"
    a.merge(b)
    assert a.mode == "dense", f"{a.n} samples > auto limit {limit} should be dense"
    check_same(a, one_stream(q), q, regime, f"auto + auto across the switch, {regime}")
    # the pool merge below the switch keeps the rows, in order
    c = fs.GradStats(D, second_moment="auto")
    c.update(q[:2])
    d = fs.GradStats(D, second_moment="auto")
    d.update(q[2:limit])
    c.merge(d)
    assert c.mode == "pool"
    torch.testing.assert_close(c.pool_rows(), q[:limit], rtol=1e-13, atol=1e-13 * float(q.abs().max()))


def test_position_unit_batches_with_masks(gen):
    mu, L = population(D, "mean_like_noise", gen)
    grad = draw((40, 6), mu, L, gen)
    mask = torch.rand(40, 6, generator=gen) < 0.6
    one = fs.GradStats(D, second_moment="dense")
    one.update(grad, mask=mask, unit="position")
    acc = fs.GradStats(D, second_moment="auto")
    perm = torch.randperm(40, generator=gen)
    for cut in random_batches(40, gen, largest=9):
        acc.update(grad[perm][cut], mask=mask[perm][cut], unit="position")
    q = grad[mask]
    check_same(acc, one, q, "mean_like_noise", "position unit, shuffled masked batches")
