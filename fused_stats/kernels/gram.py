"""Gram-rows kernel (the pool form of the second moment; docs/design.md, section 6.2):
``G_new = X P^T``.

``X`` (B, d) are the batch's new centred rows, ``P`` (N, d) the pool's rows; the result (B, N) is
float64 (the accumulator stores the pool's Gram matrix in fp64). A plain tiled "NT" GEMM: both
operands are read along ``d`` (the K dimension), the natural layout for tensor-core MMAs.
FLOPs ``2 B N d``; bytes ``(B + N) d`` elements read (re-read once per output tile column/row) and
``8 B N`` written.

Both operands are converted to one compute dtype inside the kernel, so mixed inputs need no copies:

* either operand fp64 -> fp64 MMA (DMMA) with fp64 accumulation (the accumulator's pool is fp64:
  the result then matches the fp64 twin to rounding);
* else either operand fp32 (or a bf16/fp16 mix) -> fp32 with ``input_precision="tf32x3"``;
* else (both bf16, or both fp16) -> native 16-bit MMA with fp32 accumulation (exact products).

The output is written once per tile (no accumulation into state), so results are deterministic.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..contracts import check_gram_args
from ._common import (
    TORCH_TO_TL,
    cdiv,
    check_kernel_device,
    config_value,
    kernel,
    kernel_dtype,
    launch,
    on_gpu,
)

F64 = torch.float64

# (BM, BN, BK, num_warps, num_stages) per compute dtype on Hopper; BM = 64 suits the short side
# (a batch of new rows) and is one warpgroup's wgmma M.
GPU_CONFIGS = {
    torch.bfloat16: (64, 128, 64, 4, 3),
    torch.float16: (64, 128, 64, 4, 3),
    torch.float32: (64, 128, 32, 4, 3),
    torch.float64: (64, 64, 16, 8, 3),
}
INTERPRETER_CONFIG = (16, 16, 16, 4, 1)


def compute_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The MMA input dtype for operands of dtypes ``a`` and ``b`` (module docstring)."""
    if F64 in (a, b):
        return F64
    if a == b and a in (torch.bfloat16, torch.float16):
        return a
    return torch.float32


@kernel
def _gram_kernel(
    X,
    P,
    G,  # new rows (B, D), pool rows (N, D), output (B, N) fp64; any strides
    B,
    N,
    D,
    sx_0,
    sx_1,
    sp_0,
    sp_1,
    sg_0,
    sg_1,
    DOT_DTYPE: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_in = rm < B
    n_in = rn < N
    acc = tl.full((BM, BN), 0.0, ACC_DTYPE)
    for k0 in range(0, D, BK):
        k = k0 + rk
        k_in = k < D
        k = k.to(tl.int64)  # a feature stride times k can pass 2^31 (transposed operands)
        a = tl.load(X + rm[:, None] * sx_0 + k[None, :] * sx_1, mask=m_in[:, None] & k_in[None, :], other=0.0)
        b = tl.load(P + rn[None, :] * sp_0 + k[:, None] * sp_1, mask=k_in[:, None] & n_in[None, :], other=0.0)
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), acc, input_precision=PRECISION, out_dtype=ACC_DTYPE)
    tl.store(
        G + rm[:, None] * sg_0 + rn[None, :] * sg_1, acc.to(tl.float64), mask=m_in[:, None] & n_in[None, :]
    )


def gram_rows(new_rows: torch.Tensor, pool_rows: torch.Tensor) -> torch.Tensor:
    """``new_rows @ pool_rows^T`` as float64: (B, d) x (N, d) -> (B, N). Triton twin of
    :func:`fused_stats.ops.torch_twin.gram_rows`."""
    check_gram_args(new_rows, pool_rows)
    check_kernel_device(new_rows, "new_rows")
    B, d = new_rows.shape
    N = pool_rows.shape[0]
    device = new_rows.device
    out = torch.empty(B, N, dtype=F64, device=device)
    if B == 0 or N == 0:
        return out
    if d == 0:
        return out.zero_()
    x, p = kernel_dtype(new_rows), kernel_dtype(pool_rows)
    dot = compute_dtype(x.dtype, p.dtype)
    if not on_gpu(device) and dot == torch.bfloat16:
        dot = torch.float32  # the interpreter's numpy dot has no bf16; bf16 -> fp32 is exact
    cfg = GPU_CONFIGS[dot] if on_gpu(device) else INTERPRETER_CONFIG
    BM, BN, BK, warps, stages = config_value("gram_config", cfg)
    grid = (cdiv(B, BM), cdiv(N, BN))
    launch(
        _gram_kernel,
        grid,
        device,
        x,
        p,
        out,
        B,
        N,
        d,
        x.stride(0),
        x.stride(1),
        p.stride(0),
        p.stride(1),
        out.stride(0),
        out.stride(1),
        DOT_DTYPE=TORCH_TO_TL[dot],
        ACC_DTYPE=tl.float64 if dot == F64 else tl.float32,
        PRECISION="tf32x3" if dot == torch.float32 else "ieee",
        BM=BM,
        BN=BN,
        BK=BK,
        num_warps=warps,
        num_stages=stages,
    )
    return out
