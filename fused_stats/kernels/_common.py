"""Shared machinery of the Triton kernels: launch helpers, block configurations and input checks.

The kernel object (:class:`DualKernel`: one object compiled for CUDA and ahead of time, and
interpreted on CPU) and the combine functions :data:`SUM`/:data:`MAX` come from
:mod:`._triton_compat`, the one module that touches Triton internals.

Launch-time choices (block sizes, warps, pipelining depth) are fixed per kernel and dtype: nothing
here autotunes, because the second-moment kernel adds into state (an autotuner would run it several
times on the same ``S``). Small blocks are used under the interpreter so that tests exercise every
tail and chunk loop at tiny shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import triton.language as tl

from ..errors import FusedStatsError
from ._triton_compat import MAX, SUM, DualKernel, kernel  # noqa: F401  (re-exported)

TORCH_TO_TL = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float64: tl.float64,
}
KERNEL_DTYPES = tuple(TORCH_TO_TL)


# ---------------------------------------------------------------------------- recorded launches
# The ahead-of-time gate (aot.py) compiles exactly what the launchers launch: it calls them on
# "meta" tensors (shapes and strides, no data) inside record_launches(), where a meta device stands
# for the GPU (its configurations, AOT_SM_COUNT multiprocessors) and launch() records instead of
# running. No second table of configurations exists to drift from the launchers.
AOT_SM_COUNT = 132  # an H100/H200 SXM: what the recorded grids and split decisions assume
_RECORDING: list | None = None


@dataclasses.dataclass
class Launch:
    """One recorded launch: the kernel, its grid, positional arguments and keyword meta-parameters
    (constexprs plus num_warps/num_stages/enable_fp_fusion)."""

    kernel: DualKernel
    grid: tuple
    args: tuple
    meta: dict


@contextlib.contextmanager
def record_launches():
    """Inside, launchers given meta tensors choose their GPU configuration and record each launch
    (yielded list of :class:`Launch`) instead of running it."""
    global _RECORDING
    old, _RECORDING = _RECORDING, []
    try:
        yield _RECORDING
    finally:
        _RECORDING = old


def on_gpu(device: torch.device) -> bool:
    """Whether launches on ``device`` take the GPU configurations: CUDA, or a meta device while
    launches are recorded for the ahead-of-time gate."""
    return device.type == "cuda" or (device.type == "meta" and _RECORDING is not None)


def launch(kern: DualKernel, grid, device: torch.device, *args, **meta):
    """Launch ``kern`` on ``grid``; ``meta`` holds constexprs plus num_warps/num_stages (ignored by
    the interpreter)."""
    if device.type == "meta" and _RECORDING is not None:
        meta.setdefault("enable_fp_fusion", True)  # as a CUDA launch below
        _RECORDING.append(Launch(kern, tuple(grid), args, meta))
        return None
    if device.type == "cuda":
        # FMA contraction on explicitly (more accurate, and Triton 3.9 warns when left implicit)
        meta.setdefault("enable_fp_fusion", True)
        with torch.cuda.device(device):
            return kern[grid](*args, **meta)
    meta = {k: v for k, v in meta.items() if k not in ("num_warps", "num_stages", "enable_fp_fusion")}
    return kern.interpreted[grid](*args, **meta)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors on ``device``; under the interpreter a small number keeps grids tiny."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if on_gpu(device):
        return AOT_SM_COUNT
    return 2


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------- configurations
_OVERRIDES: dict = {}


@contextlib.contextmanager
def override_config(**values):
    """Temporarily force configuration values (tests use it to hit every code path at tiny shapes)."""
    old = dict(_OVERRIDES)
    _OVERRIDES.update(values)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(old)


def config_value(name: str, default):
    return _OVERRIDES.get(name, default)


# ---------------------------------------------------------------------------- device check
def check_kernel_device(x: torch.Tensor, name: str) -> None:
    """The kernels take CUDA tensors, or CPU tensors under Triton's interpreter (the argument
    checks shared with the twins are :mod:`fused_stats.contracts`)."""
    if on_gpu(x.device):
        return
    from ..backend import interpreter_enabled

    if x.device.type != "cpu":
        raise FusedStatsError(
            f"{name} is on {x.device}; the Triton kernels take CUDA tensors "
            "(or CPU tensors under TRITON_INTERPRET=1)"
        )
    if not interpreter_enabled():
        raise FusedStatsError(
            f"{name} is a CPU tensor: the Triton kernels need a CUDA device "
            "or Triton's interpreter (set TRITON_INTERPRET=1)"
        )


def kernel_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when the kernels read its dtype natively, else an fp32 copy (e.g. fp8)."""
    return x if x.dtype in KERNEL_DTYPES else x.to(torch.float32)
