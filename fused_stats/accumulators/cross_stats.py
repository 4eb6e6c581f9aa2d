"""Streaming cross-gradient statistics and the depth-saturation test (depth paper, DESIGN section 2).

For a zero-output block ``h(z) = W_out φ(W_in z)`` at a point, ``c_i = Σ_{t∈i} q_t φ(W_in z_t)ᵀ``
and ``C = E[c_i]``. The state is ``n``, ``Σ c_i`` (d × r, fp64), ``Σ |c_i|_F²`` and, from pairs of
samples inside each batch, sums of ``k_ij²``, ``k_ij k_jk``, ``k_ij k_kl`` over distinct tuples
(``k_ij = <c_i, c_j>``) with their counts. Estimates:

* ``|C|_F² = (|Σ c_i|_F² − Σ |c_i|_F²) / (n(n−1))`` — the U-statistic with kernel ``<c_i, c_j>``,
  exactly unbiased (DESIGN section 2).
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
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .. import ops
from ..errors import FusedStatsError

F64 = torch.float64


@dataclass(frozen=True)
class Saturation:
    """Depth-saturation summary at one point."""

    n: int
    rank: int
    cross_frob2: float  # unbiased |C|_F^2
    cross_frob2_se: float  # standard error (full Hoeffding variance, plug-in)
    cross_frob2_se_null: float  # standard error under H0: C = 0
    z: float
    p_value: float
    alpha: float
    saturated: bool
    ag_max: float
    ag_mean: float

    @property
    def cross_frob(self) -> float:
        """``|C|_F`` from the unbiased square (0 when the estimate is negative)."""
        return math.sqrt(max(self.cross_frob2, 0.0))

    def to_dict(self) -> dict:
        out = asdict(self)
        out["cross_frob"] = self.cross_frob
        return out


def normal_sf(z: float) -> float:
    """Upper tail of the standard normal."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def null_tail(value: float, n: int, tr1: float, tr2: float) -> tuple[float, float]:
    """``(z, p)``: upper-tail p-value of ``|C|²_hat = value`` under H0 (module docstring)."""
    if tr2 <= 0 or tr1 <= 0:
        return (math.inf, 0.0) if value > 0 else (0.0, 1.0)
    scale, dof = tr2 / tr1, tr1 * tr1 / tr2
    x = max(((n - 1) * value + tr1) / scale, 0.0)
    # Wilson–Hilferty: (χ²_ν/ν)^(1/3) ≈ N(1 − 2/(9ν), 2/(9ν))
    z = ((x / dof) ** (1.0 / 3.0) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return z, normal_sf(z)


class CrossStats:
    """Streaming ``|C|_F²`` for a zero-output block with input projection ``w_in`` (r × d_in).

    Parameters
    ----------
    dim : int
        Size of the gradient ``q_t`` (the residual stream).
    w_in : torch.Tensor
        (rank, d_in) projection; the block's features are ``φ(w_in z_t)``.
    activation : str
        One of ``gelu, relu, silu, tanh, identity, constant`` (``constant``: φ ≡ 1, a bias).
    """

    def __init__(self, dim: int, w_in: torch.Tensor, activation: str = "gelu", device=None,
                 backend: str = "auto", name: str | None = None, group_size: int = 256):
        from ..ops.cross_twin import ACTIVATIONS

        if activation not in ACTIVATIONS:
            raise FusedStatsError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if w_in.dim() != 2:
            raise FusedStatsError(f"w_in must be (rank, d_in), got shape {tuple(w_in.shape)}")
        self.dim = dim
        self.rank, self.in_dim = w_in.shape
        self.activation = activation
        self.backend = backend
        self.name = name
        self.group_size = group_size
        self.device = torch.device(device) if device is not None else w_in.device
        self.w_in = w_in.detach().to(self.device)
        self.n = 0
        self.batches = 0
        self.c_sum = torch.zeros(dim, self.rank, dtype=F64, device=self.device)
        self.sq_norm_sum = torch.zeros((), dtype=F64, device=self.device)
        self.u = torch.zeros(3, dtype=F64, device=self.device)  # Σ k², Σ k k', Σ k k''
        self.p = [0, 0, 0]

    def _where(self) -> str:
        return f" at point {self.name!r}" if self.name else ""

    def update(self, grad: torch.Tensor, act: torch.Tensor, mask: torch.Tensor | None = None,
               unit: str = "sample") -> None:
        """``grad`` and ``act``: (B, T, d) and (B, T, d_in) (or (B, d)/(B, d_in)); ``mask`` (B, T)."""
        w = self._where()
        if grad.dim() == 2:
            grad = grad.unsqueeze(1)
        if act.dim() == 2:
            act = act.unsqueeze(1)
        if grad.dim() != 3 or grad.shape[-1] != self.dim:
            raise FusedStatsError(
                f"cross gradient{w}: grad has shape {tuple(grad.shape)}, expected (B, T, {self.dim})")
        if act.shape[:2] != grad.shape[:2] or act.shape[-1] != self.in_dim:
            raise FusedStatsError(
                f"cross gradient{w}: activation has shape {tuple(act.shape)}, expected "
                f"({grad.shape[0]}, {grad.shape[1]}, {self.in_dim}) to match grad {tuple(grad.shape)}")
        if grad.device != self.device or act.device != self.device:
            raise FusedStatsError(
                f"cross gradient{w}: tensors on {grad.device}/{act.device}, state on {self.device}")
        if mask is not None and tuple(mask.shape) != tuple(grad.shape[:2]):
            raise FusedStatsError(
                f"cross gradient{w}: mask has shape {tuple(mask.shape)}, expected {tuple(grad.shape[:2])}")
        batch = ops.cross_reduce(grad, act, mask, self.w_in, self.activation, unit,
                                 self.group_size, self.backend)
        if batch.n == 0:
            return
        if not (torch.isfinite(batch.sq_norm_sum) and torch.isfinite(batch.c_sum).all()):
            raise FusedStatsError(f"non-finite gradient or activation{w}; nothing was accumulated")
        self.n += batch.n
        self.batches += 1
        self.c_sum += batch.c_sum
        self.sq_norm_sum += batch.sq_norm_sum
        self.u += torch.stack([batch.u2, batch.u3, batch.u4])
        self.p = [self.p[0] + batch.p2, self.p[1] + batch.p3, self.p[2] + batch.p4]

    def merge(self, other: "CrossStats") -> "CrossStats":
        if (other.dim, other.rank, other.in_dim, other.activation) != (
                self.dim, self.rank, self.in_dim, self.activation) or not torch.equal(
                other.w_in.to(self.device), self.w_in):
            raise FusedStatsError(f"cannot merge cross statistics with a different block{self._where()}")
        self.n += other.n
        self.batches += other.batches
        self.c_sum += other.c_sum.to(self.device)
        self.sq_norm_sum += other.sq_norm_sum.to(self.device)
        self.u += other.u.to(self.device)
        self.p = [a + b for a, b in zip(self.p, other.p)]
        return self

    def cross_frob2(self) -> float:
        """Unbiased ``|C|_F²`` (module docstring)."""
        if self.n < 2:
            raise FusedStatsError(f"|C|_F^2{self._where()} needs at least 2 samples, have n={self.n}")
        total = float((self.c_sum * self.c_sum).sum())
        return (total - float(self.sq_norm_sum)) / (self.n * (self.n - 1))

    def saturation(self, alpha: float = 0.05, ag_max: float = math.nan,
                   ag_mean: float = math.nan) -> Saturation:
        """The saturation test at level ``alpha`` (module docstring)."""
        if not 0 < alpha < 1:
            raise FusedStatsError(f"alpha must be in (0, 1), got {alpha}")
        value = self.cross_frob2()
        n = self.n
        if self.p[0] == 0:
            raise FusedStatsError(
                f"saturation test{self._where()} needs batches with at least 2 samples (for the "
                f"standard error); got {self.batches} batches totalling n={n}")
        e2 = float(self.u[0]) / self.p[0]
        m4 = float(self.u[2]) / self.p[2] if self.p[2] else max(value, 0.0) ** 2
        e3 = float(self.u[1]) / self.p[1] if self.p[1] else m4
        zeta1, zeta2 = e3 - m4, e2 - m4
        var = (4 * (n - 2) * zeta1 + 2 * zeta2) / (n * (n - 1))
        se = math.sqrt(max(var, 0.0))
        se0 = math.sqrt(max(2 * e2 / (n * (n - 1)), 0.0))
        z, p = null_tail(value, n, tr1=float(self.sq_norm_sum) / n, tr2=e2)
        return Saturation(n=n, rank=self.rank, cross_frob2=value, cross_frob2_se=se,
                          cross_frob2_se_null=se0, z=z, p_value=p, alpha=alpha,
                          saturated=p > alpha, ag_max=ag_max, ag_mean=ag_mean)

    def state_nbytes(self) -> int:
        return (self.c_sum.numel() + self.w_in.numel() + 4) * 8
