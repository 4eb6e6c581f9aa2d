"""``pool``, ``dense`` and ``auto`` agree, and ``auto`` stays small.

* The three representations of the second moment (d x d matrix, or stored samples + Gram) must
  give the same estimates (1e-10 relative, in every regime), fed the same
  batches, including batches that make ``auto`` cross from pool to dense.
* After every batch, the bytes ``auto`` really holds (counted here from its tensors' storages, and
  as reported by ``state_nbytes``) never exceed the smaller of the pool and dense representations
  for its current n (``GradStats.planned_nbytes``), which are also checked against a count written
  here: dense ``d^2`` fp64 values, pool ``n d + n^2``, plus the centre, s, t and four scalars.
"""

from __future__ import annotations

import pytest
import torch

import fused_stats as fs
from fused_stats.accumulators import auto_pool_limit

from reference import REGIMES, TARGETS, assert_targets_close, draw, population

D = 16  # the auto switch sits at auto_pool_limit(16) = 9 samples (9*16 + 81 <= 256 < 10*16 + 100)


def held_bytes(acc: fs.GradStats) -> int:
    """Bytes of every distinct tensor storage the accumulator references (views count in full)."""
    seen, total = set(), 0
    for value in vars(acc).values():
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage.data_ptr() not in seen or storage.nbytes() == 0:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def expected_bytes(dim: int, mode: str, n: int) -> int:
    vectors = 3 * dim * 8 + 4 * 8  # centre, s, t and the scalars a1, a2, max|q|, sum|q|
    return vectors + 8 * (dim * dim if mode == "dense" else n * dim + n * n)


def test_planned_nbytes_counts():
    assert auto_pool_limit(D) == 9
    for n in (0, 1, 9, 10, 40):
        assert fs.GradStats.planned_nbytes(D, "pool", n) == expected_bytes(D, "pool", n)
    assert fs.GradStats.planned_nbytes(D, "dense") == expected_bytes(D, "dense", 0)
    for dim in range(1, 200):
        limit = auto_pool_limit(dim)  # the largest pool no bigger than the dense matrix
        assert limit * dim + limit**2 <= dim * dim < (limit + 1) * dim + (limit + 1) ** 2


@pytest.mark.parametrize("regime", list(REGIMES))
def test_modes_agree_and_auto_stays_small(regime, gen):
    mu, L = population(D, regime, gen)
    q = draw((60,), mu, L, gen)
    accs = {mode: fs.GradStats(D, second_moment=mode) for mode in ("pool", "dense", "auto")}
    sizes = [1, 2, 3, 1, 4, 2, 7, 40]  # crosses the switch (9) inside the 5th batch
    start, switched_at = 0, None
    for size in sizes:
        batch = q[start : start + size]
        start += size
        for acc in accs.values():
            acc.update(batch)
        auto = accs["auto"]
        bound = min(fs.GradStats.planned_nbytes(D, "pool", auto.n), fs.GradStats.planned_nbytes(D, "dense"))
        assert auto.state_nbytes() <= bound, f"auto holds {auto.state_nbytes()} B > {bound} B at n={auto.n}"
        assert held_bytes(auto) <= bound, (
            f"auto's storages hold {held_bytes(auto)} B > {bound} B at n={auto.n}"
        )
        assert held_bytes(auto) == auto.state_nbytes()
        assert auto.mode == ("pool" if auto.n <= 9 else "dense"), f"n={auto.n}, mode={auto.mode}"
        if auto.mode == "dense" and switched_at is None:
            switched_at = auto.n
        for mode in ("pool", "dense"):
            assert held_bytes(accs[mode]) == expected_bytes(D, mode, accs[mode].n)
        if accs["pool"].n >= 4:
            want = {key: getattr(accs["pool"].estimate(), key) for key in TARGETS}
            for mode in ("dense", "auto"):
                assert_targets_close(
                    accs[mode].estimate(), want, 1e-10, context=f"{mode} vs pool at n={start}, {regime}"
                )
    assert switched_at == 11  # 1+2+3+1 = 7 <= 9 < 7+4


def test_auto_with_small_pool_capacity_switches_there(gen):
    mu, L = population(D, "mean_like_noise", gen)
    q = draw((20,), mu, L, gen)
    acc = fs.GradStats(D, second_moment="auto", pool_capacity=5)
    dense = fs.GradStats(D, second_moment="dense")
    for k in range(0, 20, 2):
        acc.update(q[k : k + 2])
        dense.update(q[k : k + 2])
        assert acc.mode == ("pool" if acc.n <= 5 else "dense")
    assert_targets_close(acc.estimate(), {key: getattr(dense.estimate(), key) for key in TARGETS}, 1e-10)


def test_auto_merges_stay_small(gen):
    # merging a big pool into an empty or small auto accumulator must respect auto's switch too
    mu, L = population(D, "mean_like_noise", gen)
    q = draw((30,), mu, L, gen)
    big_pool = fs.GradStats(D, second_moment="pool")
    big_pool.update(q[:20])
    small = fs.GradStats(D, second_moment="auto")
    small.update(q[20:23])
    for target in (fs.GradStats(D, second_moment="auto"), small):
        target.merge(big_pool)
        bound = min(fs.GradStats.planned_nbytes(D, "pool", target.n), fs.GradStats.planned_nbytes(D, "dense"))
        assert held_bytes(target) <= bound, f"auto holds {held_bytes(target)} B > {bound} B at n={target.n}"
        assert target.mode == "dense"
    ref = fs.GradStats(D, second_moment="dense")
    ref.update(q[20:23])
    ref.update(q[:20])
    assert_targets_close(small.estimate(), {key: getattr(ref.estimate(), key) for key in TARGETS}, 1e-10)
