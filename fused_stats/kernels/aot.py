"""Ahead-of-time compilation of every kernel for Hopper (sm_90a) at its production configuration,
and the resource/instruction report the compile gate checks (docs/design.md, section 6); no GPU
needed.

``triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32))``
runs the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin, ptxas from Triton's wheel). The
signature mirrors what a launch specialises on: pointers are 16-byte aligned (torch allocations
are), integer arguments equal to 1 become constants and multiples of 16 carry a divisibility hint.
For each compiled kernel :func:`report` then gives

* registers and spill bytes from ``ptxas -v`` re-run on the kernel's PTX (the same flags Triton uses),
* ``REG/STACK/LOCAL/SHARED`` from ``cuobjdump -res-usage`` on the cubin,
* opcode counts from ``cuobjdump -sass``: ``LDG.E.128`` (16-byte global loads), ``HGMMA``
  (Hopper warpgroup MMA, wgmma), ``DMMA`` (fp64 MMA), ``FFMA``, ``LDL``/``STL`` (local memory).

Which instruction each configuration must produce, and why, is :attr:`Spec.expect` (and
bench/KERNELS.md). :func:`production_specs` covers capture-reduce, second moment, Gram rows and the
two cross-gradient kernels (:func:`cross_specs`). The Triton internals this needs (``ASTSource``,
``GPUTarget``, the wheel's ptxas/cuobjdump) come from :mod:`._triton_compat`.
Run ``python -m fused_stats.kernels.aot`` for a table.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import torch

from . import capture, cross, gram, second_moment
from ._common import TORCH_TO_TL
from ._triton_compat import compile_for, nvidia_tool, ptxas_path, standard_library_compilable

_TL_NAME = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.float64: "fp64",
    torch.int8: "i8",
    torch.int32: "i32",
    torch.uint8: "u8",
}


@dataclasses.dataclass(frozen=True)
class Ptr:
    """A pointer argument of the given element dtype (assumed 16-byte aligned)."""

    dtype: torch.dtype


@dataclasses.dataclass
class Spec:
    name: str
    kernel: object
    args: dict  # runtime arguments: Ptr or int
    constexprs: dict
    num_warps: int
    num_stages: int
    expect: tuple  # SASS opcodes that must appear (each with count > 0)
    note: str = ""


def _signature(spec: Spec):
    """(signature, constexprs, attrs) as a launch would specialise ``spec.args``."""
    sig, const, attrs = {}, dict(spec.constexprs), {}
    names = spec.kernel.arg_names
    for idx, name in enumerate(names):
        if name in const:
            sig[name] = "constexpr"
            continue
        value = spec.args[name]
        if isinstance(value, Ptr):
            sig[name] = "*" + _TL_NAME[value.dtype]
            attrs[(idx,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            sig[name] = "u1"
        elif isinstance(value, int):
            if value == 1:
                sig[name] = "constexpr"
                const[name] = 1
                continue
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(idx,)] = [["tt.divisibility", 16]]
        else:
            raise TypeError(f"{spec.name}: argument {name} has unsupported example {value!r}")
    missing = set(spec.args) - set(names)
    if missing:
        raise TypeError(f"{spec.name}: unknown arguments {sorted(missing)}")
    return sig, const, attrs


def production_specs(d: int = 4096, tokens: int = 65536) -> list[Spec]:
    """The production configurations (H200-sized problem: ``tokens`` rows of ``d`` features)."""
    specs = []
    bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    dev = torch.device("cuda")

    # capture-reduce, whole row in registers (d <= 8192), bf16 gradient (B, T, d) contiguous, masked
    block_r, block_d, single, warps = capture._row_config(d, dev)
    T = 2048
    for has_mask in (False, True):
        specs.append(
            Spec(
                name=f"capture_rows_bf16_d{d}" + ("_mask" if has_mask else ""),
                kernel=capture._capture_rows_kernel,
                args=dict(
                    X=Ptr(bf16),
                    MASK=Ptr(torch.uint8),
                    CENTRE=Ptr(f32),
                    ROWS=Ptr(f32),
                    VALID=Ptr(torch.int8),
                    S_PART=Ptr(f32),
                    T_PART=Ptr(f32),
                    A_PART=Ptr(f64),
                    R=tokens,
                    R2=T,
                    L=1,
                    D=d,
                    n_iters=7,
                    sx_i=T * d,
                    sx_j=d,
                    sx_l=0,
                    sx_d=1,
                    sm_i=T,
                    sm_j=1,
                    sm_l=0,
                ),
                constexprs=dict(HAS_MASK=has_mask, BLOCK_R=block_r, BLOCK_D=block_d, SINGLE_CHUNK=single),
                num_warps=warps,
                num_stages=2,
                expect=("LDG.E.128",),
                note="memory-bound: 16-byte loads of the bf16 gradient",
            )
        )
    # capture-reduce of an fp64 gradient (computed in fp64), whole row in registers
    specs.append(
        Spec(
            name=f"capture_rows_fp64_d{d}",
            kernel=capture._capture_rows_kernel,
            args=dict(
                X=Ptr(f64),
                MASK=Ptr(torch.uint8),
                CENTRE=Ptr(f64),
                ROWS=Ptr(f64),
                VALID=Ptr(torch.int8),
                S_PART=Ptr(f64),
                T_PART=Ptr(f64),
                A_PART=Ptr(f64),
                R=tokens,
                R2=T,
                L=1,
                D=d,
                n_iters=7,
                sx_i=T * d,
                sx_j=d,
                sx_l=0,
                sx_d=1,
                sm_i=T,
                sm_j=1,
                sm_l=0,
            ),
            constexprs=dict(HAS_MASK=True, BLOCK_R=block_r, BLOCK_D=block_d, SINGLE_CHUNK=single),
            num_warps=warps,
            num_stages=2,
            expect=("LDG.E.128",),
        )
    )
    # capture-reduce, two-pass path for wide rows (d > 8192), fp32 gradient
    wide = 3 * 8192
    block_r, block_d, single, warps = capture._row_config(wide, dev)
    specs.append(
        Spec(
            name=f"capture_rows_fp32_d{wide}_chunked",
            kernel=capture._capture_rows_kernel,
            args=dict(
                X=Ptr(f32),
                MASK=Ptr(torch.uint8),
                CENTRE=Ptr(f32),
                ROWS=Ptr(f32),
                VALID=Ptr(torch.int8),
                S_PART=Ptr(f32),
                T_PART=Ptr(f32),
                A_PART=Ptr(f64),
                R=4096,
                R2=1,
                L=16,
                D=wide,
                n_iters=3,
                sx_i=16 * wide,
                sx_j=0,
                sx_l=wide,
                sx_d=1,
                sm_i=16,
                sm_j=0,
                sm_l=1,
            ),
            constexprs=dict(HAS_MASK=True, BLOCK_R=block_r, BLOCK_D=block_d, SINGLE_CHUNK=single),
            num_warps=warps,
            num_stages=2,
            expect=("LDG.E.128",),
        )
    )
    # stage 1 of unit="sample" with few samples: sums over a slice of positions
    block_t, block_d, warps = capture._positions_config(d, dev)
    specs.append(
        Spec(
            name=f"sum_positions_bf16_d{d}",
            kernel=capture._sum_positions_kernel,
            args=dict(
                X=Ptr(bf16),
                MASK=Ptr(torch.uint8),
                QPART=Ptr(f32),
                CNT=Ptr(torch.int32),
                B=32,
                T=T,
                D=d,
                t_per_split=128,
                sx_b=T * d,
                sx_t=d,
                sx_d=1,
                sm_b=T,
                sm_t=1,
            ),
            constexprs=dict(HAS_MASK=True, BLOCK_T=block_t, BLOCK_D=block_d),
            num_warps=warps,
            num_stages=2,
            expect=("LDG.E.128",),
        )
    )

    # second moment S += Y^T Y, rows (tokens, d) contiguous
    for dtype, expect, note in (
        (bf16, ("HGMMA",), "native bf16 wgmma, exact products"),
        (torch.float16, ("HGMMA",), "native fp16 wgmma, exact products"),
        (f32, ("HGMMA",), "tf32x3: three tf32 wgmma per tile product"),
        (f64, ("DMMA",), "fp64 MMA (Hopper has no fp64 wgmma)"),
    ):
        BM, BK, warps, stages = second_moment.GPU_CONFIGS[dtype]
        specs.append(
            Spec(
                name=f"syrk_upper_{_TL_NAME[dtype]}_d{d}",
                kernel=second_moment._syrk_upper_kernel,
                args=dict(
                    Y=Ptr(dtype),
                    S=Ptr(f64),
                    W=Ptr(f64 if dtype == f64 else f32),
                    TILES=Ptr(torch.int32),
                    R=tokens,
                    D=d,
                    k_per_split=tokens,
                    sy_r=d,
                    sy_d=1,
                    ss_0=d,
                    ss_1=1,
                ),
                constexprs=dict(
                    ACCUMULATE=True,
                    DOT_DTYPE=TORCH_TO_TL[dtype],
                    BM=BM,
                    BK=BK,
                    PRECISION=second_moment.dot_precision(dtype),
                ),
                num_warps=warps,
                num_stages=stages,
                expect=expect,
                note=note,
            )
        )
    # split-K variant (few tiles, many rows: d = 512): tiles stored to the fp32 workspace
    BM, BK, warps, stages = second_moment.GPU_CONFIGS[bf16]
    specs.append(
        Spec(
            name="syrk_upper_bf16_d512_splitk",
            kernel=second_moment._syrk_upper_kernel,
            args=dict(
                Y=Ptr(bf16),
                S=Ptr(f64),
                W=Ptr(f32),
                TILES=Ptr(torch.int32),
                R=tokens,
                D=512,
                k_per_split=tokens // 16,
                sy_r=512,
                sy_d=1,
                ss_0=512,
                ss_1=1,
            ),
            constexprs=dict(ACCUMULATE=False, DOT_DTYPE=TORCH_TO_TL[bf16], BM=BM, BK=BK, PRECISION="ieee"),
            num_warps=warps,
            num_stages=stages,
            expect=("HGMMA",),
        )
    )
    # Gram rows: new rows (64, d) x pool (N, d)^T
    for dtype, expect in ((bf16, ("HGMMA",)), (f32, ("HGMMA",)), (f64, ("DMMA",))):
        BM, BN, BK, warps, stages = gram.GPU_CONFIGS[dtype]
        specs.append(
            Spec(
                name=f"gram_{_TL_NAME[dtype]}_d{d}",
                kernel=gram._gram_kernel,
                args=dict(
                    X=Ptr(dtype),
                    P=Ptr(dtype),
                    G=Ptr(f64),
                    B=64,
                    N=2496,
                    D=d,
                    sx_0=d,
                    sx_1=1,
                    sp_0=d,
                    sp_1=1,
                    sg_0=2496,
                    sg_1=1,
                ),
                constexprs=dict(
                    DOT_DTYPE=TORCH_TO_TL[dtype],
                    ACC_DTYPE=TORCH_TO_TL[f64 if dtype == f64 else f32],
                    PRECISION="tf32x3" if dtype == f32 else "ieee",
                    BM=BM,
                    BN=BN,
                    BK=BK,
                ),
                num_warps=warps,
                num_stages=stages,
                expect=expect,
            )
        )
    # cross-gradient: stage 1 phi(Z W_in^T) and stage 2 Q_i^T Phi_i (both units), rank 64
    specs.extend(cross_specs(d=d, r=64, tokens=tokens))
    return specs


def cross_specs(d: int = 4096, r: int = 64, tokens: int = 65536, inputs=("bf16", "fp32", "fp64")):
    """Production configurations of both cross-gradient kernels (:mod:`.cross`; part of
    :func:`production_specs`): bf16 or fp32 gradient/activation with fp32 ``tf32x3`` products
    (``HGMMA``), fp64 inputs in fp64 (``DMMA``).
    ``tokens`` rows of width ``d`` in stage 1, rows of ``T = 2048`` positions in stage 2."""
    bf16, f32, f64, i32 = torch.bfloat16, torch.float32, torch.float64, torch.int32
    T = 2048
    specs = []
    for io, dot, expect in ((bf16, f32, ("HGMMA",)), (f32, f32, ("HGMMA",)), (f64, f64, ("DMMA",))):
        name = {bf16: "bf16", f32: "fp32", f64: "fp64"}[io]
        if name not in inputs:
            continue
        prec = second_moment.dot_precision(dot)
        mma = "tf32x3 wgmma" if prec == "tf32x3" else "fp64 DMMA"
        BM, BN, BK, warps, stages = cross.PHI_GPU[dot]
        specs.append(
            Spec(
                name=f"cross_phi_{name}_d{d}_r{r}",
                kernel=cross._phi_kernel,
                args=dict(
                    Z=Ptr(io),
                    W=Ptr(dot),
                    ROWS=Ptr(i32),
                    PHI=Ptr(dot),
                    n_rows=tokens,
                    T=T,
                    DIN=d,
                    R=r,
                    sz_b=T * d,
                    sz_t=d,
                    sz_d=1,
                    sw_r=d,
                    sw_d=1,
                ),
                constexprs=dict(ACT="gelu", DOT_DTYPE=TORCH_TO_TL[dot], PRECISION=prec, BM=BM, BN=BN, BK=BK),
                num_warps=warps,
                num_stages=stages,
                expect=expect,
                note=f"stage 1: Z W_in^T ({mma}), gelu (erf) in the epilogue",
            )
        )
        BD, BR, BT, warps, stages = cross.CROSS_GPU[dot]
        for store in (True, False):
            specs.append(
                Spec(
                    name=f"cross_{'sample' if store else 'position'}_{name}_d{d}_r{r}",
                    kernel=cross._cross_kernel,
                    args=dict(
                        Q=Ptr(io),
                        PHI=Ptr(dot),
                        ROWS=Ptr(i32),
                        SEG=Ptr(i32),
                        C_OUT=Ptr(dot),
                        SQ_PART=Ptr(f64),
                        CSUM_PART=Ptr(f64),
                        n_items=256,
                        items_per_split=32,
                        T=T,
                        D=d,
                        R=r,
                        sq_b=T * d,
                        sq_t=d,
                        sq_d=1,
                    ),
                    constexprs=dict(
                        STORE_C=store, DOT_DTYPE=TORCH_TO_TL[dot], PRECISION=prec, BD=BD, BR=BR, BT=BT
                    ),
                    num_warps=warps,
                    num_stages=stages,
                    expect=expect,
                    note=(
                        f"stage 2: c_i = Q_i^T Phi_i ({mma}), fp64 c_sum partials"
                        + (", c_i and |c_i|^2 stored" if store else "")
                    ),
                )
            )
    return specs


def compile_spec(spec: Spec, arch: int = 90):
    """``triton.compile`` of ``spec`` for ``GPUTarget("cuda", arch, 32)``."""
    sig, const, attrs = _signature(spec)
    return compile_for(
        spec.kernel,
        sig,
        const,
        attrs,
        arch,
        {"num_warps": spec.num_warps, "num_stages": spec.num_stages, "enable_fp_fusion": True},
    )


SASS_OPS = (
    "LDG.E.128",
    "LDG.E.64",
    "LDG.E",
    "LDGSTS",
    "HGMMA",
    "HMMA",
    "DMMA",
    "FFMA",
    "DFMA",
    "LDL",
    "STL",
    "BAR.SYNC",
)


def count_sass(sass: str) -> dict:
    """Opcode counts for :data:`SASS_OPS` (a prefix match on the mnemonic, so ``LDG.E`` counts all
    global loads and ``LDG.E.128`` only the 16-byte ones)."""
    mnemonics = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    counts = collections.Counter()
    for m in mnemonics:
        for op in SASS_OPS:
            if m == op or m.startswith(op + "."):
                counts[op] += 1
    return {op: counts.get(op, 0) for op in SASS_OPS}


@dataclasses.dataclass
class Report:
    name: str
    n_regs: int
    spill_stores: int
    spill_loads: int
    stack: int
    local: int
    shared: int
    sass: dict
    expect: tuple
    note: str

    @property
    def ok(self) -> bool:
        return (
            self.spill_stores == 0
            and self.spill_loads == 0
            and self.local == 0
            and self.sass["LDL"] == 0
            and self.sass["STL"] == 0
            and all(self.sass[op] > 0 for op in self.expect)
        )


def report(spec: Spec, arch: int = 90) -> Report:
    """Compile ``spec`` and read its resource usage and SASS."""
    k = compile_spec(spec, arch)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        cubin = os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        suffix = "a" if arch >= 90 else ""
        log = subprocess.run(
            [
                ptxas_path(arch),
                "-v",
                "--regAllocOptLevel=2",
                f"--gpu-name=sm_{arch}{suffix}",
                ptx,
                "-o",
                os.path.join(tmp, "v.cubin"),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        res = subprocess.run(
            [nvidia_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [nvidia_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)

    def field(key):
        m = re.search(key + r":(\d+)", res)
        return int(m.group(1)) if m else -1

    return Report(
        name=spec.name,
        n_regs=int(regs.group(1)) if regs else field("REG"),
        spill_stores=int(spills.group(1)) if spills else -1,
        spill_loads=int(spills.group(2)) if spills else -1,
        stack=field("STACK"),
        local=field("LOCAL"),
        shared=k.metadata.shared,
        sass=count_sass(sass),
        expect=spec.expect,
        note=spec.note,
    )


def can_compile_in_process() -> bool:
    """False when Triton was imported with ``TRITON_INTERPRET=1``: its standard library (the
    reduction combine functions our kernels use) is then interpreted-only and cannot be compiled."""
    return standard_library_compilable()


def reports_via_subprocess(timeout: float = 600) -> dict:
    """:func:`report` of every production spec, computed in a child process without the
    interpreter flag; returns ``{name: Report}``."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-m", "fused_stats.kernels.aot", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode not in (0, 1):
        raise RuntimeError(f"AOT child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    return {r["name"]: Report(**{**r, "expect": tuple(r["expect"])}) for r in rows}


def all_reports() -> dict:
    """``{name: Report}`` for every production spec, in process when possible."""
    if can_compile_in_process():
        return {s.name: report(s) for s in production_specs()}
    return reports_via_subprocess()


def main(argv=None) -> int:
    import json

    argv = sys.argv[1:] if argv is None else argv
    specs = {s.name: s for s in production_specs()}
    rows = [report(s) for s in specs.values()]
    if "--json" in argv:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
        return 0 if all(r.ok for r in rows) else 1
    cols = (
        "kernel",
        "warps",
        "stages",
        "regs",
        "spill B",
        "local",
        "smem B",
        "LDG.128",
        "LDGSTS",
        "HGMMA",
        "DMMA",
        "FFMA",
        "ok",
    )
    print(" | ".join(cols))
    for r in rows:
        sp = specs[r.name]
        print(
            " | ".join(
                str(v)
                for v in (
                    r.name,
                    sp.num_warps,
                    sp.num_stages,
                    r.n_regs,
                    r.spill_stores + r.spill_loads,
                    r.local,
                    r.shared,
                    r.sass["LDG.E.128"],
                    r.sass["LDGSTS"],
                    r.sass["HGMMA"],
                    r.sass["DMMA"],
                    r.sass["FFMA"],
                    r.ok,
                )
            )
        )
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
