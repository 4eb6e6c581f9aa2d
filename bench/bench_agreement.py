"""How far the statistics move across BLAS code paths and thread counts (agreement to rounding).

Bit identity is promised only on one machine and build: another CPU runs other BLAS kernels
(vector width, blocking, summation order), which round differently. This script measures by how
much, on this machine, by re-running the same computation under settings that pick other kernels:

* ``MKL_CBWR=COMPATIBLE`` (MKL's conditional numerical reproducibility: a generic code path),
  ``MKL_CBWR=AVX2`` (the kernels an AVX2-only CPU, e.g. an AMD EPYC, would run), and
  2 torch threads instead of 1 (another split of the work), each in a fresh process;
* in-process, input batches in tensors 8 bytes off a 64-byte boundary instead of aligned ones.

Two workloads, each compared with the default setting (1 thread, no ``MKL_CBWR``):

1. ``accumulator``: GradStats (dense at d = 256, pool at d = 64) on fixed fp32 batches whose mean is
   3x the noise; the estimates (``mu_norm2 ... d_align``) are pure fp64 arithmetic on the same data.
2. ``demo``: ``fused-stats demo --quick`` end to end. Training amplifies a last-bit difference in
   the first step into visible changes of the trained weights, so the probed statistics of the
   printed tables move by far more than rounding of the statistics alone.

Prints the largest relative difference of the estimates per setting (and, for the demo, how many
lines of the printed summary differ) and writes ``bench/results/agreement_cpu.json``.

    python bench/bench_agreement.py            # both workloads (~3 min on 2 busy cores)
    python bench/bench_agreement.py --no-demo  # the accumulator workload only (~20 s)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIELDS = (
    "mu_norm2",
    "mu_norm4",
    "mu_sigma_mu",
    "trace_sigma2",
    "d_par",
    "d_2",
    "d_align",
    "ag_max",
    "ag_mean",
)
SETTINGS = {  # name -> (extra environment, torch threads)
    "default": ({}, 1),
    "MKL_CBWR=COMPATIBLE": ({"MKL_CBWR": "COMPATIBLE"}, 1),
    "MKL_CBWR=AVX2": ({"MKL_CBWR": "AVX2"}, 1),
    "2 threads": ({}, 2),
}


# ----------------------------------------------------------------------------- workers
def _misaligned(value, offset=8):
    import torch

    nbytes = value.numel() * value.element_size()
    buffer = torch.empty(nbytes + 128, dtype=torch.uint8)
    start = (offset - buffer.data_ptr()) % 64
    raw = buffer[start : start + nbytes]
    raw.copy_(value.contiguous().reshape(-1).view(torch.uint8))
    return raw.view(value.dtype).reshape(value.shape)


def accumulator_estimates(misaligned: bool = False) -> dict:
    """Estimates of GradStats on fixed data: {case: {field: value}}."""
    import torch

    import fused_stats as fs

    out = {}
    for case, dim, batches in (("dense d=256", 256, 20), ("pool d=64", 64, 5)):
        gen = torch.Generator().manual_seed(dim)
        scales = torch.linspace(0.2, 2.0, dim)
        mean = 3.0 * torch.randn(dim, generator=gen) / math.sqrt(dim) * scales.norm()
        acc = fs.GradStats(dim, second_moment="dense" if case.startswith("dense") else "pool")
        for _ in range(batches):
            grad = (mean + scales * torch.randn(128, dim, generator=gen)).float()
            acc.update(_misaligned(grad) if misaligned else grad)
        est = acc.estimate()
        out[case] = {field: getattr(est, field) for field in FIELDS}
    return out


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    print(json.dumps(accumulator_estimates(misaligned=args.misaligned)))


# ----------------------------------------------------------------------------- comparison
def rel_diff(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def run_env(extra: dict) -> dict:
    env = dict(os.environ)
    env.pop("MKL_CBWR", None)
    env.update(extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def accumulator_in_process(extra: dict, threads: int, misaligned: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--threads", str(threads)]
    if misaligned:
        cmd.append("--misaligned")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env(extra), check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare_accumulator(base: dict, other: dict) -> dict:
    worst = {}
    for case in base:
        for field in FIELDS:
            worst[f"{case}: {field}"] = rel_diff(base[case][field], other[case][field])
    return worst


DEMO_POINT_FIELDS = (
    [("train", f) for f in FIELDS[:7]]
    + [("test", f) for f in FIELDS[:7]]
    + [("certificate", "b_exact"), ("saturation", "cross_frob2"), ("misalignment", "probability")]
)


def demo_values(folder: Path) -> dict:
    """{(run, point, group, field): value} of every report the demo wrote, plus the train loss."""
    values = {}
    for path in sorted((folder / "runs").glob("*.json")):
        report = json.loads(path.read_text())
        values[(path.stem, "", "meta", "train_loss")] = float(report["meta"]["train_loss"])
        for point in report["points"]:
            values[(path.stem, point["name"], "", "realized_alignment")] = float(point["realized_alignment"])
            for group, field in DEMO_POINT_FIELDS:
                entry = point.get(group) or {}
                if field in entry:
                    values[(path.stem, point["name"], group, field)] = float(entry[field])
    return values


def summary_lines(folder: Path) -> list[str]:
    """The printed summary without its header (date) and with every time in seconds blanked."""
    return [
        re.sub(r"\d+(\.\d+)? s\b", "<time>", line)
        for line in (folder / "summary.md").read_text().splitlines()
        if not line.startswith("fused-stats demo (")
    ]


def run_demo(extra: dict, threads: int, folder: Path) -> float:
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "fused_stats.cli",
            "demo",
            "--quick",
            "--no-progress",
            "--threads",
            str(threads),
            "--out",
            str(folder),
        ],
        env=run_env(extra),
        check=True,
        capture_output=True,
        text=True,
    )
    return time.perf_counter() - start


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--misaligned", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-demo", action="store_true", help="skip the demo workload")
    parser.add_argument(
        "--json",
        default=str(ROOT / "bench" / "results" / "agreement_cpu.json"),
        help="where to write the results (default: %(default)s)",
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    import torch

    results = {
        "machine": f"{cpu_name()}, {platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "accumulator": {},
        "demo": {},
    }
    print(f"machine: {results['machine']}, torch {torch.__version__}")
    base = accumulator_in_process({}, 1)
    print(
        "\naccumulator (GradStats estimates on fixed fp32 data), largest relative difference "
        "to the default setting:"
    )
    variants = [
        (name, env, threads, False) for name, (env, threads) in SETTINGS.items() if name != "default"
    ] + [("misaligned input batches", {}, 1, True)]
    for name, env, threads, misaligned in variants:
        worst = compare_accumulator(base, accumulator_in_process(env, threads, misaligned))
        key = max(worst, key=worst.get)
        results["accumulator"][name] = {"max_rel_diff": worst[key], "where": key}
        print(f"  {name:<26} {worst[key]:.2e}  ({key})")

    if not args.no_demo:
        print(
            "\ndemo --quick (train + probe + print), largest relative difference to the default "
            "setting over every run, point and estimate:"
        )
        with tempfile.TemporaryDirectory() as tmp:
            folders = {}
            for name, (env, threads) in SETTINGS.items():
                folders[name] = Path(tmp) / name.replace("=", "_").replace(" ", "_")
                seconds = run_demo(env, threads, folders[name])
                print(f"  ran {name:<22} in {seconds:.0f} s", flush=True)
            base_values, base_lines = demo_values(folders["default"]), summary_lines(folders["default"])
            for name in SETTINGS:
                if name == "default":
                    continue
                values, lines = demo_values(folders[name]), summary_lines(folders[name])
                diffs = {k: rel_diff(base_values[k], values[k]) for k in base_values}
                estimates = {k: v for k, v in diffs.items() if k[2] in ("train", "test", "")}
                worst = max(estimates, key=estimates.get)
                worst_any = max(diffs, key=diffs.get)
                changed = sum(a != b for a, b in zip(base_lines, lines)) + abs(len(base_lines) - len(lines))
                results["demo"][name] = {
                    "max_rel_diff_estimates": estimates[worst],
                    "where": " ".join(worst),
                    "max_rel_diff_any": diffs[worst_any],
                    "where_any": " ".join(worst_any),
                    "median_rel_diff_estimates": sorted(estimates.values())[len(estimates) // 2],
                    "summary_lines_changed": changed,
                    "summary_lines": len(base_lines),
                }
                print(
                    f"  {name:<26} estimates {estimates[worst]:.2e} ({' '.join(worst)}), median "
                    f"{results['demo'][name]['median_rel_diff_estimates']:.1e}; any value "
                    f"{diffs[worst_any]:.2e} ({' '.join(worst_any)}); {changed} of "
                    f"{len(base_lines)} summary lines differ"
                )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
