"""Plug-in ("comparable") statistics: what per-sequence scripts compute from stored rows.

Role: many published scripts store the per-sample rows ``q_1..q_n``, centre them
(``X = rows − q̄``) and report ratios of plug-in moments::

    S = |q̄|²                             (plug-in |μ|²)
    V = Σ_i (q̄ᵀ(q_i − q̄))² / (n − 1)     (plug-in μᵀΣμ)
    T = |X Xᵀ|_F² / (n − 1)²             (plug-in tr(Σ²), = tr(Σ̂²) with Σ̂ = XᵀX/(n−1))
    d_par = S²/V,  d_2 = S²/T,  d_align = min(d_par, d_2)

With the centred sums shifted to the sample mean (``s = 0``, ``S_c = XᵀX``) these are
``κ = |q̄|²``, ``β/(n−1)`` with ``β = q̄ᵀ S_c q̄``, and ``F/(n−1)²`` with ``F = tr(S_c²)``, so no
row is stored. They are biased: ``E[S] = |μ|² + tr(Σ)/n`` (noise inflates a weak mean) and
``E[T] ≈ tr(Σ²) + tr(Σ)²/n``, so ``d_align`` comes out inflated when the mean is noise-dominated
and deflated when the mean is strong (then ``T``'s ``tr(Σ)²/n`` term dominates). They are
reported only for comparison with such scripts, never used for a certificate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class PluginEstimate:
    """Plug-in (biased) values ``S, V, T, d_par, d_2, d_align`` (module docstring)."""

    S: float
    V: float
    T: float
    d_par: float | None  # None where V = 0 (no spread along the mean: not estimable)
    d_2: float | None  # None where T = 0
    d_align: float | None  # the smaller of the two that exist; None where neither does

    def to_dict(self) -> dict:
        return asdict(self)


def plugin_from_centred(n: int, kappa: float, beta: float, F: float) -> PluginEstimate:
    """Plug-in values from sums centred at the sample mean: ``κ = |q̄|²``, ``β = q̄ᵀ S_c q̄``,
    ``F = tr(S_c²)`` with ``S_c = Σ (q_i − q̄)(q_i − q̄)ᵀ``; needs ``n ≥ 2``."""
    S = kappa
    V = beta / (n - 1)
    T = F / (n - 1) ** 2
    S2 = S * S
    d_par = S2 / V if V > 0 else None
    d_2 = S2 / T if T > 0 else None
    ratios = [d for d in (d_par, d_2) if d is not None]
    return PluginEstimate(S=S, V=V, T=T, d_par=d_par, d_2=d_2, d_align=min(ratios) if ratios else None)
