"""Memory over a long stream: RSS stays flat at 1e5 samples; the plan matches the live state.

Run: ``python -m pytest bench/bench_memory.py -q -s`` (about a minute on 2 CPU cores). Prints, side
by side in one run, per case: RSS after warm-up, RSS growth after warm-up, the accumulator's state
bytes, the plan's predicted bytes and their ratio; writes ``bench/results/memory.json``.

Cases: ``GradStats`` dense and auto (d = 256) over 1e5 samples (200 batches of 500); a pool of
2 000 samples, where the state grows by design (RSS growth against the planned pool bytes); and a
:class:`~fused_stats.Probe` on a small residual MLP over 1e5 samples (train stream, 3 points).
RSS is ``VmRSS`` from ``/proc/self/status`` after every batch. "Growth after warm-up" is the median
RSS of the last fifth of the batches minus that of the first fifth after warm-up (single samples
move up and down by the per-batch workspace, a few MiB at B = 500, d = 256, also printed as the
largest spike); "flat" means it stays below 1 MiB, where a per-batch leak of rows or of a d x d
matrix would grow without bound (1 MiB a batch for S at d = 256).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.api.streaming.plan import human_bytes, plan_memory

RESULTS = Path(__file__).parent / "results"
ROWS: list[dict] = []


def rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def stream(update, batches: int, warm: int) -> dict:
    samples = []
    start = time.perf_counter()
    for i in range(batches):
        update(i)
        samples.append(rss_bytes())
    # the trend, not single samples: RSS moves by the per-batch workspace from batch to batch
    # (freed buffers are not always returned to the OS at once), while a leak grows steadily
    window = max(1, (batches - warm) // 5)
    early = statistics.median(samples[warm : warm + window])
    late = statistics.median(samples[-window:])
    return {
        "rss_warm": samples[warm - 1],
        "rss_final": samples[-1],
        "growth_after_warm": late - early,
        "max_spike_after_warm": max(samples[warm:]) - samples[warm - 1],
        "seconds": time.perf_counter() - start,
    }


def record(case: str, result: dict, state: int, planned: int) -> dict:
    row = {
        "case": case,
        **result,
        "state_nbytes": state,
        "planned_nbytes": planned,
        "plan_ratio": planned / state,
    }
    ROWS.append(row)
    print(
        f"\n{case:<28} RSS warm {human_bytes(row['rss_warm']):>11}  growth after warm-up "
        f"{human_bytes(row['growth_after_warm']):>11} (largest spike "
        f"{human_bytes(row['max_spike_after_warm'])})  state {human_bytes(state):>11}  plan "
        f"{human_bytes(planned):>11}  plan/state {row['plan_ratio']:.3f}  ({row['seconds']:.1f} s)"
    )
    return row


@pytest.mark.parametrize("second_moment", ["dense", "auto"])
def test_grad_stats_1e5_samples_flat(benchmark, second_moment):
    dim, batch, batches, warm = 256, 500, 200, 20
    gen = torch.Generator().manual_seed(0)
    acc = fs.GradStats(dim, second_moment=second_moment)
    x = torch.empty(batch, dim)

    def update(i):
        torch.randn(batch, dim, generator=gen, out=x)
        acc.update(x + 0.5)

    result = benchmark.pedantic(lambda: stream(update, batches, warm), rounds=1, iterations=1)
    plan = plan_memory(dim=dim, points=1, pool_size=acc.n, streams=1)
    row = record(
        f"GradStats {second_moment} d={dim} n={acc.n}",
        result,
        acc.state_nbytes(),
        getattr(plan, second_moment),
    )
    assert acc.n == 100_000
    assert abs(row["plan_ratio"] - 1) <= 0.10
    assert row["growth_after_warm"] < 2**20


def test_pool_grows_as_planned(benchmark):
    dim, batch, batches, warm = 256, 100, 20, 1
    gen = torch.Generator().manual_seed(1)
    acc = fs.GradStats(dim, second_moment="pool")
    x = torch.empty(batch, dim)

    def update(i):
        torch.randn(batch, dim, generator=gen, out=x)
        acc.update(x)

    before = rss_bytes()
    result = benchmark.pedantic(lambda: stream(update, batches, warm), rounds=1, iterations=1)
    result["growth_total"] = result["rss_final"] - before
    plan = plan_memory(dim=dim, points=1, pool_size=acc.n, streams=1)
    row = record(f"GradStats pool d={dim} n={acc.n}", result, acc.state_nbytes(), plan.pool)
    print(
        f"{'':<28} RSS growth over the whole stream {human_bytes(result['growth_total'])} for a "
        f"planned pool of {human_bytes(plan.pool)} (ratio {result['growth_total'] / plan.pool:.2f})"
    )
    assert abs(row["plan_ratio"] - 1) <= 0.10


class ResidualMLP(nn.Module):
    def __init__(self, d=64, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(depth)])
        self.out = nn.Linear(d, 10)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def test_probe_1e5_samples_flat(benchmark):
    from fused_stats.api.probe.driver import Probe

    model = ResidualMLP()
    names = [f"blocks.{i}" for i in range(3)]
    probe = Probe(model, points=names, second_moment="dense")
    gen = torch.Generator().manual_seed(2)
    batch, batches, warm = 500, 200, 20

    def loss_fn(m, b):
        return nn.functional.cross_entropy(m(b[0]), b[1], reduction="none")

    def update(i):
        probe.step(
            (torch.randn(batch, 16, generator=gen), torch.randint(0, 10, (batch,), generator=gen)), loss_fn
        )

    result = benchmark.pedantic(lambda: stream(update, batches, warm), rounds=1, iterations=1)
    state = sum(acc.state_nbytes() for acc in probe.stats.values())
    plan = plan_memory(dim=64, points=3, streams=1)
    row = record("Probe 3 points d=64 n=1e5", result, state, plan.total("dense"))
    assert probe.stats[names[0]].n == 100_000
    assert abs(row["plan_ratio"] - 1) <= 0.10
    assert row["growth_after_warm"] < 2**20


def teardown_module(module):
    if ROWS:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "memory.json").write_text(json.dumps(ROWS, indent=1))
