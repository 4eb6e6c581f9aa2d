"""The Triton internals the kernels lean on are present, and only one module touches them.

* ``fused_stats.kernels._triton_compat.missing_internals()`` is empty on the installed Triton; when
  it is not, the failure lists each missing or changed internal by name (what a Triton upgrade
  that moved ``JITFunction``, ``_sum_combine`` ... would show).
* The check itself can fail: with an internal removed (monkeypatched away) it names it, and
  :func:`require` raises a ``FusedStatsError`` naming the module and attribute.
* No other file of the package imports ``triton.runtime``, ``triton.compiler``,
  ``triton.backends`` or ``triton.language.standard`` (a source scan), and the kernels' reductions
  use the shim's combine functions, which are Triton's own objects here.
* Under the interpreter a reduction with those combine functions gives the numpy sum / max.
* The AOT module imports the kernel modules and none of them imports it back (no circle).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("triton")

import torch
import triton.language as tl

import fused_stats
from fused_stats import FusedStatsError
from fused_stats.kernels import _common, _triton_compat

PACKAGE = Path(fused_stats.__file__).resolve().parent
INTERNAL_IMPORT = re.compile(
    r"^\s*(from|import)\s+triton\.(runtime|compiler|backends|language\.standard)\b", re.M
)


def test_installed_triton_has_every_internal_the_kernels_use():
    missing = _triton_compat.missing_internals()
    assert not missing, (
        "the installed Triton lacks or changed internals fused_stats' kernels use:\n  " + "\n  ".join(missing)
    )


def test_a_missing_internal_is_named(monkeypatch):
    real = _triton_compat._lookup
    monkeypatch.setattr(_triton_compat, "_lookup", lambda key: None if key == "sum_combine" else real(key))
    missing = _triton_compat.missing_internals(aot=False)
    assert any("triton.language.standard._sum_combine" in line for line in missing), missing
    with pytest.raises(FusedStatsError, match=r"no triton\.language\.standard\._sum_combine"):
        _triton_compat.require("sum_combine")


def test_only_the_shim_imports_triton_internals():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_triton_compat.py":
            continue
        text = path.read_text()
        for m in INTERNAL_IMPORT.finditer(text):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}: {m.group(0).strip()}")
        if "_sum_combine" in text or "_elementwise_max" in text or "JITFunction)" in text:
            offenders.append(f"{path.relative_to(PACKAGE.parent)}: names a Triton internal")
    assert not offenders, "Triton internals used outside kernels/_triton_compat.py:\n" + "\n".join(offenders)


def test_reductions_use_tritons_own_combine_functions():
    assert _common.SUM is _triton_compat.SUM is tl.standard._sum_combine
    assert _common.MAX is _triton_compat.MAX is tl.standard._elementwise_max
    assert isinstance(_common.kernel(_triton_compat._probe_kernel), _triton_compat.JITFunction)


@_triton_compat.kernel
def _row_sums_and_max(X, S, M, N: tl.constexpr):
    x = tl.load(X + tl.arange(0, N))
    tl.store(S, tl.reduce(x, 0, _triton_compat.SUM))
    tl.store(M, tl.reduce(x, 0, _triton_compat.MAX))


def test_interpreted_reductions_with_the_shims_combine_functions(monkeypatch, gen):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(16, generator=gen, dtype=torch.float64)
    s, m = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    _common.launch(_row_sums_and_max, (1,), x.device, x, s, m, N=16)
    assert abs(float(s) - sum(x.tolist())) <= 1e-12 * float(x.abs().sum())
    assert float(m) == max(x.tolist())


def test_no_kernel_module_imports_the_aot_module():
    kernels = PACKAGE / "kernels"
    for path in sorted(kernels.glob("*.py")):
        if path.name == "aot.py":
            continue
        text = path.read_text()
        assert not re.search(
            r"^\s*from\s+(\.|fused_stats\.kernels\.)aot\s+import|^\s*from\s+\.\s+import\s+.*\baot\b",
            text,
            re.M,
        ), f"{path.name} imports the AOT module"
