"""The four estimators are unbiased (Monte Carlo over known populations).

For each population we know mu and Sigma exactly, so the targets |mu|^2, |mu|^4, mu^T Sigma mu and
tr(Sigma^2) are computed from them (not from the code under test). R independent replications of
n samples each go through GradStats; the z-score of the replication mean against the true value
must satisfy |z| < 4. To show the check has power, the same replications' plug-in estimates
(|q_bar|^4 and tr(Sigma_hat^2), which docs/design.md, section 2 says are biased) must FAIL it.

Populations:
* spiked Gaussian: Sigma = 0.5 I + 4 v v^T, mean with a component along the spike;
* multivariate t with df = 10: q = mu + sqrt(df / chi2_df) A z, so Cov = df/(df-2) A A^T. The
  estimators are degree-4 polynomials, so their variance needs 8th moments (df > 8); with df <= 8
  the replication variance is infinite and a z-score's denominator would be meaningless. df = 10
  is still markedly heavy-tailed (excess kurtosis 6/(df-4) = 1 per coordinate).
"""

from __future__ import annotations

import math

import pytest
import torch

import fused_stats as fs

D, N, R = 6, 12, 5000
F64 = torch.float64


def targets(mu: torch.Tensor, sigma: torch.Tensor) -> dict[str, float]:
    m2 = float(mu @ mu)
    return {
        "mu_norm2": m2,
        "mu_norm4": m2 * m2,
        "mu_sigma_mu": float(mu @ sigma @ mu),
        "trace_sigma2": float((sigma @ sigma).trace()),
    }


def spiked_gaussian(gen: torch.Generator):
    v = torch.randn(D, generator=gen, dtype=F64)
    v = v / v.norm()
    sigma = 0.5 * torch.eye(D, dtype=F64) + 4.0 * torch.outer(v, v)
    mu = 0.6 * v + 0.3 * torch.randn(D, generator=gen, dtype=F64)
    chol = torch.linalg.cholesky(sigma)
    z = torch.randn(R, N, D, generator=gen, dtype=F64)
    return mu + z @ chol.T, mu, sigma


def multivariate_t(gen: torch.Generator, df: int = 10):
    A = torch.randn(D, D, generator=gen, dtype=F64) / math.sqrt(D)
    mu = 0.8 * torch.randn(D, generator=gen, dtype=F64) / math.sqrt(D)
    chi2 = torch.randn(R, N, df, generator=gen, dtype=F64).square().sum(-1, keepdim=True)
    z = torch.randn(R, N, D, generator=gen, dtype=F64)
    q = mu + torch.sqrt(df / chi2) * (z @ A.T)
    return q, mu, (df / (df - 2)) * (A @ A.T)


def z_score(values: torch.Tensor, truth: float) -> float:
    return float((values.mean() - truth) / (values.std() / math.sqrt(len(values))))


@pytest.mark.parametrize("population", [spiked_gaussian, multivariate_t])
def test_estimators_unbiased(population, gen):
    q, mu, sigma = population(gen)
    truth = targets(mu, sigma)
    est = {key: torch.empty(R, dtype=F64) for key in truth}
    plug_in = {"mu_norm4": torch.empty(R, dtype=F64), "trace_sigma2": torch.empty(R, dtype=F64)}
    for r in range(R):
        acc = fs.GradStats(D, second_moment="dense")
        acc.update(q[r, :5])  # two batches, so every replication also moves a centre
        acc.update(q[r, 5:])
        e = acc.estimate()
        for key in truth:
            est[key][r] = getattr(e, key)
        mean = q[r].mean(0)
        cov = torch.cov(q[r].T)
        plug_in["mu_norm4"][r] = float(mean @ mean) ** 2
        plug_in["trace_sigma2"][r] = float((cov @ cov).trace())
    z = {key: z_score(est[key], truth[key]) for key in truth}
    assert all(abs(value) < 4 for value in z.values()), f"{population.__name__}: z = {z}, truth = {truth}"
    z_plug = {key: z_score(plug_in[key], truth[key]) for key in plug_in}
    assert all(abs(value) > 4 for value in z_plug.values()), (
        f"{population.__name__}: biased plug-ins not detected, z = {z_plug} (test has no power)"
    )
