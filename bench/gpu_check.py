#!/usr/bin/env python
"""One prepared GPU check of the fused kernels (docs/design.md, section 8).

Run on a CUDA machine (written for an H200) from the repository root::

    python bench/gpu_check.py                 # full sizes: 64K tokens x d = 4096, bf16
    python bench/gpu_check.py --dry-run       # no GPU needed: tiny sizes through the interpreter

It measures, in one run and side by side:

* ceilings: copy bandwidth (``torch.clone`` of a tensor of the capture input's size, bytes read +
  written) and dense matmul rates (bf16, TF32, fp64; 8192^3 / 4096^3 products);
* correctness of every kernel against its torch twin (fp64) at realistic sizes;
* medians of ``triton.testing.do_bench`` for each kernel, with the torch twin in eager mode and
  under ``torch.compile`` as peer columns;
* targets: capture-reduce >= 85 % of the measured copy bandwidth (bytes it must move, see
  bench/KERNELS.md); second moment from bf16 rows >= 60 % of the measured bf16 matmul rate, counting
  the triangle's FLOPs ``d (d + 1) R``. fp32 rows use tf32x3 (three TF32 MMAs per product), whose
  ceiling is a third of the measured TF32 rate; it is reported against that, with no target.

Every section runs in its own try/except, so one failure still leaves the others; the JSON is
rewritten after each section (``$OUT/gpu_check.json`` when ``OUT`` is set, else
``bench/results/gpu_check.json``, or ``--out DIR``) and a table is printed last. Sections that only
add peers (torch.compile, configuration sweep) are skipped once ``--budget-s`` seconds (default
420, i.e. 7 minutes) have passed, so the whole run stays under 8 minutes.
The cross-gradient kernel is checked against its twin when it exists (``cross`` section).
The weight-streamed probe step (``stream`` section): LLaMA-shaped bf16 model with its weights in pinned
host memory, block host-to-device GB/s against a pinned copy, streamed / in-memory step ratio.
``--skip a,b`` leaves sections out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
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
        help="skip optional sections (compile peers, sweep) after this many seconds",
    )
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


class Run:
    """Collects sections, table rows and writes the JSON after every section."""

    def __init__(self, args, path: Path):
        self.args = args
        self.path = path
        self.sections: dict = {}
        self.table: list = []
        self.meta: dict = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv[1:],
            "dry_run": bool(args.dry_run),
            "python": platform.python_version(),
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

    def section(self, name, fn, optional=False):
        if optional and time.time() - T0 > self.args.budget_s:
            self.sections[name] = {"status": "skipped", "reason": f"time budget {self.args.budget_s:.0f}s"}
            self.write()
            return None
        start = time.time()
        print(f"[{time.time() - T0:6.1f}s] {name} ...", flush=True)
        try:
            result = fn(self) or {}
            entry = {"status": result.pop("_status", "ok"), **result}
        except Exception as exc:  # one failure must not lose the rest
            entry = {
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:],
            }
            print(f"    error: {entry['error']}", flush=True)
            result = None
        entry["seconds"] = round(time.time() - start, 2)
        self.sections[name] = entry
        self.write()
        return result

    def write(self):
        doc = {
            "meta": {**self.meta, "elapsed_s": round(time.time() - T0, 1)},
            "sections": self.sections,
            "table": self.table,
        }
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=_json_default))
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


# ---------------------------------------------------------------------------- sections
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
    return g[: min(8, g.shape[0])].to(torch.float64).mean((0, 1)).to(torch.float32).to(torch.float64)


def section_capture_correctness(run, ctx):
    torch = ctx.torch
    from fused_stats.kernels import capture_reduce
    from fused_stats.ops import torch_twin

    out = {}
    worst = 0.0
    for name, g, mask, unit in _capture_cases(ctx):
        c = _centre(ctx, g)
        got = capture_reduce(g, mask, c, unit)
        want = torch_twin.capture_reduce(g, mask, c, unit)
        errs = {"n_equal": got.n == want.n, "valid_equal": bool(torch.equal(got.valid, want.valid))}
        for key in ("rows", "s", "t", "a1", "a2", "norm_max", "norm_sum"):
            errs[key] = rel_err(getattr(got, key), getattr(want, key))
        e = max(v for k, v in errs.items() if isinstance(v, float))
        worst = max(worst, e)
        ok = errs["n_equal"] and errs["valid_equal"] and e < 2e-5
        out[name] = {**errs, "shape": list(g.shape), "ok": ok}
        run.row("capture correctness", f"{name} max rel err", e, note="tol 2e-5, n and valid equal", ok=ok)
        if ctx.cuda:
            torch.cuda.empty_cache()
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def _capture_bytes(g, mask, unit):
    """Bytes the capture op must move: read the gradient (and mask), write the rows (fp32)."""
    B, T, d = g.shape
    rows = B * T if unit == "position" else B
    return g.numel() * g.element_size() + (mask.numel() if mask is not None else 0) + rows * d * 4 + rows


def section_capture_speed(run, ctx):
    torch = ctx.torch
    if not ctx.cuda:
        return {"_status": "skipped", "reason": "no CUDA"}
    from fused_stats.kernels import capture
    from fused_stats.ops import torch_twin

    copy = ctx.peers.get("copy_GBps")
    out = {}
    for name, g, mask, unit in _capture_cases(ctx):
        c = _centre(ctx, g)
        nbytes = _capture_bytes(g, mask, unit)
        ms_k = bench(lambda g=g, mask=mask, c=c, unit=unit: capture.capture_partials(g, mask, c, unit), run)
        ms_op = bench(lambda g=g, mask=mask, c=c, unit=unit: capture.capture_reduce(g, mask, c, unit), run)
        ms_twin = bench(
            lambda g=g, mask=mask, c=c, unit=unit: torch_twin.capture_reduce(g, mask, c, unit), run
        )
        gbps = nbytes / (ms_k * 1e-3) / 1e9
        out[name] = {
            "bytes": nbytes,
            "kernels_ms": ms_k,
            "op_ms": ms_op,
            "twin_eager_ms": ms_twin,
            "GBps": gbps,
            "fraction_of_copy": gbps / copy if copy else None,
        }
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


def section_second_moment(run, ctx):
    torch = ctx.torch
    from fused_stats.kernels import second_moment_update
    from fused_stats.ops import torch_twin

    out = {}
    d, R = ctx.d, ctx.tokens
    flops = d * (d + 1) * R
    for label, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
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
            ms = bench(lambda S=S, rows=rows: second_moment_update(S, rows), run)
            ms_twin = bench(lambda want=want, rows=rows: torch_twin.second_moment_update(want, rows), run)
            rate = flops / (ms * 1e-3) / 1e12
            entry.update(ms=ms, twin_eager_ms=ms_twin, TFLOPs_triangle=rate)
            if label == "bf16":
                ref = ctx.peers.get("bf16_TFLOPs")
                full = bench(lambda rows=rows: torch.mm(rows.T, rows), run)  # full d x d, bf16 out
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
        out[label] = entry
        if ctx.cuda:
            torch.cuda.empty_cache()
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


def section_gram(run, ctx):
    torch = ctx.torch
    from fused_stats.kernels import gram_rows
    from fused_stats.ops import torch_twin

    out = {}
    d = ctx.d
    n_pool = max(2, int(d * 0.61))  # about the auto pool's size limit
    for label, dtype in (("fp64", torch.float64), ("bf16", torch.bfloat16), ("fp32", torch.float32)):
        new = ctx.randn(64, d, dtype=dtype)
        pool = ctx.randn(n_pool, d, dtype=dtype)
        got = gram_rows(new, pool)
        want = torch_twin.gram_rows(new, pool)
        err = rel_err(got, want)
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        entry = {"rel_err": err, "ok": err < tol, "shape": [64, n_pool, d]}
        run.row("gram correctness", f"{label} max rel err", err, note=f"tol {tol:g}", ok=entry["ok"])
        if ctx.cuda:
            ms = bench(lambda new=new, pool=pool: gram_rows(new, pool), run)
            ms_twin = bench(lambda new=new, pool=pool: torch_twin.gram_rows(new, pool), run)
            entry.update(ms=ms, twin_eager_ms=ms_twin, TFLOPs=2 * 64 * n_pool * d / (ms * 1e-3) / 1e12)
            run.row("gram speed", f"{label} ms", ms, "ms", note=f"twin eager {ms_twin:.3f} ms")
        out[label] = entry
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


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
        args = (grad, act, mask, w_in, "gelu", unit)
        got = cross.cross_reduce(*args)
        want = cross_twin.cross_reduce(*args)
        errs = {
            k: rel_err(getattr(got, k), getattr(want, k)) for k in ("c_sum", "sq_norm_sum", "u2", "u3", "u4")
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
            ms = bench(lambda args=args: cross.cross_reduce(*args), run)
            ms_twin = bench(lambda args=args: cross_twin.cross_reduce(*args), run)
            # extra memory while one call runs: phi(W_in z) must exist only per chunk in the kernel
            peak = {}
            for who, fn in (("kernel", cross.cross_reduce), ("twin", cross_twin.cross_reduce)):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(ctx.device)
                base = torch.cuda.memory_allocated(ctx.device)
                fn(*args)
                torch.cuda.synchronize()
                peak[who] = (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**20
            # the two GEMMs over counted positions (phi = Z W_in^T, then Q^T Phi), fp32 products as tf32x3 (HGMMA)
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
        out[unit] = entry
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
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


SECTIONS = [
    ("env", section_env, False),
    ("ceilings", section_ceilings, False),
    ("capture_correctness", section_capture_correctness, False),
    ("capture_speed", section_capture_speed, False),
    ("second_moment", section_second_moment, False),
    ("gram", section_gram, False),
    ("grad_stats", section_grad_stats, False),
    ("cross", section_cross, False),
    ("stream", section_stream, False),
    ("capture_sweep", section_capture_sweep, True),
    ("syrk_sweep", section_syrk_sweep, True),
    ("compile_peers", section_compile_peers, True),
]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run and not os.environ.get("TRITON_INTERPRET"):
        # must be set before Triton is imported when there is no GPU (harmless with one: the
        # kernels pick the compiled path for CUDA tensors)
        os.environ["TRITON_INTERPRET"] = "1"
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
    ctx = Ctx(args)
    skip = {x for x in args.skip.split(",") if x}
    unknown = skip - {name for name, _, _ in SECTIONS}
    if unknown:
        print(f"unknown sections in --skip: {sorted(unknown)}")
        return 2
    for name, fn, optional in SECTIONS:
        if name in skip:
            run.sections[name] = {"status": "skipped", "reason": "--skip"}
            continue
        run.section(name, lambda r, fn=fn: fn(r, ctx), optional=optional)
    run.meta["elapsed_s"] = round(time.time() - T0, 1)
    run.write()
    run.print_table()
    errors = [n for n, s in run.sections.items() if s.get("status") == "error"]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
