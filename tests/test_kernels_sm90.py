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
* the gate compiles what the launchers launch: its specs are recorded from the launchers called on
  meta tensors (``record_launches``), so a configuration changed in a launcher changes the gate,
  and the variants production launches are there (stage 2 of ``unit="sample"``, ``d = 8192``, the
  pool's fp32 x fp64 Gram, odd row counts, odd and feature-strided inputs).

If Triton was imported with ``TRITON_INTERPRET=1`` in this process (its standard library is then
interpreted-only), the reports are computed in a child process without the flag.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

pytest.importorskip("triton")

import torch
import triton.language as tl

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


# inputs that cannot be read 16 bytes at a time: an odd width, every other feature
UNALIGNED = ("_odd", "_strided")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_expected_instructions(reports, name):
    r = reports[name]
    assert r.expect or name.endswith(UNALIGNED), name
    for op in r.expect:
        assert r.sass[op] > 0, f"{name}: no {op} in the SASS ({r.sass})"


@pytest.mark.parametrize(
    "name",
    [n for n in sorted(SPECS) if n.startswith(("capture", "sum_positions")) and not n.endswith(UNALIGNED)],
)
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


def test_cross_specs_cover_both_stages_and_units():
    names = [n for n in SPECS if n.startswith("cross")]
    assert len(names) == 9, names  # {phi, sample, position} x {bf16, fp32, fp64}


def test_the_gate_compiles_what_the_launchers_launch():
    """The specs are recorded from the launchers: the variants production launches are there with
    the arguments it passes (stage 2 of unit="sample" reads stage 1's fp32 slices with an int32
    count mask and L = n_split; d = 8192 at 16 warps with one whole row per block; the pool's
    fp32 x fp64 Gram in fp64; a pool size that is no multiple of 16)."""
    stage2 = SPECS["capture_rows_bf16_d4096_sample"]
    assert stage2.args["MASK"].dtype == torch.int32 and stage2.args["X"].dtype == torch.float32
    assert stage2.args["L"] > 1 and stage2.constexprs["HAS_MASK"]
    wide = SPECS["capture_rows_bf16_d8192"]
    assert (wide.num_warps, wide.constexprs["BLOCK_D"], wide.constexprs["SINGLE_CHUNK"]) == (16, 8192, True)
    assert not SPECS["capture_rows_fp64_d8192"].constexprs["SINGLE_CHUNK"]  # the two-pass path
    mixed = next(s for n, s in SPECS.items() if n.startswith("gram_fp32_fp64"))
    assert (mixed.args["X"].dtype, mixed.args["P"].dtype) == (torch.float32, torch.float64)
    assert mixed.constexprs["DOT_DTYPE"] == tl.float64 and mixed.expect == ("DMMA",)
    assert any(s.args.get("N", 0) % 16 for n, s in SPECS.items() if n.startswith("gram"))
    assert SPECS["syrk_upper_bf16_d512_splitk"].constexprs["ACCUMULATE"] is False


def test_the_gate_follows_a_changed_launcher_configuration(monkeypatch):
    """No second table: a configuration changed in a launcher's module is what the gate compiles."""
    monkeypatch.setitem(gram.GPU_CONFIGS, torch.float32, (32, 64, 32, 4, 2))
    monkeypatch.setitem(cross.CROSS_GPU, torch.float64, (16, 32, 16, 4, 2))
    monkeypatch.setattr(capture, "GPU_SINGLE_CHUNK_MAX_D", 2048)
    specs = {s.name: s for s in aot.production_specs()}
    g = next(s for n, s in specs.items() if n.startswith("gram_fp32_d"))
    assert (g.constexprs["BM"], g.constexprs["BN"], g.num_warps, g.num_stages) == (32, 64, 4, 2)
    c = specs["cross_sample_fp64_d4096_r64"]
    assert (c.constexprs["BD"], c.constexprs["BR"], c.num_warps, c.num_stages) == (16, 32, 4, 2)
    assert not specs["capture_rows_bf16_d4096"].constexprs["SINGLE_CHUNK"]


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
