"""Ops layer: one entry point per fused operation, dispatched to a Triton kernel or its torch twin.

The accumulators call only these functions; ``backend`` is resolved per call from the tensor's
device (see :mod:`fused_stats.backend`). Kernels are imported lazily so that importing the package
never imports Triton.
"""

from __future__ import annotations

import torch

from ..backend import resolve_backend
from . import cross_twin, torch_twin
from .cross_twin import CrossBatch
from .torch_twin import BatchSums

__all__ = ["BatchSums", "CrossBatch", "cross_reduce", "capture_reduce", "second_moment_update", "gram_rows", "implementation"]


def implementation(backend: str, device: torch.device | str):
    """The module providing the ops for ``backend`` on ``device``."""
    if resolve_backend(backend, device) == "torch":
        return torch_twin
    from .. import kernels  # lazy: imports triton

    return kernels


def capture_reduce(grad, mask, centre, unit, backend="auto") -> BatchSums:
    return implementation(backend, grad.device).capture_reduce(grad, mask, centre, unit)


def second_moment_update(S, rows, backend="auto") -> None:
    implementation(backend, rows.device).second_moment_update(S, rows)


def gram_rows(new_rows, pool_rows, backend="auto") -> torch.Tensor:
    return implementation(backend, new_rows.device).gram_rows(new_rows, pool_rows)


def cross_reduce(grad, act, mask, w_in, activation, unit, group_size=cross_twin.DEFAULT_GROUP_SIZE,
                 backend="auto") -> CrossBatch:
    if resolve_backend(backend, grad.device) == "torch":
        return cross_twin.cross_reduce(grad, act, mask, w_in, activation, unit, group_size)
    from .. import kernels  # lazy: imports triton

    return kernels.cross_reduce(grad, act, mask, w_in, activation, unit, group_size)
