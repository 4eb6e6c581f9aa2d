"""Second-moment kernel (docs/design.md, section 6.2): ``S += Y^T Y`` for the dense accumulator.

``S`` is ``d x d`` float64 (the running total), ``Y`` is ``R x d`` (the batch's centred rows, any
float dtype and strides; for ``unit="position"`` ``R`` is the number of tokens, so this is a real
GEMM over tokens with ``K = R``). ``Y^T Y`` is symmetric, so only the ``n_t (n_t + 1) / 2`` tiles on
or above the diagonal are computed (``n_t = ceil(d / BM)``) and each is also written mirrored below
the diagonal; a diagonal tile is replaced by ``(A + A^T) / 2`` so that ``S`` stays exactly
symmetric. FLOPs: ``d (d + 1) R`` instead of ``2 d^2 R``.

Precision (docs/design.md, section 2: fp32 products are fine, plain TF32 is not):

=============  ================================  ==================================================
rows dtype     tile product                      why
=============  ================================  ==================================================
bf16 / fp16    native 16-bit MMA, fp32 acc        products of 16-bit inputs are exact in fp32
fp32           ``input_precision="tf32x3"``       3 TF32 MMAs (hi*hi + hi*lo + lo*hi), ~fp32 error
fp64           fp64 MMA (DMMA), fp64 acc          the accumulator's pool rows are fp64
=============  ================================  ==================================================

Each program owns one tile for the whole ``K`` range (or one ``K`` slice, below), accumulates over
``K`` chunks of ``BK`` rows in fp32 (fp64 for fp64 rows), then loads the fp64 tile of ``S``, adds
and stores: no two programs touch the same element, no atomics, bitwise reproducible. When there are
too few tiles to fill the device (small ``d``, many rows), ``K`` is split: each slice writes its
tile to a workspace and ``torch.sum(dtype=float64)`` over the slices is added to ``S``.

No autotuning: the kernel adds into ``S``, so one fixed configuration per dtype is used (Hopper:
128 x 128 tiles, 8 warps, 3 stages; see bench/KERNELS.md).
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from ..contracts import check_second_moment_args
from ._common import (
    TORCH_TO_TL,
    cdiv,
    check_kernel_device,
    config_value,
    kernel,
    kernel_dtype,
    launch,
    on_gpu,
    sm_count,
)

F64 = torch.float64

# (BM, BK, num_warps, num_stages) per rows dtype on Hopper
GPU_CONFIGS = {
    torch.bfloat16: (128, 64, 8, 3),
    torch.float16: (128, 64, 8, 3),
    torch.float32: (128, 32, 8, 3),
    torch.float64: (64, 16, 4, 3),
}
INTERPRETER_CONFIG = (16, 16, 4, 1)
MAX_WORKSPACE_BYTES = 256 << 20


def mma_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The tile-product input dtype: the rows' own dtype, except bf16 under the interpreter, whose
    numpy ``dot`` has no bf16 (there bf16 -> fp32 is exact and so are the products, in either)."""
    if not on_gpu(device) and dtype == torch.bfloat16:
        return torch.float32
    return dtype


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` of the tile products for rows of ``dtype`` (see module docstring)."""
    return "tf32x3" if dtype == torch.float32 else "ieee"


@kernel
def _add_half(S, part, rm, rn, m_in, D, ss_0, ss_1, mirror):
    """``S[rm, rn] += part`` and, off the diagonal, ``S[rn, rm] += part^T`` (fp64)."""
    mask = m_in[:, None] & (rn < D)[None, :]
    val = part.to(tl.float64)
    p = S + rm[:, None] * ss_0 + rn[None, :] * ss_1
    tl.store(p, tl.load(p, mask=mask, other=0.0) + val, mask=mask)
    if mirror:
        pt = S + rn[None, :] * ss_0 + rm[:, None] * ss_1
        tl.store(pt, tl.load(pt, mask=mask, other=0.0) + val, mask=mask)


@kernel
def _syrk_upper_kernel(
    Y,
    S,
    W,
    TILES,  # rows (R, D) strided; S (D, D) fp64; workspace (n_split, D, D); tile table
    R,
    D,
    k_per_split,  # rows, features, rows per K slice (a multiple of BK)
    sy_r,
    sy_d,
    ss_0,
    ss_1,
    ACCUMULATE: tl.constexpr,  # True: S += tile (fp64); False: W[split] = tile
    DOT_DTYPE: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    ti = tl.load(TILES + 2 * tile).to(tl.int64)
    tj = tl.load(TILES + 2 * tile + 1).to(tl.int64)
    rm = ti * BM + tl.arange(0, BM)
    rn = tj * BM + tl.arange(0, BM)
    rk = tl.arange(0, BK)
    m_in = rm < D
    n_in = rn < D
    acc = tl.full((BM, BM), 0.0, W.dtype.element_ty)
    k0 = split * k_per_split
    k_end = k0 + k_per_split
    for kk in range(0, k_per_split, BK):
        k = k0 + kk + rk
        k_in = (k < R) & (k < k_end)
        a = tl.load(Y + k[:, None] * sy_r + rm[None, :] * sy_d, mask=k_in[:, None] & m_in[None, :], other=0.0)
        b = tl.load(Y + k[:, None] * sy_r + rn[None, :] * sy_d, mask=k_in[:, None] & n_in[None, :], other=0.0)
        acc = tl.dot(
            tl.trans(a.to(DOT_DTYPE)),
            b.to(DOT_DTYPE),
            acc,
            input_precision=PRECISION,
            out_dtype=W.dtype.element_ty,
        )
    if ti == tj:
        # exact symmetry on the diagonal (the MMA may round a_i.b_j and b_j.a_i differently)
        acc = (acc + tl.trans(acc)) * 0.5
    if ACCUMULATE:
        # add into S one half-tile (BM x BM/2 columns) at a time: a whole fp64 tile next to the
        # fp32 accumulator does not fit in registers (spills at 128 x 128)
        left, right = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BM // 2)), (0, 2, 1)))
        _add_half(S, left, rm, tj * BM + tl.arange(0, BM // 2), m_in, D, ss_0, ss_1, ti != tj)
        _add_half(S, right, rm, tj * BM + BM // 2 + tl.arange(0, BM // 2), m_in, D, ss_0, ss_1, ti != tj)
    else:
        out_mask = m_in[:, None] & n_in[None, :]
        w = W + split * D * D
        tl.store(w + rm[:, None] * D + rn[None, :], acc, mask=out_mask)
        if ti != tj:
            tl.store(w + rn[None, :] * D + rm[:, None], acc, mask=out_mask)


def _config(dtype: torch.dtype, device: torch.device):
    cfg = GPU_CONFIGS[dtype] if on_gpu(device) else INTERPRETER_CONFIG
    return config_value("syrk_config", cfg)


@functools.lru_cache(maxsize=64)
def upper_tiles(n_t: int, device: torch.device) -> torch.Tensor:
    """int32 table of the (i, j) tile pairs with i <= j, row by row (cached: no host-to-device
    copy per update)."""
    idx = torch.triu_indices(n_t, n_t)
    return idx.T.contiguous().to(device=device, dtype=torch.int32)


def second_moment_update(S: torch.Tensor, rows: torch.Tensor) -> None:
    """In place ``S += rows^T rows`` (full symmetric result); ``S`` (d, d) float64, ``rows``
    (R, d) any float dtype. Triton twin of :func:`fused_stats.ops.torch_twin.second_moment_update`."""
    check_second_moment_args(S, rows)
    check_kernel_device(rows, "rows")
    R, d = rows.shape
    if R == 0 or d == 0:
        return
    device = rows.device
    y = kernel_dtype(rows)
    BM, BK, warps, stages = _config(y.dtype, device)
    n_t = cdiv(d, BM)
    tiles = upper_tiles(n_t, device)
    n_tiles = tiles.shape[0]
    acc_dtype = F64 if y.dtype == F64 else torch.float32
    # split K when the triangle has too few tiles to fill the device and there are many rows
    n_split = config_value("syrk_splits", None)
    if n_split is None:
        want = cdiv(2 * sm_count(device), n_tiles)
        by_rows = max(1, R // (8 * BK))
        by_memory = max(1, MAX_WORKSPACE_BYTES // (d * d * acc_dtype.itemsize))
        n_split = max(1, min(want, by_rows, by_memory))
    k_per_split = cdiv(cdiv(R, n_split), BK) * BK
    n_split = cdiv(R, k_per_split)
    accumulate = n_split == 1
    work = (
        torch.empty(n_split, d, d, dtype=acc_dtype, device=device)
        if not accumulate
        else torch.empty(0, dtype=acc_dtype, device=device)
    )
    launch(
        _syrk_upper_kernel,
        (n_tiles, n_split),
        device,
        y,
        S,
        work,
        tiles,
        R,
        d,
        k_per_split,
        y.stride(0),
        y.stride(1),
        S.stride(0),
        S.stride(1),
        ACCUMULATE=accumulate,
        DOT_DTYPE=TORCH_TO_TL[mma_dtype(y.dtype, device)],
        BM=BM,
        BK=BK,
        PRECISION=dot_precision(y.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    if not accumulate:
        S += work.sum(dim=0, dtype=F64)


__all__ = ["GPU_CONFIGS", "dot_precision", "second_moment_update"]
assert set(GPU_CONFIGS) == set(TORCH_TO_TL)
