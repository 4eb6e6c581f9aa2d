"""Torch twin of the cross-gradient kernel (depth paper; docs/design.md, sections 2 and 6.3).

A zero-output residual block ``h(z) = W_out φ(W_in z)`` with ``W_out = 0`` inserted at a point has
one first-order signal, the cross-gradient ``C = E[c_i]`` with ``c_i = Σ_{t∈i} q_t φ_tᵀ`` (d × r),
``φ_t = φ(W_in z_t)``, ``q_t = dℓ_i/dz_t``. Per batch this op returns

* ``n`` samples, ``c_sum = Σ_i c_i`` (fp64),
* ``sq_norm_sum = Σ_i |c_i|_F²`` (the per-sample "ghost" norms), and
* sums over ordered tuples of distinct samples *inside groups* of at most ``group_size``
  consecutive samples of ``k_ij = <c_i, c_j>_F``: ``u2 = Σ k_ij²``, ``u3 = Σ k_ij k_jk``,
  ``u4 = Σ k_ij k_kl`` with their tuple counts — these give the standard error of the unbiased
  ``|C|_F²`` (see :mod:`fused_stats.accumulators.cross_stats`).

``unit="sample"`` materialises ``c_i`` per sample (a batched GEMM) unless the "ghost" form
``k_ij = Σ_{t,s} (q_itᵀq_js)(φ_itᵀφ_js)`` from position Grams is cheaper (few positions per
sample). ``unit="position"``: each unmasked position is a sample with the rank-one ``c = q φᵀ``,
so ``k_ij = (q_iᵀq_j)(φ_iᵀφ_j)`` and nothing d × r is formed per sample.
"""

from __future__ import annotations

import math

import torch

from ..contracts import (
    ACTIVATIONS,
    DEFAULT_GROUP_SIZE,
    CrossBatch,
    check_cross_args,
    check_cross_features_args,
    tuple_sums,
)
from ..errors import FusedStatsError

F64 = torch.float64
SQRT_HALF = math.sqrt(0.5)


def apply_activation(pre: torch.Tensor, activation: str) -> torch.Tensor:
    """φ applied to pre-activations; ``constant`` is φ ≡ 1 (the bias-only block, C = μ)."""
    if activation == "gelu":
        # the exact (erf) GELU, x Φ(x) = x erfc(-x/√2) / 2: as accurate as torch's gelu where that is
        # accurate (and more so for x << 0, where 1 + erf cancels), and faster in fp64 on CPU
        return torch.erfc(pre * -SQRT_HALF).mul_(pre).mul_(0.5)
    if activation == "relu":
        return torch.relu(pre)
    if activation == "silu":
        return torch.nn.functional.silu(pre)
    if activation == "tanh":
        return torch.tanh(pre)
    if activation == "identity":
        return pre
    if activation == "constant":
        return torch.ones_like(pre)
    raise FusedStatsError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def fold_groups(k_blocks, d: int, r: int, n: int, c_sum: torch.Tensor) -> CrossBatch:
    """Assemble a :class:`CrossBatch` from the within-group Gram blocks of the ``c_i``."""
    u2 = u3 = u4 = sq = None  # None until the first block (no additions to zero for one group)
    p2 = p3 = p4 = 0
    for k in k_blocks:
        a, b, c, q2, q3, q4 = tuple_sums(k)
        diag = torch.diagonal(k).to(F64).sum()
        if u2 is None:
            u2, u3, u4, sq = a, b, c, diag
        else:
            u2, u3, u4, sq = u2 + a, u3 + b, u4 + c, sq + diag
        p2, p3, p4 = p2 + q2, p3 + q3, p4 + q4
    if u2 is None:
        u2 = u3 = u4 = sq = torch.zeros((), dtype=F64, device=c_sum.device)
    return CrossBatch(n=n, c_sum=c_sum, sq_norm_sum=sq, u2=u2, u3=u3, u4=u4, p2=p2, p3=p3, p4=p4)


def ghost_is_cheaper(T: int, d: int, r: int, group: int) -> bool:
    """``unit="sample"``: whether the per-sample Gram is cheaper from the (g T)² position Grams,
    ``g T² (d + r)`` multiply-adds per sample, than from the materialised ``c_i``, ``T d r`` to form
    and ``g d r`` for their Gram (g = samples per group)."""
    return group * T * T * (d + r) < (T + group) * d * r


def features(
    act: torch.Tensor, mask: torch.Tensor | None, w_in: torch.Tensor, activation: str
) -> torch.Tensor:
    """``φ(W_in z_t)`` (B, T, r) fp64 for ``act`` (B, T, d_in), zero at positions ``mask`` leaves
    out, exactly as :func:`cross_reduce` forms them: a caller that keeps only these features (the
    probe's forward hook, instead of ``z``) gets the same bits from :func:`cross_reduce_features`."""
    if mask is None or bool(mask.all()):
        return apply_activation(act.to(F64) @ w_in.to(F64).T, activation)
    keep = mask.to(device=act.device, dtype=torch.bool).unsqueeze(-1)
    zero = torch.zeros((), dtype=F64, device=act.device)
    z = torch.where(keep, act.to(F64), zero)
    return torch.where(keep, apply_activation(z @ w_in.to(F64).T, activation), zero)


def cross_reduce(
    grad: torch.Tensor,
    act: torch.Tensor,
    mask: torch.Tensor | None,
    w_in: torch.Tensor,
    activation: str,
    unit: str,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> CrossBatch:
    """One batch: ``grad`` (B, T, d) and ``act`` (B, T, d_in) (the point's output z), ``mask``
    (B, T) or None, ``w_in`` (r, d_in). Returns a :class:`CrossBatch` (module docstring)."""
    check_cross_args(grad, act, mask, w_in, activation, unit, group_size)
    return cross_reduce_features(grad, features(act, mask, w_in, activation), mask, unit, group_size)


def cross_reduce_features(
    grad: torch.Tensor,
    phi: torch.Tensor,
    mask: torch.Tensor | None,
    unit: str,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> CrossBatch:
    """:func:`cross_reduce` from the features ``phi`` (B, T, r) of :func:`features` (zero at the
    positions ``mask`` leaves out) instead of ``z`` and ``W_in``."""
    check_cross_features_args(grad, phi, mask, unit, group_size)
    B, T, d = grad.shape
    r = phi.shape[-1]
    all_kept = mask is None or bool(mask.all())
    ghost = unit == "sample" and ghost_is_cheaper(T, d, r, min(group_size, B))
    keep = None  # the ghost path with nothing masked needs no mask tensor
    if not (all_kept and ghost):
        keep = (
            torch.ones(B, T, dtype=torch.bool, device=grad.device)
            if mask is None
            else mask.to(device=grad.device, dtype=torch.bool)
        )
    if all_kept:  # nothing to zero out: skip the masking passes (the common case)
        q = grad.to(F64)
    else:
        q = torch.where(keep.unsqueeze(-1), grad.to(F64), torch.zeros((), dtype=F64, device=grad.device))
    phi = phi.to(F64)
    if ghost:
        # k_ij = Σ_{t,s} (q_itᵀ q_js)(φ_itᵀ φ_js): the per-sample Gram from position Grams, with
        # no d × r matrix per sample (few positions per sample, e.g. one row per sample)
        if all_kept:
            qv, pv = q, phi
        else:
            valid = keep.any(dim=1)
            qv, pv = q[valid], phi[valid]  # (n, T, d), (n, T, r); masked positions are zero
        n = qv.shape[0]
        blocks = []
        for i in range(0, n, group_size):
            qg, pg = qv[i : i + group_size].reshape(-1, d), pv[i : i + group_size].reshape(-1, r)
            gram = (qg @ qg.T) * (pg @ pg.T)
            if T > 1:
                m = qg.shape[0] // T
                gram = gram.reshape(m, T, m, T).sum(dim=(1, 3))
            blocks.append(gram)
        c_sum = qv.reshape(n * T, d).T @ pv.reshape(n * T, r)
    elif unit == "sample":
        valid = keep.any(dim=1)
        c = torch.einsum("btd,btr->bdr", q, phi)[valid]  # (n, d, r)
        n = c.shape[0]
        flat = c.reshape(n, d * r)
        blocks = [flat[i : i + group_size] @ flat[i : i + group_size].T for i in range(0, n, group_size)]
        c_sum = c.sum(dim=0) if n else torch.zeros(d, r, dtype=F64, device=grad.device)
    else:  # "position"
        sel = keep.reshape(B * T)
        qs, ps = q.reshape(B * T, d)[sel], phi.reshape(B * T, r)[sel]
        n = qs.shape[0]
        blocks = [
            (qs[i : i + group_size] @ qs[i : i + group_size].T)
            * (ps[i : i + group_size] @ ps[i : i + group_size].T)
            for i in range(0, n, group_size)
        ]
        c_sum = qs.T @ ps
    return fold_groups(blocks, d, r, n, c_sum)


def stacks(B: int, T: int, d: int, r: int, unit: str, group_size: int) -> bool:
    """Whether :func:`cross_reduce_stacked` takes batches of this shape: ``unit="sample"`` in the
    ghost form with the whole batch one group (several points then share each product call)."""
    return unit == "sample" and group_size >= B and ghost_is_cheaper(T, d, r, B)


def cross_reduce_stacked(
    grads: torch.Tensor, acts: torch.Tensor, w_ins: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The batches of P points in one set of batched calls: ``grads`` (P, B, T, d), ``acts``
    (P, B, T, d_in), ``w_ins`` (P, r, d_in), nothing masked, ``unit="sample"``, one group
    (:func:`stacks`). Returns ``c_sum`` (P, d, r), ``sums`` (P, 4) = (``sq_norm_sum``, ``u2``,
    ``u3``, ``u4``) per point, and ``n`` = B; the same sums as :func:`cross_reduce` per point
    (up to the order of fp64 additions)."""
    P, B, T, d = grads.shape
    q = grads.to(F64).reshape(P, B * T, d)
    z = acts.to(F64).reshape(P, B * T, acts.shape[-1])
    phi = apply_activation(torch.bmm(z, w_ins.to(F64).transpose(1, 2)), activation)
    # k_ij = Σ_{t,s} (q_itᵀ q_js)(φ_itᵀ φ_js) (module docstring), per point
    k = torch.bmm(q, q.transpose(1, 2)).mul_(torch.bmm(phi, phi.transpose(1, 2)))
    if T > 1:
        k = k.reshape(P, B, T, B, T).sum(dim=(2, 4))
    c_sum = torch.bmm(q.transpose(1, 2), phi)
    sq = k.diagonal(dim1=1, dim2=2).sum(dim=1)
    u2, u3, u4, *_ = tuple_sums(k)  # every point's group at once
    sums = torch.stack([sq, u2, u3, u4], dim=1)
    return c_sum, sums, B


def seeded_w_in(rank: int, dim: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """The default random projection: iid N(0, 1/dim) entries from a seeded CPU generator, so
    pre-activations are O(|z|/sqrt(dim)) (the usual fan-in initialisation)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rank, dim, generator=gen, dtype=F64) / math.sqrt(dim)).to(dtype)
