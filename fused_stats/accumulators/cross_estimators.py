"""Estimates from the cross-gradient sums of a CrossStats: the unbiased ``|C|_F²``, its variance,
and the depth-saturation test (depth paper; docs/design.md, section 2).

With ``n`` samples, ``Σ c_i``, ``Σ |c_i|_F²`` and the within-batch tuple averages of ``k_ij²``,
``k_ij k_jk``, ``k_ij k_kl`` (``k_ij = <c_i, c_j>``):

* ``|C|_F² = (|Σ c_i|_F² − Σ |c_i|_F²) / (n(n−1))`` — the U-statistic with kernel ``<c_i, c_j>``,
  exactly unbiased.
* Its variance (Hoeffding): ``Var = (4(n−2) ζ1 + 2 ζ2) / (n(n−1))`` with ``ζ1 = Cᵀ Σ_c C =
  E[k_ij k_jk] − |C|⁴`` and ``ζ2 = Var(k_ij) = E[k_ij²] − |C|⁴``; the three expectations are
  estimated without bias by the within-batch tuple averages (``|C|⁴`` by ``E[k_ij k_kl]``).
* Saturation test of ``H0: C = 0``: under H0, ``ζ1 = 0`` and ``Var = 2 E[k_ij²]/(n(n−1))``.
  The statistic is a degenerate U-statistic: ``(n−1)·|C|²_hat ≈ |Z|² − tr Σ_c`` with
  ``Z ~ N(0, Σ_c)``, a weighted sum of centred chi-squares, which is skewed when ``Σ_c`` has few
  dominant eigenvalues. Its upper tail is taken from the moment-matched ``a·χ²_ν``
  (Satterthwaite: ``a = tr Σ_c² / tr Σ_c``, ``ν = (tr Σ_c)² / tr Σ_c²``, with ``tr Σ_c = E|c|²``
  and ``tr Σ_c² = E[k_ij²]`` under H0) and the Wilson–Hilferty cube-root normal approximation of
  the chi-square tail. ``saturated`` means H0 was not rejected at level ``alpha``; ``z`` is the
  equivalent standard-normal score.

Two standard errors, and which one the test uses: ``cross_frob2_se`` (full Hoeffding variance) is
the error of the estimate wherever ``C`` is; ``cross_frob2_se_null`` is the spread under H0, the scale
the test's ``z`` and ``p`` come from. Where ``C ≠ 0`` the first is the larger (the ``ζ1`` term), so
an estimate can lie within one SE of 0 while the test rejects H0; every printed line shows both,
labelled (:func:`saturation_line`). A value not estimable at this n (the plug-in Hoeffding variance
below 0; a null variance of 0) is None, with the reason in ``not_estimable``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

__all__ = [
    "UNADJUSTED_TEST",
    "CrossEstimate",
    "Saturation",
    "normal_sf",
    "null_tail",
    "saturation_line",
    "saturation_test",
    "unbiased_frob2",
]


# the test a Saturation reports; the same point can be saturated after fs.advise's Holm adjustment
# across a protocol's candidates while not saturated here, and the other way round never
UNADJUSTED_TEST = (
    "unadjusted one-sided z-test of H0: C = 0 at this point alone "
    "(fs.advise: Holm-adjusted across the candidates)"
)


@dataclass(frozen=True)
class Saturation:
    """Depth-saturation summary at one point: ``p_value`` and ``saturated`` are this point's
    own test (``test``), not adjusted for the other points probed with it. ``z`` and ``p_value``
    come from the null standard error ``cross_frob2_se_null``, not from ``cross_frob2_se``
    (module docstring); ``not_estimable``: ``{field: reason}`` for each field that is None."""

    n: int
    rank: int
    cross_frob2: float  # unbiased |C|_F^2
    cross_frob2_se: float | None  # SE of the estimate (full Hoeffding, plug-in); None: variance < 0
    cross_frob2_se_null: float  # SE under H0: C = 0, the one the test uses
    z: float | None  # None where the null variance estimate is 0 (p is then 0 or 1)
    p_value: float
    alpha: float
    saturated: bool
    ag_max: float | None
    ag_mean: float | None
    test: str = UNADJUSTED_TEST
    not_estimable: dict = field(default_factory=dict)

    @property
    def cross_frob(self) -> float:
        """``|C|_F`` from the unbiased square (0 when the estimate is negative)."""
        return math.sqrt(max(self.cross_frob2, 0.0))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["cross_frob"] = self.cross_frob
        return out

    def __str__(self) -> str:
        return saturation_line(self.to_dict())


_MISSING = object()


def _num(value, spec: str = ".3g") -> str:
    """``—`` for a key the dict lacks, "not estimable" for a None value, else the number."""
    if value is _MISSING:
        return "—"
    return "not estimable" if value is None else format(value, spec)


def saturation_line(sat: dict) -> str:
    """One saturation test as printed everywhere (CLI, markdown, the demo): the estimate, the
    null SE the test uses with its z and p, the verdict, then the estimate's own SE, each
    labelled. ``sat``: a :meth:`Saturation.to_dict` (or a report's saturation dict)."""

    def get(key, spec=".3g"):
        return _num(sat.get(key, _MISSING), spec)

    verdict = {True: "saturated", False: "not saturated"}.get(sat.get("saturated"), "verdict —")
    reason = (sat.get("not_estimable") or {}).get("cross_frob2_se")
    own = get("cross_frob2_se") + (f" ({reason})" if reason else "")
    return (
        f"|C|_F^2 = {get('cross_frob2')}; test of C = 0 (SE under H0 = {get('cross_frob2_se_null')}): "
        f"z = {get('z')}, p = {get('p_value')}, {verdict} at alpha = {get('alpha', 'g')}; "
        f"SE of the estimate = {own}"
    )


@dataclass(frozen=True)
class CrossEstimate:
    """The cross-gradient ``C = E[c_i]`` at one point (``c_i = Σ_{t∈i} q_t φ(W_in z_t)ᵀ``).

    * ``n``: samples; ``rank``: columns of ``C`` (the block's width ``r``); ``dim``: rows (``d``).
    * ``cross_frob2 = (|Σ c_i|_F² − Σ |c_i|_F²) / (n(n−1))``: the unbiased ``|C|_F²``.
    * ``plugin_frob2 = |C̄|_F²`` with ``C̄ = Σ c_i / n``: the plug-in value other tools report;
      its expectation is ``|C|_F² + tr Σ_c / n`` (biased upwards).
    * ``mean_sq_norm = Σ |c_i|_F² / n``: estimates ``E|c|_F² = |C|_F² + tr Σ_c``.
    * ``c_mean``: ``C̄`` itself (d × r, fp64, on CPU).
    """

    n: int
    dim: int
    rank: int
    cross_frob2: float
    plugin_frob2: float
    mean_sq_norm: float
    c_mean: torch.Tensor

    def to_dict(self) -> dict:
        """The scalar fields (``c_mean`` left out: a matrix)."""
        return {k: v for k, v in asdict(self).items() if k != "c_mean"}


def normal_sf(z: float) -> float:
    """Upper tail of the standard normal."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def null_tail(value: float, n: int, tr1: float, tr2: float) -> tuple[float | None, float]:
    """``(z, p)``: upper-tail p-value of ``|C|²_hat = value`` under H0 (module docstring); ``z`` is
    None where a null variance estimate is 0 (no scale: p is 0 for a positive value, else 1)."""
    if tr2 <= 0 or tr1 <= 0:
        return None, (0.0 if value > 0 else 1.0)
    scale, dof = tr2 / tr1, tr1 * tr1 / tr2
    x = max(((n - 1) * value + tr1) / scale, 0.0)
    # Wilson–Hilferty: (χ²_ν/ν)^(1/3) ≈ N(1 − 2/(9ν), 2/(9ν))
    z = ((x / dof) ** (1.0 / 3.0) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return z, normal_sf(z)


def unbiased_frob2(c_sum: torch.Tensor, sq_norm_sum: torch.Tensor, n: int) -> float:
    """``|C|_F² = (|Σ c_i|_F² − Σ |c_i|_F²) / (n(n−1))`` (module docstring); needs n >= 2."""
    total = float((c_sum * c_sum).sum())
    return (total - float(sq_norm_sum)) / (n * (n - 1))


def saturation_test(
    value: float,
    n: int,
    rank: int,
    u,
    p_counts,
    sq_norm_sum,
    alpha: float,
    ag_max: float | None,
    ag_mean: float | None,
) -> Saturation:
    """The saturation test at level ``alpha`` of ``|C|²_hat = value`` from the tuple sums ``u``
    (``Σ k², Σ k k', Σ k k''``) and their counts ``p_counts`` (``p_counts[0] > 0``), with
    ``tr Σ_c = Σ |c_i|_F² / n`` (module docstring)."""
    e2 = float(u[0]) / p_counts[0]
    m4 = float(u[2]) / p_counts[2] if p_counts[2] else max(value, 0.0) ** 2
    e3 = float(u[1]) / p_counts[1] if p_counts[1] else m4
    zeta1, zeta2 = e3 - m4, e2 - m4
    var = (4 * (n - 2) * zeta1 + 2 * zeta2) / (n * (n - 1))
    reasons = {}
    # the plug-in variance can come out negative at small n: no standard error, not a zero one
    se = math.sqrt(var) if var >= 0 else None
    if se is None:
        reasons["cross_frob2_se"] = f"its plug-in Hoeffding variance {var:.3e} is < 0 at n={n}"
    se0 = math.sqrt(max(2 * e2 / (n * (n - 1)), 0.0))
    z, p = null_tail(value, n, tr1=float(sq_norm_sum) / n, tr2=e2)
    if z is None:
        reasons["z"] = f"the null variance estimate is 0 at n={n} (p from the sign of |C|_F^2 alone)"
    return Saturation(
        n=n,
        rank=rank,
        cross_frob2=value,
        cross_frob2_se=se,
        cross_frob2_se_null=se0,
        z=z,
        p_value=p,
        alpha=alpha,
        saturated=p > alpha,
        ag_max=ag_max,
        ag_mean=ag_mean,
        not_estimable=reasons,
    )
