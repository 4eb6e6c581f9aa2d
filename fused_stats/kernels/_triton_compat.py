"""The Triton internals the kernels rely on, in one place (checked by tests/test_triton_shim.py).

The kernels otherwise use Triton's public surface only (``triton.language`` builtins,
``kernel[grid](...)`` launches, ``triton.compile``). What is not public API, and may change from one
Triton release to the next, is imported here and nowhere else:

* ``triton.runtime.jit.JITFunction`` — subclassed by :class:`DualKernel`; its ``fn`` (the Python
  function) and ``arg_names`` attributes are read.
* ``triton.runtime.interpreter.InterpretedFunction`` — runs the same Python source on CPU tensors.
* ``triton.language.standard._sum_combine`` and ``_elementwise_max`` — the combine functions of
  ``tl.sum``/``tl.max``, which the interpreter recognises by identity and runs as numpy reductions.
* ``triton.compiler.ASTSource``, ``triton.backends.compiler.GPUTarget``,
  ``triton.backends.nvidia.compiler.get_ptxas`` and the wheel's ``backends/nvidia/bin`` tools —
  ahead-of-time compilation for a GPU that is not present, and ptxas/cuobjdump to read the result.

Why a kernel object of our own: Triton decides at *decoration* time whether ``@triton.jit`` yields a
compiled ``JITFunction`` or an ``InterpretedFunction`` (the ``TRITON_INTERPRET`` knob is read when
the decorator runs, and its standard library is decorated when ``triton`` is imported). A process
that imported Triton without the flag could then not interpret kernels, and one that set it could
not compile them ahead of time. :class:`DualKernel` is a ``JITFunction`` (the compiler, the AOT gate
and CUDA launches see an ordinary kernel) that also owns an ``InterpretedFunction`` of the same
source for CPU tensors. Kernels call only builtins plus :data:`SUM` and :data:`MAX`, so they run
both ways whatever the import order.

A missing ``JITFunction`` or ``InterpretedFunction`` makes importing the kernels fail with a
:class:`FusedStatsError` naming it (the torch backend is unaffected: the ops layer imports the
kernels lazily). Missing combine functions fall back to our own (correct, but the interpreter then
runs reductions element by element). The AOT pieces are looked up when used.
:func:`missing_internals` lists everything the installed Triton lacks.
"""

from __future__ import annotations

import importlib
import inspect
import os

import triton
import triton.language as tl

from ..errors import FusedStatsError

# name -> (module, attribute, what the package uses it for)
INTERNALS = {
    "JITFunction": ("triton.runtime.jit", "JITFunction", "as the base class of every kernel"),
    "InterpretedFunction": (
        "triton.runtime.interpreter",
        "InterpretedFunction",
        "to run the kernels on CPU tensors (TRITON_INTERPRET=1)",
    ),
    "sum_combine": (
        "triton.language.standard",
        "_sum_combine",
        "as the tl.reduce combine function the interpreter runs as a numpy sum",
    ),
    "max_combine": (
        "triton.language.standard",
        "_elementwise_max",
        "as the tl.reduce combine function the interpreter runs as a numpy max",
    ),
    "ASTSource": ("triton.compiler", "ASTSource", "to compile kernels ahead of time (sm_90a gate)"),
    "GPUTarget": ("triton.backends.compiler", "GPUTarget", "to name the ahead-of-time target without a GPU"),
    "get_ptxas": (
        "triton.backends.nvidia.compiler",
        "get_ptxas",
        "to find the wheel's ptxas for the register/spill report",
    ),
}


def _lookup(key: str):
    module, attr, _ = INTERNALS[key]
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def require(key: str):
    """The internal ``key`` of :data:`INTERNALS`, or a :class:`FusedStatsError` naming it."""
    value = _lookup(key)
    if value is None:
        module, attr, why = INTERNALS[key]
        raise FusedStatsError(
            f"the installed Triton {triton.__version__} has no {module}.{attr}, which fused_stats' "
            f"Triton kernels use {why}; run with backend='torch', or install a Triton release that "
            "provides it (the Triton internals the kernels use are listed in "
            "fused_stats/kernels/_triton_compat.py)"
        )
    return value


JITFunction = require("JITFunction")


class DualKernel(JITFunction):
    """A Triton kernel usable both compiled (CUDA, AOT) and through the CPU interpreter."""

    _interpreted = None

    @property
    def interpreted(self):
        if self._interpreted is None:
            self._interpreted = require("InterpretedFunction")(self.fn)
        return self._interpreted

    def __call__(self, *args, **kwargs):
        # The compiler inlines calls between JITFunctions without calling __call__; reaching it
        # means an interpreted kernel called this function as a device helper.
        return self.interpreted(*args, **kwargs)

    def on(self, device):
        """The launchable object for tensors on ``device`` (a ``torch.device``)."""
        return self if device.type == "cuda" else self.interpreted


def kernel(fn) -> DualKernel:
    """Decorator: make ``fn`` a :class:`DualKernel`."""
    return DualKernel(fn)


def _own_sum(a, b):
    return a + b


def _own_max(a, b):
    return tl.maximum(a, b)


# Combine functions for ``tl.reduce``: Triton's own when present (see the module docstring).
SUM = _lookup("sum_combine") or kernel(_own_sum)
MAX = _lookup("max_combine") or kernel(_own_max)


def standard_library_compilable() -> bool:
    """False when Triton was imported with ``TRITON_INTERPRET=1``: its standard library (the
    combine functions above) is then interpreted-only and cannot be compiled ahead of time."""
    return isinstance(SUM, JITFunction) and isinstance(MAX, JITFunction)


# ---------------------------------------------------------------------------- ahead of time
def compile_for(fn, signature: dict, constexprs: dict, attrs: dict, arch: int, options: dict):
    """``triton.compile`` of kernel ``fn`` for ``GPUTarget("cuda", arch, 32)`` (no GPU needed)."""
    source = require("ASTSource")(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=require("GPUTarget")("cuda", arch, 32), options=options)


def nvidia_tool(name: str) -> str:
    """Path of a CUDA tool shipped in Triton's wheel (``ptxas``, ``cuobjdump``)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def ptxas_path(arch: int = 90) -> str:
    """The ptxas Triton itself uses for ``arch`` (the wheel's copy if that lookup fails)."""
    get_ptxas = _lookup("get_ptxas")
    if get_ptxas is not None:
        try:
            return get_ptxas(arch).path
        except Exception:  # pragma: no cover - a layout where it needs a GPU or an env variable
            pass
    return nvidia_tool("ptxas")


# ---------------------------------------------------------------------------- the check
def _probe_kernel(X, N):  # a trivial kernel source: what the checks wrap
    return X + N


def missing_internals(aot: bool = True) -> list[str]:
    """Every internal of this module the installed Triton lacks or changed, one line each (empty:
    all present). ``aot=False`` leaves out the ahead-of-time pieces."""
    keys = [k for k in INTERNALS if aot or k not in ("ASTSource", "GPUTarget", "get_ptxas")]
    out = [
        f"{INTERNALS[k][0]}.{INTERNALS[k][1]} (used {INTERNALS[k][2]})" for k in keys if _lookup(k) is None
    ]
    k = kernel(_probe_kernel)
    for attr, want in (("fn", _probe_kernel), ("arg_names", ["X", "N"])):
        got = getattr(k, attr, None)
        if got != want:
            out.append(
                f"triton.runtime.jit.JITFunction.{attr} (expected {want!r}, got {got!r}): "
                "read by DualKernel and the AOT signature"
            )
    if not callable(getattr(k, "__getitem__", None)):
        out.append("triton.runtime.jit.JITFunction.__getitem__ (kernel[grid] launches)")
    # the interpreter's numpy fast path for reductions is chosen by identity with these objects
    interp = importlib.import_module("triton.runtime.interpreter")
    source = inspect.getsource(interp)
    for attr in ("_sum_combine", "_elementwise_max"):
        if f"tl.standard.{attr}" not in source:
            out.append(
                f"triton.runtime.interpreter: no longer special-cases tl.standard.{attr} "
                "(interpreted reductions would run element by element)"
            )
    if aot:
        for tool in ("ptxas", "cuobjdump"):
            if not os.path.exists(nvidia_tool(tool)):
                out.append(f"{nvidia_tool(tool)} (the wheel's {tool}, for the AOT report)")
    return out
