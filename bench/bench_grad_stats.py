"""Benchmark: GradStats update throughput and peak memory vs a naive store-everything baseline.

* ``GradStats``: ``second_moment="dense"``, fp32 batches of 1000 per-sample vectors, streaming
  centred sums with fp64 totals (``S += Y^T Y`` per batch), one ``estimate()`` at the end.
* naive baseline: keep every per-sample vector (as fp64 numpy), then at the end centre at the mean
  and plug the centred sums into the same unbiased formulas (docs/design.md, section 2), Gram-free:
  ``y = q - q_bar``, ``S = Y^T Y``, ``F = |S|_F^2``, ``A1 = sum|y|^2``, ``A2 = sum|y|^4``,
  ``t = sum |y|^2 y``, ``kappa = |q_bar|^2``, ``beta = q_bar^T S q_bar``, ``tau = q_bar^T t``.

Both see the same fp32 batches (a few pre-generated batches, cycled, so data generation is not
timed). Time = all updates + the final estimate, as wall time and as process CPU time (with one
thread the CPU time does not count the time the process waits for a core, so its ratio is the
steadier one on a shared machine). Each case runs ``--repeat`` times, the two approaches
alternating; the ratios printed are medians of the per-pair ratios. Peak memory = growth of the
process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``) over its RSS before the run;
each run is a fresh subprocess so allocator caches of one case do not hide another's peak
(tracemalloc does not see torch allocations). A growth below a few MiB is noise (allocator reuse
of the warm-up's pages): it prints as flat and the memory ratio as a lower bound against the
floor, never as a ratio over a near-zero or negative number. "held" = bytes of the state each
approach keeps between batches.

Note on the baseline: numpy's ``q.T @ q`` already dispatches a matrix times its own transpose to
BLAS ``syrk`` (one triangle), so the baseline does the same FLOPs as GradStats' one-triangle
update; what differs is one large call against per-batch calls plus the per-batch sums.

Run the table (n = 1e4, 1e5; d = 256, 1024; both approaches, ratios side by side)::

    python bench/bench_grad_stats.py --threads 1   # --quick: n = 1e4 only; --repeat N runs per case
    python bench/bench_grad_stats.py --threads 1 --floor   # also naive / dsyrk floor, the bound

The pytest-benchmark version (small: n = 1e4, d = 256) is not part of the test suite::

    python -m pytest bench/bench_grad_stats.py --benchmark-only -q
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

BATCH = 1000
N_DISTINCT_BATCHES = 8


def make_batches(d: int, seed: int = 0) -> list[torch.Tensor]:
    """A few fp32 batches with mean ~ noise (cycled through by both approaches)."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(d, generator=gen) / d**0.5
    return [
        (mean + torch.randn(BATCH, d, generator=gen) / d**0.5).contiguous() for _ in range(N_DISTINCT_BATCHES)
    ]


def run_gradstats(n: int, batches: list[torch.Tensor]) -> tuple[dict, int]:
    import fused_stats as fs

    d = batches[0].shape[1]
    acc = fs.GradStats(d, second_moment="dense", backend="torch")
    for k in range(n // BATCH):
        acc.update(batches[k % len(batches)])
    est = acc.estimate()
    return (
        {key: getattr(est, key) for key in ("mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2")},
        acc.state_nbytes(),
    )


def run_naive(n: int, batches: list[torch.Tensor]) -> tuple[dict, int]:
    d = batches[0].shape[1]
    q = np.empty((n, d), dtype=np.float64)  # every per-sample vector, kept to the end
    for k in range(n // BATCH):
        q[k * BATCH : (k + 1) * BATCH] = batches[k % len(batches)].numpy()
    held = q.nbytes
    mean = q.mean(axis=0)
    q -= mean  # in place: y = q - q_bar (the baseline does not double its own footprint)
    sq = np.einsum("ij,ij->i", q, q)
    S = q.T @ q
    t = sq @ q
    a1, a2, F = sq.sum(), (sq * sq).sum(), (S * S).sum()
    kappa, beta, tau = mean @ mean, mean @ S @ mean, mean @ t
    n2, n3, n4 = n * (n - 1.0), n * (n - 1.0) * (n - 2.0), n * (n - 1.0) * (n - 2.0) * (n - 3.0)
    est = {
        "mu_norm2": kappa - a1 / n2,
        "mu_norm4": kappa**2
        - 2 * kappa * a1 / n2
        - 4 * beta / n2
        + 8 * tau / n3
        + (a1**2 - 6 * a2 + 2 * F) / n4,
        "mu_sigma_mu": beta / (n - 1)
        - 2 * tau / ((n - 1) * (n - 2))
        + (2 * n * a2 - (n - 1) * F - a1**2) / n4,
        "trace_sigma2": ((n - 1) * (n - 2) * F - n * (n - 1) * a2 + a1**2) / n4,
    }
    return {k: float(v) for k, v in est.items()}, held


def run_gradstats_addmm(n: int, batches: list[torch.Tensor]) -> tuple[dict, int]:
    """GradStats with the BLAS ``dsyrk`` path switched off: every update through torch's addmm."""
    from fused_stats.ops import cpu_blas

    cpu_blas.available = lambda: False
    return run_gradstats(n, batches)


def run_syrk_floor(n: int, batches: list[torch.Tensor]) -> tuple[dict, int]:
    """The floor of an exact streaming fp64 second moment: per batch only the fp64 upcast and the
    one-triangle BLAS ``dsyrk`` GradStats calls (no centring, norms or other sums, no estimate)."""
    from fused_stats.ops import cpu_blas

    d = batches[0].shape[1]
    S = torch.zeros(d, d, dtype=torch.float64)
    for k in range(n // BATCH):
        cpu_blas.syrk_update(S, batches[k % len(batches)].to(torch.float64), mirror=False)
    return {}, S.numel() * S.element_size()


APPROACHES = {
    "gradstats": run_gradstats,
    "naive": run_naive,
    "gradstats_addmm": run_gradstats_addmm,
    "syrk_floor": run_syrk_floor,
}


# RSS moves by a few MiB between identical runs (allocator caches, page reuse): a growth below this
# is reported as "flat" and a memory ratio against it only as a lower bound
RSS_NOISE_FLOOR_BYTES = 4 << 20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(approach: str, n: int, d: int) -> dict:
    """Time and peak-RSS growth of one approach (meant to run in a fresh process)."""
    batches = make_batches(d)
    APPROACHES[approach](2 * BATCH, batches)  # warm-up: imports, BLAS threads, allocator
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    rss0 = _status_kib("VmRSS")
    cpu0, start = time.process_time(), time.perf_counter()
    est, held = APPROACHES[approach](n, batches)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu0
    peak = _status_kib("VmHWM")
    blas_threads = None
    if approach == "gradstats":
        from fused_stats.ops import cpu_blas

        blas_threads = cpu_blas.blas_thread_counts() if cpu_blas.available() else []
    return {
        "approach": approach,
        "n": n,
        "d": d,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "samples_per_s": n / seconds,
        "peak_rss_growth_bytes": (peak - rss0) * 1024 if reset else None,
        "held_bytes": held,
        "estimates": est,
        "threads": torch.get_num_threads(),
        "blas_threads_after": blas_threads,
    }


def measure_in_subprocess(approach: str, n: int, d: int, threads: int | None = None) -> dict:
    env = dict(os.environ)
    if threads:  # the same thread count for torch (OpenMP) and numpy's BLAS
        for key in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[key] = str(threads)
    out = subprocess.run(
        [sys.executable, __file__, "--one", approach, str(n), str(d)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_words(gs_growth: int | None, naive_growth: int | None) -> tuple[str, str, str, float | None]:
    """``(GradStats peak, naive peak, ratio, ratio or its lower bound)`` as table words: a growth
    below the noise floor prints as flat, and the ratio against it as ">= naive / floor"."""
    if gs_growth is None or naive_growth is None:
        return "n/a", "n/a", "n/a", None
    mb = 1 / 2**20
    naive_word = f"{naive_growth * mb:.1f}"
    if gs_growth < RSS_NOISE_FLOOR_BYTES:
        bound = naive_growth / RSS_NOISE_FLOOR_BYTES
        return f"flat(<{RSS_NOISE_FLOOR_BYTES * mb:.0f})", naive_word, f">={bound:.0f}", bound
    ratio = naive_growth / gs_growth
    return f"{gs_growth * mb:.1f}", naive_word, f"{ratio:.1f}", ratio


def table(
    ns, ds, threads: int | None = None, repeat: int = 1, with_addmm: bool = False, with_floor: bool = False
) -> list[dict]:
    """Each case ``repeat`` times, GradStats and naive alternating (fresh processes); medians.
    ``with_addmm``: also GradStats on torch's addmm only (CPU-time ratio addmm / dsyrk path).
    ``with_floor``: also the ``dsyrk`` floor (:func:`run_syrk_floor`): naive / floor is the most
    any exact streaming fp64 method calling those BLAS routines could reach in that run."""
    rows = []
    header = (
        f"{'n':>7} {'d':>5} | {'GS s':>7} {'naive s':>7} {'time x':>6} | {'GS cpu s':>8} "
        f"{'naive cpu s':>11} {'cpu x':>5} | {'GS peak MB':>11} {'naive peak MB':>13} "
        f"{'mem x':>6} | {'GS held MB':>10} {'naive held MB':>13} | {'max rel diff':>12}"
        + (f" | {'addmm cpu x':>12}" if with_addmm else "")
        + (f" | {'floor cpu x':>12}" if with_floor else "")
    )
    print(header)
    print("-" * len(header))
    med = statistics.median
    for n in ns:
        for d in ds:
            runs, addmm, floor = [], [], []
            for _ in range(repeat):
                runs.append(
                    (
                        measure_in_subprocess("gradstats", n, d, threads),
                        measure_in_subprocess("naive", n, d, threads),
                    )
                )
                if with_addmm:
                    addmm.append(measure_in_subprocess("gradstats_addmm", n, d, threads))
                if with_floor:
                    floor.append(measure_in_subprocess("syrk_floor", n, d, threads))
            gs, nv = runs[0]
            diff = max(
                abs(g["estimates"][k] - v["estimates"][k]) / abs(v["estimates"][k])
                for g, v in runs
                for k in v["estimates"]
            )
            t_gs, t_nv = med(g["seconds"] for g, _ in runs), med(v["seconds"] for _, v in runs)
            c_gs, c_nv = med(g["cpu_seconds"] for g, _ in runs), med(v["cpu_seconds"] for _, v in runs)
            time_x = med(v["seconds"] / g["seconds"] for g, v in runs)  # per pair, then median
            cpu_x = med(v["cpu_seconds"] / g["cpu_seconds"] for g, v in runs)
            addmm_x = (
                med(a["cpu_seconds"] / g["cpu_seconds"] for a, (g, _) in zip(addmm, runs)) if addmm else None
            )
            floor_x = (
                med(v["cpu_seconds"] / f["cpu_seconds"] for f, (_, v) in zip(floor, runs)) if floor else None
            )
            growth = [g["peak_rss_growth_bytes"] for g, _ in runs]
            naive_growth = [v["peak_rss_growth_bytes"] for _, v in runs]
            gs_peak = None if None in growth else max(growth)  # the worst run counts for memory
            nv_peak = None if None in naive_growth else med(naive_growth)
            gs_word, nv_word, mem_word, mem_x = memory_words(gs_peak, nv_peak)
            mb = 1 / 2**20
            print(
                f"{n:>7} {d:>5} | {t_gs:>7.3f} {t_nv:>7.3f} {time_x:>6.2f} | {c_gs:>8.3f} "
                f"{c_nv:>11.3f} {cpu_x:>5.2f} | {gs_word:>11} {nv_word:>13} {mem_word:>6} | "
                f"{gs['held_bytes'] * mb:>10.2f} {nv['held_bytes'] * mb:>13.1f} | {diff:>12.1e}"
                + (f" | {addmm_x:>12.2f}" if addmm_x is not None else "")
                + (f" | {floor_x:>12.2f}" if floor_x is not None else ""),
                flush=True,
            )
            rows.append(
                {
                    "runs": [{"gradstats": g, "naive": v} for g, v in runs],
                    "speed_ratio_naive_over_gradstats": time_x,
                    "cpu_ratio_naive_over_gradstats": cpu_x,
                    "gradstats_peak_rss_growth_bytes": gs_peak,
                    "naive_peak_rss_growth_bytes": nv_peak,
                    "peak_ratio_naive_over_gradstats": mem_x,
                    "peak_ratio_is_lower_bound": gs_peak is not None and gs_peak < RSS_NOISE_FLOOR_BYTES,
                    "max_rel_diff": diff,
                    "addmm_runs": addmm,
                    "cpu_ratio_addmm_over_gradstats": addmm_x,
                    "floor_runs": floor,
                    "cpu_ratio_naive_over_syrk_floor": floor_x,
                }
            )
    print(
        f"x > 1: GradStats faster / smaller; time x and cpu x are medians of the per-pair ratios "
        f"over {repeat} alternating run(s); cpu = process CPU time (steadier than wall time on a "
        f"shared machine with --threads 1); peak = growth of peak RSS during the run, "
        f"'flat' below {RSS_NOISE_FLOOR_BYTES >> 20} MiB (then mem x is a lower bound)"
        + ("; addmm cpu x: GradStats on torch's addmm only / GradStats" if with_addmm else "")
        + (
            "; floor cpu x: naive / (upcast + dsyrk per batch only), the bound for GradStats"
            if with_floor
            else ""
        )
    )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="n = 1e4 only")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads for both approaches (default: torch/BLAS defaults); 1 is steadier on a shared machine",
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="alternating runs per case (medians are printed)"
    )
    parser.add_argument(
        "--addmm",
        action="store_true",
        help="also time GradStats on torch's addmm only (the second moment without BLAS dsyrk)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time the dsyrk floor (fp64 upcast + dsyrk per batch only): the bound on the ratio",
    )
    parser.add_argument("--one", nargs=3, metavar=("APPROACH", "N", "D"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--json", type=Path, default=Path(__file__).parent / "results" / "bench_grad_stats.json"
    )
    args = parser.parse_args(argv)
    if args.one:
        approach, n, d = args.one[0], int(args.one[1]), int(args.one[2])
        print(json.dumps(measure(approach, n, d)))
        return
    print(
        f"torch {torch.__version__}, {args.threads or torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, fp32 batches of {BATCH}, {args.repeat} alternating run(s) per case"
    )
    rows = table(
        [10_000] if args.quick else [10_000, 100_000],
        [256, 1024],
        args.threads,
        args.repeat,
        args.addmm,
        args.floor,
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.json}")


# ----------------------------------------------------------------------------- pytest-benchmark
def _bench(benchmark, approach: str) -> None:
    n, d = 10_000, 256
    batches = make_batches(d)
    est, held = benchmark.pedantic(
        APPROACHES[approach], args=(n, batches), rounds=3, iterations=1, warmup_rounds=1
    )
    benchmark.extra_info.update({"n": n, "d": d, "held_bytes": held})
    assert all(np.isfinite(v) for v in est.values())


def test_update_throughput_gradstats(benchmark):
    benchmark.group = "grad_stats n=1e4 d=256"
    _bench(benchmark, "gradstats")


def test_update_throughput_naive(benchmark):
    benchmark.group = "grad_stats n=1e4 d=256"
    _bench(benchmark, "naive")


def test_ratio_side_by_side(capsys):
    """Both approaches in one run (fresh subprocesses), printing the speed and memory ratios."""
    rows = table([10_000], [256])
    assert rows[0]["max_rel_diff"] < 1e-8
    with capsys.disabled():
        print(
            f"\nnaive/GradStats time {rows[0]['speed_ratio_naive_over_gradstats']:.2f}x, "
            f"peak RSS {rows[0]['peak_ratio_naive_over_gradstats']:.1f}x"
            f"{' (lower bound)' if rows[0]['peak_ratio_is_lower_bound'] else ''}"
        )


if __name__ == "__main__":
    main()
