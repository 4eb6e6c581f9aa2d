"""Ops layer: one entry point per fused operation, dispatched to a Triton kernel or its torch twin.

The accumulators call only these functions; ``backend`` is resolved per call from the tensor's
device (see :mod:`fused_stats.backend`) and every op dispatches the same way, to the Triton
launcher or to its torch twin; both validate their arguments with the same checks
(:mod:`fused_stats.contracts`), so bad input raises the same ``FusedStatsError`` on either path.
Kernels are imported lazily so that importing the package never imports Triton.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..backend import resolve_backend
from ..contracts import DEFAULT_GROUP_SIZE, BatchSums, CrossBatch
from . import cross_twin, torch_twin

__all__ = [
    "BatchSums",
    "CrossBatch",
    "capture_reduce",
    "capture_reduce_stacked",
    "cross_features",
    "cross_reduce",
    "cross_reduce_features",
    "cross_reduce_stacked",
    "cross_stacks",
    "gram_rows",
    "implementation",
    "mirror_upper",
    "second_moment_update",
    "second_moment_update_stacked",
]


class _TorchTwins:
    """The torch twins under the launchers' names (looked up at each call)."""

    _modules: ClassVar[dict] = {
        "capture_reduce": torch_twin,
        "second_moment_update": torch_twin,
        "gram_rows": torch_twin,
        "cross_reduce": cross_twin,
    }

    def __getattr__(self, name: str):
        if name not in self._modules:
            raise AttributeError(name)
        return getattr(self._modules[name], name)


TORCH_TWINS = _TorchTwins()


def implementation(backend: str, device: torch.device | str):
    """What provides the four ops (``capture_reduce``, ``second_moment_update``, ``gram_rows``,
    ``cross_reduce``) for ``backend`` on ``device``: the torch twins or the Triton launchers."""
    if resolve_backend(backend, device) == "torch":
        return TORCH_TWINS
    from .. import kernels  # lazy: imports triton

    return kernels


def capture_reduce(grad, mask, centre, unit, backend="auto") -> BatchSums:
    return implementation(backend, _device(grad)).capture_reduce(grad, mask, centre, unit)


def second_moment_update(S, rows, backend="auto", mirror=True) -> bool:
    """``S += rowsᵀ rows``. ``mirror=False``: only the upper triangle must be right on return; the
    result says whether the strict lower one was left stale (then :func:`mirror_upper` completes
    ``S``); the Triton launchers always update all of ``S``."""
    impl = implementation(backend, _device(rows))
    if not mirror and impl is TORCH_TWINS:
        return impl.second_moment_update(S, rows, mirror=False)
    impl.second_moment_update(S, rows)
    return False


def second_moment_update_stacked(Ss, rows, backend="auto") -> bool:
    """``Ss[i] += rows[i]ᵀ rows[i]`` for P matrices ``Ss`` (d, d) and ``rows`` (P, R, d) in one
    batched product (:func:`fused_stats.ops.torch_twin.second_moment_update_stacked`); False,
    with nothing changed, where that path does not apply (a Triton backend, or blocks large
    enough for the CPU ``dsyrk`` path): the caller then updates one matrix at a time."""
    if resolve_backend(backend, _device(rows)) != "torch":
        return False
    return torch_twin.second_moment_update_stacked(Ss, rows)


def mirror_upper(S) -> None:
    """Copy the upper triangle of the square ``S`` onto its strict lower triangle, in place."""
    torch_twin.mirror_upper(S)


def gram_rows(new_rows, pool_rows, backend="auto") -> torch.Tensor:
    return implementation(backend, _device(new_rows)).gram_rows(new_rows, pool_rows)


def cross_reduce(
    grad, act, mask, w_in, activation, unit, group_size=DEFAULT_GROUP_SIZE, backend="auto"
) -> CrossBatch:
    return implementation(backend, _device(grad)).cross_reduce(
        grad, act, mask, w_in, activation, unit, group_size
    )


def cross_features(act, mask, w_in, activation, backend="auto") -> torch.Tensor:
    """The features ``φ(W_in z)`` (B, T, r) :func:`cross_reduce` forms from ``act`` (B, T, d_in),
    zero where ``mask`` is 0 (:func:`fused_stats.ops.cross_twin.features`); for
    :func:`cross_reduce_features`, so that a caller can keep them instead of ``act``."""
    return cross_twin.features(act, mask, w_in, activation)


def cross_reduce_features(grad, phi, mask, unit, group_size=DEFAULT_GROUP_SIZE, backend="auto") -> CrossBatch:
    """:func:`cross_reduce` from given features ``phi`` (B, T, r). The torch twin gives the bits of
    ``cross_reduce(grad, act, ...)`` when ``phi = cross_features(act, ...)``; the Triton launcher
    takes them as its activation with an identity ``W_in`` and φ = identity (exact products)."""
    if resolve_backend(backend, _device(grad)) == "torch":
        return cross_twin.cross_reduce_features(grad, phi, mask, unit, group_size)
    from .. import kernels  # lazy: imports triton

    r = phi.shape[-1]
    eye = torch.eye(r, dtype=phi.dtype, device=phi.device)
    return kernels.cross_reduce(grad, phi, mask, eye, "identity", unit, group_size)


def capture_reduce_stacked(grads, centres, backend="auto"):
    """Several points' unmasked one-row-per-sample batches in one call
    (:func:`fused_stats.ops.torch_twin.capture_reduce_stacked`), or None where that path does not
    apply (a Triton backend: one launch per point there)."""
    if resolve_backend(backend, _device(grads)) != "torch":
        return None
    return torch_twin.capture_reduce_stacked(grads, centres)


def cross_reduce_stacked(grads, acts, w_ins, activation, backend="auto"):
    """Several points' batches in one call (:func:`fused_stats.ops.cross_twin.cross_reduce_stacked`),
    or None where that path does not apply (a Triton backend: one launch per point there)."""
    if resolve_backend(backend, _device(grads)) != "torch":
        return None
    return cross_twin.cross_reduce_stacked(grads, acts, w_ins, activation)


cross_stacks = cross_twin.stacks


def _device(x) -> torch.device:
    """Where ``x`` lives, for the dispatch; a non-tensor is left to the op's own check, which
    raises the same error on every backend."""
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
