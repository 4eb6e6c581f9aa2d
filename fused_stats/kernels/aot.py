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
two cross-gradient kernels (:func:`cross_specs`). The specs are *recorded from the launchers*: each
launcher is called on meta tensors inside :func:`fused_stats.kernels._common.record_launches`, where
it picks its GPU configuration and records its launches instead of running them, so the gate
compiles exactly what production launches (arguments, constexprs, warps, stages) and there is no
second table to drift. The Triton internals this needs (``ASTSource``,
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
import triton.language as tl

from . import capture, cross, gram, second_moment
from ._common import record_launches
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
    """A pointer argument of the given element dtype, 16-byte aligned or not (torch allocations
    are; a view's offset may not be)."""

    dtype: torch.dtype
    aligned: bool = True


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
            if value.aligned:
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


def _meta(*shape, dtype=torch.float32):
    """A contiguous tensor of ``shape`` without data (the launchers only read shapes and strides)."""
    return torch.empty(*shape, dtype=dtype, device="meta")


_KERNEL_PREFIX = {
    "_capture_rows_kernel": "capture_rows",
    "_sum_positions_kernel": "sum_positions",
    "_syrk_upper_kernel": "syrk_upper",
    "_gram_kernel": "gram",
    "_phi_kernel": "cross_phi",
}
_NON_KERNEL_META = ("num_warps", "num_stages", "enable_fp_fusion")


def _aligned(t: torch.Tensor) -> bool:
    return (t.storage_offset() * t.element_size()) % 16 == 0


def _expect(launch, args: dict) -> tuple:
    """The instruction a recorded launch must compile to (see :class:`Spec`): ``DMMA`` for fp64 tile
    products (Hopper has no fp64 wgmma), ``HGMMA`` for the others; ``LDG.E.128`` in the capture
    kernels when the input's rows are 16-byte aligned with unit feature stride (a feature-strided
    input or an odd ``d`` cannot be read 16 bytes at a time: no expectation then, no spills still)."""
    meta = launch.meta
    if "DOT_DTYPE" in meta:
        return ("DMMA",) if meta["DOT_DTYPE"] == tl.float64 else ("HGMMA",)
    x = args["X"]
    strides = [v for k, v in args.items() if k.startswith("sx_") and k != "sx_d"]
    if args["sx_d"] == 1 and x.aligned and all(v % 16 == 0 for v in strides):
        return ("LDG.E.128",)
    return ()


def specs_of(case: str, launches, note: str = "") -> list[Spec]:
    """A :class:`Spec` per recorded launch (:func:`fused_stats.kernels._common.record_launches`):
    tensor arguments become :class:`Ptr` of their dtype, integers stay as passed, keyword
    meta-parameters become constexprs and options. Named ``<kernel>_<case>``."""
    out = []
    for launch in launches:
        fn = launch.kernel.fn.__name__
        prefix = _KERNEL_PREFIX.get(fn)
        if fn == "_cross_kernel":
            prefix = "cross_sample" if launch.meta["STORE_C"] else "cross_position"
        args = {}
        for name, value in zip(launch.kernel.arg_names, launch.args):
            if isinstance(value, torch.Tensor):
                args[name] = Ptr(value.dtype, _aligned(value))
            else:
                args[name] = int(value)
        constexprs = {k: v for k, v in launch.meta.items() if k not in _NON_KERNEL_META}
        out.append(
            Spec(
                name=f"{prefix}_{case}",
                kernel=launch.kernel,
                args=args,
                constexprs=constexprs,
                num_warps=launch.meta["num_warps"],
                num_stages=launch.meta["num_stages"],
                expect=_expect(launch, args),
                note=note,
            )
        )
    return out


def _recorded(fn, *args) -> list:
    with record_launches() as launches:
        fn(*args)
    return list(launches)


def production_specs(d: int = 4096, tokens: int = 65536) -> list[Spec]:
    """What the launchers launch on an H200-sized problem (``tokens`` rows of ``d`` features),
    recorded from the launchers themselves on meta tensors (no second table of configurations):
    capture-reduce (both units, stage 1 and its stage 2, short sequences, wide, odd and
    feature-strided rows, ``d = 8192``), the second moment (each dtype, split-K), Gram rows (each
    dtype, the fp32 x fp64 of a pool, an odd pool size) and both cross-gradient stages
    (:func:`cross_specs`). Duplicate compilations (same kernel, signature and options) are dropped."""
    bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    specs = []
    T = 2048
    B = max(1, tokens // T)
    mask = _meta(B, T, dtype=torch.bool)

    def capture_case(case, grad, m, unit, note=""):
        c = _meta(grad.shape[-1], dtype=f64)
        specs.extend(specs_of(case, _recorded(capture.capture_partials, grad, m, c, unit), note))

    capture_case(f"bf16_d{d}", _meta(B, T, d, dtype=bf16), None, "position", "memory-bound: 16-byte loads")
    capture_case(f"bf16_d{d}_mask", _meta(B, T, d, dtype=bf16), mask, "position")
    capture_case(f"fp64_d{d}_mask", _meta(B, T, d, dtype=f64), mask, "position", "computed in fp64")
    # unit="sample", long sequences: stage 1 over slices of positions, stage 2 sums the slices
    # (an int32 count mask, L = n_split)
    capture_case(f"bf16_d{d}_sample", _meta(B, T, d, dtype=bf16), mask, "sample", "stage 1, then stage 2")
    # the layout of a sequence-first model, (T, B, d) viewed as (B, T, d)
    capture_case(f"bf16_d{d}_sample_tbd", _meta(T, B, d, dtype=bf16).transpose(0, 1), None, "sample")
    # short sequences (T < 16): positions summed inside the row kernel
    short = max(1, tokens // 8)
    capture_case(
        f"bf16_d{d}_sample_t8", _meta(short, 8, d, dtype=bf16), _meta(short, 8, dtype=torch.bool), "sample"
    )
    # an odd width and a feature-strided view (every other feature of a wider buffer): no 16-byte
    # loads possible, but the configuration must still not spill
    capture_case(f"bf16_d{d - 1}_odd", _meta(B, T, d - 1, dtype=bf16), None, "position")
    capture_case(f"bf16_d{d}_strided", _meta(B, T, 2 * d, dtype=bf16)[:, :, ::2], None, "position")
    # the widest whole-row configuration and beyond it the two-pass path
    wide = capture.GPU_SINGLE_CHUNK_MAX_D
    for dtype in (bf16, f32, f64):
        capture_case(f"{_TL_NAME[dtype]}_d{wide}", _meta(B // 2, T, wide, dtype=dtype), None, "position")
    capture_case(f"fp32_d{3 * wide}", _meta(4096, 1, 3 * wide, dtype=f32), None, "position", "two-pass")

    # second moment S += Y^T Y; rows (tokens, d) and an odd row count
    S = _meta(d, d, dtype=f64)
    for dtype in (bf16, torch.float16, f32, f64):
        rows = _meta(tokens, d, dtype=dtype)
        specs.extend(
            specs_of(f"{_TL_NAME[dtype]}_d{d}", _recorded(second_moment.second_moment_update, S, rows))
        )
    rows = _meta(tokens - 15, d, dtype=f32)
    specs.extend(
        specs_of(f"fp32_d{d}_r{tokens - 15}", _recorded(second_moment.second_moment_update, S, rows))
    )
    # few tiles, many rows: the launcher splits K (tiles stored to the workspace)
    S512 = _meta(512, 512, dtype=f64)
    specs.extend(
        specs_of(
            "bf16_d512_splitk",
            _recorded(second_moment.second_moment_update, S512, _meta(tokens, 512, dtype=bf16)),
        )
    )

    # Gram rows: a batch of new rows against a pool of N rows (N about the auto pool's limit, odd)
    n_pool = int(0.61 * d)
    for new_dtype, pool_dtype in ((bf16, bf16), (f32, f32), (f64, f64), (f32, f64)):
        name = (
            _TL_NAME[new_dtype]
            if new_dtype == pool_dtype
            else f"{_TL_NAME[new_dtype]}_{_TL_NAME[pool_dtype]}"
        )
        new, pool = _meta(64, d, dtype=new_dtype), _meta(n_pool, d, dtype=pool_dtype)
        note = "a pool's extension: fp32 new rows, fp64 pool" if new_dtype != pool_dtype else ""
        specs.extend(specs_of(f"{name}_d{d}_n{n_pool}", _recorded(gram.gram_rows, new, pool), note))

    specs.extend(cross_specs(d=d, r=64, tokens=tokens))
    return _unique(specs)


def _unique(specs: list[Spec]) -> list[Spec]:
    seen, out = set(), []
    for spec in specs:
        sig, const, attrs = _signature(spec)
        key = (
            id(spec.kernel),
            tuple(sorted(sig.items())),
            tuple(sorted((k, str(v)) for k, v in const.items())),
            tuple(sorted((k, str(v)) for k, v in attrs.items())),
            spec.num_warps,
            spec.num_stages,
        )
        if key not in seen:
            seen.add(key)
            out.append(spec)
    return out


def cross_specs(d: int = 4096, r: int = 64, tokens: int = 65536, inputs=("bf16", "fp32", "fp64")):
    """Both cross-gradient stages (:mod:`.cross`; part of :func:`production_specs`) as the stage
    launchers ``_phi`` and ``_cross`` launch them, with the configurations ``_configs`` picks: bf16
    or fp32 gradient/activation with fp32 ``tf32x3`` products (``HGMMA``), fp64 inputs in fp64
    (``DMMA``). ``tokens`` counted positions of width ``d`` in rows of ``T = 2048`` positions;
    ``unit="sample"`` items are samples, ``"position"`` items runs of ``ITEM_ROWS`` positions."""
    bf16, f32, f64, i32 = torch.bfloat16, torch.float32, torch.float64, torch.int32
    T = 2048
    B = max(1, tokens // T)
    dev = torch.device("meta")
    specs = []
    for io, dot in ((bf16, f32), (f32, f32), (f64, f64)):
        name = _TL_NAME[io]
        if name not in inputs:
            continue
        with record_launches():
            phi_cfg, cross_cfg = cross._configs(dot, dev)
        z, q = _meta(B, T, d, dtype=io), _meta(B, T, d, dtype=io)
        w = _meta(r, d, dtype=dot)
        rows = _meta(tokens, dtype=i32)
        mma = "tf32x3 wgmma" if dot == f32 else "fp64 DMMA"
        case = f"{name}_d{d}_r{r}"
        specs.extend(
            specs_of(
                case,
                _recorded(cross._phi, z, w, rows, "gelu", dot, phi_cfg),
                f"stage 1: Z W_in^T ({mma}), gelu (erf) in the epilogue",
            )
        )
        phi = _meta(tokens, r, dtype=dot)
        for store, n_items in ((True, B), (False, -(-tokens // cross.ITEM_ROWS))):
            seg = _meta(n_items + 1, dtype=i32)
            specs.extend(
                specs_of(
                    case,
                    _recorded(cross._cross, q, phi, rows, seg, store, dot, cross_cfg),
                    f"stage 2: c_i = Q_i^T Phi_i ({mma}), fp64 c_sum partials"
                    + (", c_i and |c_i|^2 stored" if store else ""),
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
    if "--json" not in argv:
        return _print_table(specs)
    rows = [report(s) for s in specs.values()]
    if "--json" in argv:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
        return 0 if all(r.ok for r in rows) else 1
    return 1  # pragma: no cover


def _print_table(specs: dict) -> int:
    """The report table, one line per spec; a spec that fails to compile is a line saying so (the
    others are still compiled and reported). 0 when every spec compiled and passed."""
    failed = []
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
    print(" | ".join(cols), flush=True)
    for sp in specs.values():
        try:
            r = report(sp)
        except Exception as exc:  # one variant failing to compile must not hide the others
            failed.append(sp.name)
            print(
                f"{sp.name} | compile error: {type(exc).__name__}: {str(exc).strip().splitlines()[-1:]}",
                flush=True,
            )
            continue
        if not r.ok:
            failed.append(sp.name)
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
            ),
            flush=True,
        )
    print(
        f"{len(specs)} kernel configurations, {len(failed)} failed"
        + (f": {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
