"""Cross-gradient kernel (docs/design.md, section 6.3; depth paper): the fused Triton twin of
:func:`fused_stats.ops.cross_twin.cross_reduce` (same signature, same :class:`CrossBatch`).

Maths (the twin is the oracle). For a zero-output block ``h(z) = W_out φ(W_in z)`` at a point with
activation ``z_t`` and gradient ``q_t`` at each counted position ``t``::

    φ_t = φ(W_in z_t)                                   (r features)
    unit="sample":   c_i = Σ_{t ∈ i} q_t φ_tᵀ            (d × r, one per sample with a counted position)
    unit="position": c_t = q_t φ_tᵀ                      (rank one, one per counted position)
    c_sum = Σ c,   sq_norm_sum = Σ |c|_F²,   k_ij = <c_i, c_j>_F inside groups of ``group_size``
    consecutive samples -> u2 = Σ k², u3 = Σ k_ij k_jk, u4 = Σ k_ij k_kl over distinct tuples

Structure. The counted positions are listed once as flat indices ``b·T + t`` (b-major, so a
sample's rows are contiguous in the list, CSR-style); masked positions are never read, so a NaN
stored at padding cannot leak in. The samples (or positions) are processed in *chunks* of whole
groups, so ``φ(W_in z)`` exists only for one chunk at a time, never for all tokens:

1. ``_phi_kernel``: a tiled GEMM ``Z_chunk W_inᵀ`` (rows gathered through the index list, any
   strides) with the activation applied in its epilogue, written as ``Φ`` (rows, r).
2. ``_cross_kernel``: program ``(tile, split)`` owns a ``BD × BR`` tile of ``c`` and a contiguous
   range of *items* (a sample for ``"sample"``; a run of ``item_rows`` positions for
   ``"position"``); per item it forms ``Σ_t q_t φ_tᵀ`` as ``tl.dot(Qᵀ, Φ)`` over blocks of ``BT``
   rows, stores it (``"sample"``: the per-sample ``c_i``, and ``Σ |c_i|²`` of its tile in fp64)
   and adds it to an fp64 partial of ``c_sum``. Partials go to a workspace, one slot per split;
   ``torch.sum(dtype=float64)`` reduces them: no float atomics, bitwise reproducible.
3. Within-group Gram matrices: ``"sample"``: :func:`fused_stats.kernels.gram.gram_rows` of the
   flattened ``c_i`` of each group; ``"position"``: ``(Q_g Q_gᵀ) ⊙ (Φ_g Φ_gᵀ)`` from two
   ``gram_rows`` calls (no d × r per position). The tuple sums of each (m × m) block come from the
   twin's :func:`~fused_stats.ops.cross_twin.tuple_sums` (O(m²) work in torch).

Precision (docs/design.md, section 2: fp32 products are fine, plain TF32 is not). Loads are cast to the
compute dtype right away; the tile products follow :func:`dot_precision` (the same rule as
:mod:`.second_moment` and :mod:`.gram`):

==================  ==================================  ======================================
inputs              tile products (both stages)         on sm_90a
==================  ==================================  ======================================
bf16 / fp16 / fp32  fp32, ``input_precision="tf32x3"``  ``HGMMA`` (wgmma .tf32), 3 per product
any of them fp64    fp64, ``input_precision="ieee"``    ``DMMA`` (Hopper has no fp64 wgmma)
==================  ==================================  ======================================

``tf32x3`` splits each fp32 operand as ``a = a_hi + a_lo`` (``a_hi`` = ``a`` rounded to TF32) and
sums ``a_hi b_hi + a_hi b_lo + a_lo b_hi`` in fp32 (``|a_lo| <= 2^-11 |a|``): the dropped
``a_lo b_lo`` and the TF32 rounding of the ``lo`` parts leave at most about ``3 · 2^-22`` of each
product, a few times fp32's own ``2^-24`` rounding, with fp32 accumulation as before. Native bf16
products (exact) do not apply: ``Φ`` is an fp32 activation output and ``W_in`` is fp32 or fp64.
Under the interpreter ``tl.dot`` is a numpy fp32 (fp64) matmul whatever the precision.
Per-sample sums over positions are fp32; every sum over samples (``c_sum``, ``sq_norm_sum``) is
fp64. ``Σ |c_i|²`` is taken from the same fp32 ``c_i`` that enter ``c_sum``, so the unbiased
``|C|² = (|Σc|² − Σ|c|²)/(n(n−1))`` cancels consistently. The Gram blocks use ``gram_rows`` as it
is (also ``tf32x3`` for fp32 rows on a GPU; for ``"position"`` the gathered ``Q_g`` is upcast to
fp64 when any input is fp64, so ``Σ |c_t|² = Σ |q_t|² |φ_t|²`` is fp64 then): they feed only the
standard error, except that ``"position"`` takes ``Σ |c_t|²`` from their diagonals.

Memory per chunk: ``Φ`` is ``rows × r`` and the per-sample ``c`` is ``m × d × r`` (fp32); chunks are
sized by :data:`CHUNK_BYTES`.

Activations (``ACT`` is a compile-time string): ``gelu`` (exact, erf form), ``relu``, ``silu``
(``x / (1 + e^{−x})``), ``tanh`` (``sign(x)(1 − e^{−2|x|})/(1 + e^{−2|x|})``: absolute error of a
few ulps of 1, the form the interpreter also runs), ``identity``, ``constant`` (φ ≡ 1: the GEMM is
skipped).
"""

from __future__ import annotations

import torch
import triton.language as tl

from ..contracts import DEFAULT_GROUP_SIZE, CrossBatch, check_cross_args, tuple_sums
from ..errors import FusedStatsError
from ._common import (
    SUM,
    cdiv,
    check_kernel_device,
    config_value,
    kernel,
    kernel_dtype,
    launch,
    on_gpu,
    sm_count,
)
from .gram import gram_rows
from .second_moment import dot_precision

IS_FUSED_KERNEL = True  # bench/gpu_check.py and the tests read this
F64 = torch.float64
F32 = torch.float32

# Hopper configurations: stage 1 (BM, BN, BK, warps, stages) and stage 2 (BD, BR, BT, warps,
# stages) per compute dtype, chosen at compile time (no GPU) so that bf16 and fp32 inputs compile
# to wgmma with no spills and no local memory (the sm_90a gate, tests/test_kernels_sm90.py; table
# in bench/KERNELS.md). BN = BR = 64 = r: Z and Q are each read once per chunk. Stage 2 is
# register-bound (a gathered BT x BD operand, the fp32 tile and its fp64 c_sum partial): 64 x 64
# tiles over two warpgroups leave ~40 registers of headroom, while 128-wide tiles or BT = 64 at
# 4 warps spill.
PHI_GPU = {F32: (128, 64, 32, 8, 3), F64: (64, 64, 16, 4, 3)}
CROSS_GPU = {F32: (64, 64, 32, 8, 3), F64: (32, 64, 16, 8, 3)}
PHI_INTERPRETER = (16, 16, 16, 1, 1)
CROSS_INTERPRETER = (16, 16, 16, 1, 1)
ITEM_ROWS = 256  # unit="position": positions per stage-2 item (fp32 sum, then fp64)
CHUNK_BYTES = 256 << 20  # bound on Φ plus the per-sample c of one chunk


@kernel
def _phi_kernel(
    Z,
    W,
    ROWS,
    PHI,  # act (B, T, DIN) strided; w_in (R, DIN) strided; int32 row list; out (n_rows, R)
    n_rows,
    T,
    DIN,
    R,
    sz_b,
    sz_t,
    sz_d,
    sw_r,
    sw_d,
    ACT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_in = rm < n_rows
    n_in = rn < R
    if ACT == "constant":
        phi = tl.full((BM, BN), 1.0, DOT_DTYPE)
    else:
        idx = tl.load(ROWS + rm, mask=m_in, other=0).to(tl.int64)
        b = idx // T
        base = b * sz_b + (idx - b * T) * sz_t
        x = tl.full((BM, BN), 0.0, DOT_DTYPE)
        for k0 in range(0, DIN, BK):
            k = k0 + tl.arange(0, BK)
            k_in = k < DIN
            k = k.to(tl.int64)  # a feature stride times k can pass 2^31 (e.g. a transposed act)
            a = tl.load(Z + base[:, None] + k[None, :] * sz_d, mask=m_in[:, None] & k_in[None, :], other=0.0)
            w = tl.load(
                W + rn[None, :] * sw_r + k[:, None] * sw_d, mask=k_in[:, None] & n_in[None, :], other=0.0
            )
            x = tl.dot(a.to(DOT_DTYPE), w.to(DOT_DTYPE), x, input_precision=PRECISION, out_dtype=DOT_DTYPE)
        # the activation in the GEMM's epilogue: the pre-activations never leave registers
        if ACT == "gelu":
            phi = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
        elif ACT == "relu":
            phi = tl.maximum(x, 0.0)
        elif ACT == "silu":
            phi = x / (1.0 + tl.exp(-x))
        elif ACT == "tanh":
            e = tl.exp(-2.0 * tl.abs(x))
            mag = (1.0 - e) / (1.0 + e)
            phi = tl.where(x < 0, -mag, mag)
        else:  # identity
            phi = x
    tl.store(PHI + rm[:, None] * R + rn[None, :], phi.to(DOT_DTYPE), mask=m_in[:, None] & n_in[None, :])


@kernel
def _cross_kernel(
    Q,
    PHI,
    ROWS,
    SEG,
    C_OUT,
    SQ_PART,
    CSUM_PART,  # grad (B, T, D) strided; Φ (rows, R); row list;
    # item offsets (n_items + 1); per-item c (n_items, D, R); (n_tiles, n_items) fp64; (splits, D, R) fp64
    n_items,
    items_per_split,
    T,
    D,
    R,
    sq_b,
    sq_t,
    sq_d,
    STORE_C: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BD: tl.constexpr,
    BR: tl.constexpr,
    BT: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    # plain integer maths: tl.cdiv is a jit function, which the interpreter cannot call when
    # triton was imported without TRITON_INTERPRET (see _triton_compat.DualKernel)
    n_tr = (R + BR - 1) // BR
    td = tile // n_tr
    tr = tile - td * n_tr
    rd = td * BD + tl.arange(0, BD)
    rr = tr * BR + tl.arange(0, BR)
    d_in = rd < D
    r_in = rr < R
    out_mask = d_in[:, None] & r_in[None, :]
    rt = tl.arange(0, BT)
    csum = tl.full((BD, BR), 0.0, tl.float64)
    first = split * items_per_split
    last = tl.minimum(first + items_per_split, n_items)
    for item in range(first, last):
        lo = tl.load(SEG + item).to(tl.int64)
        hi = tl.load(SEG + item + 1).to(tl.int64)
        acc = tl.full((BD, BR), 0.0, DOT_DTYPE)
        for j0 in range(lo, hi, BT):
            j = j0 + rt
            j_in = j < hi
            idx = tl.load(ROWS + j, mask=j_in, other=0).to(tl.int64)
            b = idx // T
            base = b * sq_b + (idx - b * T) * sq_t
            q = tl.load(Q + base[:, None] + rd[None, :] * sq_d, mask=j_in[:, None] & d_in[None, :], other=0.0)
            p = tl.load(PHI + j[:, None] * R + rr[None, :], mask=j_in[:, None] & r_in[None, :], other=0.0)
            acc = tl.dot(
                tl.trans(q.to(DOT_DTYPE)),
                p.to(DOT_DTYPE),
                acc,
                input_precision=PRECISION,
                out_dtype=DOT_DTYPE,
            )
        acc64 = acc.to(tl.float64)
        csum += acc64
        if STORE_C:
            tl.store(C_OUT + item * D * R + rd[:, None] * R + rr[None, :], acc, mask=out_mask)
            sq = tl.reduce(tl.reduce(acc64 * acc64, 1, SUM), 0, SUM)
            tl.store(SQ_PART + tile * n_items + item, sq)
    tl.store(CSUM_PART + split * D * R + rd[:, None] * R + rr[None, :], csum, mask=out_mask)


def _configs(dot: torch.dtype, device: torch.device):
    if on_gpu(device):
        phi, cross = PHI_GPU[dot], CROSS_GPU[dot]
    else:
        phi, cross = PHI_INTERPRETER, CROSS_INTERPRETER
    return config_value("cross_phi_config", phi), config_value("cross_config", cross)


def _phi(z, w, rows, activation, dot, cfg) -> torch.Tensor:
    """Stage 1: ``Φ = φ(Z[rows] W_inᵀ)`` for one chunk's rows, (len(rows), r) in ``dot``."""
    n_rows = rows.shape[0]
    T, din = z.shape[1], z.shape[2]
    r = w.shape[0]
    out = torch.empty(n_rows, r, dtype=dot, device=z.device)
    BM, BN, BK, warps, stages = cfg
    launch(
        _phi_kernel,
        (cdiv(n_rows, BM), cdiv(r, BN)),
        z.device,
        z,
        w,
        rows,
        out,
        n_rows,
        T,
        din,
        r,
        z.stride(0),
        z.stride(1),
        z.stride(2),
        w.stride(0),
        w.stride(1),
        ACT=activation,
        DOT_DTYPE=_TL[dot],
        PRECISION=dot_precision(dot),
        BM=BM,
        BN=BN,
        BK=BK,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def _cross(q, phi, rows, seg, store_c, dot, cfg):
    """Stage 2 for one chunk: ``(c per item or None, Σ|c|² fp64 or None, c_sum fp64)``."""
    device = q.device
    T, d = q.shape[1], q.shape[2]
    r = phi.shape[1]
    n_items = seg.shape[0] - 1
    BD, BR, BT, warps, stages = cfg
    n_tiles = cdiv(d, BD) * cdiv(r, BR)
    n_split = config_value("cross_splits", None)
    if n_split is None:  # enough programs to fill the device, never more than items
        n_split = cdiv(2 * sm_count(device), n_tiles)
    n_split = max(1, min(n_split, n_items))
    per = cdiv(n_items, n_split)
    n_split = cdiv(n_items, per)
    c = torch.empty((n_items if store_c else 0), d, r, dtype=dot, device=device)
    sq = torch.empty((n_tiles if store_c else 0), n_items, dtype=F64, device=device)
    part = torch.empty(n_split, d, r, dtype=F64, device=device)
    launch(
        _cross_kernel,
        (n_tiles, n_split),
        device,
        q,
        phi,
        rows,
        seg,
        c,
        sq,
        part,
        n_items,
        per,
        T,
        d,
        r,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        STORE_C=store_c,
        DOT_DTYPE=_TL[dot],
        PRECISION=dot_precision(dot),
        BD=BD,
        BR=BR,
        BT=BT,
        num_warps=warps,
        num_stages=stages,
    )
    return (c if store_c else None), (sq.sum() if store_c else None), part.sum(dim=0)


_TL = {F32: tl.float32, F64: tl.float64}


def _chunk_groups(group_size: int, per_group_bytes: int) -> int:
    """Whole groups per chunk: as many as fit :data:`CHUNK_BYTES` (at least one)."""
    forced = config_value("cross_chunk_groups", None)
    if forced is not None:
        return forced
    return max(1, CHUNK_BYTES // max(1, group_size * per_group_bytes))


def cross_reduce(
    grad: torch.Tensor,
    act: torch.Tensor,
    mask: torch.Tensor | None,
    w_in: torch.Tensor,
    activation: str,
    unit: str,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> CrossBatch:
    """Triton twin of :func:`fused_stats.ops.cross_twin.cross_reduce`: ``grad`` (B, T, d), ``act``
    (B, T, d_in), ``mask`` (B, T) or None, ``w_in`` (r, d_in). See the module docstring."""
    check_cross_args(grad, act, mask, w_in, activation, unit, group_size)
    check_kernel_device(grad, "grad")
    B, T, d = grad.shape
    r, _ = w_in.shape
    device = grad.device
    q, z, w = kernel_dtype(grad), kernel_dtype(act), kernel_dtype(w_in)
    dot = F64 if F64 in (q.dtype, z.dtype, w.dtype) else F32
    keep = (
        torch.ones(B, T, dtype=torch.bool, device=device)
        if mask is None
        else mask.to(device=device, dtype=torch.bool)
    )
    # counted positions as flat indices b*T + t, b-major: a sample's rows are contiguous
    # (int32: B*T < 2^31 always holds for one batch; the kernels widen to int64 before any offset)
    if B * T >= 2**31:
        raise FusedStatsError(f"a batch of {B} x {T} positions is too large for one call; split it")
    rows_all = keep.reshape(-1).nonzero().squeeze(1).to(torch.int32)
    phi_cfg, cross_cfg = _configs(dot, device)
    itemsize = dot.itemsize
    zero = torch.zeros((), dtype=F64, device=device)
    c_sum = torch.zeros(d, r, dtype=F64, device=device)
    sq_sum, u = zero.clone(), [zero.clone(), zero.clone(), zero.clone()]
    p = [0, 0, 0]

    def add_block(k):
        a, b, c, q2, q3, q4 = tuple_sums(k)
        for i, v in enumerate((a, b, c)):
            u[i] += v
        for i, v in enumerate((q2, q3, q4)):
            p[i] += v

    if unit == "sample":
        counts = keep.sum(dim=1)
        counts = counts[counts > 0]
        n = int(counts.shape[0])
        seg_all = torch.zeros(n + 1, dtype=torch.int32, device=device)
        seg_all[1:] = torch.cumsum(counts, 0)
        step = _chunk_groups(group_size, d * r * itemsize + T * r * itemsize) * group_size
        for s0 in range(0, n, step):
            s1 = min(n, s0 + step)
            lo, hi = int(seg_all[s0]), int(seg_all[s1])
            rows = rows_all[lo:hi]
            phi = _phi(z, w, rows, activation, dot, phi_cfg)
            c, sq, part = _cross(q, phi, rows, seg_all[s0 : s1 + 1] - lo, True, dot, cross_cfg)
            c_sum += part
            sq_sum += sq
            flat = c.reshape(s1 - s0, d * r)
            for g0 in range(0, s1 - s0, group_size):
                block = flat[g0 : g0 + group_size]
                add_block(gram_rows(block, block))
    else:
        n = int(rows_all.shape[0])
        step = _chunk_groups(group_size, r * itemsize) * group_size
        item_rows = config_value("cross_item_rows", ITEM_ROWS)
        for s0 in range(0, n, step):
            s1 = min(n, s0 + step)
            rows = rows_all[s0:s1]
            phi = _phi(z, w, rows, activation, dot, phi_cfg)
            seg = torch.arange(0, s1 - s0 + item_rows, item_rows, dtype=torch.int32, device=device)
            seg[-1] = s1 - s0
            seg = seg[: cdiv(s1 - s0, item_rows) + 1]
            _, _, part = _cross(q, phi, rows, seg, False, dot, cross_cfg)
            c_sum += part
            for g0 in range(0, s1 - s0, group_size):
                g_rows = rows[g0 : g0 + group_size]
                qg = q[g_rows // T, g_rows % T]  # a copy of one group's rows only
                if dot == F64:  # an fp64 act or W_in makes the whole computation fp64, |q|² too
                    qg = qg.to(F64)
                pg = phi[g0 : g0 + group_size]
                gq, gp = gram_rows(qg, qg), gram_rows(pg, pg)
                sq_sum += (torch.diagonal(gq) * torch.diagonal(gp)).sum()
                add_block(gq * gp)
    return CrossBatch(
        n=n, c_sum=c_sum, sq_norm_sum=sq_sum, u2=u[0], u3=u[1], u4=u[2], p2=p[0], p3=p[1], p4=p[2]
    )


__all__ = ["IS_FUSED_KERNEL", "cross_reduce"]
