"""Benchmark: one probe step with the depth probe (``cross=``) against one full training step of the
same small residual MLP.

* model: ``x -> Linear(inputs, d) -> blocks -> Linear(d, classes)``, each block
  ``z + W2 gelu(W1 z)`` (width ``d``, hidden ``4d``); a probe point after every block.
* training step: ``zero_grad``, forward, mean cross-entropy, full backward (every weight gradient),
  ``Adam.step()``: what a training loop pays per batch.
* probe step: ``Probe.step(batch, classification_loss)`` with ``unit="sample"``, dense second
  moment and ``cross=fs.CrossSpec()`` (rank 64, gelu): forward, the activation-only backward and
  the GradStats and CrossStats updates at every point.

The two cases are interleaved round by round so that load from other processes hits both alike;
the medians of wall time and of process CPU time (steadier on a shared machine with one thread)
and their ratios probe / train are printed side by side and written to
``bench/results/cross_step_cpu.json``. A ratio at or below 1 means a probe step costs no more than
a training step.

``--baseline DIR`` adds a third case, the same probe step from the fused_stats package of another
checkout (e.g. ``git worktree add /tmp/before <commit>``), imported under another name and
interleaved with the other two, so a before/after ratio comes from one run.

Run (defaults: d = 32, batch 64, 4 blocks, 1 thread)::

    python bench/bench_cross_step.py            # --rounds 200 --dim 32 --batch 64 --blocks 4
    python bench/bench_cross_step.py --profile  # cProfile of the probe steps, top functions
    python bench/bench_cross_step.py --baseline /tmp/before --out /tmp/cross_step_ab.json
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from _harness import RESULTS, write_result
from torch import nn

import fused_stats as fs


class MLPBlock(nn.Module):
    """``z + W2 gelu(W1 z)``."""

    def __init__(self, d: int):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, z):
        return z + self.down(nn.functional.gelu(self.up(z)))


class ResidualMLP(nn.Module):
    def __init__(self, inputs: int, d: int, blocks: int, classes: int):
        super().__init__()
        self.embed = nn.Linear(inputs, d)
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(blocks))
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        z = self.embed(x)
        for block in self.blocks:
            z = block(z)
        return self.head(z)


def build(dim=32, batch=64, blocks=4, inputs=16, classes=10, seed=0):
    torch.manual_seed(seed)
    model = ResidualMLP(inputs, dim, blocks, classes)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, inputs, generator=gen)
    y = torch.randint(0, classes, (batch,), generator=gen)
    return model, (x, y)


def load_checkout(directory: str):
    """The fused_stats package of another checkout, imported as ``fused_stats_baseline``."""
    root = Path(directory).resolve() / "fused_stats"
    if not (root / "__init__.py").is_file():
        raise SystemExit(f"--baseline: no fused_stats package in {directory}")
    spec = importlib.util.spec_from_file_location(
        "fused_stats_baseline", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["fused_stats_baseline"] = module
    spec.loader.exec_module(module)
    return module


def measure(rounds=200, warmup=10, profile=False, baseline=None, **sizes) -> dict:
    model, batch = build(**sizes)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    points = [f"blocks.{i}" for i in range(len(model.blocks))]
    probe = fs.Probe(model, points=points, unit="sample", second_moment="dense", cross=fs.CrossSpec())

    def train_step():
        optimizer.zero_grad(set_to_none=True)
        x, y = batch
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    def probe_step():
        probe.step(batch, fs.classification_loss)

    cases = {"train step (fwd + bwd + Adam)": train_step, "probe step (cross=)": probe_step}
    if baseline is not None:
        old_model, old_batch = build(**sizes)
        old_probe = baseline.Probe(
            old_model, points=points, unit="sample", second_moment="dense", cross=baseline.CrossSpec()
        )
        cases["probe step, baseline checkout"] = lambda: old_probe.step(
            old_batch, baseline.classification_loss
        )
    wall = {name: [] for name in cases}
    cpu = {name: [] for name in cases}
    for r in range(warmup + rounds):
        for name, fn in cases.items():
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if r >= warmup:
                wall[name].append(dt)
                cpu[name].append(dc)
    med_wall = {name: statistics.median(ts) for name, ts in wall.items()}
    med_cpu = {name: statistics.median(ts) for name, ts in cpu.items()}
    train, probe_name = "train step (fwd + bwd + Adam)", "probe step (cross=)"
    result = {
        "sizes": sizes,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "median_wall_s": med_wall,
        "median_cpu_s": med_cpu,
        "wall_ratio_probe_over_train": med_wall[probe_name] / med_wall[train],
        "cpu_ratio_probe_over_train": med_cpu[probe_name] / med_cpu[train],
        "per_round_ratio_over_train": {
            name: statistics.median(a / b for a, b in zip(wall[name], wall[train])) for name in cases
        },
        "probe_samples": probe.stats[points[0]].n,
        "cross_samples": probe.cross_stats[points[0]].n,
    }
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(rounds):
            probe_step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--profile", action="store_true", help="cProfile the probe steps afterwards")
    parser.add_argument("--out", default=str(RESULTS / "cross_step_cpu.json"))
    parser.add_argument("--baseline", metavar="DIR", help="also time the probe of the checkout in DIR")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    baseline = load_checkout(args.baseline) if args.baseline else None
    result = measure(
        args.rounds,
        profile=args.profile,
        baseline=baseline,
        dim=args.dim,
        batch=args.batch,
        blocks=args.blocks,
    )
    if baseline is not None:
        result["baseline_checkout"] = str(Path(args.baseline).resolve())
        head = subprocess.run(
            ["git", "-C", args.baseline, "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        )
        result["baseline_commit"] = head.stdout.strip() or None
    print(
        f"torch {torch.__version__}, {result['threads']} thread(s); residual MLP d={args.dim}, "
        f"batch {args.batch}, {args.blocks} blocks; {args.rounds} interleaved rounds"
    )
    print(f"{'case':32s} {'median wall ms':>14} {'median cpu ms':>14}")
    for name in result["median_wall_s"]:
        print(
            f"{name:32s} {result['median_wall_s'][name] * 1e3:>14.3f} "
            f"{result['median_cpu_s'][name] * 1e3:>14.3f}"
        )
    print(
        f"probe / train: wall {result['wall_ratio_probe_over_train']:.3f}x, "
        f"cpu {result['cpu_ratio_probe_over_train']:.3f}x (<= 1: a probe step costs no more)"
    )
    print(
        "median per-round ratio over the training step: "
        + ", ".join(f"{name} {r:.3f}x" for name, r in result["per_round_ratio_over_train"].items())
    )
    write_result(args.out, result)


if __name__ == "__main__":
    main()
