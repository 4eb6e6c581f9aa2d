"""The data contract between the ops layer, the Triton kernels and their torch twins.

What a capture-reduce pass (:class:`BatchSums`) and a cross-gradient pass (:class:`CrossBatch`)
return, the accepted units and activations, :func:`tuple_sums` (the closed forms both
cross-gradient implementations use) and the argument checks of the four ops
(:func:`check_capture_args`, :func:`check_second_moment_args`, :func:`check_gram_args`,
:func:`check_cross_args`): a launcher and its twin call the same check, so both refuse the same
input with the same :class:`~fused_stats.FusedStatsError`. A leaf module (it imports only
:mod:`fused_stats.errors`), so the kernels and the twins share it without either importing the ops
layer above them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import FusedStatsError

F64 = torch.float64
UNITS_CAPTURED = ("sample", "position")
ACTIVATIONS = ("gelu", "relu", "silu", "tanh", "identity", "constant")
DEFAULT_GROUP_SIZE = 256


@dataclass
class BatchSums:
    """What one capture-reduce pass returns; all sums are float64 on the input's device."""

    rows: torch.Tensor  # (R, d) centred vectors; R = B ("sample") or B*T ("position")
    valid: torch.Tensor  # (R,) bool: which rows are samples
    n: int
    s: torch.Tensor  # (d,)
    t: torch.Tensor  # (d,)
    a1: torch.Tensor  # ()
    a2: torch.Tensor  # ()
    norm_max: torch.Tensor  # ()
    norm_sum: torch.Tensor  # ()

    def valid_rows(self) -> torch.Tensor:
        """The sample rows only, as float64 (what a pool stores)."""
        return self.rows[self.valid].to(torch.float64)


@dataclass
class CrossBatch:
    n: int
    c_sum: torch.Tensor  # (d, r) fp64
    sq_norm_sum: torch.Tensor  # () fp64
    u2: torch.Tensor  # () fp64: Σ_{i≠j} k_ij² within groups
    u3: torch.Tensor  # () fp64: Σ_{i,j,k distinct} k_ij k_jk
    u4: torch.Tensor  # () fp64: Σ_{i,j,k,l distinct} k_ij k_kl
    p2: int
    p3: int
    p4: int
    u: torch.Tensor | None = None  # (3,) = (u2, u3, u4), where the producer has them stacked


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every entry of ``tensors`` is finite, with one reduction per tensor and one host
    read: a NaN or Inf entry makes the total non-finite, so a finite total proves them all finite;
    a non-finite total (also finite entries whose sum overflows) is settled by the exact check."""
    total = tensors[0].sum()
    for t in tensors[1:]:
        total = total + t.sum()
    if math.isfinite(total.item()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def tuple_counts(m: int) -> tuple[int, int, int]:
    """How many ordered pairs, triples and quadruples of distinct indices ``m`` items have."""
    return m * (m - 1), m * (m - 1) * (m - 2), m * (m - 1) * (m - 2) * (m - 3)


def tuple_sums(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Sums of ``k_ij²``, ``k_ij k_jk``, ``k_ij k_kl`` over ordered distinct tuples of one group
    ``k`` (m, m), or of each group of a stack ``k`` (..., m, m) (the sums then have shape (...)).

    With ``H`` = ``k`` with its diagonal zeroed: ``Σ_{i≠j} h² = |H|_F²``;
    ``Σ_{distinct i,j,k} h_ij h_jk = |H1|² − |H|_F²``; and, expanding ``(1ᵀH1)²`` by how two
    ordered pairs overlap, ``Σ_{distinct i,j,k,l} h_ij h_kl = (1ᵀH1)² − 4·u3 − 2·u2``.
    """
    m = k.shape[-1]
    h = k.to(F64, copy=True)
    h.diagonal(dim1=-2, dim2=-1).zero_()
    u2 = (h * h).sum(dim=(-2, -1))
    row = h.sum(dim=-1)
    u3 = (row * row).sum(dim=-1) - u2
    total = row.sum(dim=-1)
    u4 = total * total - 4 * u3 - 2 * u2
    return u2, u3, u4, *tuple_counts(m)


# ---------------------------------------------------------------------------- argument checks
def check_tensor(x, name: str, ndim: int, device: torch.device | None = None) -> None:
    """``x`` is a floating-point tensor with ``ndim`` dimensions (on ``device`` when given)."""
    if not isinstance(x, torch.Tensor):
        raise FusedStatsError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise FusedStatsError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise FusedStatsError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if device is not None and x.device != device:
        raise FusedStatsError(f"{name} is on {x.device}, expected {device}")


def _check_mask(mask, B: int, T: int, grad: torch.Tensor, same_device: bool) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise FusedStatsError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if tuple(mask.shape) != (B, T):
        raise FusedStatsError(
            f"mask has shape {tuple(mask.shape)}; expected {(B, T)} for grad of shape {tuple(grad.shape)}"
        )
    if same_device and mask.device != grad.device:
        raise FusedStatsError(f"mask is on {mask.device}, grad on {grad.device}")


def check_capture_args(grad, mask, centre, unit: str) -> None:
    """Capture-reduce: ``grad`` (B, T, d) float; ``mask`` None or (B, T) on grad's device (any
    dtype, nonzero = counted); ``centre`` a (d,) tensor (any device); ``unit`` in
    :data:`UNITS_CAPTURED`."""
    check_tensor(grad, "grad", 3)
    if unit not in UNITS_CAPTURED:
        raise FusedStatsError(f"unit must be one of {UNITS_CAPTURED}, got {unit!r}")
    B, T, d = grad.shape
    if not isinstance(centre, torch.Tensor) or tuple(centre.shape) != (d,):
        raise FusedStatsError(
            f"centre must be a tensor of shape {(d,)}, got "
            f"{tuple(centre.shape) if isinstance(centre, torch.Tensor) else type(centre).__name__}"
        )
    _check_mask(mask, B, T, grad, same_device=True)


def check_second_moment_args(S, rows) -> None:
    """Second moment: ``rows`` (R, d) float; ``S`` (d, d) float64 on the same device."""
    check_tensor(rows, "rows", 2)
    check_tensor(S, "S", 2, device=rows.device)
    d = rows.shape[1]
    if S.dtype != F64 or tuple(S.shape) != (d, d):
        raise FusedStatsError(
            f"S must be float64 of shape {(d, d)} for rows of shape "
            f"{tuple(rows.shape)}; got {S.dtype} {tuple(S.shape)}"
        )


def check_gram_args(new_rows, pool_rows) -> None:
    """Gram rows: ``new_rows`` (B, d) and ``pool_rows`` (N, d), float, on one device."""
    check_tensor(new_rows, "new_rows", 2)
    check_tensor(pool_rows, "pool_rows", 2, device=new_rows.device)
    d, d2 = new_rows.shape[1], pool_rows.shape[1]
    if d2 != d:
        raise FusedStatsError(
            f"pool_rows has {d2} features (shape {tuple(pool_rows.shape)}); "
            f"new_rows has {d} (shape {tuple(new_rows.shape)})"
        )


def check_cross_features_args(grad, phi, mask, unit: str, group_size: int) -> None:
    """Cross-gradient from given features: ``grad`` (B, T, d) and ``phi`` (B, T, r), float, on one
    device; ``mask``, ``unit`` and ``group_size`` as :func:`check_cross_args`."""
    check_tensor(grad, "grad", 3)
    check_tensor(phi, "phi", 3, device=grad.device)
    if unit not in UNITS_CAPTURED:
        raise FusedStatsError(f"unit must be one of {UNITS_CAPTURED}, got {unit!r}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise FusedStatsError(f"group_size must be a positive int, got {group_size!r}")
    B, T, _ = grad.shape
    if tuple(phi.shape[:2]) != (B, T):
        raise FusedStatsError(
            f"phi has shape {tuple(phi.shape)}, expected ({B}, {T}, r) for grad {tuple(grad.shape)}"
        )
    _check_mask(mask, B, T, grad, same_device=False)


def check_cross_args(grad, act, mask, w_in, activation: str, unit: str, group_size: int) -> None:
    """Cross-gradient: ``grad`` (B, T, d), ``act`` (B, T, d_in) and ``w_in`` (r, d_in), float, on
    one device; ``mask`` None or (B, T) (moved to grad's device by the op); ``activation`` in
    :data:`ACTIVATIONS`; ``unit`` in :data:`UNITS_CAPTURED`; ``group_size`` a positive int."""
    check_tensor(grad, "grad", 3)
    check_tensor(act, "act", 3, device=grad.device)
    check_tensor(w_in, "w_in", 2, device=grad.device)
    if activation not in ACTIVATIONS:
        raise FusedStatsError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if unit not in UNITS_CAPTURED:
        raise FusedStatsError(f"unit must be one of {UNITS_CAPTURED}, got {unit!r}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise FusedStatsError(f"group_size must be a positive int, got {group_size!r}")
    B, T, _ = grad.shape
    _, din = w_in.shape
    if tuple(act.shape) != (B, T, din):
        raise FusedStatsError(
            f"act has shape {tuple(act.shape)}, expected {(B, T, din)} for grad "
            f"{tuple(grad.shape)} and w_in {tuple(w_in.shape)}"
        )
    _check_mask(mask, B, T, grad, same_device=False)
