"""Backend selection: which implementation of the ops runs for a given tensor.

``backend`` is ``"auto"`` (Triton for CUDA tensors when Triton imports, the torch twin otherwise),
``"triton"`` or ``"torch"``. The environment variable ``FUSED_STATS_BACKEND`` overrides ``"auto"``.
``"triton"`` on CPU tensors is allowed only under Triton's interpreter (``TRITON_INTERPRET=1`` set
before Triton is imported), which is how the kernels are tested on machines without a GPU.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

from .errors import FusedStatsError

Backend = Literal["auto", "triton", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_available() -> bool:
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - platform without triton
        return False
    return True


def validate_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise FusedStatsError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def resolve_backend(backend: str, device: torch.device | str) -> str:
    """Return ``"triton"`` or ``"torch"`` for tensors living on ``device``."""
    validate_backend(backend)
    device = torch.device(device)
    if backend == "auto":
        env = os.environ.get("FUSED_STATS_BACKEND", "auto")
        if env not in BACKENDS:
            raise FusedStatsError(f"FUSED_STATS_BACKEND must be one of {BACKENDS}, got {env!r}")
        backend = env
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise FusedStatsError("backend='triton' requested but triton is not importable")
        if device.type != "cuda" and not interpreter_enabled():
            raise FusedStatsError(
                f"backend='triton' on a {device.type} tensor needs a CUDA device or Triton's "
                "interpreter (set TRITON_INTERPRET=1 before triton is imported)"
            )
    return backend
