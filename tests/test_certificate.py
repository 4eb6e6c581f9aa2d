"""The transfer certificate and the alignment diagnostics.

References (all independent of the package code):
* Theorem 1 of the width paper re-derived in the test from the estimate's fields:
  Var = (1/M + 1/K) mu^T Sigma mu + tr(Sigma^2)/(MK), B_exact = Var/(Var + |mu|^4),
  n_eff = MK/(M+K+1), B_align = 1/(1 + n_eff d_align); and B_exact <= B_align.
* population truth: Pr(mu_M^T g_K <= 0) simulated with fresh train/test draws from a Gaussian with
  known mu, Sigma; Cantelli with the true moments must bound it, and the simulated mean/variance of
  mu_M^T g_K must match Theorem 1's |mu|^2 and Var.
* exhaustive enumeration of every disjoint split of a tiny pool, and plain loops over random
  splits, computing mean(q[A]) . mean(q[B]) from the raw vectors;
* realized alignment: mean(train) . mean(test) from the raw vectors.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import fused_stats as fs
from fused_stats.accumulators import split_alignments

from reference import brute_force_u, draw, population

F64 = torch.float64


def theorem1(mu_norm4: float, mu_sigma_mu: float, trace_sigma2: float, M: int, K: int) -> tuple[float, float]:
    var = (1 / M + 1 / K) * mu_sigma_mu + trace_sigma2 / (M * K)
    return var, var / (var + mu_norm4)


def gaussian(d: int, ratio: float, gen: torch.Generator):
    mu, L = population(d, "mean_like_noise", gen)
    return mu * ratio, L


def test_b_exact_below_b_align_on_random_instances(gen):
    checked = 0
    for _ in range(40):
        d = int(torch.randint(2, 30, (1,), generator=gen))
        n = int(torch.randint(6, 200, (1,), generator=gen))
        ratio = float(10 ** (2 * torch.rand(1, generator=gen) - 1.5))  # |mu|/noise in [0.03, 3]
        mu, L = gaussian(d, ratio, gen)
        acc = fs.GradStats(d, second_moment="dense")
        acc.update(draw((n,), mu, L, gen))
        est = acc.estimate()
        for M, K in ((1, 1), (5, 3), (32, 32), (1000, 10), (10**5, 10**5)):
            cert = est.certificate(M, K)
            assert cert.n_eff == pytest.approx(M * K / (M + K + 1), rel=1e-15)
            if not est.has_signal:
                assert (cert.estimable, cert.b_align, cert.b_exact) == (False, 1.0, 1.0)
                continue
            checked += 1
            # a ratio over a variance estimate <= 0 is not estimable: None, and d_align the other
            d_par = est.mu_norm4 / est.mu_sigma_mu if est.mu_sigma_mu > 0 else None
            d_2 = est.mu_norm4 / est.trace_sigma2 if est.trace_sigma2 > 0 else None
            assert est.d_par == (None if d_par is None else pytest.approx(d_par))
            assert est.d_2 == (None if d_2 is None else pytest.approx(d_2))
            assert est.d_align == min(d for d in (est.d_par, est.d_2) if d is not None)
            _, b_exact = theorem1(est.mu_norm4, max(est.mu_sigma_mu, 0.0), max(est.trace_sigma2, 0.0), M, K)
            b_align = 1 / (1 + cert.n_eff * est.d_align)
            assert cert.estimable
            assert cert.b_exact == pytest.approx(b_exact, rel=1e-12)
            assert cert.b_align == pytest.approx(b_align, rel=1e-12)
            # Var <= |mu|^4 (M + K + 1) / (MK d_align), so Cantelli is never weaker than B_align
            assert 0.0 <= cert.b_exact <= cert.b_align * (1 + 1e-12) <= 1.0 + 1e-12, (est, cert)
    assert checked > 100  # most instances carry a signal: the inequality was really exercised


def test_misalignment_below_cantelli_pool_and_population(gen):
    d, N, M, K = 16, 400, 4, 4
    mu, L = gaussian(d, 0.25, gen)
    sigma = L @ L.T
    m2 = float(mu @ mu)
    var_true, b_true = theorem1(m2 * m2, float(mu @ sigma @ mu), float((sigma @ sigma).trace()), M, K)
    # population: fresh train and test draws
    trials = 40_000
    train = draw((trials, M), mu, L, gen).mean(dim=1)
    test = draw((trials, K), mu, L, gen).mean(dim=1)
    align = (train * test).sum(dim=1)
    p_true = float((align <= 0).double().mean())
    se_true = math.sqrt(p_true * (1 - p_true) / trials)
    assert float(align.mean()) == pytest.approx(m2, abs=4 * float(align.std()) / math.sqrt(trials))
    # Theorem 1's variance, up to the Monte Carlo error of a sample variance (~ sqrt(2/trials) x)
    assert float(align.var()) == pytest.approx(var_true, rel=0.05)
    assert 0.05 < p_true < 0.5  # a regime where the bound is informative, not trivially true
    assert p_true <= b_true + 4 * se_true, (p_true, b_true)
    # pool of N Gaussian samples: split Monte Carlo vs the certificate from the same pool
    acc = fs.GradStats(d, second_moment="pool")
    acc.update(draw((N,), mu, L, gen))
    mis = fs.misalignment_probability(acc, M, K, trials=10_000, seed=3)
    cert = acc.estimate().certificate(M, K)
    assert cert.estimable
    assert mis.probability <= cert.b_exact + 4 * mis.stderr, (mis, cert)
    assert cert.b_exact <= cert.b_align
    # the pool's split probability estimates the population one
    assert abs(mis.probability - p_true) < 4 * math.hypot(mis.stderr, se_true) + 0.03


def test_non_positive_mu_norm4_means_no_certificate(gen):
    d = 3
    mu, L = population(d, "mean_zero", gen)
    for _ in range(100):
        q = draw((10,), mu, L, gen)
        if brute_force_u(q)["U4"] < 0:  # chosen by the exact reference, not by the package
            break
    else:
        pytest.fail("no sample with negative U4 found")
    acc = fs.GradStats(d)
    acc.update(q)
    est = acc.estimate()
    assert est.mu_norm4 < 0 and not est.has_signal
    assert (est.d_par, est.d_2, est.d_align) == (0.0, 0.0, 0.0)
    for M, K in ((1, 1), (100, 100)):
        cert = est.certificate(M, K)
        assert cert.estimable is False
        assert (cert.b_align, cert.b_exact) == (1.0, 1.0)
        assert cert.reason
    with pytest.raises(fs.FusedStatsError, match="M=0"):
        est.certificate(0, 5)


def test_split_alignments_against_exhaustive_enumeration(gen):
    d, N, M, K = 3, 7, 2, 3  # M != K: a swapped M, K would show
    mu, L = gaussian(d, 0.15, gen)
    q = draw((N,), mu, L, gen)
    acc = fs.GradStats(d, second_moment="pool")
    acc.update(q[:2])  # centre = mean of 2 samples: the split algebra must undo it exactly
    acc.update(q[2:])
    exact = []
    for A in itertools.permutations(range(N), M):
        if list(A) != sorted(A):
            continue
        rest = [i for i in range(N) if i not in A]
        for B in itertools.combinations(rest, K):
            exact.append(float(q[list(A)].mean(0) @ q[list(B)].mean(0)))
    exact = torch.tensor(exact, dtype=F64)
    assert len(exact) == math.comb(N, M) * math.comb(N - M, K)
    # identity: the average over all disjoint splits is the U-statistic U1 (= mu_norm2 estimate)
    assert float(exact.mean()) == pytest.approx(float(brute_force_u(q)["U1"]), rel=1e-12)
    p_exact = float((exact <= 0).double().mean())
    assert 0.05 < p_exact < 0.95
    trials = 4000
    values = split_alignments(acc, M, K, trials, seed=1)
    scale = float(exact.abs().max())
    distance = (values[:, None] - exact[None, :]).abs().min(dim=1).values
    assert float(distance.max()) < 1e-12 * scale, "a split value that no disjoint split produces"
    mis = fs.misalignment_probability(acc, M, K, trials=trials, seed=1)
    assert mis.trials == trials and mis.pool_size == N and (mis.M, mis.K) == (M, K)
    assert abs(mis.probability - p_exact) < 4 * math.sqrt(p_exact * (1 - p_exact) / trials)
    assert abs(mis.mean_alignment - float(exact.mean())) < 4 * float(exact.std()) / math.sqrt(trials)


def test_misalignment_probability_against_plain_loop(gen):
    d, N, M, K = 8, 60, 10, 15
    mu, L = gaussian(d, 0.12, gen)
    q = draw((N,), mu, L, gen)
    acc = fs.GradStats(d, second_moment="pool", pool_capacity=N)
    for start in range(0, N, 16):
        acc.update(q[start : start + 16])
    trials = 3000
    loop = torch.empty(trials, dtype=F64)
    for r in range(trials):
        perm = torch.randperm(N, generator=gen)
        loop[r] = q[perm[:M]].mean(0) @ q[perm[M : M + K]].mean(0)
    p_loop = float((loop <= 0).double().mean())
    mis = fs.misalignment_probability(acc, M, K, trials=trials, seed=7)
    se = math.sqrt(2 * p_loop * (1 - p_loop) / trials)
    assert 0.05 < p_loop < 0.95
    assert abs(mis.probability - p_loop) < 4 * se + 1e-12
    assert abs(mis.mean_alignment - float(loop.mean())) < 4 * float(loop.std()) * math.sqrt(2 / trials)
    # different seeds give different splits, the same seed the same ones
    assert torch.equal(split_alignments(acc, M, K, 50, seed=2), split_alignments(acc, M, K, 50, seed=2))
    assert not torch.equal(split_alignments(acc, M, K, 50, seed=2), split_alignments(acc, M, K, 50, seed=3))


@pytest.mark.parametrize("modes", [("dense", "pool"), ("auto", "auto"), ("pool", "dense")])
def test_realized_alignment(modes, gen):
    d = 9
    mu, L = population(d, "mean_100x_noise", gen)
    train, test = draw((70,), mu, L, gen), draw((45,), mu, L, gen)
    a = fs.GradStats(d, second_moment=modes[0])
    b = fs.GradStats(d, second_moment=modes[1])
    for start in range(0, 70, 20):
        a.update(train[start : start + 20])
    for start in range(0, 45, 9):
        b.update(test[start : start + 9])
    want = float(train.mean(0) @ test.mean(0))
    assert fs.realized_alignment(a, b) == pytest.approx(want, rel=1e-12)
    assert fs.realized_alignment(b, a) == pytest.approx(want, rel=1e-12)


def test_alignment_errors(gen):
    dense = fs.GradStats(4, second_moment="dense")
    dense.update(torch.randn(10, 4, generator=gen, dtype=F64))
    with pytest.raises(fs.FusedStatsError, match="pool"):
        fs.misalignment_probability(dense, 2, 2)
    pool = fs.GradStats(4, second_moment="pool")
    pool.update(torch.randn(10, 4, generator=gen, dtype=F64))
    with pytest.raises(fs.FusedStatsError, match="M=6, K=5"):
        fs.misalignment_probability(pool, 6, 5)
    with pytest.raises(fs.FusedStatsError, match="dim"):
        fs.realized_alignment(pool, fs.GradStats(5))
    with pytest.raises(fs.FusedStatsError, match="n=0"):
        fs.realized_alignment(pool, fs.GradStats(4))
