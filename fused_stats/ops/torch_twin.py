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

from ..contracts import UNITS_CAPTURED, BatchSums  # noqa: F401  (re-exported)
from ..contracts import check_capture_args, check_gram_args, check_second_moment_args
from . import cpu_blas


def capture_reduce(grad: torch.Tensor, mask: torch.Tensor | None, centre: torch.Tensor,
                   unit: str) -> BatchSums:
    """One pass over ``grad`` (B, T, d), any float dtype and strides; ``mask`` (B, T) bool or None;
    ``centre`` (d,) float64. Returns :class:`BatchSums` (see module docstring)."""
    check_capture_args(grad, mask, centre, unit)
    g = grad.to(torch.float64)
    owned = g is not grad  # a copy of ours: it may be overwritten (the caller's tensor may not)
    B, T, d = g.shape
    zero = torch.zeros((), dtype=torch.float64, device=g.device)
    keep = None if mask is None else mask.to(device=g.device, dtype=torch.bool)
    if keep is not None and bool(keep.all()):
        keep = None  # nothing masked: skip the masking passes (the common case on CPU)
    if keep is not None:
        # where(), not multiply: a NaN at a masked (padding) position must not leak into the sums
        g = torch.where(keep.unsqueeze(-1), g, zero)
        owned = True
    if unit == "sample":
        q = g[:, 0] if T == 1 else g.sum(dim=1)
        q_owned = owned or T > 1
        valid = None if keep is None else keep.any(dim=1)
    else:
        q = g.reshape(B * T, d)
        q_owned = owned or q.data_ptr() != g.data_ptr()  # reshape copied
        valid = None if keep is None else keep.reshape(B * T)
    q_norm = torch.linalg.vector_norm(q, dim=1)  # 0 on rows that are not samples
    centre = centre.to(device=g.device, dtype=torch.float64)
    # centring in place where q is our own tensor: one fresh (B, d) fp64 allocation less per batch,
    # which on CPU costs more in page faults than the subtraction itself
    y = q.sub_(centre) if q_owned else q - centre
    if valid is not None:
        # rows that are not samples must be exactly zero (q is already 0 there, y would be -centre)
        y = torch.where(valid.unsqueeze(-1), y, zero)
    else:
        valid = torch.ones(q.shape[0], dtype=torch.bool, device=g.device)
    y_sq = (y * y).sum(dim=1)
    return BatchSums(
        rows=y,
        valid=valid,
        n=int(valid.sum().item()),
        s=y.sum(dim=0),
        t=y_sq @ y,
        a1=y_sq.sum(),
        a2=y_sq @ y_sq,
        norm_max=q_norm.max() if q_norm.numel() else zero.clone(),
        norm_sum=q_norm.sum(),
    )


def second_moment_update(S: torch.Tensor, rows: torch.Tensor) -> None:
    """In place ``S += rows^T rows``; ``S`` (d, d) float64, ``rows`` (R, d) any float dtype."""
    check_second_moment_args(S, rows)
    if cpu_blas.takes_second_moment(S, rows):
        cpu_blas.syrk_update(S, rows)
        return
    r = rows.to(torch.float64)
    S.addmm_(r.T, r)


def gram_rows(new_rows: torch.Tensor, pool_rows: torch.Tensor) -> torch.Tensor:
    """``new_rows @ pool_rows^T`` as float64: (B, d) x (N, d) -> (B, N)."""
    check_gram_args(new_rows, pool_rows)
    return new_rows.to(torch.float64) @ pool_rows.to(torch.float64).T
