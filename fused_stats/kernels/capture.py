"""Capture-reduce kernel (docs/design.md, section 6.1): one read of the gradient ``(B, T, d)`` gives the
per-sample centred vectors and every batch sum the accumulator needs.

Maths (the torch twin :func:`fused_stats.ops.torch_twin.capture_reduce` is the oracle)::

    unit="sample":   q_b = sum_t [mask_bt] g_bt        (sample b exists iff some mask_bt is set)
    unit="position": q_(b,t) = g_bt                    (exists iff mask_bt is set)
    y = q - c  (0 for rows that are not samples),   |y|^2 per row,   |q| per row (uncentred)
    s = sum y,  t = sum |y|^2 y,  a1 = sum |y|^2,  a2 = sum |y|^4,  max |q|,  sum |q|

Structure (two launches at most, then a small fp64 reduction in torch):

1. ``_sum_positions_kernel`` (``unit="sample"`` with ``T >= 16`` positions): program ``(split, b)``
   sums its slice of positions of sample ``b`` into ``qpart[split, b]`` (fp32) and counts its
   unmasked positions; samples are split over positions when there are too few of them to fill the
   device. It holds no per-program state, so many programs with many loads in flight fit on each
   multiprocessor. Extra traffic ``2 * n_split * B * d * 4`` bytes, small next to the ``B * T * d``
   elements read (``n_split <= T / 16``).
2. ``_capture_rows_kernel``: a persistent grid; each program owns blocks of ``BLOCK_R`` whole rows
   (all ``d`` features), so a row's norms are complete inside one program. It sums over the ``L``
   inner positions (the sample's positions, the splits of stage 1, or a single position), subtracts
   the centre, writes ``y``, and keeps per-program partials of ``s``, ``t`` (fp32 vectors) and of
   ``a1``, ``a2``, ``sum |q|``, ``max |q|`` (fp64). ``t`` needs ``|y|^2`` of the whole row before
   it can weight ``y``: when ``d`` fits one block (``d <= 8192`` on GPU, ``d <= 4096`` for fp64)
   the row stays in registers; otherwise the kernel loops over ``d`` twice and re-reads the ``y``
   it just wrote (L2-resident).
3. ``torch.sum`` in fp64 over the ``P x d`` partials (``P`` about 4 per multiprocessor): no float
   atomics anywhere, so results are bitwise reproducible.

Everything is computed in fp32 right after the load (fp64 when the gradient is fp64). The centre is
expected to be fp32-representable for non-fp64 inputs (the accumulator rounds it), so passing it to
the kernel in fp32 loses nothing and ``q - c`` is a single fp32 rounding. Every load is masked; padding positions are never read, so a NaN stored there
cannot leak into the sums. Offsets are int64 (``program_id(0).to(tl.int64)``, and every
stride product).

NaN: ``max |q|`` is NaN whenever a counted row's ``|q|`` is NaN, as in the torch twin, compiled and
interpreted alike (``tl.maximum`` alone would drop it when compiled; the kernel takes the NaN from
``sum |q|``). Offsets are int64 throughout, products of a stride with a position or feature index
included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from ..contracts import BatchSums, check_capture_args
from ._common import (
    MAX,
    SUM,
    cdiv,
    check_kernel_device,
    config_value,
    kernel,
    kernel_dtype,
    launch,
    next_pow2,
    on_gpu,
    sm_count,
)

F64 = torch.float64

# Production (Hopper) choices; see bench/KERNELS.md. A row block holds this many elements (or one
# whole row when d is larger): at d = 4096, one row per step, 8 warps, ~110 registers, 2 programs/SM.
GPU_TILE_ELEMENTS = 4096
GPU_SINGLE_CHUNK_MAX_D = 8192  # up to this d a whole row stays in registers
# fp64 rows hold twice the registers: at d = 8192 (16 warps) the whole-row path spills (about 500
# bytes per thread in the sm_90a gate), so wider fp64 rows take the two-pass path
GPU_SINGLE_CHUNK_MAX_D_FP64 = 4096
GPU_CHUNK_D = 2048  # d-chunk of the two-pass path
GPU_PROGRAMS_PER_SM = 4
SUM_POSITIONS_MIN_T = 16  # unit="sample": from this many positions on, stage 1 sums them


@kernel
def _load_q(
    X,
    MASK,
    x_row,
    m_row,
    r_in,
    dd,
    d_in,
    L,
    sx_l,
    sx_d,
    sm_l,
    HAS_MASK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
):
    """The (BLOCK_R, BLOCK_D) tile summed over the L inner positions, in ``ACC`` (fp32, or fp64 for
    fp64 gradients); masked positions are not loaded at all (whatever is stored there, NaN
    included, never enters)."""
    q = tl.full((BLOCK_R, BLOCK_D), 0.0, ACC)
    for pos in range(0, L):
        # int64 products: a position stride times a position index can pass 2^31 elements
        # (e.g. a (T, B, d) buffer viewed as (B, T, d)), as can a feature stride times a feature
        pos64 = tl.cast(pos, tl.int64)
        if HAS_MASK:
            mv = tl.load(MASK + m_row + pos64 * sm_l, mask=r_in, other=0)
            take = r_in & (mv != 0)
        else:
            take = r_in
        x = tl.load(
            X + (x_row + pos64 * sx_l)[:, None] + dd.to(tl.int64)[None, :] * sx_d,
            mask=take[:, None] & d_in[None, :],
            other=0.0,
        )
        q += x.to(ACC)
    return q


@kernel
def _capture_rows_kernel(
    X,
    MASK,
    CENTRE,  # input (strided), mask (strided, any integer dtype) or dummy, centre (D,)
    ROWS,
    VALID,  # out: rows (R, D) contiguous in the compute dtype, valid (R,) int8
    S_PART,
    T_PART,
    A_PART,  # out: per-program partials (P, D), (P, D), (P, 4) fp64
    R,
    R2,
    L,
    D,
    n_iters,  # rows; row r -> (i, j) = (r // R2, r % R2); L inner positions summed
    sx_i,
    sx_j,
    sx_l,
    sx_d,  # element strides of X for i, j, the inner position l, the feature
    sm_i,
    sm_j,
    sm_l,  # element strides of MASK for i, j, l
    HAS_MASK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE_CHUNK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.num_programs(0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    a1_acc = tl.full((BLOCK_R,), 0.0, tl.float64)
    a2_acc = tl.full((BLOCK_R,), 0.0, tl.float64)
    nsum_acc = tl.full((BLOCK_R,), 0.0, tl.float64)
    nmax_acc = tl.full((BLOCK_R,), 0.0, tl.float64)
    s_acc = tl.full((BLOCK_D,), 0.0, ROWS.dtype.element_ty)
    t_acc = tl.full((BLOCK_D,), 0.0, ROWS.dtype.element_ty)
    if SINGLE_CHUNK:  # the centre stays in registers for all of this program's rows
        c_row = tl.load(CENTRE + offs_d, mask=offs_d < D, other=0.0)
    for it in range(0, n_iters):
        r = (pid + it * nprog) * BLOCK_R + offs_r
        r_in = r < R
        i = r // R2
        j = r - i * R2
        x_row = i * sx_i + j * sx_j
        m_row = i * sm_i + j * sm_j
        if HAS_MASK:
            cnt = tl.full((BLOCK_R,), 0, tl.int32)
            for pos in range(0, L):
                mv = tl.load(MASK + m_row + tl.cast(pos, tl.int64) * sm_l, mask=r_in, other=0)
                cnt += (mv != 0).to(tl.int32)
            valid = r_in & (cnt > 0)
        else:
            valid = r_in
        if SINGLE_CHUNK:
            d_in = offs_d < D
            q = _load_q(
                X,
                MASK,
                x_row,
                m_row,
                r_in,
                offs_d,
                d_in,
                L,
                sx_l,
                sx_d,
                sm_l,
                HAS_MASK,
                BLOCK_R,
                BLOCK_D,
                ROWS.dtype.element_ty,
            )
            y = tl.where(valid[:, None] & d_in[None, :], q - c_row[None, :], 0.0)
            tl.store(ROWS + r[:, None] * D + offs_d[None, :], y, mask=r_in[:, None] & d_in[None, :])
            qsq = tl.reduce(q * q, 1, SUM)
            ysq = tl.reduce(y * y, 1, SUM)
            s_acc += tl.reduce(y, 0, SUM)
            t_acc += tl.reduce(y * ysq[:, None], 0, SUM)
        else:
            qsq = tl.full((BLOCK_R,), 0.0, ROWS.dtype.element_ty)
            ysq = tl.full((BLOCK_R,), 0.0, ROWS.dtype.element_ty)
            for d0 in range(0, D, BLOCK_D):
                dd = d0 + offs_d
                d_in = dd < D
                q = _load_q(
                    X,
                    MASK,
                    x_row,
                    m_row,
                    r_in,
                    dd,
                    d_in,
                    L,
                    sx_l,
                    sx_d,
                    sm_l,
                    HAS_MASK,
                    BLOCK_R,
                    BLOCK_D,
                    ROWS.dtype.element_ty,
                )
                c = tl.load(CENTRE + dd, mask=d_in, other=0.0)
                y = tl.where(valid[:, None] & d_in[None, :], q - c[None, :], 0.0)
                tl.store(ROWS + r[:, None] * D + dd[None, :], y, mask=r_in[:, None] & d_in[None, :])
                qsq += tl.reduce(q * q, 1, SUM)
                ysq += tl.reduce(y * y, 1, SUM)
                # read-modify-write of this program's own partial: a barrier orders it against the
                # previous block's write by another thread of the program (no atomics needed)
                tl.debug_barrier()
                sp = S_PART + pid * D + dd
                tl.store(sp, tl.load(sp, mask=d_in, other=0.0) + tl.reduce(y, 0, SUM), mask=d_in)
            # second pass: t needs the complete |y|^2 of each row; y is re-read from ROWS (written
            # by other threads of this program just above, hence the barrier)
            tl.debug_barrier()
            for d0 in range(0, D, BLOCK_D):
                dd = d0 + offs_d
                d_in = dd < D
                y = tl.load(
                    ROWS + r[:, None] * D + dd[None, :], mask=r_in[:, None] & d_in[None, :], other=0.0
                )
                tl.debug_barrier()
                tp = T_PART + pid * D + dd
                tl.store(
                    tp, tl.load(tp, mask=d_in, other=0.0) + tl.reduce(y * ysq[:, None], 0, SUM), mask=d_in
                )
        qn = tl.where(valid, tl.sqrt(qsq.to(tl.float64)), 0.0)
        y2 = ysq.to(tl.float64)
        a1_acc += y2
        a2_acc += y2 * y2
        nsum_acc += qn
        nmax_acc = tl.maximum(nmax_acc, qn)  # NaN handled below (one rule on every stack)
        tl.store(VALID + r, valid.to(tl.int8), mask=r_in)
    if SINGLE_CHUNK:
        d_in = offs_d < D
        tl.store(S_PART + pid * D + offs_d, s_acc, mask=d_in)
        tl.store(T_PART + pid * D + offs_d, t_acc, mask=d_in)
    tl.store(A_PART + pid * 4 + 0, tl.reduce(a1_acc, 0, SUM))
    tl.store(A_PART + pid * 4 + 1, tl.reduce(a2_acc, 0, SUM))
    nsum = tl.reduce(nsum_acc, 0, SUM)
    # The NaN rule: max |q| is NaN when some counted row's |q| is (as the torch twin's max is).
    # Whether tl.maximum and the MAX reduction drop a NaN differs between compiled code (fmax:
    # dropped), Triton 3.6's interpreter (elementwise: kept) and 3.9's (dropped); the sum of the
    # norms is NaN exactly when one of them is (they are >= 0, so inf + -inf cannot occur), so the
    # rule is applied from it, whatever the max does.
    nmax = tl.reduce(nmax_acc, 0, MAX)
    tl.store(A_PART + pid * 4 + 2, nsum)
    tl.store(A_PART + pid * 4 + 3, tl.where(nsum != nsum, nsum, nmax))


@kernel
def _sum_positions_kernel(
    X,
    MASK,
    QPART,
    CNT,  # input (strided), mask or dummy; out: (n_split, B, D), (n_split, B) int32
    B,
    T,
    D,
    t_per_split,
    sx_b,
    sx_t,
    sx_d,
    sm_b,
    sm_t,
    HAS_MASK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid % B
    split = pid // B
    t0 = split * t_per_split
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + offs_d
        d_in = dd < D
        acc = tl.full((BLOCK_T, BLOCK_D), 0.0, QPART.dtype.element_ty)
        for tt in range(0, t_per_split, BLOCK_T):
            t = t0 + tt + offs_t
            t_in = (t < T) & (tt + offs_t < t_per_split)
            if HAS_MASK:
                mv = tl.load(MASK + b * sm_b + t * sm_t, mask=t_in, other=0)
                take = t_in & (mv != 0)
            else:
                take = t_in
            x = tl.load(
                X + b * sx_b + t[:, None] * sx_t + dd.to(tl.int64)[None, :] * sx_d,
                mask=take[:, None] & d_in[None, :],
                other=0.0,
            )
            acc += x.to(QPART.dtype.element_ty)
        tl.store(QPART + (split * B + b) * D + dd, tl.reduce(acc, 0, SUM), mask=d_in)
    cnt = tl.full((BLOCK_T,), 0, tl.int32)
    for tt in range(0, t_per_split, BLOCK_T):
        t = t0 + tt + offs_t
        t_in = (t < T) & (tt + offs_t < t_per_split)
        if HAS_MASK:
            mv = tl.load(MASK + b * sm_b + t * sm_t, mask=t_in, other=0)
            cnt += (t_in & (mv != 0)).to(tl.int32)
        else:
            cnt += t_in.to(tl.int32)
    tl.store(CNT + split * B + b, tl.reduce(cnt, 0, SUM))


# ---------------------------------------------------------------------------- launcher
def _row_config(
    d: int, device: torch.device, dtype: torch.dtype = torch.float32, sums_positions: bool = False
):
    """(BLOCK_R, BLOCK_D, SINGLE_CHUNK, num_warps) for rows of ``d`` features computed in ``dtype``
    (fp32, or fp64 for fp64 gradients); ``sums_positions``: the kernel also sums a short
    sequence's positions of the gradient itself (``unit="sample"``, ``T < 16``)."""
    if on_gpu(device):
        single_max = GPU_SINGLE_CHUNK_MAX_D_FP64 if dtype == F64 else GPU_SINGLE_CHUNK_MAX_D
        chunk, tile = GPU_CHUNK_D, GPU_TILE_ELEMENTS
    else:  # interpreter: tiny blocks so that tails and chunk loops are exercised
        single_max, chunk, tile = 64, 16, 256
    single_max = config_value("capture_single_chunk_max_d", single_max)
    chunk = config_value("capture_chunk_d", chunk)
    if d <= single_max:
        block_d, single = next_pow2(d), True
    else:
        block_d, single = next_pow2(chunk), False
    block_r = config_value("capture_block_r", max(1, min(64, tile // block_d)))
    # about 16 fp32 tile elements per thread (plus s, t and the centre: 3 * BLOCK_D / threads)
    warps = max(4, min(16, block_r * block_d // 512))
    if sums_positions and on_gpu(device):
        # the mask and gradient loads of each position in flight next to the running sum: at 8
        # warps Triton 3.6 spills there (d = 4096, 12 + 12 bytes), at 16 it needs 90 registers
        warps = min(16, 2 * warps)
    num_warps = config_value("capture_num_warps", warps)
    return block_r, block_d, single, num_warps


def _positions_config(d: int, device: torch.device):
    """(BLOCK_T, BLOCK_D, num_warps) of stage 1: a (BLOCK_T, BLOCK_D) tile per step, d looped over."""
    if on_gpu(device):
        block_d = min(next_pow2(d), GPU_CHUNK_D * 2)
        block_t = max(1, min(64, 2 * GPU_TILE_ELEMENTS // block_d))
        warps = 8
    else:
        block_d, block_t, warps = min(next_pow2(d), 32), 4, 4
    block_d = config_value("positions_block_d", block_d)
    block_t = config_value("positions_block_t", block_t)
    return block_t, block_d, config_value("positions_num_warps", warps)


def _mask_view(mask: torch.Tensor | None):
    """The (checked) mask as an integer tensor the kernel reads (nonzero = counted), strides kept."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8)
    if mask.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        return mask
    return mask != 0  # floats: nonzero (NaN included, as in the twin's .to(bool)) counts


@dataclass
class Partials:
    """What the kernels leave on the device before the final fp64 reduction (no host sync yet)."""

    rows: torch.Tensor  # (R, d) fp32 (fp64 for fp64 inputs)
    valid: torch.Tensor  # (R,) int8
    s_part: torch.Tensor  # (P, d)
    t_part: torch.Tensor  # (P, d)
    a_part: torch.Tensor  # (P, 4) fp64: a1, a2, sum |q|, max |q|


def finish(p: Partials) -> BatchSums:
    """Stage 3: fp64 sums over the per-program partials (deterministic torch reductions)."""
    valid = p.valid.view(torch.bool)
    zero = torch.zeros((), dtype=F64, device=p.rows.device)
    empty = p.a_part.shape[0] == 0
    return BatchSums(
        rows=p.rows,
        valid=valid,
        n=int(valid.sum().item()),
        s=p.s_part.sum(dim=0, dtype=F64),
        t=p.t_part.sum(dim=0, dtype=F64),
        a1=zero.clone() if empty else p.a_part[:, 0].sum(),
        a2=zero.clone() if empty else p.a_part[:, 1].sum(),
        norm_max=zero.clone() if empty else p.a_part[:, 3].max(),
        norm_sum=zero.clone() if empty else p.a_part[:, 2].sum(),
    )


def capture_reduce(
    grad: torch.Tensor, mask: torch.Tensor | None, centre: torch.Tensor, unit: str
) -> BatchSums:
    """Triton twin of :func:`fused_stats.ops.torch_twin.capture_reduce` (same signature and result;
    rows in fp32, or fp64 for fp64 gradients; sums in fp64)."""
    return finish(capture_partials(grad, mask, centre, unit))


def capture_partials(
    grad: torch.Tensor, mask: torch.Tensor | None, centre: torch.Tensor, unit: str
) -> Partials:
    """Validate and launch the kernels (stages 1 and 2); :func:`finish` does stage 3."""
    check_capture_args(grad, mask, centre, unit)
    check_kernel_device(grad, "grad")
    device = grad.device
    B, T, d = grad.shape
    m = _mask_view(mask)
    if m is not None and m.dtype == torch.bool:
        m = m.view(torch.uint8)
    g = kernel_dtype(grad)
    f64_in = g.dtype == F64
    ct = F64 if f64_in else torch.float32
    c = centre.to(device=device, dtype=ct).contiguous()
    R = B * T if unit == "position" else B

    if R == 0 or T == 0 or d == 0:
        return Partials(
            rows=torch.zeros(R, d, dtype=ct, device=device),
            valid=torch.zeros(R, dtype=torch.int8, device=device),
            s_part=torch.zeros(0, d, dtype=ct, device=device),
            t_part=torch.zeros(0, d, dtype=ct, device=device),
            a_part=torch.zeros(0, 4, dtype=F64, device=device),
        )

    has_mask = m is not None
    dummy = g  # any valid pointer for an unused argument
    programs = GPU_PROGRAMS_PER_SM * sm_count(device)
    if unit == "position" or T == 1:
        # every (b, t) is its own row; for T == 1 "sample" and "position" coincide
        X, R2, L = g, T, 1
        sx = (g.stride(0), g.stride(1), 0, g.stride(2))
        M = m if has_mask else dummy
        sm = (m.stride(0), m.stride(1), 0) if has_mask else (0, 0, 0)
    else:
        # Long sequences go through stage 1 (a light kernel with many loads in flight, split over
        # positions when there are few samples); short ones are summed inside the row kernel,
        # where stage 1's extra B*d round trip would cost as much as reading the input.
        n_split = config_value("capture_splits", None)
        if n_split is None:
            n_split = 0 if T < SUM_POSITIONS_MIN_T else max(1, min(cdiv(programs, B), T // 16))
        n_split = min(n_split, T)
        if n_split == 0:
            X, R2, L = g, 1, T
            sx = (g.stride(0), 0, g.stride(1), g.stride(2))
            M = m if has_mask else dummy
            sm = (m.stride(0), 0, m.stride(1)) if has_mask else (0, 0, 0)
        else:
            t_per_split = cdiv(T, n_split)
            n_split = cdiv(T, t_per_split)
            qpart = torch.empty(n_split, B, d, dtype=ct, device=device)
            cnt = torch.empty(n_split, B, dtype=torch.int32, device=device)
            block_t, block_d, warps = _positions_config(d, device)
            launch(
                _sum_positions_kernel,
                (B * n_split,),
                device,
                g,
                m if has_mask else dummy,
                qpart,
                cnt,
                B,
                T,
                d,
                t_per_split,
                g.stride(0),
                g.stride(1),
                g.stride(2),
                m.stride(0) if has_mask else 0,
                m.stride(1) if has_mask else 0,
                HAS_MASK=has_mask,
                BLOCK_T=block_t,
                BLOCK_D=block_d,
                num_warps=warps,
                num_stages=2,
            )
            X, R2, L = qpart, 1, n_split
            sx = (d, 0, B * d, 1)
            M, has_mask = cnt, True
            sm = (1, 0, B)

    sums_positions = X is g and L > 1
    block_r, block_d, single, warps = _row_config(d, device, ct, sums_positions)
    n_blocks = cdiv(R, block_r)
    P = max(1, min(n_blocks, config_value("capture_programs", programs)))
    n_iters = cdiv(n_blocks, P)
    rows = torch.empty(R, d, dtype=ct, device=device)
    valid = torch.empty(R, dtype=torch.int8, device=device)
    s_part = torch.zeros(P, d, dtype=ct, device=device)
    t_part = torch.zeros(P, d, dtype=ct, device=device)
    a_part = torch.empty(P, 4, dtype=F64, device=device)
    launch(
        _capture_rows_kernel,
        (P,),
        device,
        X,
        M,
        c,
        rows,
        valid,
        s_part,
        t_part,
        a_part,
        R,
        R2,
        L,
        d,
        n_iters,
        *sx,
        *sm,
        HAS_MASK=has_mask,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        SINGLE_CHUNK=single,
        num_warps=warps,
        num_stages=2,
    )
    return Partials(rows=rows, valid=valid, s_part=s_part, t_part=t_part, a_part=a_part)
