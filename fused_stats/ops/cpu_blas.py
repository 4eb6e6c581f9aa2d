"""The CPU second moment through SciPy's BLAS: a one-triangle fp64 update at torch's thread count.

``S += Yᵀ Y`` for fp64 rows ``Y`` (R × d) is R·d² multiply-adds as a GEMM; the symmetric rank-k
update (BLAS ``dsyrk``) computes only the upper triangle, R·d(d+1)/2, and the strict lower triangle
is then copied from it (d²/2 moves), so ``S`` stays the full, exactly symmetric matrix; an owner
that reads S through one place (GradStats' ``S``) skips the copy per call and mirrors once per read.
Every product is still an fp64 sum of fp64 products (no lower precision).

Threads: the path is taken only while torch runs ``MAX_TORCH_THREADS`` (one) thread, and each
BLAS call runs with ``torch.get_num_threads()`` threads (set through threadpoolctl for the call,
the previous setting restored after), so ``torch.set_num_threads(1)`` means one thread here too,
whatever ``OPENBLAS_NUM_THREADS`` says; with more torch threads torch's ``addmm`` runs on torch's
own thread pool. For a fixed thread count the same inputs give the same bits on every run.

The triangle mirror and the wrapper cost about d² memory moves per call, whatever R: the path is
taken only for row blocks large enough to win (``d >= MIN_DIM`` and ``R d >= MIN_ROWS_TIMES_DIM``,
measured on one core). Without SciPy or threadpoolctl, or for tensors it does not take (not CPU,
not a contiguous fp64 ``S``, a small block), the caller uses torch's ``addmm``. Gram rows stay on
torch: a GEMM of two different blocks gains nothing from ``dsyrk``.
"""

from __future__ import annotations

import contextlib
import functools

import torch

# below these sizes the mirror and wrapper overhead outweigh the halved FLOPs (1 thread:
# d = 1024 wins from R = 128 rows, d = 256 from R = 512, d = 128 not even at R = 2000)
MIN_DIM = 192
MIN_ROWS_TIMES_DIM = 1 << 17
# with more torch threads the path is not taken: OpenBLAS's own thread pool then competes for the
# cores with torch's OpenMP pool (both spin while waiting); measured on 2 cores, 2 threads, d = 1024:
# 2-5x slower than torch's multi-threaded addmm, which runs on torch's pool
MAX_TORCH_THREADS = 1
# block size of the triangle mirror: strips of 64 columns keep the transposed reads in cache
MIRROR_BLOCK = 64


@functools.cache
def _blas():
    """``(scipy.linalg.blas, [threadpoolctl controllers of the BLAS libraries])`` or ``None``."""
    try:
        from scipy.linalg import blas
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    controllers = ThreadpoolController().select(user_api="blas").lib_controllers
    return blas, tuple(controllers)


def available() -> bool:
    """Whether the SciPy BLAS path can be used in this environment."""
    return _blas() is not None


@contextlib.contextmanager
def torch_thread_count():
    """Run the BLAS libraries with ``torch.get_num_threads()`` threads inside the block."""
    _, controllers = _blas()
    want = torch.get_num_threads()
    previous = [c.get_num_threads() for c in controllers]
    for c, was in zip(controllers, previous):
        if was != want:
            c.set_num_threads(want)
    try:
        yield
    finally:
        for c, was in zip(controllers, previous):
            if was != want:
                c.set_num_threads(was)


def blas_thread_counts() -> list[int]:
    """The thread counts the BLAS libraries report now (for tests and benchmarks)."""
    return [c.get_num_threads() for c in _blas()[1]]


def takes_second_moment(S: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether :func:`syrk_update` handles this ``S`` and ``rows`` (else: torch's addmm)."""
    return (
        available()
        and torch.get_num_threads() <= MAX_TORCH_THREADS
        and S.device.type == "cpu"
        and rows.device.type == "cpu"
        and S.dtype == torch.float64
        and S.dim() == 2
        and S.shape[0] == S.shape[1]
        and S.shape[0] >= MIN_DIM
        and S.is_contiguous()
        and not S.requires_grad
        and rows.dim() == 2
        and rows.shape[1] == S.shape[0]
        and rows.shape[0] * rows.shape[1] >= MIN_ROWS_TIMES_DIM
    )


def syrk_update(S: torch.Tensor, rows: torch.Tensor, mirror: bool = True) -> None:
    """In place ``S += rowsᵀ rows`` for a C-contiguous fp64 ``S`` (d, d), through ``dsyrk`` on the
    upper triangle and a mirror of it into the lower one; ``mirror=False`` leaves the strict lower
    triangle as it was (only the upper one is read and written)."""
    blas, _ = _blas()
    y = rows.detach().to(torch.float64).contiguous().numpy()
    s = S.numpy()
    # s.T is the Fortran-ordered view of the same memory; its lower triangle is S's upper one.
    # a = y.T (d x R, Fortran order, no copy), trans=0: c += a aᵀ = Yᵀ Y
    with torch_thread_count():
        out = blas.dsyrk(1.0, y.T, beta=1.0, c=s.T, trans=0, lower=1, overwrite_c=1)
    if out.ctypes.data != s.ctypes.data:  # the wrapper copied c (it should not): write it back
        s.T[...] = out
    if mirror:
        mirror_upper(S)


def mirror_upper(S: torch.Tensor) -> None:
    """Copy the upper triangle of the square ``S`` onto its strict lower triangle, in place."""
    d = S.shape[0]
    for j0 in range(0, d, MIRROR_BLOCK):
        j1 = min(j0 + MIRROR_BLOCK, d)
        if j1 < d:
            S[j1:, j0:j1].copy_(S[j0:j1, j1:].T)
        block = S[j0:j1, j0:j1]
        block.copy_(block.triu() + block.triu(1).T)
