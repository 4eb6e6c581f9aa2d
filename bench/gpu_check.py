#!/usr/bin/env python3
"""The one prepared GPU check (docs/design.md, section 8): the gpu tests, then the measurements.

Run on a CUDA machine (written for an H200) from the repository root; the first command::

    python3 bench/gpu_check.py                # at most 8 minutes (--max-s 480)
    python3 bench/gpu_check.py --dry-run      # no GPU needed: the launcher itself at tiny sizes
    python3 bench/gpu_check.py --sweeps --compile-peers   # then, if time is left: the heavy extras

1. Correctness: ``pytest -m gpu tests/test_gpu_kernels.py`` (``--tests`` for others) in a child
   process, watched: a test that runs past ``--test-timeout`` is killed, and one that crashes the
   process (a CUDA illegal-address abort, a segfault) or hangs is recorded and the others run again
   without it; all of them within ``--tests-timeout``. The same tests run on any GPU machine with
   ``pytest -m gpu``.
2. Measurements, each section in its own child process with its own timeout (:data:`TIMEOUT_S`,
   ``--timeout NAME=SECONDS``), each dtype or case in its own try:

   * ceilings: copy bandwidth (``torch.clone`` of a tensor of the capture input's size, bytes read +
     written) and dense matmul rates (bf16, TF32, fp64);
   * capture-reduce GB/s against the copy bandwidth (target >= 85 %; bytes it must move, see
     bench/KERNELS.md); second moment TFLOP/s from bf16 rows against the bf16 matmul rate (target
     >= 60 %, counting the triangle's FLOPs ``d (d + 1) R``; fp32 rows use tf32x3, reported against
     a third of the TF32 rate, with no target); Gram rows and cross gradient times; the torch twin in
     eager mode as the peer column (``torch.compile`` peers with ``--compile-peers``);
   * probe overhead: one probe step against one training step of a LLaMA-shaped model;
   * the weight-streamed probe step (``stream``): block host-to-device GB/s against a pinned copy,
     streamed / in-memory step ratio.

No section starts after ``--max-s`` seconds (default 480) and each child's timeout is cut to the
time left. The JSON is rewritten after every section (``$OUT/gpu_check.json`` when ``OUT`` is set,
else ``bench/results/gpu_check.json``, or ``--out DIR``; a dry run writes ``gpu_check_dry_run.json``)
and a table is printed last; the exit status is 1 when a test or a section failed. Sections marked
optional are skipped once ``--budget-s`` seconds (default 420) have passed. ``--skip a,b`` leaves
sections out (``gpu_tests`` too); ``--in-process`` runs the sections in this process (no isolation;
for debugging). ``--inject-failure SECTION[.CASE]:KIND`` (KIND = ``raise``, ``crash``, ``hang``)
makes a section or one case fail on purpose: the test of the isolation uses it.

A dry run on CPU: the gpu tests are collected and skipped, and every measurement section runs at
tiny sizes through Triton's interpreter, timed by the wall clock (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the GPU machine runs from a plain checkout (package not installed)
    sys.path.insert(0, str(ROOT))

T0 = time.time()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny sizes (checks the launcher); without CUDA the gpu tests skip and the kernels run "
        "through Triton's interpreter, timings meaningless",
    )
    p.add_argument("--out", default=None, help="directory for gpu_check.json")
    p.add_argument("--tokens", type=int, default=65536, help="B x T of the capture/GEMM problems")
    p.add_argument("--d", type=int, default=4096, help="feature dimension")
    p.add_argument(
        "--stream-blocks",
        type=int,
        default=4,
        help="blocks of the LLaMA-shaped model of the weight-streaming section",
    )
    p.add_argument("--skip", default="", help="comma-separated sections (gpu_tests included) to leave out")
    p.add_argument(
        "--tests",
        nargs="+",
        default=["tests/test_gpu_kernels.py"],
        help="what pytest -m gpu runs first (paths or node ids; tests/ for every gpu test)",
    )
    p.add_argument("--tests-timeout", type=float, default=300.0, help="seconds for all the gpu tests")
    p.add_argument(
        "--test-timeout", type=float, default=120.0, help="seconds one gpu test may run before it is killed"
    )
    p.add_argument(
        "--max-restarts", type=int, default=4, help="reruns of the rest after a test crashes or hangs"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="skip optional sections after this many seconds",
    )
    p.add_argument(
        "--max-s",
        type=float,
        default=None,
        help="hard wall: no section starts after this many seconds, and none runs past it "
        "(default 480; none for a dry run, whose speed is the CPU's)",
    )
    p.add_argument("--sweeps", action="store_true", help="also the configuration sweeps (heavy)")
    p.add_argument("--compile-peers", action="store_true", help="also torch.compile peers (slow to compile)")
    p.add_argument(
        "--timeout", action="append", default=[], metavar="NAME=SECONDS", help="a section's timeout"
    )
    p.add_argument("--in-process", action="store_true", help="no child processes (no isolation)")
    p.add_argument(
        "--inject-failure",
        action="append",
        default=[],
        metavar="SECTION[.CASE]:KIND",
        help="fail on purpose (KIND: raise, crash, hang); tests the isolation",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one section
    p.add_argument("--child-dir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def out_path(args) -> Path:
    if args.out:
        base = Path(args.out)
    elif os.environ.get("OUT"):
        base = Path(os.environ["OUT"])
    else:
        base = ROOT / "bench" / "results"
    base.mkdir(parents=True, exist_ok=True)
    # a CPU dry run must never be mistaken for (or overwrite) the GPU results
    return base / ("gpu_check_dry_run.json" if args.dry_run else "gpu_check.json")


def inject(args, key: str) -> None:
    """The failure ``--inject-failure`` asks for at ``key`` (a section, or ``section.case``)."""
    for item in args.inject_failure:
        where, _, kind = item.rpartition(":")
        if where != key:
            continue
        if kind == "raise":
            raise RuntimeError(f"failure injected at {key}")
        if kind == "crash":  # what a CUDA illegal-address abort or a segfault does to a process
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGSEGV)
        if kind == "hang":
            time.sleep(10**6)
        raise ValueError(f"--inject-failure {item}: unknown kind {kind!r}")


class Run:
    """Collects sections, table rows and writes the JSON after every section (a child process: after
    every row and case, so that what a crash leaves behind still reaches the parent)."""

    def __init__(self, args, path: Path):
        self.args = args
        self.path = path
        self.sections: dict = {}
        self.table: list = []
        self.peers: dict = {}
        self.current: str | None = None  # the section running now
        self.partial: dict = {}  # its cases so far
        self.meta: dict = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv[1:],
            "dry_run": bool(args.dry_run),
            "python": platform.python_version(),
            "isolation": "gpu tests in a watched pytest child; sections "
            + ("in-process" if args.in_process else "one child process each"),
        }

    def row(self, section, metric, value, unit="", reference=None, target=None, note="", ok=None):
        """One table line; ``ok`` is ratio >= target when a target is given, else as passed."""
        ratio = None
        if reference not in (None, 0) and value is not None and math.isfinite(value):
            ratio = value / reference
        if target is not None:
            ok = None if ratio is None else bool(ratio >= target)
        self.table.append(
            dict(
                section=section,
                metric=metric,
                value=value,
                unit=unit,
                reference=reference,
                ratio=ratio,
                target=target,
                ok=ok,
                note=note,
            )
        )
        if self.args.child:
            self.write()

    def case(self, out: dict, label: str, fn):
        """``out[label] = fn()``, or the error it raised: one case (dtype, unit, shape) failing
        leaves the section's other cases."""
        try:
            inject(self.args, f"{self.current}.{label}")
            out[label] = fn()
        except Exception as exc:
            out[label] = {
                "ok": False,
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-3000:],
            }
            print(f"    {self.current}.{label} error: {out[label]['error'][:300]}", flush=True)
            self.row(self.current, f"{label}", None, note=out[label]["error"][:120], ok=False)
        self.partial = out
        if self.args.child:
            self.write()
        return out[label]

    def section(self, name, fn):
        """Run section ``fn`` here; its result (or its error) becomes ``sections[name]``."""
        start = time.time()
        self.current, self.partial = name, {}
        print(f"[{time.time() - T0:6.1f}s] {name} ...", flush=True)
        try:
            inject(self.args, name)
            result = fn(self) or {}
            entry = {"status": result.pop("_status", "ok"), **result}
            failed = [k for k, v in result.items() if isinstance(v, dict) and v.get("error")]
            if failed and entry["status"] == "ok":
                entry["status"] = "error"
                entry["error"] = f"cases failed: {', '.join(failed)}"
        except Exception as exc:  # one failure must not lose the rest
            entry = {
                **self.partial,
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:],
            }
            print(f"    error: {entry['error']}", flush=True)
            result = None
        entry["seconds"] = round(time.time() - start, 2)
        self.sections[name] = entry
        self.current, self.partial = None, {}
        self.write()
        return result

    def document(self) -> dict:
        sections = dict(self.sections)
        if self.current is not None:  # a child's section still running: its cases so far
            sections[self.current] = {"status": "running", **self.partial}
        return {
            "meta": {**self.meta, "elapsed_s": round(time.time() - T0, 1)},
            "sections": sections,
            "table": self.table,
            "peers": self.peers,
        }

    def write(self):
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.document(), indent=1, default=_json_default))
        os.replace(tmp, self.path)

    def print_table(self):
        cols = ("section", "metric", "value", "unit", "reference", "ratio", "target", "ok", "note")
        cells = [[_fmt(r[c]) for c in cols] for r in self.table]
        widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
        print()
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        print("  ".join("-" * w for w in widths))
        for x in cells:
            print("  ".join(v.ljust(w) for v, w in zip(x, widths)))
        bad = [n for n, s in self.sections.items() if s.get("status") == "error"]
        print(f"\nsections: {len(self.sections)}, errors: {bad or 'none'}; JSON: {self.path}")


def _json_default(x):
    try:
        return float(x)
    except Exception:
        return str(x)


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.4g}"
        return f"{v:.3e}"
    return str(v)


# ---------------------------------------------------------------------------- helpers
def bench(fn, run) -> float:
    """Median milliseconds: triton.testing.do_bench on a GPU; on CPU (a dry run, whose figures only
    show that the section's code runs) the median of three wall-clock calls."""
    import torch

    if not torch.cuda.is_available():
        return 1e3 * _wall(fn, 3, cuda=False)
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


class Ctx:
    """Problem sizes and tensors shared by the sections."""

    def __init__(self, args):
        import torch

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        if args.dry_run:
            self.tokens, self.d, self.matmul_n = 96, 40, 64
        else:
            self.tokens, self.d, self.matmul_n = args.tokens, args.d, 8192
        self.gen = torch.Generator(device=self.device).manual_seed(1234)
        self.peers: dict = {}

    def randn(self, *shape, dtype=None, scale=1.0, shift=0.0):
        torch = self.torch
        x = torch.randn(*shape, generator=self.gen, device=self.device, dtype=torch.float32)
        return (x * scale + shift).to(dtype or torch.float32)


def section_env(run, ctx):
    torch = ctx.torch
    import triton

    out = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": str(ctx.device),
        "tokens": ctx.tokens,
        "d": ctx.d,
    }
    if ctx.cuda:
        prop = torch.cuda.get_device_properties(ctx.device)
        out.update(
            gpu=prop.name,
            sms=prop.multi_processor_count,
            memory_gib=round(prop.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            capability=list(torch.cuda.get_device_capability(ctx.device)),
        )
    else:
        out["note"] = "no CUDA device: kernels through the interpreter at tiny sizes; timings mean nothing"
    out["driver"] = _driver_version() if ctx.cuda else None
    return out


def section_ceilings(run, ctx):
    torch = ctx.torch
    n = ctx.tokens * ctx.d  # elements of one bf16 gradient (B x T x d)
    x = torch.empty(n, dtype=torch.bfloat16, device=ctx.device).normal_()
    ms = bench(lambda: x.clone(), run)
    copy = 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9
    y = torch.empty_like(x)
    ms_copy = bench(lambda: y.copy_(x), run)
    copy_ = 2 * x.numel() * x.element_size() / (ms_copy * 1e-3) / 1e9
    ctx.peers["copy_GBps"] = copy
    run.row("ceilings", "clone GB/s (read+write)", copy, "GB/s", note=f"{n * 2 / 1e9:.2f} GB tensor")
    run.row("ceilings", "copy_ GB/s (read+write)", copy_, "GB/s")
    m = ctx.matmul_n
    out = {"clone_GBps": copy, "copy_GBps": copy_}
    for name, dtype, tf32, size in (
        ("bf16", torch.bfloat16, False, m),
        ("tf32", torch.float32, True, m),
        ("fp64", torch.float64, False, m // 2),
    ):
        a = torch.randn(size, size, device=ctx.device, dtype=torch.float32).to(dtype)
        b = torch.randn(size, size, device=ctx.device, dtype=torch.float32).to(dtype)
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            ms = bench(lambda a=a, b=b: a @ b, run)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        rate = 2 * size**3 / (ms * 1e-3) / 1e12
        ctx.peers[f"{name}_TFLOPs"] = rate
        out[f"matmul_{name}_TFLOPs"] = rate
        run.row("ceilings", f"{name} matmul {size}^3", rate, "TFLOP/s")
    if ctx.cuda:
        torch.cuda.empty_cache()
    return out


def _capture_cases(ctx):
    """(name, grad, mask, unit) at the realistic size: B x T = tokens."""
    torch = ctx.torch
    d, tokens = ctx.d, ctx.tokens
    T = min(4096, max(1, tokens // 16)) if tokens >= 64 else 4
    B = max(1, tokens // T)
    Ts = min(2048, max(1, tokens // 32))
    Bs = max(1, tokens // Ts)
    g = ctx.randn(B, T, d, dtype=torch.bfloat16, shift=0.5)
    mask = torch.rand(B, T, generator=ctx.gen, device=ctx.device) > 0.1
    gs = ctx.randn(Bs, Ts, d, dtype=torch.bfloat16, shift=0.5)
    ms = torch.rand(Bs, Ts, generator=ctx.gen, device=ctx.device) > 0.1
    ms[0] = False  # one sample fully masked
    gt = ctx.randn(Ts, Bs, d, dtype=torch.bfloat16, shift=0.5).transpose(0, 1)  # HF-like strides
    return [
        ("position_bf16", g, None, "position"),
        ("position_bf16_mask", g, mask, "position"),
        ("sample_bf16_mask", gs, ms, "sample"),
        ("sample_bf16_transposed", gt, None, "sample"),
    ]


def _centre(ctx, g):
    torch = ctx.torch
    # the mean of some of the samples (never all: s = sum y would then vanish, and its relative
    # error be that of cancellation), rounded to fp32 as the accumulator rounds its centre
    head = g[: max(1, min(8, g.shape[0] // 2))]
    return head.to(torch.float64).mean((0, 1)).to(torch.float32).to(torch.float64)


def _capture_bytes(g, mask, unit):
    """Bytes the capture op must move: read the gradient (and mask), write the rows (fp32)."""
    B, T, d = g.shape
    rows = B * T if unit == "position" else B
    return g.numel() * g.element_size() + (mask.numel() if mask is not None else 0) + rows * d * 4 + rows


def section_capture_speed(run, ctx):
    """Achieved GB/s of the capture kernels (bytes they must move) against the copy bandwidth."""
    torch = ctx.torch
    from fused_stats.kernels import capture
    from fused_stats.ops import torch_twin

    copy = ctx.peers.get("copy_GBps")
    out = {}
    for name, g, mask, unit in _capture_cases(ctx):

        def one(g=g, mask=mask, unit=unit, name=name):
            c = _centre(ctx, g)
            nbytes = _capture_bytes(g, mask, unit)
            ms_k = bench(lambda: capture.capture_partials(g, mask, c, unit), run)
            ms_op = bench(lambda: capture.capture_reduce(g, mask, c, unit), run)
            ms_twin = bench(lambda: torch_twin.capture_reduce(g, mask, c, unit), run)
            gbps = nbytes / (ms_k * 1e-3) / 1e9
            run.row(
                "capture speed",
                f"{name} kernels GB/s",
                gbps,
                "GB/s",
                reference=copy,
                target=0.85,
                note=f"op {ms_op:.3f} ms, twin eager {ms_twin:.3f} ms",
            )
            if ctx.cuda:
                torch.cuda.empty_cache()
            return {
                "bytes": nbytes,
                "kernels_ms": ms_k,
                "op_ms": ms_op,
                "twin_eager_ms": ms_twin,
                "GBps": gbps,
                "fraction_of_copy": gbps / copy if copy else None,
            }

        run.case(out, name, one)
    return out


def section_second_moment(run, ctx):
    """TFLOP/s of the second-moment kernel (the triangle's FLOPs ``d (d + 1) R``): bf16 rows against
    the measured bf16 matmul rate; fp32 rows (tf32x3: three TF32 MMAs a product) against a third of
    the TF32 rate, with no target."""
    torch = ctx.torch
    from fused_stats.kernels import second_moment_update
    from fused_stats.ops import torch_twin

    out = {}
    d, R = ctx.d, ctx.tokens
    flops = d * (d + 1) * R
    for label, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):

        def one(label=label, dtype=dtype):
            rows = _rows(ctx, dtype)
            S = torch.zeros(d, d, dtype=torch.float64, device=ctx.device)
            scratch = S.clone()
            ms = bench(lambda: second_moment_update(S, rows), run)
            ms_twin = bench(lambda: torch_twin.second_moment_update(scratch, rows), run)
            rate = flops / (ms * 1e-3) / 1e12
            entry = {"ms": ms, "twin_eager_ms": ms_twin, "TFLOPs_triangle": rate}
            if label == "bf16":
                full = bench(lambda: torch.mm(rows.T, rows), run)  # full d x d, bf16 out
                entry["torch_bf16_full_gemm_ms"] = full
                run.row(
                    "second moment speed",
                    "bf16 rows TFLOP/s (triangle)",
                    rate,
                    "TFLOP/s",
                    reference=ctx.peers.get("bf16_TFLOPs"),
                    target=0.60,
                    note=f"{ms:.3f} ms; torch bf16 full GEMM {full:.3f} ms; twin fp64 {ms_twin:.1f} ms",
                )
            else:
                tf32 = ctx.peers.get("tf32_TFLOPs")
                entry["tf32x3_ceiling_TFLOPs"] = tf32 / 3 if tf32 else None
                run.row(
                    "second moment speed",
                    "fp32 rows (tf32x3) TFLOP/s (triangle)",
                    rate,
                    "TFLOP/s",
                    reference=entry["tf32x3_ceiling_TFLOPs"],
                    note=f"reference = TF32 matmul / 3; {ms:.3f} ms",
                )
            if ctx.cuda:
                torch.cuda.empty_cache()
            return entry

        run.case(out, label, one)
    return out


def section_gram(run, ctx):
    """Milliseconds of the Gram rows of 64 new rows against a pool of about the auto pool's size."""
    torch = ctx.torch
    from fused_stats.kernels import gram_rows
    from fused_stats.ops import torch_twin

    out = {}
    d = ctx.d
    n_pool = max(2, int(d * 0.61))
    f32, f64 = torch.float32, torch.float64
    for label, new_dtype, pool_dtype in (
        ("fp64", f64, f64),
        ("bf16", torch.bfloat16, torch.bfloat16),
        ("fp32", f32, f32),
        ("fp32_x_fp64_pool", f32, f64),  # a pool's extension: fp32 new rows against the fp64 pool
    ):

        def one(label=label, new_dtype=new_dtype, pool_dtype=pool_dtype):
            new = ctx.randn(64, d, dtype=new_dtype)
            pool = ctx.randn(n_pool, d, dtype=pool_dtype)
            ms = bench(lambda: gram_rows(new, pool), run)
            ms_twin = bench(lambda: torch_twin.gram_rows(new, pool), run)
            rate = 2 * 64 * n_pool * d / (ms * 1e-3) / 1e12
            run.row("gram speed", f"{label} ms", ms, "ms", note=f"twin eager {ms_twin:.3f} ms")
            return {"ms": ms, "twin_eager_ms": ms_twin, "TFLOPs": rate, "shape": [64, n_pool, d]}

        run.case(out, label, one)
    return out


def section_cross(run, ctx):
    """The cross-gradient kernel's time, its two GEMMs' TFLOP/s and its extra memory, both units."""
    torch = ctx.torch
    from fused_stats.kernels import cross
    from fused_stats.ops import cross_twin

    if not getattr(cross, "IS_FUSED_KERNEL", False):
        return {
            "_status": "skipped",
            "reason": "no fused cross-gradient kernel in this build; "
            "fused_stats.kernels.cross_reduce runs the torch twin",
        }
    d = ctx.d
    r = 8 if run.args.dry_run else 64
    tokens = max(24, ctx.tokens // 4)
    T = min(512, max(1, tokens // 8))
    B = max(1, tokens // T)
    grad = ctx.randn(B, T, d, dtype=torch.bfloat16, shift=0.2)
    act = ctx.randn(B, T, d, dtype=torch.bfloat16)
    w_in = ctx.randn(r, d, scale=d**-0.5)
    mask = torch.rand(B, T, generator=ctx.gen, device=ctx.device) > 0.1
    out = {"shape": [B, T, d, r]}
    for unit in ("sample", "position"):

        def one(unit=unit):
            args = (grad, act, mask, w_in, "gelu", unit)
            ms = bench(lambda: cross.cross_reduce(*args), run)
            ms_twin = bench(lambda: cross_twin.cross_reduce(*args), run)
            # the two GEMMs over counted positions (phi = Z W_in^T, then Q^T Phi), tf32x3 products
            tflops = 4 * int(mask.sum()) * d * r / (ms * 1e-3) / 1e12
            entry = {"ms": ms, "twin_eager_ms": ms_twin, "gemm_TFLOPs": tflops}
            note = f"twin eager {ms_twin:.3f} ms; {tflops:.1f} TFLOP/s in the 2 GEMMs"
            if ctx.cuda:  # extra memory of one call: phi(W_in z) must exist only per chunk in the kernel
                peak = {}
                for who, fn in (("kernel", cross.cross_reduce), ("twin", cross_twin.cross_reduce)):
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                    base = torch.cuda.memory_allocated(ctx.device)
                    fn(*args)
                    torch.cuda.synchronize()
                    peak[who] = (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**20
                entry["peak_extra_MiB"] = peak
                note += f"; extra memory {peak['kernel']:.0f} MiB (twin {peak['twin']:.0f} MiB)"
            run.row("cross speed", f"{unit} ms", ms, "ms", note=note)
            return entry

        run.case(out, unit, one)
    return out


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:  # no nvidia-smi: the versions torch reports still stand
        return None


def section_capture_sweep(run, ctx):
    """Block-size alternatives of the row kernel (capture adds into nothing: safe to re-run)."""
    if not ctx.cuda:
        return {"_status": "skipped", "reason": "no CUDA"}
    from fused_stats.kernels import capture
    from fused_stats.kernels._common import override_config

    name, g, mask, unit = _capture_cases(ctx)[1]
    c = _centre(ctx, g)
    nbytes = _capture_bytes(g, mask, unit)
    out = {}
    combos = [(r, w, 4) for r in (1, 2, 4) for w in (4, 8, 16)] + [(1, 8, 2), (1, 8, 8), (2, 16, 2)]
    for block_r, warps, per_sm in combos:
        key = f"r{block_r}_w{warps}_p{per_sm}"
        try:
            with override_config(
                capture_block_r=block_r,
                capture_num_warps=warps,
                capture_programs=per_sm * capture.sm_count(ctx.device),
            ):
                ms = bench(lambda: capture.capture_partials(g, mask, c, unit), run)
            out[key] = nbytes / (ms * 1e-3) / 1e9
        except Exception as exc:  # e.g. out of registers for a large block
            out[key] = f"{type(exc).__name__}: {exc}"[:200]
    best = max((v, k) for k, v in out.items() if isinstance(v, float))
    run.row(
        "capture sweep",
        f"best {best[1]} ({name})",
        best[0],
        "GB/s",
        reference=ctx.peers.get("copy_GBps"),
        target=0.85,
    )
    return {"GBps": out, "best": best[1]}


def section_syrk_sweep(run, ctx):
    """Alternative (BM, BK, warps, stages) of the second-moment kernel, bf16 rows, on a scratch S."""
    torch = ctx.torch
    if not ctx.cuda:
        return {"_status": "skipped", "reason": "no CUDA"}
    from fused_stats.kernels import second_moment
    from fused_stats.kernels._common import override_config

    rows = _rows(ctx, torch.bfloat16)
    S = torch.zeros(ctx.d, ctx.d, dtype=torch.float64, device=ctx.device)
    flops = ctx.d * (ctx.d + 1) * ctx.tokens
    out = {}
    for cfg in ((128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 4), (128, 64, 4, 3), (64, 64, 4, 4)):
        key = "bm{}_bk{}_w{}_s{}".format(*cfg)
        try:
            with override_config(syrk_config=cfg, syrk_splits=1):
                ms = bench(lambda: second_moment.second_moment_update(S, rows), run)
            out[key] = flops / (ms * 1e-3) / 1e12
        except Exception as exc:  # e.g. out of shared memory
            out[key] = f"{type(exc).__name__}: {exc}"[:200]
    best = max((v, k) for k, v in out.items() if isinstance(v, float))
    run.row(
        "second moment sweep",
        f"best {best[1]} (bf16 rows)",
        best[0],
        "TFLOP/s",
        reference=ctx.peers.get("bf16_TFLOPs"),
        target=0.60,
    )
    return {"TFLOPs": out, "best": best[1]}


def _rows(ctx, dtype):
    return ctx.randn(ctx.tokens, ctx.d, dtype=dtype, shift=0.01)


def section_compile_peers(run, ctx):
    """torch.compile of the twins, the last peer column (compilation takes a while)."""
    torch = ctx.torch
    if not ctx.cuda:
        return {"_status": "skipped", "reason": "no CUDA"}
    from fused_stats.ops import torch_twin

    out = {}
    name, g, mask, unit = _capture_cases(ctx)[1]
    c = _centre(ctx, g)
    cap = torch.compile(torch_twin.capture_reduce)
    t = time.time()
    cap(g, mask, c, unit)
    out["capture_compile_s"] = time.time() - t
    out["capture_compiled_ms"] = bench(lambda: cap(g, mask, c, unit), run)
    run.row("peers", f"capture {name}: torch.compile(twin) ms", out["capture_compiled_ms"], "ms")
    rows = _rows(ctx, torch.bfloat16)
    S = torch.zeros(ctx.d, ctx.d, dtype=torch.float64, device=ctx.device)
    sm = torch.compile(torch_twin.second_moment_update)
    t = time.time()
    sm(S, rows)
    out["second_moment_compile_s"] = time.time() - t
    out["second_moment_compiled_ms"] = bench(lambda: sm(S, rows), run)
    run.row(
        "peers", "second moment bf16 rows: torch.compile(twin) ms", out["second_moment_compiled_ms"], "ms"
    )
    return out


# ---------------------------------------------------------------------------- weight streaming
def _wall(fn, reps, cuda):
    """Median seconds of ``fn()`` over ``reps`` calls (synchronised on a GPU)."""
    import statistics

    import torch

    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _llama(run, ctx, tokens, blocks):
    """``(model, batch, sizes)``: a LLaMA-shaped model (LLaMA-3-8B's widths, ``blocks`` blocks, bf16,
    on the host) and one batch of ``tokens`` random tokens on the device; a dry run: a tiny fp32 one."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if run.args.dry_run:
        hidden, ff, heads, kv, blocks, seq, vocab, tokens = 64, 160, 4, 2, 3, 32, 128, 128
    else:
        hidden, ff, heads, kv, seq, vocab = 4096, 14336, 32, 8, 4096, 32000
    batch_size = max(tokens // seq, 1)
    dtype = torch.bfloat16 if ctx.cuda and not run.args.dry_run else torch.float32
    cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ff,
        num_hidden_layers=blocks,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=seq,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ids = torch.randint(0, vocab, (batch_size, seq), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids.to(ctx.device),
        "attention_mask": torch.ones_like(ids).to(ctx.device),
        "labels": ids.to(ctx.device),
    }
    sizes = {"tokens": batch_size * seq, "blocks": blocks, "hidden": hidden, "dtype": str(dtype)}
    return model, batch, sizes


def section_probe_overhead(run, ctx):
    """One probe step (``Probe.step``: forward, the activation-only backward, the accumulators) against
    one training step (forward and the full backward, weight gradients included) of the same
    LLaMA-shaped model on the device, a quarter of --tokens a batch; medians of interleaved rounds."""
    import statistics

    import fused_stats as fs

    model, batch, out = _llama(run, ctx, max(1, ctx.tokens // 4), run.args.stream_blocks)
    model = model.to(ctx.device)
    probe = fs.Probe(model)

    def train_step():
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    def probe_step():
        probe.step(batch, fs.causal_lm_loss)

    rounds = 1 if run.args.dry_run else 5
    train_step(), probe_step()  # warm-up: kernels compiled, allocator primed
    times = {"train": [], "probe": []}
    for _ in range(rounds):
        times["train"].append(_wall(train_step, 1, ctx.cuda))
        times["probe"].append(_wall(probe_step, 1, ctx.cuda))
    train, step = statistics.median(times["train"]), statistics.median(times["probe"])
    model.zero_grad(set_to_none=True)
    out.update(train_step_s=train, probe_step_s=step, ratio=step / train, rounds=rounds)
    run.row(
        "probe overhead",
        "probe step / training step",
        step,
        "s",
        train,
        note=f"{out['tokens']} tokens, {out['blocks']} blocks, {out['dtype']}; train {train:.3f} s",
    )
    return out


def section_stream(run, ctx):
    """fs.stream_blocks on a LLaMA-shaped bf16 model with its weights in pinned host memory:
    achieved host-to-device GB/s of one block's materialisation against a measured pinned copy of
    the same bytes, and the streamed / in-memory probe step ratio at --tokens tokens a batch
    (target <= 1.2 with prefetch). Dry run: a tiny fp32 model on CPU, streamed from the module and
    from a sharded checkpoint folder (its statistics against the in-memory ones are a gpu test)."""
    import copy
    import tempfile

    import torch

    import fused_stats as fs

    dry, cuda = run.args.dry_run, ctx.cuda
    host_model, batch, out = _llama(run, ctx, ctx.tokens, run.args.stream_blocks)
    batch_size, seq = batch["input_ids"].shape
    blocks = out["blocks"]
    reps = 1 if dry else 3

    device_model = copy.deepcopy(host_model).to(ctx.device)
    reference = fs.Probe(device_model)
    t_memory = _wall(lambda: reference.step(batch, fs.causal_lm_loss), reps, cuda)
    del device_model
    if cuda:
        torch.cuda.empty_cache()
        for p in host_model.parameters():  # the weights sit in pinned host memory
            p.data = p.data.pin_memory()
    sources = {"host": host_model}
    tmp = None
    if dry:  # also a sharded folder (reading, the prefetch thread)
        tmp = tempfile.TemporaryDirectory()
        host_model.save_pretrained(tmp.name, max_shard_size="100KB")
        sources["folder"] = tmp.name
    try:
        for name, source in sources.items():
            with fs.stream_blocks(source, device=ctx.device, prefetch=1) as st:
                probe = fs.Probe(st.model)
                t_stream = _wall(lambda probe=probe: probe.step(batch, fs.causal_lm_loss), reps, cuda)
                out[f"{name}_step_s"] = t_stream
                out[f"{name}_peak_over_block"] = st.peak_resident_bytes / st.block_bytes
                run.row(
                    "stream",
                    f"streamed/in-memory step ({name})",
                    t_stream,
                    "s",
                    t_memory,
                    note=f"target <= 1.2; {batch_size * seq} tokens, {blocks} blocks",
                )
                if cuda:
                    nbytes = st.block_bytes
                    t_block = _wall(lambda: st._materialise(1), reps, cuda)
                    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    t_copy = _wall(lambda pinned=pinned: pinned.to(ctx.device, non_blocking=True), reps, cuda)
                    out[f"{name}_h2d_GBps"] = nbytes / t_block / 1e9
                    out["pinned_copy_GBps"] = nbytes / t_copy / 1e9
                    run.row(
                        "stream",
                        f"block H2D GB/s ({name})",
                        nbytes / t_block / 1e9,
                        "GB/s",
                        nbytes / t_copy / 1e9,
                        note="vs a pinned copy of one block's bytes",
                    )
    finally:
        if tmp is not None:
            tmp.cleanup()
    out["in_memory_step_s"] = t_memory
    out["_status"] = "ok"
    return out


# name, function, kind: "core" always runs, "optional" is skipped past --budget-s, "sweep" and
# "compile" only with --sweeps / --compile-peers (heavy: left out of the first command)
SECTIONS = [
    ("env", section_env, "core"),
    ("ceilings", section_ceilings, "core"),
    ("capture_speed", section_capture_speed, "core"),
    ("second_moment", section_second_moment, "core"),
    ("gram", section_gram, "core"),
    ("cross", section_cross, "core"),
    ("probe_overhead", section_probe_overhead, "core"),
    ("stream", section_stream, "optional"),
    ("capture_sweep", section_capture_sweep, "sweep"),
    ("syrk_sweep", section_syrk_sweep, "sweep"),
    ("compile_peers", section_compile_peers, "compile"),
]
# per-section wall-clock limits of the child processes (seconds); the gpu tests compile the kernels
# first, and Triton's on-disk cache serves the sections
TIMEOUT_S = {"stream": 240, "compile_peers": 300, "capture_sweep": 240, "syrk_sweep": 240}
DEFAULT_TIMEOUT_S = 150


# ---------------------------------------------------------------------------- the gpu tests
# pytest hooks: this module is loaded into the tests' pytest process as a plugin (``-p gpu_check``)
# and logs each test's start and reports as JSON lines, flushed at once, so that a crash or a hang
# still leaves which test was running
def _log_event(**event):
    path = os.environ.get("GPU_CHECK_TEST_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def pytest_collection_finish(session):
    _log_event(event="collected", nodeids=[item.nodeid for item in session.items])


def pytest_runtest_logstart(nodeid, location):
    _log_event(event="start", nodeid=nodeid, t=time.time())


def pytest_runtest_logreport(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    else:
        message = report.longreprtext[-1500:] if report.failed else ""
    _log_event(
        event="report", nodeid=report.nodeid, when=report.when, outcome=report.outcome, message=message
    )


def _read_log(path: Path):
    """(collected nodeids, {nodeid: outcome and message}, the nodeid started last and not finished)."""
    collected, results, running = [], {}, None
    if not path.exists():
        return collected, results, running
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if e["event"] == "collected":
            collected = e["nodeids"]
        elif e["event"] == "start":
            running = (e["nodeid"], e["t"])
        elif e["event"] == "report":
            entry = results.setdefault(e["nodeid"], {"outcome": "passed", "message": ""})
            # a failed setup or teardown is the test's error; a skip in setup its skip
            if e["outcome"] == "failed":
                entry.update(outcome="failed" if e["when"] == "call" else "error", message=e["message"])
            elif e["outcome"] == "skipped" and entry["outcome"] == "passed":
                entry.update(outcome="skipped", message=e["message"])
            if e["when"] == "teardown" and running and running[0] == e["nodeid"]:
                running = None
    return collected, results, running


def _pytest_once(args, log: Path, deselect, deadline: float):
    """One pytest process over the gpu tests, watched: killed when a test runs past --test-timeout or
    the phase past ``deadline``. Returns (how it ended, the test it was killed in, its output)."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "--tb=short", "-p", "no:cacheprovider"]
    cmd += ["-p", "gpu_check", *args.tests]
    for nodeid in deselect:
        cmd += ["--deselect", nodeid]
    env = dict(os.environ, GPU_CHECK_TEST_LOG=str(log))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        killed = None
        while proc.poll() is None:
            time.sleep(0.2)
            _, _, running = _read_log(log)
            now = time.time()
            if running and now - running[1] > args.test_timeout:
                killed = (running[0], f"hung: killed after --test-timeout {args.test_timeout:g} s")
            elif now > deadline:
                killed = (
                    running[0] if running else None,
                    "killed: the tests' time (--tests-timeout) ran out",
                )
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)  # pytest and anything it started
                proc.wait()
        output.seek(0)
        text = output.read()
    if killed:
        return killed[1], killed[0], text
    rc = proc.returncode
    if rc < 0:
        return f"crashed (signal {-rc})", None, text
    return rc, None, text


def run_gpu_tests(run, args, deadline: float) -> None:
    """The ``gpu`` tests in a pytest child process; a test that crashes the process or hangs is
    recorded and the rest run again without it (and without those already done)."""
    start = time.time()
    print(f"[{start - T0:6.1f}s] gpu_tests (pytest -m gpu {' '.join(args.tests)}) ...", flush=True)
    results: dict = {}
    collected: list = []
    entry: dict = {"status": "ok", "command": f"pytest -m gpu {' '.join(args.tests)}"}
    if importlib.util.find_spec("pytest") is None:
        entry.update(status="error", error="pytest is not installed (pip install pytest): no gpu test ran")
        print(f"    error: {entry['error']}", flush=True)
        run.row("gpu tests", "not run", None, note=entry["error"], ok=False)
        run.sections["gpu_tests"] = entry
        run.write()
        return
    with tempfile.TemporaryDirectory(prefix="gpu_tests_") as tmp:
        for attempt in range(args.max_restarts + 1):
            log = Path(tmp) / f"log{attempt}.jsonl"
            ended, killed_in, output = _pytest_once(args, log, list(results), deadline)
            got, new, running = _read_log(log)
            collected = collected or got
            results.update(new)
            victim = killed_in or (running[0] if running else None)
            if isinstance(ended, int):  # pytest exited by itself: 0 passed, 1 failed, 5 none selected
                if ended not in (0, 1, 5) or not collected:
                    entry.update(
                        status="error", error=f"pytest exit code {ended}", output_tail=output[-3000:]
                    )
                break
            if victim is None:  # died outside any test (collection, start-up)
                entry.update(
                    status="error", error=f"pytest {ended} outside a test", output_tail=output[-3000:]
                )
                break
            results[victim] = {
                "outcome": "crashed" if ended.startswith("crashed") else "hung",
                "message": ended,
            }
            print(f"    {victim}: {ended}", flush=True)
            if time.time() > deadline:
                break
        else:
            entry.update(status="error", error=f"stopped after {args.max_restarts} restarts")
    for nodeid in collected:
        results.setdefault(nodeid, {"outcome": "not run", "message": "the tests' time ran out"})
    counts = {k: sum(r["outcome"] == k for r in results.values()) for k in ("passed", "skipped")}
    bad = {n: r for n, r in results.items() if r["outcome"] not in ("passed", "skipped")}
    reasons: dict = {}
    for r in results.values():
        if r["outcome"] == "skipped":
            reasons[r["message"]] = reasons.get(r["message"], 0) + 1
    entry.update(collected=len(collected), **counts, not_passed=bad, skip_reasons=reasons, results=results)
    if bad and entry["status"] == "ok":
        entry.update(status="error", error=f"{len(bad)} of {len(collected)} gpu tests did not pass")
    elif entry["status"] == "ok" and not counts["passed"]:
        if args.dry_run:  # a CPU machine skips them all: nothing measured, nothing wrong
            entry.update(status="skipped", reason=f"{counts['skipped']} gpu tests collected, all skipped")
        else:
            entry.update(status="error", error="no gpu test passed")
    summary = ", ".join(f"{v} {k}" for k, v in counts.items()) + f", {len(bad)} not passed"
    ok = None if entry["status"] == "skipped" else not bad and counts["passed"] > 0
    run.row("gpu tests", f"{len(collected)} collected", None, note=summary, ok=ok)
    for nodeid, r in bad.items():
        last = (r["message"].strip().splitlines() or [""])[-1]
        run.row("gpu tests", nodeid.split("::", 1)[-1], None, note=f"{r['outcome']}: {last[:150]}", ok=False)
        print(f"    {r['outcome']}: {nodeid}: {last[:300]}", flush=True)
    entry["seconds"] = round(time.time() - start, 2)
    run.sections["gpu_tests"] = entry
    run.write()


def _timeouts(args) -> dict:
    out = dict(TIMEOUT_S)
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        out[name] = float(seconds)
    return out


def _child_main(args) -> int:
    """Run the one section ``args.child`` in this process (the parent's options and the peers of the
    sections before it come from ``--child-dir``); its result goes to ``<dir>/<name>.json``."""
    import torch

    child_dir = Path(args.child_dir)
    run = Run(args, child_dir / f"{args.child}.json")
    peers_file = child_dir / "peers.json"
    if peers_file.exists():
        run.peers.update(json.loads(peers_file.read_text()))
    ctx = Ctx(args)
    ctx.peers = run.peers
    fn = dict((n, f) for n, f, _ in SECTIONS)[args.child]
    run.section(args.child, lambda r: fn(r, ctx))
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # an asynchronous CUDA error surfaces here, inside the section's time
    return 0


def _run_child(run, name: str, child_dir: Path, timeout: float) -> None:
    """Section ``name`` in a child process: its entry, rows and peers merged into ``run``; a crash,
    a hang (killed at ``timeout``) or a missing result is that section's error, with whatever
    cases it had finished."""
    (child_dir / "peers.json").write_text(json.dumps(run.peers, default=_json_default))
    result = child_dir / f"{name}.json"
    result.unlink(missing_ok=True)
    argv = [arg for arg in sys.argv[1:]]
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        *argv,
        "--child",
        name,
        "--child-dir",
        str(child_dir),
    ]
    start = time.time()
    print(f"[{start - T0:6.1f}s] {name} (child process, timeout {timeout:.0f} s) ...", flush=True)
    error = None
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
        output, _ = proc.communicate()
        error = f"timed out after {timeout:.0f} s (killed)"
    if error is None and proc.returncode != 0:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
        error = f"child process died ({how})"
    for line in (output or "").splitlines():
        if not line.startswith("["):  # the child's own progress lines are the parent's already
            print(f"    | {line}", flush=True)
    doc = {}
    if result.exists():
        try:
            doc = json.loads(result.read_text())
        except ValueError:
            doc = {}
    entry = dict(doc.get("sections", {}).get(name, {}))
    if error is not None:
        entry.update(status="error", error=error, output_tail=(output or "")[-3000:])
    elif not entry:
        entry = {
            "status": "error",
            "error": "the child wrote no result",
            "output_tail": (output or "")[-3000:],
        }
    entry["seconds"] = round(time.time() - start, 2)
    run.sections[name] = entry
    run.table.extend(doc.get("table", []))
    run.peers.update(doc.get("peers", {}))
    if entry.get("status") == "error":
        print(f"    error: {entry.get('error')}", flush=True)
    run.write()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run and not os.environ.get("TRITON_INTERPRET"):
        # must be set before Triton is imported when there is no GPU (harmless with one: the
        # kernels pick the compiled path for CUDA tensors); children inherit it
        os.environ["TRITON_INTERPRET"] = "1"
    if args.child:
        return _child_main(args)
    import torch

    path = out_path(args)
    run = Run(args, path)
    if not torch.cuda.is_available() and not args.dry_run:
        msg = "no CUDA device: this check needs a GPU (use --dry-run to check the script on CPU)"
        print(msg)
        run.meta["error"] = msg
        run.write()
        return 1
    if args.dry_run:
        print(
            "dry run: tiny sizes"
            + (
                ""
                if torch.cuda.is_available()
                else ", no CUDA: gpu tests skipped, kernels through Triton's interpreter, timings meaningless"
            )
        )
    skip = {x for x in args.skip.split(",") if x}
    unknown = skip - {name for name, _, _ in SECTIONS} - {"gpu_tests"}
    if unknown:
        print(f"unknown sections in --skip: {sorted(unknown)}")
        return 2
    timeouts = _timeouts(args)
    if args.max_s is None:
        args.max_s = math.inf if args.dry_run else 480.0
    if "gpu_tests" in skip:
        run.sections["gpu_tests"] = {"status": "skipped", "reason": "--skip"}
    else:
        run_gpu_tests(run, args, deadline=min(time.time() + args.tests_timeout, T0 + args.max_s - 20))
    ctx = None
    if args.in_process:
        ctx = Ctx(args)
        ctx.peers = run.peers
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as child_dir:
        for name, fn, kind in SECTIONS:
            reason = None
            if name in skip:
                reason = "--skip"
            elif kind == "sweep" and not args.sweeps:
                reason = "heavy: run with --sweeps"
            elif kind == "compile" and not args.compile_peers:
                reason = "heavy: run with --compile-peers"
            elif kind == "optional" and time.time() - T0 > args.budget_s:
                reason = f"time budget {args.budget_s:.0f}s"
            elif args.max_s - (time.time() - T0) < 20:
                reason = f"out of time (--max-s {args.max_s:.0f})"
            if reason:
                run.sections[name] = {"status": "skipped", "reason": reason}
                run.write()
                continue
            if args.in_process:
                run.section(name, lambda r, fn=fn: fn(r, ctx))
            else:
                left = args.max_s - (time.time() - T0)
                _run_child(run, name, Path(child_dir), min(timeouts.get(name, DEFAULT_TIMEOUT_S), left))
    run.meta["elapsed_s"] = round(time.time() - T0, 1)
    run.write()
    run.print_table()
    errors = [n for n, s in run.sections.items() if s.get("status") == "error"]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
