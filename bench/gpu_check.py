#!/usr/bin/env python3
"""One prepared GPU check of the fused kernels (docs/design.md, section 8).

Run on a CUDA machine (written for an H200) from the repository root; the first command::

    python3 bench/gpu_check.py                # at most 8 minutes (--max-s 480): every section below
    python3 bench/gpu_check.py --dry-run      # no GPU needed: tiny sizes through the interpreter
    python3 bench/gpu_check.py --sweeps --compile-peers   # then, if time is left: the heavy extras

It measures, in one run and side by side:

* preflight (first): versions of Triton, torch, CUDA and the driver, the Triton internals the
  package's compatibility shim lacks, and a tiny JIT launch of every kernel variant (fp64 MMAs,
  the pool's mixed fp32 x fp64 Gram, the two-pass capture, ``T < 16`` samples, stage 1, split-K,
  both cross units), each in its own try, checked against its torch twin;
* ceilings: copy bandwidth (``torch.clone`` of a tensor of the capture input's size, bytes read +
  written) and dense matmul rates (bf16, TF32, fp64; 8192^3 / 4096^3 products);
* correctness of every kernel against its torch twin (fp64) at realistic sizes, and the cases that
  only compiled code shows: the two-pass capture forced at d = 4096 and natural at d = 12288, an
  odd d, a feature-strided input, inputs past 2^31 elements checked by additivity (the full input
  against the sum of its halves, for the capture sums and ``S``), the bf16 second moment's mean
  signed diagonal error (plain and split-K: a rounding bias of long fp32 chains would show there)
  and bitwise repeats (each op twice, ``torch.equal``);
* medians of ``triton.testing.do_bench`` for each kernel, with the torch twin in eager mode as the
  peer column (``torch.compile`` peers with ``--compile-peers``);
* targets: capture-reduce >= 85 % of the measured copy bandwidth (bytes it must move, see
  bench/KERNELS.md); second moment from bf16 rows >= 60 % of the measured bf16 matmul rate, counting
  the triangle's FLOPs ``d (d + 1) R``. fp32 rows use tf32x3 (three TF32 MMAs per product), whose
  ceiling is a third of the measured TF32 rate; it is reported against that, with no target.

Failure isolation: every section runs in its own child process with its own timeout
(:data:`TIMEOUT_S`, ``--timeout NAME=SECONDS``), so a CUDA illegal-address error, a crash or a hang
ends that section only; inside a section each dtype or case has its own try. No section starts
after ``--max-s`` seconds (default 480: the first command stays within 8 minutes) and each child's
timeout is cut to the time left. The JSON is rewritten
after every section (``$OUT/gpu_check.json`` when ``OUT`` is set, else
``bench/results/gpu_check.json``, or ``--out DIR``; a dry run writes ``gpu_check_dry_run.json``)
and a table is printed last. Sections marked optional are skipped once ``--budget-s`` seconds
(default 420) have passed. ``--skip a,b`` leaves sections out; ``--in-process`` runs them all in
this process (no isolation; for debugging). ``--inject-failure SECTION[.CASE]:KIND`` (KIND =
``raise``, ``crash``, ``hang``) makes a section or one case fail on purpose: the test of the
isolation uses it.
The weight-streamed probe step (``stream`` section): LLaMA-shaped bf16 model with its weights in
pinned host memory, block host-to-device GB/s against a pinned copy, streamed / in-memory step ratio.
"""

from __future__ import annotations

import argparse
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
        help="tiny sizes; on a machine without CUDA, through Triton's interpreter, no timing",
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
    p.add_argument("--skip", default="", help="comma-separated sections to leave out")
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
            "isolation": "in-process" if args.in_process else "one child process per section",
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
def rel_err(got, want) -> float:
    """max |got - want| / max |want| (fp64)."""
    import torch

    got = got.to(torch.float64)
    want = want.to(torch.float64)
    scale = float(want.abs().max()) if want.numel() else 0.0
    return float((got - want).abs().max()) / scale if scale > 0 else float((got - want).abs().max())


def bench(fn, run) -> float | None:
    """Median milliseconds from triton.testing.do_bench, or None when not timing (dry run on CPU)."""
    import torch

    if not torch.cuda.is_available():
        return None
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
            self.tokens, self.d = 96, 40
        else:
            self.tokens, self.d = args.tokens, args.d
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
        out["note"] = "no CUDA device: correctness through the interpreter at tiny sizes, no timing"
    return out


def section_ceilings(run, ctx):
    torch = ctx.torch
    if not ctx.cuda:
        return {"_status": "skipped", "reason": "no CUDA"}
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
    m = 8192
    out = {"clone_GBps": copy, "copy_GBps": copy_}
    for name, dtype, tf32, size in (
        ("bf16", torch.bfloat16, False, m),
        ("tf32", torch.float32, True, m),
        ("fp64", torch.float64, False, 4096),
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


def _capture_check(ctx, g, mask, unit, tol=2e-5, **config):
    """capture_reduce against its twin (fp64): the errors and whether all are within ``tol``."""
    torch = ctx.torch
    from fused_stats.kernels import capture_reduce
    from fused_stats.kernels._common import override_config
    from fused_stats.ops import torch_twin

    c = _centre(ctx, g)
    with override_config(**config):
        got = capture_reduce(g, mask, c, unit)
    want = torch_twin.capture_reduce(g, mask, c, unit)
    errs = {"n_equal": got.n == want.n, "valid_equal": bool(torch.equal(got.valid, want.valid))}
    for key in ("rows", "s", "t", "a1", "a2", "norm_max", "norm_sum"):
        errs[key] = rel_err(getattr(got, key), getattr(want, key))
    worst = max(v for v in errs.values() if isinstance(v, float))
    ok = errs["n_equal"] and errs["valid_equal"] and worst < tol
    if ctx.cuda:
        torch.cuda.empty_cache()
    return {**errs, "max_rel_err": worst, "shape": list(g.shape), "strides": list(g.stride()), "ok": ok}


def section_capture_correctness(run, ctx):
    out = {}
    for name, g, mask, unit in _capture_cases(ctx):

        def one(g=g, mask=mask, unit=unit, name=name):
            entry = _capture_check(ctx, g, mask, unit)
            run.row(
                "capture correctness",
                f"{name} max rel err",
                entry["max_rel_err"],
                note="tol 2e-5, n and valid equal",
                ok=entry["ok"],
            )
            return entry

        run.case(out, name, one)
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def section_capture_speed(run, ctx):
    torch = ctx.torch
    if not ctx.cuda:
        return {"_status": "skipped", "reason": "no CUDA"}
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
    torch = ctx.torch
    from fused_stats.kernels import second_moment_update
    from fused_stats.ops import torch_twin

    out = {}
    d, R = ctx.d, ctx.tokens
    flops = d * (d + 1) * R
    for label, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):

        def one(label=label, dtype=dtype):
            rows = _rows(ctx, dtype)
            S0 = torch.zeros(d, d, dtype=torch.float64, device=ctx.device)
            S = S0.clone()
            second_moment_update(S, rows)
            want = S0.clone()
            torch_twin.second_moment_update(want, rows)
            err = rel_err(S, want)
            sym = bool(torch.equal(S, S.T))
            entry = {"rel_err": err, "symmetric": sym, "ok": err < 2e-5 and sym}
            run.row(
                "second moment correctness",
                f"{label} rows max rel err",
                err,
                note="tol 2e-5, " + ("symmetric" if sym else "NOT symmetric"),
                ok=entry["ok"],
            )
            if ctx.cuda:
                ms = bench(lambda: second_moment_update(S, rows), run)
                ms_twin = bench(lambda: torch_twin.second_moment_update(want, rows), run)
                rate = flops / (ms * 1e-3) / 1e12
                entry.update(ms=ms, twin_eager_ms=ms_twin, TFLOPs_triangle=rate)
                if label == "bf16":
                    ref = ctx.peers.get("bf16_TFLOPs")
                    full = bench(lambda: torch.mm(rows.T, rows), run)  # full d x d, bf16 out
                    entry["torch_bf16_full_gemm_ms"] = full
                    run.row(
                        "second moment speed",
                        "bf16 rows TFLOP/s (triangle)",
                        rate,
                        "TFLOP/s",
                        reference=ref,
                        target=0.60,
                        note=f"{ms:.3f} ms; torch bf16 full GEMM {full:.3f} ms; twin fp64 {ms_twin:.1f} ms",
                    )
                else:
                    tf32 = ctx.peers.get("tf32_TFLOPs")
                    ceiling = tf32 / 3 if tf32 else None
                    run.row(
                        "second moment speed",
                        "fp32 rows (tf32x3) TFLOP/s (triangle)",
                        rate,
                        "TFLOP/s",
                        reference=ceiling,
                        note=f"reference = TF32 matmul / 3; {ms:.3f} ms",
                    )
                    entry["tf32x3_ceiling_TFLOPs"] = ceiling
                torch.cuda.empty_cache()
            return entry

        run.case(out, label, one)
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def section_gram(run, ctx):
    torch = ctx.torch
    from fused_stats.kernels import gram_rows
    from fused_stats.ops import torch_twin

    out = {}
    d = ctx.d
    n_pool = max(2, int(d * 0.61))  # about the auto pool's size limit (no multiple of 16)
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
            got = gram_rows(new, pool)
            want = torch_twin.gram_rows(new, pool)
            err = rel_err(got, want)
            tol = 1e-12 if f64 in (new_dtype, pool_dtype) else 2e-5
            entry = {"rel_err": err, "ok": err < tol, "shape": [64, n_pool, d]}
            run.row("gram correctness", f"{label} max rel err", err, note=f"tol {tol:g}", ok=entry["ok"])
            if ctx.cuda:
                ms = bench(lambda: gram_rows(new, pool), run)
                ms_twin = bench(lambda: torch_twin.gram_rows(new, pool), run)
                entry.update(ms=ms, twin_eager_ms=ms_twin, TFLOPs=2 * 64 * n_pool * d / (ms * 1e-3) / 1e12)
                run.row("gram speed", f"{label} ms", ms, "ms", note=f"twin eager {ms_twin:.3f} ms")
            return entry

        run.case(out, label, one)
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def section_cross(run, ctx):
    """The cross-gradient kernel against its twin, both units, and its speed."""
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
            got = cross.cross_reduce(*args)
            want = cross_twin.cross_reduce(*args)
            errs = {
                k: rel_err(getattr(got, k), getattr(want, k))
                for k in ("c_sum", "sq_norm_sum", "u2", "u3", "u4")
            }
            counts = all(getattr(got, k) == getattr(want, k) for k in ("n", "p2", "p3", "p4"))
            worst = max(errs.values())
            entry = {**errs, "counts_equal": counts, "ok": counts and worst < 1e-4}
            run.row(
                "cross correctness",
                f"{unit} max rel err",
                worst,
                ok=entry["ok"],
                note="tol 1e-4 (fp32 products), counts equal" if counts else "COUNTS DIFFER",
            )
            if ctx.cuda:
                ms = bench(lambda: cross.cross_reduce(*args), run)
                ms_twin = bench(lambda: cross_twin.cross_reduce(*args), run)
                # extra memory while one call runs: phi(W_in z) must exist only per chunk in the kernel
                peak = {}
                for who, fn in (("kernel", cross.cross_reduce), ("twin", cross_twin.cross_reduce)):
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                    base = torch.cuda.memory_allocated(ctx.device)
                    fn(*args)
                    torch.cuda.synchronize()
                    peak[who] = (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**20
                # the two GEMMs over counted positions (phi = Z W_in^T, then Q^T Phi), tf32x3 products
                tflops = 4 * int(mask.sum()) * d * r / (ms * 1e-3) / 1e12
                entry.update(ms=ms, twin_eager_ms=ms_twin, peak_extra_MiB=peak, gemm_TFLOPs=tflops)
                run.row(
                    "cross speed",
                    f"{unit} ms",
                    ms,
                    "ms",
                    note=f"twin eager {ms_twin:.3f} ms; {tflops:.1f} TFLOP/s in the 2 GEMMs; extra "
                    f"memory {peak['kernel']:.0f} MiB (twin {peak['twin']:.0f} MiB)",
                )
            return entry

        run.case(out, unit, one)
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


# ---------------------------------------------------------------------------- preflight
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


def _tiny_launches(ctx):
    """(label, fn) per kernel variant: ``fn()`` launches it at a tiny size and returns its largest
    relative error against the twin and the tolerance."""
    torch = ctx.torch
    from fused_stats.kernels import capture_reduce, cross, gram_rows, second_moment_update
    from fused_stats.kernels._common import override_config
    from fused_stats.ops import cross_twin, torch_twin

    bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64

    def capture(dtype, B, T, d, unit, **config):
        def fn():
            g = ctx.randn(B, T, d, dtype=dtype, shift=0.3)
            c = torch.zeros(d, dtype=f64, device=ctx.device)
            with override_config(**config):
                got = capture_reduce(g, None, c, unit)
            want = torch_twin.capture_reduce(g, None, c, unit)
            err = max(
                rel_err(getattr(got, k), getattr(want, k)) for k in ("rows", "s", "t", "a1", "norm_max")
            )
            return err, 1e-9 if dtype == f64 else 1e-4

        return fn

    def syrk(dtype, **config):
        def fn():
            rows = ctx.randn(100, 48, dtype=dtype)
            S = torch.zeros(48, 48, dtype=f64, device=ctx.device)
            with override_config(**config):
                second_moment_update(S, rows)
            want = torch.zeros_like(S)
            torch_twin.second_moment_update(want, rows)
            return rel_err(S, want), 1e-9 if dtype == f64 else 1e-4

        return fn

    def gram(a, b):
        def fn():
            new, pool = ctx.randn(5, 40, dtype=a), ctx.randn(19, 40, dtype=b)
            return rel_err(gram_rows(new, pool), torch_twin.gram_rows(new, pool)), 1e-9 if f64 in (
                a,
                b,
            ) else 1e-4

        return fn

    def cross_case(dtype, unit):
        def fn():
            grad, act = ctx.randn(3, 5, 24, dtype=dtype), ctx.randn(3, 5, 20, dtype=dtype)
            w = ctx.randn(4, 20, dtype=f64 if dtype == f64 else f32, scale=0.2)
            got = cross.cross_reduce(grad, act, None, w, "gelu", unit)
            want = cross_twin.cross_reduce(grad, act, None, w, "gelu", unit)
            return rel_err(got.c_sum, want.c_sum), 1e-9 if dtype == f64 else 1e-4

        return fn

    d_two = 2 * (64 if not ctx.cuda else 2048)
    return [
        ("capture_bf16_position", capture(bf16, 2, 3, 40, "position")),
        ("capture_fp64_position", capture(f64, 2, 3, 40, "position")),
        ("capture_two_pass", capture(bf16, 2, 3, d_two, "position", capture_single_chunk_max_d=d_two // 2)),
        ("capture_sample_t_lt_16", capture(bf16, 3, 5, 40, "sample")),
        ("capture_sample_stage1", capture(bf16, 2, 40, 40, "sample")),
        ("syrk_bf16", syrk(bf16)),
        ("syrk_fp32", syrk(f32)),
        ("syrk_fp64", syrk(f64)),
        ("syrk_bf16_split_k", syrk(bf16, syrk_splits=3)),
        ("gram_bf16", gram(bf16, bf16)),
        ("gram_fp32", gram(f32, f32)),
        ("gram_fp64", gram(f64, f64)),
        ("gram_fp32_x_fp64", gram(f32, f64)),
        ("cross_sample_bf16", cross_case(bf16, "sample")),
        ("cross_position_bf16", cross_case(bf16, "position")),
        ("cross_sample_fp64", cross_case(f64, "sample")),
        ("cross_position_fp64", cross_case(f64, "position")),
    ]


def section_preflight(run, ctx):
    """Versions, the Triton internals the shim lacks, and one tiny launch of every kernel variant
    (each in its own try: the first JIT compilation of each happens here, so a variant that does not
    compile on this stack is named before the long sections start)."""
    torch = ctx.torch
    import triton

    from fused_stats.kernels import _triton_compat

    out = {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": _driver_version() if ctx.cuda else None,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu (interpreter)",
    }
    try:
        out["missing_internals"] = _triton_compat.missing_internals(aot=False)
    except Exception as exc:
        out["missing_internals"] = [f"the check itself failed: {type(exc).__name__}: {exc}"]
    run.row(
        "preflight",
        f"triton {out['triton']}, torch {out['torch']}, CUDA {out['cuda']}, driver {out['driver']}",
        None,
        note="missing internals: " + ("; ".join(out["missing_internals"]) or "none"),
        ok=not out["missing_internals"],
    )
    launches = {}
    for label, fn in _tiny_launches(ctx):

        def one(fn=fn, label=label):
            t = time.time()
            err, tol = fn()
            if ctx.cuda:
                torch.cuda.synchronize()
            entry = {"rel_err": err, "tol": tol, "ok": err < tol, "seconds": round(time.time() - t, 2)}
            run.row(
                "preflight", f"launch {label}", err, note=f"tol {tol:g}; {entry['seconds']} s", ok=entry["ok"]
            )
            return entry

        run.case(launches, label, one)
    out["launches"] = launches
    failed = [k for k, v in launches.items() if not v.get("ok")]
    out["all_ok"] = not failed and not out["missing_internals"]
    if failed:
        out["_status"] = "error"
        out["error"] = f"variants failed: {', '.join(failed)}"
    return out


# ---------------------------------------------------------------------------- compiled-only cases
def section_capture_two_pass(run, ctx):
    """The two-pass (wide-row) capture path: forced at d = 4096 (below its natural threshold),
    and at d = 12288 where the launcher takes it by itself."""
    torch = ctx.torch
    out = {}
    rows_budget = max(8, ctx.tokens // 4)
    if ctx.cuda:
        cases = (("forced_d4096", 4096, {"capture_single_chunk_max_d": 2048}), ("d12288", 12288, {}))
    else:  # the interpreter's single-chunk limit is 64
        cases = (("forced_d40", ctx.d, {"capture_single_chunk_max_d": 16}), ("d70", 70, {}))
    for label, d, config in cases:

        def one(d=d, config=config, label=label):
            T = 8
            B = max(1, rows_budget // T)
            g = ctx.randn(B, T, d, dtype=torch.bfloat16, shift=0.5)
            mask = torch.rand(B, T, generator=ctx.gen, device=ctx.device) > 0.1
            entry = {unit: _capture_check(ctx, g, mask, unit, **config) for unit in ("position", "sample")}
            entry["ok"] = all(v["ok"] for v in entry.values())
            worst = max(v["max_rel_err"] for v in entry.values() if isinstance(v, dict))
            run.row(
                "capture two-pass", f"{label} max rel err", worst, note="tol 2e-5, both units", ok=entry["ok"]
            )
            return entry

        run.case(out, label, one)
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def section_capture_layouts(run, ctx):
    """An odd d, and a feature-strided input (every other feature of a wider buffer)."""
    torch = ctx.torch
    out = {}
    d = ctx.d
    B, T = max(1, ctx.tokens // 512), min(512, ctx.tokens)
    if not ctx.cuda:
        B, T = 3, 5
    odd = ctx.randn(B, T, d - 1, dtype=torch.bfloat16, shift=0.5)
    strided = ctx.randn(B, T, 2 * d, dtype=torch.bfloat16, shift=0.5)[:, :, ::2]
    mask = torch.rand(B, T, generator=ctx.gen, device=ctx.device) > 0.1
    for label, g in ((f"odd_d{d - 1}", odd), (f"feature_stride_2_d{d}", strided)):

        def one(g=g, label=label):
            entry = {unit: _capture_check(ctx, g, mask, unit) for unit in ("position", "sample")}
            entry["ok"] = all(v["ok"] for v in entry.values())
            worst = max(v["max_rel_err"] for v in entry.values() if isinstance(v, dict))
            run.row(
                "capture layouts", f"{label} max rel err", worst, note="tol 2e-5, both units", ok=entry["ok"]
            )
            return entry

        run.case(out, label, one)
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def section_additivity(run, ctx):
    """Inputs past 2^31 elements, which no twin can check at that size in reasonable memory: the
    capture sums and ``S`` of the full input against the sum over its two halves (each below 2^31
    elements, so computed with offsets that cannot wrap). A wrapped int32 offset in the full call
    reads the wrong elements (or faults: this section runs in its own process)."""
    torch = ctx.torch
    from fused_stats.kernels import capture_reduce, second_moment_update

    d = ctx.d
    if ctx.cuda:
        big = 2**31 + 2**26  # elements, just past 2^31
    else:
        big = 4 * 7 * d + 1  # the same logic at a tiny size
    out = {"elements_target": big}
    c = torch.zeros(d, dtype=torch.float64, device=ctx.device)
    fields = ("s", "t", "a1", "a2", "norm_sum")

    # a wrapped offset reads unrelated elements: errors of order one; what the tolerance leaves
    # out is the fp32 rounding of partial sums taken over other partitions of the rows
    def compare(full, halves, tol=1e-4):
        errs = {}
        for k in fields:
            errs[k] = rel_err(getattr(full, k), getattr(halves[0], k) + getattr(halves[1], k))
        errs["norm_max"] = rel_err(full.norm_max, torch.maximum(halves[0].norm_max, halves[1].norm_max))
        n_ok = full.n == halves[0].n + halves[1].n
        return {**errs, "n_equal": n_ok, "ok": n_ok and max(errs.values()) < tol}

    def position():
        T = 2048 if ctx.cuda else 4
        B = -(-big // (T * d))
        g = ctx.randn(B, T, d, dtype=torch.bfloat16, shift=0.3)
        full = capture_reduce(g, None, c, "position")
        del full.rows
        h = B // 2
        halves = []
        for part in (g[:h], g[h:]):
            r = capture_reduce(part, None, c, "position")
            del r.rows
            halves.append(r)
        entry = {"shape": list(g.shape), "elements": g.numel(), **compare(full, halves)}
        # S of the same rows, (B T, d) in bf16: the full call against its two halves
        rows = g.view(-1, d)
        S = torch.zeros(d, d, dtype=torch.float64, device=ctx.device)
        second_moment_update(S, rows)
        S_h = torch.zeros_like(S)
        half = rows.shape[0] // 2
        second_moment_update(S_h, rows[:half])
        second_moment_update(S_h, rows[half:])
        entry["S_rel_err"] = rel_err(S, S_h)
        entry["ok"] = entry["ok"] and entry["S_rel_err"] < 1e-4
        return entry

    def sample_transposed():
        # a sequence-first buffer (T, B, d) viewed as (B, T, d): the position stride is B d, and
        # (T - 1) B d passes 2^31; T < 16, so the row kernel sums the positions itself
        T = 8
        B = -(-big // ((T - 1) * d))
        g = ctx.randn(T, B, d, dtype=torch.bfloat16, shift=0.3).transpose(0, 1)
        full = capture_reduce(g, None, c, "sample")
        h = B // 2
        halves = [capture_reduce(part.contiguous(), None, c, "sample") for part in (g[:h], g[h:])]
        return {"shape": list(g.shape), "elements": g.numel(), **compare(full, halves)}

    for label, fn in (("position_and_S", position), ("sample_T_B_d_transposed", sample_transposed)):

        def one(fn=fn, label=label):
            entry = fn()
            worst = max(v for k, v in entry.items() if isinstance(v, float))
            run.row(
                "additivity > 2^31",
                f"{label} max rel diff",
                worst,
                note=f"{entry['elements']:.3e} elements; full vs sum of halves, tol 1e-4",
                ok=entry["ok"],
            )
            if ctx.cuda:
                torch.cuda.empty_cache()
            return entry

        run.case(out, label, one)
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def section_bf16_bias(run, ctx):
    """The bf16 second moment's mean *signed* relative error on the diagonal (a sum of squares
    over all rows: the longest fp32 accumulation chains), plain and with forced split-K. Random
    rounding averages out; a tensor-core accumulator that rounds one way shows as a mean of the
    same sign as its maximum, at a level the 2e-5 tolerance on the maximum would not flag."""
    torch = ctx.torch
    from fused_stats.kernels import second_moment_update
    from fused_stats.kernels._common import override_config
    from fused_stats.ops import torch_twin

    rows = _rows(ctx, torch.bfloat16)
    want = torch.zeros(ctx.d, ctx.d, dtype=torch.float64, device=ctx.device)
    torch_twin.second_moment_update(want, rows)
    ref = torch.diagonal(want)
    out = {}
    for label, config in (("plain", {}), ("split_k", {"syrk_splits": 8})):

        def one(config=config, label=label):
            S = torch.zeros_like(want)
            with override_config(**config):
                second_moment_update(S, rows)
            e = (torch.diagonal(S) - ref) / ref
            mean, worst = float(e.mean()), float(e.abs().max())
            entry = {
                "mean_signed_rel_err": mean,
                "max_abs_rel_err": worst,
                "ok": abs(mean) < 2e-6 and worst < 2e-5,
            }
            run.row(
                "bf16 S diagonal bias",
                f"{label} mean signed rel err",
                mean,
                note=f"max |rel err| {worst:.2e}; ok: |mean| < 2e-6 and max < 2e-5",
                ok=entry["ok"],
            )
            return entry

        run.case(out, label, one)
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def section_repeat(run, ctx):
    """Bitwise reproducibility: each op twice on the same input, ``torch.equal`` on every output."""
    torch = ctx.torch
    from fused_stats.kernels import capture_reduce, cross, gram_rows, second_moment_update
    from fused_stats.kernels._common import override_config

    out = {}
    name, g, mask, unit = _capture_cases(ctx)[1]
    c = _centre(ctx, g)

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    def capture():
        a, b = (capture_reduce(g, mask, c, unit) for _ in range(2))
        keys = ("rows", "valid", "s", "t", "a1", "a2", "norm_max", "norm_sum")
        return same([getattr(a, k) for k in keys], [getattr(b, k) for k in keys])

    def syrk(**config):
        rows = _rows(ctx, torch.bfloat16)

        def fn():
            out = []
            for _ in range(2):
                S = torch.zeros(ctx.d, ctx.d, dtype=torch.float64, device=ctx.device)
                with override_config(**config):
                    second_moment_update(S, rows)
                out.append(S)
            return torch.equal(*out)

        return fn

    def gram():
        new, pool = ctx.randn(64, ctx.d), ctx.randn(max(2, ctx.d // 2), ctx.d, dtype=torch.float64)
        return torch.equal(gram_rows(new, pool), gram_rows(new, pool))

    def cross_op():
        B, T = (8, 64) if ctx.cuda else (3, 4)
        grad, act = ctx.randn(B, T, ctx.d, dtype=torch.bfloat16), ctx.randn(B, T, ctx.d, dtype=torch.bfloat16)
        w = ctx.randn(8, ctx.d, scale=ctx.d**-0.5)
        ok = True
        for u in ("sample", "position"):
            a, b = (cross.cross_reduce(grad, act, None, w, "gelu", u) for _ in range(2))
            keys = ("c_sum", "sq_norm_sum", "u2", "u3", "u4")
            ok = ok and same([getattr(a, k) for k in keys], [getattr(b, k) for k in keys])
        return ok

    for label, fn in (
        (f"capture_{name}", capture),
        ("second_moment_bf16", syrk()),
        ("second_moment_bf16_split_k", syrk(syrk_splits=8)),
        ("gram_fp32_x_fp64", gram),
        ("cross_both_units", cross_op),
    ):

        def one(fn=fn, label=label):
            equal = bool(fn())
            run.row("bitwise repeat", label, None, note="twice, torch.equal", ok=equal)
            return {"equal": equal, "ok": equal}

        run.case(out, label, one)
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


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


def section_grad_stats(run, ctx):
    """End to end: GradStats(backend="triton") vs backend="torch" on the same batches."""
    torch = ctx.torch
    import fused_stats as fs

    d = ctx.d
    per_batch = max(8, ctx.tokens // 4)
    T = min(512, per_batch)
    B = max(1, per_batch // T)
    accs = {b: fs.GradStats(d, second_moment="dense", backend=b) for b in ("triton", "torch")}
    times = {b: 0.0 for b in accs}
    for _ in range(3):
        g = ctx.randn(B, T, d, dtype=torch.bfloat16, shift=0.3)
        for b, acc in accs.items():
            if ctx.cuda:
                torch.cuda.synchronize()
            t = time.time()
            acc.update(g, unit="position")
            if ctx.cuda:
                torch.cuda.synchronize()
            times[b] += time.time() - t
    et, er = accs["triton"].estimate(), accs["torch"].estimate()
    errs = {
        k: abs(getattr(et, k) - getattr(er, k)) / abs(getattr(er, k))
        for k in ("mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2", "ag_max", "ag_mean")
    }
    worst = max(errs.values())
    run.row(
        "GradStats",
        "triton vs torch estimates, max rel diff",
        worst,
        ok=worst < 1e-5,
        note=f"tol 1e-5; n={et.n}; update s: triton {times['triton']:.3f}, torch {times['torch']:.3f}",
    )
    return {"rel_diff": errs, "ok": worst < 1e-5, "seconds": times, "n": et.n}


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


def section_stream(run, ctx):
    """fs.stream_blocks on a LLaMA-shaped bf16 model with its weights in pinned host memory:
    achieved host-to-device GB/s of one block's materialisation against a measured pinned copy of
    the same bytes, and the streamed / in-memory probe step ratio at --tokens tokens a batch
    (target <= 1.2 with prefetch). Dry run: a tiny fp32 model on CPU, streamed from the module and
    from a sharded checkpoint folder, checked against the in-memory statistics."""
    import copy
    import tempfile

    import torch
    import transformers

    import fused_stats as fs

    transformers.logging.set_verbosity_error()
    dry, cuda = run.args.dry_run, ctx.cuda
    if dry:
        hidden, ff, heads, kv, blocks, seq, vocab = 64, 160, 4, 2, 3, 32, 128
        tokens = 128
    else:
        hidden, ff, heads, kv, blocks, seq, vocab = 4096, 14336, 32, 8, run.args.stream_blocks, 4096, 32000
        tokens = ctx.tokens
    batch_size = max(tokens // seq, 1)
    dtype = torch.bfloat16 if cuda and not dry else torch.float32
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
    host_model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch_size, seq), generator=gen)
    batch = {
        "input_ids": ids.to(ctx.device),
        "attention_mask": torch.ones_like(ids).to(ctx.device),
        "labels": ids.to(ctx.device),
    }
    out = {"tokens": batch_size * seq, "blocks": blocks, "hidden": hidden, "dtype": str(dtype)}
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
                check = fs.Probe(st.model)
                check.step(batch, fs.causal_lm_loss)
                worst = max(
                    abs(
                        check.stats[p].estimate().trace_sigma2 / reference.stats[p].estimate().trace_sigma2
                        - 1
                    )
                    for p in reference.points
                )
                out[f"{name}_step_s"] = t_stream
                out[f"{name}_max_rel_diff_trace_sigma2"] = worst
                out[f"{name}_peak_over_block"] = st.peak_resident_bytes / st.block_bytes
                run.row(
                    "stream",
                    f"streamed/in-memory step ({name})",
                    t_stream,
                    "s",
                    t_memory,
                    note=f"target <= 1.2; {batch_size * seq} tokens, {blocks} blocks",
                )
                run.row("stream", f"rel diff trace_sigma2 ({name})", worst, "", note="vs in memory")
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
    ("preflight", section_preflight, "core"),
    ("env", section_env, "core"),
    ("ceilings", section_ceilings, "core"),
    ("capture_correctness", section_capture_correctness, "core"),
    ("capture_two_pass", section_capture_two_pass, "core"),
    ("capture_layouts", section_capture_layouts, "core"),
    ("capture_speed", section_capture_speed, "core"),
    ("second_moment", section_second_moment, "core"),
    ("bf16_bias", section_bf16_bias, "core"),
    ("gram", section_gram, "core"),
    ("repeat", section_repeat, "core"),
    ("additivity", section_additivity, "core"),
    ("grad_stats", section_grad_stats, "core"),
    ("cross", section_cross, "core"),
    ("stream", section_stream, "optional"),
    ("capture_sweep", section_capture_sweep, "sweep"),
    ("syrk_sweep", section_syrk_sweep, "sweep"),
    ("compile_peers", section_compile_peers, "compile"),
]
# per-section wall-clock limits of the child processes (seconds); the first JIT compilations
# happen in preflight, and Triton's on-disk cache serves the later sections
TIMEOUT_S = {"preflight": 240, "stream": 240, "compile_peers": 300, "capture_sweep": 240, "syrk_sweep": 240}
DEFAULT_TIMEOUT_S = 150


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
                else ", no CUDA: kernels through Triton's interpreter, no timing"
            )
        )
    skip = {x for x in args.skip.split(",") if x}
    unknown = skip - {name for name, _, _ in SECTIONS}
    if unknown:
        print(f"unknown sections in --skip: {sorted(unknown)}")
        return 2
    timeouts = _timeouts(args)
    if args.max_s is None:
        args.max_s = math.inf if args.dry_run else 480.0
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
