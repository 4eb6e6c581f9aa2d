"""Compile gate for Hopper: every kernel compiles ahead of time for sm_90a
at its production block sizes, without a GPU, and the machine code is what the design needs.

``fused_stats.kernels.aot`` runs ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``
per production configuration, re-runs the wheel's ``ptxas -v`` on the PTX (registers, spill bytes)
and reads the cubin with the wheel's ``cuobjdump`` (``-res-usage``: local memory; ``-sass``: opcodes).
Checked here:

* no register spills: 0 spill-store/-load bytes, 0 local memory, no ``LDL``/``STL`` in the SASS;
* capture kernels: 128-bit global loads (``LDG.E.128``) of the gradient;
* GEMM-like kernels (second moment, Gram rows, both cross-gradient stages): ``HGMMA`` (Hopper
  warpgroup MMA) for bf16/fp16 inputs and for fp32 inputs, which use ``input_precision="tf32x3"``
  (three TF32 wgmma per product; docs/design.md forbids plain TF32); fp64 inputs (the accumulator's pool,
  fp64 activations) use ``DMMA`` -- Hopper has no fp64 wgmma, so expecting HGMMA there would be
  wrong. No ``FFMA`` next to the wgmma, except in the cross stage-1 epilogue, whose gelu (erf
  polynomial) is FFMA: a test compiles it with ``ACT="identity"`` and finds none. A further test
  shows the alternative docs/design.md allows for fp32, ``input_precision="ieee"``, compiles to FFMA only
  (no tensor cores): that is why tf32x3 is used.
* the launchers pick the gated configurations: the cross kernel's CUDA block sizes are those of
  its specs, and its fp32 products are ``tf32x3``.

If Triton was imported with ``TRITON_INTERPRET=1`` in this process (its standard library is then
interpreted-only), the reports are computed in a child process without the flag.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

pytest.importorskip("triton")

import torch

from fused_stats.kernels import _triton_compat, aot, capture, cross, gram, second_moment

SPECS = {s.name: s for s in aot.production_specs()}
H100_MAX_SMEM = 227 * 1024  # bytes of shared memory one program may use on sm_90

if not (
    os.path.exists(_triton_compat.nvidia_tool("cuobjdump")) and os.path.exists(_triton_compat.ptxas_path())
):
    pytest.skip("this Triton install ships no CUDA tools (ptxas/cuobjdump)", allow_module_level=True)


@pytest.fixture(scope="module")
def reports():
    return aot.all_reports()


def test_every_kernel_is_gated():
    gated = {id(s.kernel) for s in SPECS.values()}  # ids: hashing a JITFunction hashes its source deps
    for k in (
        capture._capture_rows_kernel,
        capture._sum_positions_kernel,
        second_moment._syrk_upper_kernel,
        gram._gram_kernel,
        cross._phi_kernel,
        cross._cross_kernel,
    ):
        assert id(k) in gated, k.fn.__name__


@pytest.mark.parametrize("name", sorted(SPECS))
def test_no_spills(reports, name):
    r = reports[name]
    assert 0 < r.n_regs <= 255, r
    assert (r.spill_stores, r.spill_loads) == (0, 0), f"{name} spills: {r}"
    assert r.local == 0 and r.stack == 0, f"{name} uses local memory: {r}"
    assert r.sass["LDL"] == 0 and r.sass["STL"] == 0, f"{name} has local loads/stores: {r.sass}"
    assert r.shared <= H100_MAX_SMEM, f"{name} needs {r.shared} bytes of shared memory"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_expected_instructions(reports, name):
    r = reports[name]
    assert r.expect, name
    for op in r.expect:
        assert r.sass[op] > 0, f"{name}: no {op} in the SASS ({r.sass})"


@pytest.mark.parametrize("name", [n for n in sorted(SPECS) if n.startswith(("capture", "sum_positions"))])
def test_capture_kernels_load_16_bytes(reports, name):
    assert "LDG.E.128" in reports[name].expect and reports[name].sass["LDG.E.128"] > 0


GEMM_PREFIXES = ("syrk", "gram", "cross")


@pytest.mark.parametrize("name", [n for n in sorted(SPECS) if n.startswith(GEMM_PREFIXES)])
def test_gemm_kernels_use_tensor_cores(reports, name):
    r = reports[name]
    if "_fp64_" in name:
        assert r.sass["DMMA"] > 0 and r.sass["HGMMA"] == 0, r.sass
    else:
        assert r.sass["HGMMA"] > 0 and r.sass["HMMA"] == 0, f"{name}: no wgmma ({r.sass})"
        if not name.startswith("cross_phi"):  # its gelu epilogue is FFMA: next test
            assert r.sass["FFMA"] == 0, f"{name}: the tile product should not fall back to FFMA"


def test_cross_phi_ffma_only_in_the_activation():
    """Stage 1's FFMA are the gelu epilogue's: with ``ACT="identity"`` none remain, wgmma does."""
    if not aot.can_compile_in_process():
        pytest.skip("Triton was imported with TRITON_INTERPRET=1 in this process")
    base = SPECS[next(n for n in SPECS if n.startswith("cross_phi_fp32"))]
    plain = dataclasses.replace(
        base, name=base.name + "_identity", constexprs={**base.constexprs, "ACT": "identity"}
    )
    r = aot.report(plain)
    assert r.sass["FFMA"] == 0 and r.sass["HGMMA"] > 0 and r.ok, r


def test_fp32_never_plain_tf32():
    assert second_moment.dot_precision(torch.float32) == "tf32x3"
    for s in SPECS.values():
        assert s.constexprs.get("PRECISION", "ieee") in ("ieee", "tf32x3"), s.name
        if s.name.startswith("cross"):  # fp32 products of bf16/fp32 inputs: tf32x3, fp64: ieee
            assert s.constexprs["PRECISION"] == ("ieee" if "_fp64_" in s.name else "tf32x3"), s.name


def test_cross_launcher_uses_the_gated_configs():
    """The CUDA configurations ``cross_reduce`` launches with (``_configs`` on a CUDA device: no GPU
    needed to ask) are those compiled above, for every gated input dtype and both stages."""
    cuda = torch.device("cuda")
    names = [n for n in SPECS if n.startswith("cross")]
    assert len(names) == 9, names  # {phi, sample, position} x {bf16, fp32, fp64}
    for name in names:
        s = SPECS[name]
        dot = torch.float64 if "_fp64_" in name else torch.float32
        phi_cfg, cross_cfg = cross._configs(dot, cuda)
        stage1 = name.startswith("cross_phi")
        keys = ("BM", "BN", "BK") if stage1 else ("BD", "BR", "BT")
        got = tuple(s.constexprs[k] for k in keys) + (s.num_warps, s.num_stages)
        assert got == (phi_cfg if stage1 else cross_cfg), name


def test_ieee_fp32_alternative_has_no_tensor_cores():
    """Why fp32 uses tf32x3: the other precision docs/design.md allows compiles to FFMA, not wgmma."""
    if not aot.can_compile_in_process():
        pytest.skip("Triton was imported with TRITON_INTERPRET=1 in this process")
    base = SPECS[next(n for n in SPECS if n.startswith("syrk_upper_fp32"))]
    ieee = dataclasses.replace(
        base, name=base.name + "_ieee", constexprs={**base.constexprs, "PRECISION": "ieee"}, expect=("FFMA",)
    )
    r = aot.report(ieee)
    assert r.sass["HGMMA"] == 0 and r.sass["FFMA"] > 0, r.sass
