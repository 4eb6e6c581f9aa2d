"""Trend statistics over the runs of a sweep: Spearman's rank correlation with a permutation
p-value, the train/test cosine of the mean gradients, and a trend described in words.

* ``ρ`` is Pearson's correlation of the ranks, ties given their average rank (Spearman, 1904).
* The p-value is two-sided: the share of re-pairings of the values with ``|ρ*| ≥ |ρ|``. With at
  most ``permutations`` distinct re-pairings (n! ≤ permutations) every one is enumerated and the
  p-value is exact; otherwise ``permutations`` seeded random re-pairings give the Monte Carlo
  estimate ``(hits + 1) / (permutations + 1)`` (Phipson and Smyth, 2010: never 0, and a valid
  p-value). The pairs are first put in a canonical order (sorted by x, then y), so the result
  depends only on the set of runs, never on the order they were listed in: the same runs give the
  same p-value wherever it is computed.
* ``cosine = realized alignment / sqrt(|μ_train|² |μ_test|²)`` with the unbiased ``|μ|²`` of each
  stream (plain ``|q̄|²`` would add the noise ``tr(Σ)/n`` and bias the cosine towards 0); a ratio of
  unbiased estimates, so noisy when the mean is weak, and it can exceed 1.

Pure numpy; no torch tensors and nothing of the probe API are needed.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

SIGNIFICANCE = 0.05


def _finite_pairs(xs, ys) -> list[tuple[float, float]]:
    pairs = []
    for a, b in zip(xs, ys):
        if a is None or b is None:
            continue
        a, b = float(a), float(b)
        if math.isfinite(a) and math.isfinite(b):
            pairs.append((a, b))
    return sorted(pairs)


def average_ranks(values) -> np.ndarray:
    """Ranks 1..n of ``values``; tied values share the mean of their ranks."""
    v = np.asarray(values, dtype=np.float64)
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v), dtype=np.float64)
    i = 0
    while i < len(v):
        j = i
        while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def rank_correlation(xs, ys, permutations: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """Spearman's ρ of paired values and its two-sided permutation p-value (module docstring).

    Pairs with a missing or non-finite side are left out. Returns ``(nan, nan)`` when ρ is
    undefined: fewer than 3 pairs, or a constant side.
    """
    pairs = _finite_pairs(xs, ys)
    n = len(pairs)
    if n < 3:
        return math.nan, math.nan
    rx = average_ranks([a for a, _ in pairs])
    ry = average_ranks([b for _, b in pairs])
    cx, cy = rx - rx.mean(), ry - ry.mean()
    scale = math.sqrt(float(cx @ cx) * float(cy @ cy))
    if scale == 0:
        return math.nan, math.nan
    rho = float(cx @ cy) / scale
    threshold = abs(rho) - 1e-12  # ties in |ρ*| = |ρ| must count despite rounding
    if math.factorial(n) <= permutations:
        shuffled = np.array(list(itertools.permutations(cy)))
        hits = int((np.abs(shuffled @ cx) / scale >= threshold).sum())
        return rho, hits / len(shuffled)
    rng = np.random.default_rng(seed)
    hits, left = 0, permutations
    while left:
        chunk = min(left, 4096)
        shuffled = rng.permuted(np.tile(cy, (chunk, 1)), axis=1)
        hits += int((np.abs(shuffled @ cx) / scale >= threshold).sum())
        left -= chunk
    return rho, (hits + 1) / (permutations + 1)


def cosine(realized_alignment, train_mu_norm2, test_mu_norm2) -> float | None:
    """Estimated cosine of the train and test mean gradients; None where undefined (a missing
    value, or an unbiased ``|μ|²`` estimate ≤ 0)."""
    values = (realized_alignment, train_mu_norm2, test_mu_norm2)
    if any(v is None or isinstance(v, bool) or not math.isfinite(float(v)) for v in values):
        return None
    if train_mu_norm2 <= 0 or test_mu_norm2 <= 0:
        return None
    return float(realized_alignment) / math.sqrt(float(train_mu_norm2) * float(test_mu_norm2))


def median(values) -> float:
    v = sorted(values)
    m = len(v) // 2
    return v[m] if len(v) % 2 else 0.5 * (v[m - 1] + v[m])


def trend_sentence(xs, ys, x_name: str, y_name: str, permutations: int = 10_000, seed: int = 0) -> str:
    """Spearman's ρ of ``ys`` against ``xs`` with its permutation p-value, in words: "increases" /
    "decreases" only at p < 0.05, "no clear monotone trend" otherwise."""
    pairs = _finite_pairs(xs, ys)
    distinct = len({a for a, _ in pairs})
    if len(pairs) < 4 or distinct < 2:
        return (
            f"{y_name} vs {x_name}: too few runs ({len(pairs)} at {distinct} {x_name} values) "
            "to speak of a trend"
        )
    rho, p = rank_correlation([a for a, _ in pairs], [b for _, b in pairs], permutations, seed)
    if math.isnan(rho):
        return f"{y_name} vs {x_name}: rank correlation undefined (a constant column)"
    stat = f"Spearman rho = {rho:+.2f}, permutation p = {p:.3g}, {len(pairs)} runs"
    if p < SIGNIFICANCE:
        word = "increases" if rho > 0 else "decreases"
        return f"{y_name} vs {x_name}: {word} with {x_name} in these runs ({stat})"
    return (
        f"{y_name} vs {x_name}: no clear monotone trend in these runs ({stat}); with this many "
        "runs and this seed scatter that is not evidence either way"
    )
