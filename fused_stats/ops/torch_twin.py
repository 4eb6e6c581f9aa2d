"""Torch twins of the Triton kernels: the CPU path and the test oracle.

Each function here has exactly the signature of its kernel launcher in ``fused_stats.kernels``.
The twins compute in float64, so on CPU they are exact up to fp64 rounding; the kernels compute
per-batch products in fp32 (``ieee`` precision) and return fp64 sums.

Capture-reduce (docs/design.md, section 6.1), for one batch of gradients ``g`` of shape (B, T, d):

* ``unit="sample"``: ``q_b = sum_t mask[b,t] g[b,t]`` (a sample with no unmasked position is not a
  sample); ``unit="position"``: each unmasked ``g[b,t]`` is a sample ``q``.
* ``y = q - centre`` for every sample (rows that are not samples are exactly zero), and the sums
  ``n``, ``s = sum y``, ``t = sum |y|^2 y``, ``a1 = sum |y|^2``, ``a2 = sum |y|^4``,
  ``norm_max = max |q|``, ``norm_sum = sum |q|`` (norms of the uncentred ``q``).

Second moment (6.2): ``S += Y^T Y``; on CPU, large row blocks go through SciPy's ``dsyrk`` (one
triangle, mirrored, at torch's thread count: :mod:`fused_stats.ops.cpu_blas`), the rest through
torch's ``addmm``; both are fp64 products and sums. Gram rows (6.2): ``Y_new Y_pool^T``.
"""

from __future__ import annotations

import torch

from ..contracts import (  # noqa: F401  (re-exported)
    UNITS_CAPTURED,
    BatchSums,
    check_capture_args,
    check_gram_args,
    check_second_moment_args,
)
from ..errors import FusedStatsError
from . import cpu_blas


def capture_reduce(
    grad: torch.Tensor, mask: torch.Tensor | None, centre: torch.Tensor, unit: str
) -> BatchSums:
    """One pass over ``grad`` (B, T, d), any float dtype and strides; ``mask`` (B, T) bool or None;
    ``centre`` (d,) float64. Returns :class:`BatchSums` (see module docstring). The caller's
    ``grad`` is never written."""
    check_capture_args(grad, mask, centre, unit)
    grad = grad.detach()  # statistics only: nothing here is differentiated
    B, T, d = grad.shape
    R = B if unit == "sample" else B * T
    keep = None if mask is None else mask.to(device=grad.device, dtype=torch.bool)
    if keep is not None and bool(keep.all()):
        keep = None  # nothing masked: skip the masking passes (the common case on CPU)
    centre = centre.to(device=grad.device, dtype=torch.float64)
    if keep is None:
        # the rows are upcast (exactly) into one fresh fp64 buffer, the norms of q taken there, then
        # centred in place: no other (R, d) temporary
        y = torch.empty(R, d, dtype=torch.float64, device=grad.device)
        if unit == "sample" and T > 1:
            torch.sum(grad, dim=1, dtype=torch.float64, out=y)
        else:
            y.copy_(grad[:, 0] if unit == "sample" else grad.reshape(R, d))  # exact upcast
        q_norm = torch.linalg.vector_norm(y, dim=1)
        y.sub_(centre)
        valid = torch.ones(R, dtype=torch.bool, device=grad.device)
        n = R
    else:
        zero = torch.zeros((), dtype=torch.float64, device=grad.device)
        # where(), not multiply: a NaN at a masked (padding) position must not leak into the sums
        g = torch.where(keep.unsqueeze(-1), grad.to(torch.float64), zero)
        if unit == "sample":
            q = g[:, 0] if T == 1 else g.sum(dim=1)
            valid = keep.any(dim=1)
        else:
            q = g.reshape(R, d)
            valid = keep.reshape(R)
        q_norm = torch.linalg.vector_norm(q, dim=1)  # 0 on rows that are not samples
        # rows that are not samples must be exactly zero (q is already 0 there, y would be -centre)
        y = torch.where(valid.unsqueeze(-1), q.sub_(centre), zero)
        n = int(valid.sum().item())
    # |y|^2 from the row norms (no (R, d) temporary), then s = 1ᵀY and t = |y|²ᵀY as one product
    y_sq = torch.linalg.vector_norm(y, dim=1).square_()
    weights = torch.stack([torch.ones_like(y_sq), y_sq])
    s, t = torch.mm(weights, y)
    return BatchSums(
        rows=y,
        valid=valid,
        n=n,
        s=s,
        t=t,
        a1=y_sq.sum(),
        a2=y_sq @ y_sq,
        norm_max=q_norm.max() if q_norm.numel() else torch.zeros((), dtype=torch.float64, device=grad.device),
        norm_sum=q_norm.sum(),
    )


def capture_reduce_stacked(grads: torch.Tensor, centres: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`capture_reduce` of P unmasked ``unit="sample"`` batches of one row per sample at once:
    ``grads`` (P, B, d), ``centres`` (P, d) float64. Returns ``rows`` (P, B, d) centred, ``st``
    (P, 2, d) = (s, t) per batch, and ``sums`` (P, 4) = (a1, a2, norm_max, norm_sum) per batch;
    the same sums as :func:`capture_reduce` per batch (up to the order of fp64 additions)."""
    y = grads.detach().to(torch.float64, copy=True)  # exact upcast into a fresh buffer
    q_norm = torch.linalg.vector_norm(y, dim=2)
    y.sub_(centres.unsqueeze(1))
    y_sq = torch.linalg.vector_norm(y, dim=2).square_()
    st = torch.bmm(torch.stack([torch.ones_like(y_sq), y_sq], dim=1), y)
    sums = torch.stack(
        [y_sq.sum(dim=1), (y_sq * y_sq).sum(dim=1), q_norm.amax(dim=1), q_norm.sum(dim=1)], dim=1
    )
    return y, st, sums


def second_moment_update(S: torch.Tensor, rows: torch.Tensor, mirror: bool = True) -> bool:
    """In place ``S += rows^T rows``; ``S`` (d, d) float64, ``rows`` (R, d) any float dtype.

    ``mirror=False``: only the upper triangle (diagonal included) must be right on return; returns
    whether the strict lower triangle was left stale (then ``mirror_upper(S)`` completes S). An
    owner that reads S only through one place can so mirror once per read instead of per batch."""
    check_second_moment_args(S, rows)
    if cpu_blas.takes_second_moment(S, rows):
        cpu_blas.syrk_update(S, rows, mirror=mirror)
        return not mirror
    r = rows.to(torch.float64)
    S.addmm_(r.T, r)
    return False


def second_moment_update_stacked(Ss, rows: torch.Tensor) -> bool:
    """:func:`second_moment_update` of several ``S`` at once: ``Ss`` P tensors (d, d) float64,
    ``rows`` (P, R, d); one batched product ``rowsᵀ rows`` and one foreach addition (the full
    matrices, both triangles). Returns False, with nothing changed, where any block is one the
    ``dsyrk`` path takes (large blocks: one call each is faster there)."""
    if rows.dim() != 3 or rows.shape[0] != len(Ss):
        raise FusedStatsError(
            f"rows must have shape ({len(Ss)}, R, d) for {len(Ss)} matrices, got {tuple(rows.shape)}"
        )
    first = rows[0]
    S0 = Ss[0]
    check_second_moment_args(S0, first)
    if cpu_blas.takes_second_moment(S0, first):
        return False
    for S in Ss[1:]:  # the checks of S0 hold for each S of its kind; the others get them in full
        if not (
            isinstance(S, torch.Tensor)
            and S.shape == S0.shape
            and S.dtype == S0.dtype
            and S.device == S0.device
            and S.is_contiguous() == S0.is_contiguous()
            and S.requires_grad == S0.requires_grad
        ):
            check_second_moment_args(S, first)
            if cpu_blas.takes_second_moment(S, first):
                return False
    r = rows.to(torch.float64)
    torch._foreach_add_(list(Ss), torch.bmm(r.transpose(1, 2), r).unbind(0))
    return True


mirror_upper = cpu_blas.mirror_upper


def gram_rows(new_rows: torch.Tensor, pool_rows: torch.Tensor) -> torch.Tensor:
    """``new_rows @ pool_rows^T`` as float64: (B, d) x (N, d) -> (B, N)."""
    check_gram_args(new_rows, pool_rows)
    return new_rows.to(torch.float64) @ pool_rows.to(torch.float64).T
