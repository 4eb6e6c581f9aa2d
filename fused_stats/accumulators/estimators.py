"""fp64 finalisation: unbiased estimates, the transfer certificate, alignment diagnostics.

Formulas (docs/design.md, section 2; width paper, "The Effective Alignment Dimension", 2026). With sums
centred at the sample mean ``q̄`` (so ``s = 0``), ``F = tr(S²)``, ``κ = |q̄|²``, ``β = q̄ᵀ S q̄``,
``τ = q̄ᵀ t`` and ``(n)_k = n (n-1) ... (n-k+1)``::

    mu_norm2     = κ − A1/(n)_2
    mu_norm4     = κ² − 2κA1/(n)_2 − 4β/(n)_2 + 8τ/(n)_3 + (A1² − 6A2 + 2F)/(n)_4
    mu_sigma_mu  = β/(n−1) − 2τ/((n−1)(n−2)) + (2nA2 − (n−1)F − A1²)/(n)_4
    trace_sigma2 = ((n−1)(n−2)F − n(n−1)A2 + A1²)/(n)_4

These equal the U-statistics ``U1``, ``U4``, ``U3 − U4`` and ``U2 − 2U3 + U4`` over ordered tuples
of distinct indices, so they are exactly unbiased. ``tr(Σ) = A1/(n−1)`` (unbiased sample variance).

Certificate (width paper, Theorem 1): for a train mean over M draws and a test mean over K draws,
``Var(μ_Mᵀg_K) = (1/M + 1/K) μᵀΣμ + tr(Σ²)/(MK)``; ``d_par = |μ|⁴/μᵀΣμ``, ``d_2 = |μ|⁴/tr(Σ²)``,
``d_align = min(d_par, d_2)``, ``n_eff = MK/(M+K+1)``, ``B_align = 1/(1 + n_eff d_align)`` and the
Cantelli bound ``B_exact = Var/(Var + |μ|⁴)``, with ``Pr(μ_Mᵀg_K ≤ 0) ≤ B_exact ≤ B_align``.
A non-positive ``|μ|⁴`` estimate means "no certificate": B = 1, d_align = 0, ``estimable=False``.

Read ``d_align`` as a sample size: a larger value means a smaller bound ``B_align`` on the probability
that a direction found on M training samples is misaligned on K test samples; ``n_eff d_align = 1``
gives ``B_align = 1/2``, ``n_eff d_align = 99`` gives ``B_align = 0.01``.

Not estimable at this n: an unbiased variance estimate (``μᵀΣμ`` or ``tr(Σ²)``) can come out ``≤ 0``
by chance. The ratio over it (``d_par`` or ``d_2``) is then None, never inf, and
``Estimate.not_estimable`` names the field and the reason; ``d_align`` is the other ratio, or None
(and no certificate) when neither is estimable.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field

from .plugin import PluginEstimate, plugin_from_centred

# one line that says what d_align is and how to read it, printed beside every d_align a report shows
D_ALIGN_READING = (
    "d_align = min(d_par, d_2), with d_par = ‖μ‖⁴/μᵀΣμ and d_2 = ‖μ‖⁴/tr(Σ²), measures how well the "
    "mean gradient stands out of the per-sample noise. A larger value means a smaller bound "
    "B_align = 1/(1 + n_eff·d_align) on the probability that a direction found on M training samples "
    "is misaligned on K test samples (n_eff = MK/(M+K+1)): n_eff·d_align = 1 gives B_align = 1/2, "
    "n_eff·d_align = 99 gives 0.01. '—' marks a value not estimable at this n (the reason is "
    "printed with the point)."
)


@dataclass(frozen=True)
class Certificate:
    """Finite-sample transfer certificate for train size ``M`` and test size ``K``.

    * ``n_eff = MK/(M+K+1)``;
    * ``b_align = 1/(1 + n_eff·d_align)``;
    * ``b_exact = Var/(Var + |μ|⁴)`` (Cantelli) with ``Var = (1/M + 1/K) μᵀΣμ + tr(Σ²)/(MK)``;
      ``Pr(μ_Mᵀg_K ≤ 0) ≤ b_exact ≤ b_align``;
    * ``estimable``: whether the bounds could be estimated at this n; False (and both bounds the
      vacuous 1) when the ``|μ|⁴`` estimate is ``≤ 0`` or no variance estimate is ``> 0``;
      ``reason`` says why. It says nothing about how small the bounds are.
    """

    M: int
    K: int
    n_eff: float
    b_align: float
    b_exact: float
    estimable: bool
    reason: str = ""

    @property
    def certified(self) -> bool:
        """Deprecated name of :attr:`estimable` (it never meant "the bound is small")."""
        warnings.warn(
            "Certificate.certified is deprecated: use Certificate.estimable (whether the bounds "
            "could be estimated at this n)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.estimable

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Estimate:
    """Unbiased estimates at one point (all floats are fp64 results).

    With per-sample vectors ``q_1..q_n`` (mean ``μ``, covariance ``Σ``), ``g_ij = q_iᵀq_j`` and
    averages over ordered tuples of distinct indices ``U1 = avg g_ij``, ``U2 = avg g_ij²``,
    ``U3 = avg g_ij g_jk``, ``U4 = avg g_ij g_kl``:

    * ``n``: samples; ``dim``: their dimension ``d``;
    * ``mu_norm2 = U1`` estimates ``|μ|²``; ``mu_norm4 = U4`` estimates ``|μ|⁴``;
    * ``mu_sigma_mu = U3 − U4`` estimates ``μᵀΣμ``;
    * ``trace_sigma2 = U2 − 2U3 + U4`` estimates ``tr(Σ²)``;
    * ``trace_sigma = Σ|q_i − q̄|²/(n−1)`` estimates ``tr Σ``;
    * ``d_par = mu_norm4/mu_sigma_mu``, ``d_2 = mu_norm4/trace_sigma2``,
      ``d_align = min(d_par, d_2)`` (ratios of unbiased estimates; None where the denominator
      estimate is ``≤ 0``, with the reason in ``not_estimable``; ``d_align`` is then the other
      ratio, None when neither is estimable; all 0 when ``has_signal`` is False);
    * ``ag_max = max_i |q_i|``, ``ag_mean = Σ|q_i|/n`` (the depth paper's indicators);
    * ``has_signal``: whether ``mu_norm4 > 0`` (else no certificate);
    * ``not_estimable``: ``{field: reason}`` for each field that is None because it cannot be
      estimated at this n.

    All are computed in fp64 from centred streaming sums (module docstring), exactly equal to the
    U-statistics above.
    """

    n: int
    dim: int
    mu_norm2: float
    mu_norm4: float
    mu_sigma_mu: float
    trace_sigma2: float
    trace_sigma: float
    d_par: float | None
    d_2: float | None
    d_align: float | None
    ag_max: float
    ag_mean: float
    has_signal: bool = field(default=True)
    # the biased values per-sequence scripts report (fused_stats.accumulators.plugin)
    plugin: PluginEstimate | None = field(default=None)
    not_estimable: dict = field(default_factory=dict)

    @property
    def effective_rank(self) -> float | None:
        """``(tr Σ)² / tr(Σ²)`` (a ratio of estimates, not itself unbiased); None where the
        ``tr(Σ²)`` estimate is ``≤ 0``."""
        if self.trace_sigma2 <= 0:
            return None
        return self.trace_sigma**2 / self.trace_sigma2

    def certificate(self, M: int, K: int) -> Certificate:
        return certificate(self, M, K)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["effective_rank"] = self.effective_rank
        return out


def falling(n: int, k: int) -> float:
    """``(n)_k = n (n−1) ... (n−k+1)`` as a float."""
    out = 1.0
    for j in range(k):
        out *= n - j
    return out


def finalize(
    n: int,
    dim: int,
    kappa: float,
    a1: float,
    a2: float,
    F: float,
    beta: float,
    tau: float,
    ag_max: float,
    ag_sum: float,
) -> Estimate:
    """Estimates from sums centred at the sample mean (module docstring); all inputs fp64 floats."""
    n2, n3, n4 = falling(n, 2), falling(n, 3), falling(n, 4)
    mu_norm2 = kappa - a1 / n2
    mu_norm4 = (
        kappa * kappa - 2 * kappa * a1 / n2 - 4 * beta / n2 + 8 * tau / n3 + (a1 * a1 - 6 * a2 + 2 * F) / n4
    )
    mu_sigma_mu = beta / (n - 1) - 2 * tau / ((n - 1) * (n - 2)) + (2 * n * a2 - (n - 1) * F - a1 * a1) / n4
    trace_sigma2 = ((n - 1) * (n - 2) * F - n * (n - 1) * a2 + a1 * a1) / n4
    has_signal = mu_norm4 > 0
    reasons = {}
    if has_signal:
        # an unbiased variance estimate can come out <= 0 by chance: the ratio over it is not
        # estimable at this n (None, not inf), and d_align rests on the other ratio alone
        d_par = _ratio_or_reason(mu_norm4, mu_sigma_mu, "d_par", "mu_sigma_mu (μᵀΣμ)", n, reasons)
        d_2 = _ratio_or_reason(mu_norm4, trace_sigma2, "d_2", "trace_sigma2 (tr(Σ²))", n, reasons)
        estimable = [d for d in (d_par, d_2) if d is not None]
        d_align = min(estimable) if estimable else None
        if d_align is None:
            reasons["d_align"] = f"neither variance estimate is > 0 at n={n}"
    else:
        d_par = d_2 = d_align = 0.0
    return Estimate(
        n=n,
        dim=dim,
        mu_norm2=mu_norm2,
        mu_norm4=mu_norm4,
        mu_sigma_mu=mu_sigma_mu,
        trace_sigma2=trace_sigma2,
        trace_sigma=a1 / (n - 1),
        d_par=d_par,
        d_2=d_2,
        d_align=d_align,
        ag_max=ag_max,
        ag_mean=ag_sum / n,
        has_signal=has_signal,
        plugin=plugin_from_centred(n, kappa, beta, F),
        not_estimable=reasons,
    )


def _ratio_or_reason(num: float, den: float, name: str, den_name: str, n: int, reasons: dict):
    """``num/den``, or None with ``reasons[name]`` set when the estimate ``den`` is ``≤ 0``."""
    if den > 0:
        return num / den
    reasons[name] = f"the {den_name} estimate {den:.3e} is <= 0 at n={n}"
    return None


def certificate(est: Estimate, M: int, K: int) -> Certificate:
    """Theorem 1 of the width paper for train size ``M`` and test size ``K`` (module docstring)."""
    from ..errors import FusedStatsError

    if int(M) != M or int(K) != K or M < 1 or K < 1:
        raise FusedStatsError(f"certificate needs positive integer sizes, got M={M!r}, K={K!r}")
    M, K = int(M), int(K)
    n_eff = M * K / (M + K + 1)
    if not est.has_signal:
        return Certificate(
            M, K, n_eff, 1.0, 1.0, False, f"no certificate: estimated |mu|^4 = {est.mu_norm4:.3e} <= 0"
        )
    if est.d_align is None:
        return Certificate(M, K, n_eff, 1.0, 1.0, False, f"no certificate: {est.not_estimable['d_align']}")
    var = (1 / M + 1 / K) * max(est.mu_sigma_mu, 0.0) + max(est.trace_sigma2, 0.0) / (M * K)
    b_exact = var / (var + est.mu_norm4)
    b_align = 1.0 / (1.0 + n_eff * est.d_align)
    return Certificate(M, K, n_eff, b_align, b_exact, True)
