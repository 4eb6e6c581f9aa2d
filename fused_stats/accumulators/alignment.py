"""Empirical transfer diagnostics from accumulated samples (width paper; docs/design.md, section 2).

* :func:`misalignment_probability`: over random disjoint splits (A of size M, B of size K) of a
  pool of N per-sample vectors, the fraction with ``μ_Mᵀg_K = 1_Aᵀ G_raw 1_B / (MK) ≤ 0``, where
  ``G_raw`` is the Gram matrix of the uncentred ``q_i``. With the pool stored about a centre ``c``
  (``q = y + c``, ``G = Y Yᵀ``, ``u = Y c``):
  ``1_Aᵀ G_raw 1_B = 1_Aᵀ G 1_B + K Σ_A u + M Σ_B u + MK |c|²``. Splits are vectorised as
  products of indicator matrices with ``G``, a chunk of trials at a time.
* :func:`realized_alignment`: ``s_trainᵀ s_test / (M K)`` for two streams (uncentred sums).

Both return a result with ``value`` (the number), the sizes ``M`` and ``K``, ``to_dict()`` and
``float(result)``: :class:`Misalignment` (``value`` = ``probability``) and :class:`Alignment`
(a float itself, so arithmetic and comparisons with the plain number keep working).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..errors import FusedStatsError

F64 = torch.float64


@dataclass(frozen=True)
class Misalignment:
    """Monte Carlo estimate of ``Pr(μ_Mᵀg_K ≤ 0)`` over random splits of a pool."""

    probability: float
    stderr: float
    trials: int
    M: int
    K: int
    pool_size: int
    mean_alignment: float  # average μ_Mᵀg_K over the trials

    def __float__(self) -> float:
        return self.probability

    @property
    def value(self) -> float:
        """The estimated probability (the result's number, as :attr:`Alignment.value`)."""
        return self.probability

    def to_dict(self) -> dict:
        return asdict(self)


class Alignment(float):
    """``μ_Mᵀ g_K = s_trainᵀ s_test / (M K)`` of a train stream (M samples) and a test stream (K).

    A ``float`` (the value) with ``value``, ``M``, ``K`` and ``to_dict()``, like
    :class:`Misalignment`."""

    M: int
    K: int

    def __new__(cls, value: float, M: int, K: int):
        out = super().__new__(cls, value)
        out.M, out.K = int(M), int(K)
        return out

    @property
    def value(self) -> float:
        return float(self)

    def to_dict(self) -> dict:
        return {"value": float(self), "M": self.M, "K": self.K}

    def __reduce__(self):
        return (Alignment, (float(self), self.M, self.K))


def split_alignments(acc, M: int, K: int, trials: int, seed: int = 0, chunk: int = 1024) -> torch.Tensor:
    """``μ_Mᵀg_K`` for ``trials`` random disjoint splits of the pool (fp64, shape (trials,))."""
    if acc.mode != "pool":
        raise FusedStatsError(acc._no_pool_message())
    N = acc.n
    if M < 1 or K < 1 or M + K > N:
        raise FusedStatsError(f"split sizes M={M}, K={K} need 1 <= M, K and M + K <= pool size {N}")
    if trials < 1:
        raise FusedStatsError(f"trials must be >= 1, got {trials}")
    G = acc.gram.to("cpu")
    u = acc.pool.to("cpu") @ acc.centre.to("cpu")
    cc = float(acc.centre @ acc.centre)
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(trials, dtype=F64)
    for start in range(0, trials, chunk):
        m = min(chunk, trials - start)
        perm = torch.rand(m, N, generator=gen).argsort(dim=1)
        in_a = torch.zeros(m, N, dtype=F64).scatter_(1, perm[:, :M], 1.0)
        in_b = torch.zeros(m, N, dtype=F64).scatter_(1, perm[:, M : M + K], 1.0)
        cross = ((in_a @ G) * in_b).sum(dim=1)
        raw = cross + K * (in_a @ u) + M * (in_b @ u) + M * K * cc
        out[start : start + m] = raw / (M * K)
    return out


def misalignment_probability(acc, M: int, K: int, trials: int = 10_000, seed: int = 0) -> Misalignment:
    """Fraction of random disjoint (M, K) splits of ``acc``'s pool whose alignment is ``≤ 0``.

    Needs a pool (``second_moment="pool"``, or ``"auto"`` before it switched to dense).
    """
    values = split_alignments(acc, M, K, trials, seed)
    p = float((values <= 0).double().mean())
    return Misalignment(
        probability=p,
        stderr=math.sqrt(max(p * (1 - p), 0.0) / trials),
        trials=trials,
        M=M,
        K=K,
        pool_size=acc.n,
        mean_alignment=float(values.mean()),
    )


def realized_alignment(train_acc, test_acc) -> Alignment:
    """``μ_Mᵀ g_K = s_trainᵀ s_test / (M K)`` from the uncentred sums of two streams."""
    if train_acc.dim != test_acc.dim:
        raise FusedStatsError(f"streams differ in dim: {train_acc.dim} vs {test_acc.dim}")
    if train_acc.n == 0 or test_acc.n == 0:
        raise FusedStatsError(
            f"realized_alignment needs samples in both streams (train n={train_acc.n}, test n={test_acc.n})"
        )
    a = train_acc.raw_sum().to("cpu")
    b = test_acc.raw_sum().to("cpu")
    return Alignment(float(a @ b) / (train_acc.n * test_acc.n), train_acc.n, test_acc.n)
