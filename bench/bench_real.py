#!/usr/bin/env python
"""Benchmark on a real pretrained LLM: probe steps against a training step, and their peak RSS.

Model: SmolLM2-135M-Instruct from :func:`fused_stats.pretrained` (LLaMA, hidden 576, 30 layers,
vocabulary 49,152), fp32 on CPU. Batch: B = 4 sequences of T = 256 real tokens, the standard
library's ``.py`` source (files in sorted order) tokenised with the model's own tokenizer, cut into
consecutive windows; every position is a token (attention mask 1) and a target.

Times, per thread count of ``--threads`` (default 1 and 2), in alternating rounds (every case once a
round, the order reversed every other round, so load from other processes and drift hit all cases
alike); each round's time of a case is divided by the training step's time in the same round:

* ``train step``: ``zero_grad``, forward with labels, mean cross-entropy, full backward (every
  weight gradient), ``AdamW.step()``: what a training loop pays per batch;
* ``floor``: a forward plus the activation-only backward from the loss to the first block's output,
  weights frozen, nothing measured: what any probe step must pay;
* ``probe``: ``fs.Probe(model)`` at all 30 residual points (target <= 0.7x);
* ``probe cross r16``: the same with ``cross=fs.CrossSpec(rank=16)`` (target <= 0.8x);
* ``probe growth 6``: ``cross=fs.GrowthProtocol`` with 6 evenly spaced candidates of
  ``fs.growth_points(model)`` (family "layer", init "zero"), at its candidates (target <= 1.5x).

The probes use ``fs.causal_lm_loss`` and the default second moment; each case runs once on a short
slice of the batch first (AdamW's state and the accumulators are allocated there, not in a timed
round). Per-round ratios, their median and spread (min..max) are printed, with the median of
process CPU time ratios beside them.

Peak RSS: a training step, a probe step and a probe step streamed by
``fs.stream_blocks(folder)`` from the saved folder, each in its own fresh process (this script with
``--rss-child``): load, one warm-up step on the short slice, reset the peak (``/proc/self/clear_refs``),
one step on the batch, then ``VmHWM``. Printed: the peak, the peak minus the RSS before the model was
loaded (interpreter and libraries), the probe's peak against the training step's (target <= 1), and
the streamed step's peak against the weights' bytes and against the in-memory probe's peak.

Run from the repository root (about 5 minutes on 2 quiet cores; ``--rounds`` sets the length)::

    python bench/bench_real.py                          # --rounds 2 --threads 1 2
    python bench/bench_real.py --profile                # plus torch.profiler's top ops of one step each

Writes ``bench/results/real_cpu.json``. ``--model`` also takes a local HF folder (its tokenizer, or
bytes when it has none), which is how the tests run this at a tiny size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402  (after the sys.path setup)
from _harness import RESULTS, write_result  # noqa: E402

import fused_stats as fs  # noqa: E402

TRAIN, FLOOR = "train step (fwd + bwd + AdamW)", "floor (fwd + act. bwd, no stats)"
PROBE, CROSS, GROWTH = "probe", "probe cross r16", "probe growth"
TARGETS = {PROBE: 0.7, CROSS: 0.8, GROWTH: 1.5}
WARM_TOKENS = 16  # the warm-up slice: 2 sequences of this many tokens


# ---------------------------------------------------------------------------- model and batch
def model_folder(spec: str) -> Path:
    """The HF folder of ``spec``: a known name (converted once by fs.pretrained_folder) or a folder."""
    path = Path(spec)
    return path if path.is_dir() else fs.pretrained_folder(spec, progress=True)


def load_model(folder: Path):
    """``(model in train mode, tokenizer or None)`` in fp32 from an HF folder."""
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, dtype=torch.float32
    )
    tokenizer = None
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.train(), tokenizer


def real_batch(tokenizer, batch: int, seq: int, vocab: int) -> dict:
    """``batch`` consecutive ``seq``-token windows of the standard library's source (module docstring);
    bytes modulo the vocabulary where there is no tokenizer."""
    from fused_stats.demo.corpus import stdlib_files

    need, ids = batch * seq, []
    for _, path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if tokenizer is not None:
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            ids.extend(b % vocab for b in text.encode())
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise SystemExit(f"the standard library's source gave {len(ids)} tokens, fewer than {need}")
    tokens = torch.tensor(ids[:need], dtype=torch.long).view(batch, seq)
    return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": tokens.clone()}


def warm_slice(batch: dict) -> dict:
    return {k: v[:2, :WARM_TOKENS].contiguous() for k, v in batch.items()}


def candidates(model, count: int) -> list[str]:
    """``count`` evenly spaced growth boundaries, the first and the last included."""
    points = fs.growth_points(model)
    count = min(count, len(points))
    if count == 1:
        return [points[-1]]
    return [points[round(i * (len(points) - 1) / (count - 1))] for i in range(count)]


# ---------------------------------------------------------------------------- the timed cases
def train_step_fn(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def train_step(batch):
        model.train()
        optimizer.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        optimizer.step()

    return train_step


def floor_step_fn(model, first_point: str):
    """Forward, then the backward from the loss to ``first_point``'s output only (weights frozen)."""
    params = [p for p in model.parameters() if p.requires_grad]
    module = model.get_submodule(first_point)

    def cut(_module, _args, output):  # the graph starts here, as the probe's does
        if isinstance(output, tuple):
            return (output[0].detach().requires_grad_(), *output[1:])
        return output.detach().requires_grad_()

    def floor_step(batch):
        handle = module.register_forward_hook(cut)
        for p in params:
            p.requires_grad_(False)
        try:
            model.eval()
            fs.causal_lm_loss(model, batch).sum().backward()
        finally:
            handle.remove()
            for p in params:
                p.requires_grad_(True)

    return floor_step


def probe_step_fn(probe):
    return lambda batch: probe.step(batch, fs.causal_lm_loss)


def build_cases(model, n_candidates: int) -> tuple[dict, dict]:
    """``(name -> step(batch), name -> the probe it steps)``."""
    protocol = fs.GrowthProtocol(candidates(model, n_candidates), family="layer", init="zero")
    probes = {
        PROBE: fs.Probe(model),
        CROSS: fs.Probe(model, points="residual", cross=fs.CrossSpec(rank=16)),
        GROWTH: fs.Probe(model, cross=protocol),
    }
    cases = {TRAIN: train_step_fn(model), FLOOR: floor_step_fn(model, probes[PROBE].points[0])}
    cases.update({name: probe_step_fn(p) for name, p in probes.items()})
    return cases, probes


def describe_probes(probes: dict) -> dict:
    """What each probe measured: its points and the samples its first point folded."""
    return {
        name: {
            "points": list(p.points),
            "samples": p.stats[p.points[0]].n,
            "cross": type(p.cross).__name__ if p.cross is not None else None,
        }
        for name, p in probes.items()
    }


def time_rounds(cases: dict, batch: dict, rounds: int, log) -> dict:
    """Wall and CPU seconds of every case in every round (module docstring: alternating order)."""
    wall = {name: [] for name in cases}
    cpu = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            c0, t0 = time.process_time(), time.perf_counter()
            cases[name](batch)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        log(
            f"  round {r + 1}/{rounds}: train {wall[TRAIN][-1]:.2f} s; "
            + ", ".join(f"{n} {wall[n][-1] / wall[TRAIN][-1]:.3f}x" for n in names if n != TRAIN)
        )
    return {"wall_s": wall, "cpu_s": cpu}


def summarise(times: dict) -> dict:
    wall, cpu = times["wall_s"], times["cpu_s"]
    out = {}
    for name in wall:
        ratios = [a / b for a, b in zip(wall[name], wall[TRAIN])]
        cpu_ratios = [a / b for a, b in zip(cpu[name], cpu[TRAIN])]
        out[name] = {
            "median_s": statistics.median(wall[name]),
            "per_round_ratio": ratios,
            "median_ratio": statistics.median(ratios),
            "spread": [min(ratios), max(ratios)],
            "median_cpu_ratio": statistics.median(cpu_ratios),
            "target": TARGETS.get(name),
        }
    return out


def print_times(threads: int, summary: dict) -> None:
    print(
        f"{threads} thread(s): {'case':34s} {'median s':>9} {'ratio':>7} {'spread':>15} "
        f"{'cpu ratio':>9} {'target':>7}"
    )
    for name, s in summary.items():
        target = s["target"]
        verdict = "" if target is None else ("  met" if s["median_ratio"] <= target else "  MISSED")
        print(
            f"{'':12s} {name:34s} {s['median_s']:9.2f} {s['median_ratio']:7.3f} "
            f"{s['spread'][0]:7.3f}..{s['spread'][1]:<6.3f} {s['median_cpu_ratio']:9.3f} "
            f"{'' if target is None else f'<= {target}':>7}{verdict}"
        )


def profile_steps(cases: dict, batch: dict, top: int = 12) -> None:
    """torch.profiler's top operators (self CPU time) of one step of every case."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in cases.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(batch)
        print(f"--- {name}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


# ---------------------------------------------------------------------------- peak RSS, in children
def status_bytes(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def rss_child(kind: str, folder: Path, batch_file: str) -> dict:
    """One step of ``kind`` ("train", "probe" or "stream") in this fresh process (module docstring)."""
    import transformers  # noqa: F401  (imported before ``base``: the libraries are not the model)

    batch = torch.load(batch_file)
    base = status_bytes("VmRSS:")
    streamer = None
    if kind == "stream":
        streamer = fs.stream_blocks(folder)
        model = streamer.model
    else:
        model, _ = load_model(folder)
    step = train_step_fn(model) if kind == "train" else probe_step_fn(fs.Probe(model))
    step(warm_slice(batch))
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # the peak so far := the current RSS
    start = status_bytes("VmRSS:")
    step(batch)
    out = {"base": base, "start": start, "peak": status_bytes("VmHWM:")}
    if streamer is not None:
        out.update(block_bytes=streamer.block_bytes, peak_resident_bytes=streamer.peak_resident_bytes)
        streamer.close()
    return out


def measure_rss(folder: Path, batch: dict, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        batch_file = os.path.join(tmp, "batch.pt")
        torch.save(batch, batch_file)
        out = {}
        for kind in ("train", "probe", "stream"):
            child = ["--rss-child", kind, "--model", str(folder), "--batch-file", batch_file]
            run = subprocess.run(
                [sys.executable, __file__, *child, "--threads", str(threads)],
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
                capture_output=True,
                text=True,
            )
            if run.returncode != 0:
                raise SystemExit(f"the {kind} RSS child failed:\n{run.stderr[-3000:]}")
            out[kind] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def print_rss(rss: dict, weight_bytes: int) -> dict:
    mib = 2**20
    print(f"peak RSS of one step, each in a fresh process (weights {weight_bytes / mib:.0f} MiB):")
    for kind, r in rss.items():
        print(
            f"  {kind:7s} peak {r['peak'] / mib:7.0f} MiB; above the interpreter "
            f"{(r['peak'] - r['base']) / mib:7.0f} MiB; step growth {(r['peak'] - r['start']) / mib:6.0f} MiB"
        )
    ratios = {
        "probe_over_train_peak": rss["probe"]["peak"] / rss["train"]["peak"],
        "stream_above_interpreter_over_weights": (rss["stream"]["peak"] - rss["stream"]["base"])
        / weight_bytes,
        "stream_over_probe_peak": rss["stream"]["peak"] / rss["probe"]["peak"],
    }
    print(
        f"  probe / train peak {ratios['probe_over_train_peak']:.3f} (target <= 1); streamed above the "
        f"interpreter / weights {ratios['stream_above_interpreter_over_weights']:.3f}; streamed / "
        f"in-memory probe peak {ratios['stream_over_probe_peak']:.3f}"
    )
    return ratios


# ---------------------------------------------------------------------------- main
def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="fs.pretrained name or an HF folder")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per thread count")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--candidates", type=int, default=6, help="growth protocol candidates")
    parser.add_argument("--profile", action="store_true", help="torch.profiler of one step per case")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS processes")
    parser.add_argument("--out", default=str(RESULTS / "real_cpu.json"))
    parser.add_argument("--rss-child", choices=("train", "probe", "stream"), help=argparse.SUPPRESS)
    parser.add_argument("--batch-file", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.rss_child:
        torch.set_num_threads(args.threads[0])
        result = rss_child(args.rss_child, Path(args.model), args.batch_file)
        print(json.dumps(result))
        return 0
    start = time.perf_counter()
    folder = model_folder(args.model)
    model, tokenizer = load_model(folder)
    batch = real_batch(tokenizer, args.batch, args.seq, model.config.vocab_size)
    weight_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    params = sum(p.numel() for p in model.parameters())
    cases, probes = build_cases(model, args.candidates)
    warm = warm_slice(batch)
    for fn in cases.values():
        fn(warm)
    print(
        f"{type(model).__name__} from {folder.name}: {params / 1e6:.1f} M parameters, hidden "
        f"{model.config.hidden_size}, {model.config.num_hidden_layers} layers, vocabulary "
        f"{model.config.vocab_size}; fp32 CPU, batch {args.batch} x {args.seq} real tokens; torch "
        f"{torch.__version__}; {args.rounds} alternating rounds per thread count",
        flush=True,
    )
    timings = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        times = time_rounds(cases, batch, args.rounds, lambda line: print(line, flush=True))
        summary = summarise(times)
        print_times(threads, summary)
        timings[str(threads)] = {"summary": summary, **times}
    if args.profile:
        profile_steps(cases, batch)
    rss = rss_ratios = None
    if not args.no_rss:
        rss = measure_rss(folder, batch, max(args.threads))
        rss_ratios = print_rss(rss, weight_bytes)
    result = {
        "model": args.model,
        "folder": folder.name,
        "parameters": params,
        "weight_bytes": weight_bytes,
        "batch": args.batch,
        "seq": args.seq,
        "rounds": args.rounds,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "probes": describe_probes(probes),
        "targets": TARGETS,
        "timings_by_threads": timings,
        "rss_bytes": rss,
        "rss_threads": max(args.threads),
        "rss_ratios": rss_ratios,
        "seconds": time.perf_counter() - start,
    }
    print(f"whole benchmark {result['seconds']:.0f} s")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
