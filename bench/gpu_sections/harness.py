"""What every section of the GPU check shares: the run record, failure injection, timing, sizes.

:class:`Run` collects the sections' entries and table rows (a row's ratio is ``value / reference``,
ok when it reaches ``target``) and rewrites the JSON after every section (in a child process: after
every row and case, so a crash leaves what was done). :func:`bench` times a call by
``triton.testing.do_bench`` (median ms) on a GPU, by the median of three wall-clock calls on CPU.
:class:`Ctx` holds the problem sizes (``--tokens`` × ``--d``; tiny for a dry run) and the tensors'
generator. :func:`inject` makes the failures ``--inject-failure`` asks for.
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
T0 = time.time()  # the check's start: every progress line and budget counts from it


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
        tmp.write_text(json.dumps(self.document(), indent=1, default=json_default))
        os.replace(tmp, self.path)

    def print_table(self):
        cols = ("section", "metric", "value", "unit", "reference", "ratio", "target", "ok", "note")
        cells = [[fmt(r[c]) for c in cols] for r in self.table]
        widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
        print()
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        print("  ".join("-" * w for w in widths))
        for x in cells:
            print("  ".join(v.ljust(w) for v, w in zip(x, widths)))
        bad = [n for n, s in self.sections.items() if s.get("status") == "error"]
        print(f"\nsections: {len(self.sections)}, errors: {bad or 'none'}; JSON: {self.path}")


def json_default(x):
    try:
        return float(x)
    except Exception:
        return str(x)


def fmt(v):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if v == 0 or 1e-3 <= abs(v) < 1e5:
            return f"{v:.4g}"
        return f"{v:.3e}"
    return str(v)


def bench(fn, run) -> float:
    """Median milliseconds: triton.testing.do_bench on a GPU; on CPU (a dry run, whose figures only
    show that the section's code runs) the median of three wall-clock calls."""
    import torch

    if not torch.cuda.is_available():
        return 1e3 * wall(fn, 3, cuda=False)
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def wall(fn, reps, cuda):
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
