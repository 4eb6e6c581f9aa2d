"""GradStats estimates equal brute-force U-statistics.

Reference: ``reference.brute_force_targets`` -- exact rational averages over all ordered tuples of
distinct indices of the Gram matrix (docs/design.md, section 2), fed with per-sample vectors built by plain
loops (``reference.per_sample_vectors``). Inputs are fp64 with n <= 12 and small d, in the four
regimes of ``reference.REGIMES``, for every unit / mask / feature_dim layout. Tolerance 1e-9 relative.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

import fused_stats as fs

from reference import (
    REGIMES,
    assert_targets_close,
    brute_force_targets,
    brute_force_u,
    draw,
    per_sample_vectors,
    population,
)

REL = 1e-9


def check(acc: fs.GradStats, q: torch.Tensor, regime: str, context: str) -> None:
    want = brute_force_targets(q)
    est = acc.estimate()
    assert est.n == q.shape[0], f"{context}: n={est.n}, expected {q.shape[0]} samples"
    assert est.dim == q.shape[1]
    # the reference is exact (rational arithmetic), so 1e-9 relative holds in every regime, also
    # where the population value is ~0 (measured worst case ~1e-13)
    assert_targets_close(est, want, REL, context=context)
    assert est.trace_sigma == pytest.approx(want["trace_sigma"], rel=REL), context
    norms = q.norm(dim=1)
    assert est.ag_max == pytest.approx(float(norms.max()), rel=1e-12), context
    assert est.ag_mean == pytest.approx(float(norms.mean()), rel=1e-12), context


def test_reference_matches_hand_computed_values():
    # d = 1, q = 1, 2, 3, 4: U1 = ((sum q)^2 - sum q^2)/12 = 70/12, U2 = ((sum q^2)^2 - sum q^4)/12
    # = 546/12, U3 = sum_j q_j^2 ((sum_{i!=j} q_i)^2 - sum_{i!=j} q_i^2) / 24 = 808/24,
    # U4 = 4! q1 q2 q3 q4 / 4! = 24, tr Sigma = sample variance = 5/3.
    u = brute_force_u(torch.tensor([[1.0], [2.0], [3.0], [4.0]], dtype=torch.float64))
    assert (u["U1"], u["U2"], u["U3"], u["U4"], u["T"]) == (
        Fraction(70, 12),
        Fraction(546, 12),
        Fraction(808, 24),
        24,
        Fraction(5, 3),
    )


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("mode", ["dense", "pool", "auto"])
def test_sample_unit_2d(regime, mode, gen):
    d = 5
    mu, L = population(d, regime, gen)
    q = draw((10,), mu, L, gen)
    acc = fs.GradStats(d, second_moment=mode)
    acc.update(q[:3])  # two batches: the estimate must move the first batch's centre exactly
    acc.update(q[3:])
    check(acc, q, regime, f"unit=sample (B, d), mode={mode}, regime={regime}")


@pytest.mark.parametrize("regime", list(REGIMES))
def test_sample_unit_sequence_with_mask(regime, gen):
    B, T, d = 11, 4, 4
    mu, L = population(d, regime, gen)
    grad = draw((B, T), mu, L, gen)
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[0] = True
    mask[:, 0] = True  # every other sample keeps at least one position, whatever the seed
    mask[3] = False  # a sample with no counted position is not a sample
    mask[5, 1] = False
    grad[5, 1] = math.nan  # padding may hold garbage: it must never reach the sums
    q = per_sample_vectors(grad, mask, "sample")
    assert q.shape[0] == 10
    acc = fs.GradStats(d)
    acc.update(grad, mask=mask, unit="sample")
    check(acc, q, regime, f"unit=sample (B, T, d) + mask, regime={regime}")


@pytest.mark.parametrize("regime", list(REGIMES))
def test_sample_unit_per_sample_mask(regime, gen):
    B, T, d = 12, 3, 4
    mu, L = population(d, regime, gen)
    grad = draw((B, T), mu, L, gen)
    mask = torch.ones(B, dtype=torch.int64)
    mask[[2, 7]] = 0  # (B,) integer mask: drops whole samples
    q = per_sample_vectors(grad, mask, "sample")
    assert q.shape[0] == 10
    acc = fs.GradStats(d, second_moment="pool")
    acc.update(grad, mask=mask)
    check(acc, q, regime, f"unit=sample (B, T, d) + (B,) mask, regime={regime}")


@pytest.mark.parametrize("regime", list(REGIMES))
def test_position_unit_with_mask(regime, gen):
    B, T, d = 3, 5, 4
    mu, L = population(d, regime, gen)
    grad = draw((B, T), mu, L, gen)
    mask = torch.zeros(B, T)
    mask.view(-1)[torch.randperm(B * T, generator=gen)[:11]] = 1.0  # float mask, 11 positions
    q = per_sample_vectors(grad, mask, "position")
    assert q.shape[0] == 11
    acc = fs.GradStats(d, second_moment="dense")
    acc.update(grad, mask=mask, unit="position")
    check(acc, q, regime, f"unit=position + mask, regime={regime}")


@pytest.mark.parametrize("regime", list(REGIMES))
def test_flat_unit_nchw(regime, gen):
    B, C, H, W = 9, 2, 2, 2
    mu, L = population(C * H * W, regime, gen)
    grad = draw((B,), mu, L, gen).reshape(B, C, H, W)
    q = per_sample_vectors(grad, None, "flat")
    acc = fs.GradStats(C * H * W)
    acc.update(grad, unit="flat")
    check(acc, q, regime, f"unit=flat (B, C, H, W), regime={regime}")


@pytest.mark.parametrize("regime", list(REGIMES))
def test_feature_dim_1_sample_unit(regime, gen):
    B, C, H, W = 10, 4, 2, 3
    mu, L = population(C, regime, gen)
    grad = draw((B, H, W), mu, L, gen).permute(0, 3, 1, 2)  # NCHW, non-contiguous
    q = per_sample_vectors(grad, None, "sample", feature_dim=1)
    acc = fs.GradStats(C, second_moment="pool")
    acc.update(grad, unit="sample", feature_dim=1)
    check(acc, q, regime, f"NCHW feature_dim=1 unit=sample, regime={regime}")


@pytest.mark.parametrize("regime", list(REGIMES))
def test_feature_dim_1_position_unit_with_mask(regime, gen):
    B, C, H, W = 2, 3, 2, 3
    mu, L = population(C, regime, gen)
    grad = draw((B, H, W), mu, L, gen).permute(0, 3, 1, 2).contiguous()
    mask = torch.zeros(B, H, W, dtype=torch.bool)
    mask.view(-1)[torch.randperm(B * H * W, generator=gen)[:10]] = True
    q = per_sample_vectors(grad, mask, "position", feature_dim=1)
    assert q.shape[0] == 10
    acc = fs.GradStats(C, second_moment="dense")
    acc.update(grad, mask=mask, unit="position", feature_dim=1)
    check(acc, q, regime, f"NCHW feature_dim=1 unit=position + mask, regime={regime}")


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("n", [8, 12])
def test_fp64_u_targets_of_the_probe_reference_match_brute_force(regime, n, gen):
    # per_sample_reference.u_targets hands n > 12 to its fp64 tuple averages (_fp64_u_targets),
    # which nothing else checks: hold them to the exact brute force where both can run. Measured
    # worst case over 20 seeds: 1.1e-14 relative (mu_sigma_mu, noise_1000x_mean).
    from per_sample_reference import _fp64_u_targets

    mu, L = population(5, regime, gen)
    q = draw((n,), mu, L, gen)
    want = brute_force_targets(q)
    got = _fp64_u_targets(q)
    assert_targets_close(got, want, 1e-12, context=f"_fp64_u_targets vs brute force, n={n}, {regime}")
    assert got["trace_sigma"] == pytest.approx(want["trace_sigma"], rel=1e-12)
