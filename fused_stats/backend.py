"""Backend selection: which implementation of the ops runs for a given tensor.

``backend`` is ``"auto"`` (Triton for CUDA tensors, the torch twin for the others), ``"triton"`` or
``"torch"``. The environment variable ``FUSED_STATS_BACKEND`` overrides ``"auto"``. ``"triton"`` on
CPU tensors is allowed only under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is
imported), which is how the kernels are tested on machines without a GPU.

Triton is an optional dependency (the ``gpu`` extra): only the kernels import it, and only when a
Triton backend is resolved, so the CPU path runs without it. A Triton backend (``"triton"``, or
``"auto"`` on a CUDA tensor) without an importable Triton is refused, naming the install command
and ``backend="torch"`` (the exact twin, also on CUDA, slower).
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


TRITON_INSTALL = "pip install 'fused-stats[gpu]'"


@functools.cache
def triton_import_error() -> str | None:
    """None when Triton imports; else why not (not installed, or the import's own error)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "triton":
            return "Triton is not installed"
        return f"Triton does not import ({type(exc).__name__}: {exc})"
    except Exception as exc:  # a broken install: a missing CUDA library, a version clash
        return f"Triton does not import ({type(exc).__name__}: {exc})"
    return None


def triton_available() -> bool:
    return triton_import_error() is None


def _refuse_without_triton(requested: str, device: torch.device) -> None:
    reason = triton_import_error()
    if reason is not None:
        raise FusedStatsError(
            f"backend={requested!r} on a {device.type} tensor runs the Triton kernels, and {reason}: "
            f"install it with `{TRITON_INSTALL}` (or `pip install triton`), or pass backend='torch' "
            "(or set FUSED_STATS_BACKEND=torch) for the exact torch path"
        )


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
        if device.type != "cuda":
            return "torch"
        _refuse_without_triton("auto", device)
        return "triton"
    if backend == "triton":
        _refuse_without_triton("triton", device)
        if device.type != "cuda" and not interpreter_enabled():
            raise FusedStatsError(
                f"backend='triton' on a {device.type} tensor needs a CUDA device or Triton's "
                "interpreter (set TRITON_INTERPRET=1 before triton is imported)"
            )
    return backend
