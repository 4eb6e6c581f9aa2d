"""Benchmark: one probe step against one plain training step of the same LLaMA-style model.

* training step: ``model(input_ids, attention_mask, labels).loss.backward()`` — forward plus the
  full backward, including every weight gradient (what a training loop pays before the optimizer).
* probe step: ``Probe.step(batch, causal_lm_loss)`` at every residual point (one per block),
  ``unit="sample"``, dense second moment — forward, then the activation-only backward
  (parameters frozen, graph cut at the lowest point, no weight-gradient products) and the
  accumulator updates.
* forward only (``torch.no_grad``): the floor both share, for context.

Same model, same batch (right-padded: one quarter of the sequences end early), CPU, fp32. The
cases are interleaved round by round (train, probe, forward, train, ...) so that load from other
processes hits all of them alike; medians over the rounds and the ratio probe/train are printed
side by side, and written to ``bench/results/probe_cpu.json``.

One torch thread by default: on a shared 2-core machine, multi-threaded kernels stall on whichever
other process holds a core, which adds noise of the size of the effect (``--threads 0`` uses torch's
default).

Run the table (defaults: hidden 256, 4 layers, seq 128, batch 8, vocab 2048)::

    python bench/bench_probe.py                 # --rounds 10 --hidden 256 --layers 4 ...

The pytest-benchmark version (same model; not part of the test suite)::

    python -m pytest bench/bench_probe.py --benchmark-only -q
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from _harness import apply_threads, build_llama, size_parser, sizes, write_result

import fused_stats as fs


def train_step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()


def forward_only(model, batch):
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def make_probe(model):
    return fs.Probe(model, unit="sample", second_moment="dense")


def measure(rounds=10, warmup=2, **sizes) -> dict:
    model, batch = build_llama(**sizes)
    probe = make_probe(model)
    cases = {
        "train step (fwd + full bwd)": lambda: train_step(model, batch),
        "probe step (fwd + act. bwd)": lambda: probe.step(batch, fs.causal_lm_loss),
        "forward only (no_grad)": lambda: forward_only(model, batch),
    }
    times = {name: [] for name in cases}
    for r in range(warmup + rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(dt)
    model.zero_grad(set_to_none=True)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    train = med["train step (fwd + full bwd)"]
    return {
        "sizes": sizes,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "median_s": med,
        "ratio_to_train": {name: m / train for name, m in med.items()},
        "probe_samples": probe.stats[probe.points[0]].n,
        "points": probe.points,
    }


def print_table(result: dict) -> None:
    s = result["sizes"]
    print(
        f"LLaMA-style hidden {s['hidden']}, {s['layers']} layers, seq {s['seq']}, batch {s['batch']}, "
        f"vocab {s['vocab']}; CPU fp32, {result['threads']} threads, median of {result['rounds']} "
        "interleaved rounds"
    )
    print(f"{'case':32s} {'median ms':>10s} {'/ train step':>13s}")
    for name, m in result["median_s"].items():
        print(f"{name:32s} {1e3 * m:10.1f} {result['ratio_to_train'][name]:13.3f}")
    ratio = result["ratio_to_train"]["probe step (fwd + act. bwd)"]
    print(
        f"probe / train = {ratio:.3f} -> the probe step is "
        f"{'cheaper' if ratio < 1 else 'NOT cheaper'} than a training step"
    )


def main(argv=None) -> None:
    args = size_parser(__doc__.split("\n")[0], rounds=10, out_name="probe_cpu.json").parse_args(argv)
    apply_threads(args)
    result = measure(rounds=args.rounds, **sizes(args))
    print_table(result)
    write_result(args.out, result)


# ---------------------------------------------------------------------------- pytest-benchmark
@pytest.fixture(scope="module")
def llama():
    return build_llama()


@pytest.mark.benchmark(group="probe-vs-train")
def test_train_step(benchmark, llama):
    model, batch = llama
    benchmark.pedantic(train_step, args=(model, batch), rounds=5, warmup_rounds=1)


@pytest.mark.benchmark(group="probe-vs-train")
def test_probe_step(benchmark, llama):
    model, batch = llama
    probe = make_probe(model)
    benchmark.pedantic(probe.step, args=(batch, fs.causal_lm_loss), rounds=5, warmup_rounds=1)


def test_probe_cheaper_than_train_step(benchmark):
    # the side-by-side ratio in one interleaved run (pytest-benchmark times the cases separately)
    result = benchmark.pedantic(
        measure,
        kwargs=dict(rounds=4, warmup=1, hidden=256, layers=4, seq=128, batch=8, vocab=2048),
        rounds=1,
        iterations=1,
    )
    print()
    print_table(result)
    assert result["ratio_to_train"]["probe step (fwd + act. bwd)"] < 1.0


if __name__ == "__main__":
    main()
