#!/usr/bin/env python
"""Weight-streamed probe step vs in-memory probe step on CPU, side by side in one run.

Run from the repository root::

    python bench/bench_stream.py                 # hidden 512, 8 blocks, batch 8 x 128, 1 thread

Times (medians over ``--rounds`` interleaved rounds) one ``Probe.step`` on a LLaMA-style model
(:func:`bench._harness.build_llama`) three ways: all weights in memory, blocks streamed by
:func:`fused_stats.stream_blocks` from the module's host tensors, and from a checkpoint folder
written by ``save_pretrained`` in several shards. Prints the ratios streamed / in-memory (target
<= 1.8: one recomputed forward per block is the price). Peak RSS growth of one probe step from
the folder, streamed vs loaded whole, is measured in two fresh processes each (``VmHWM`` after the
step minus ``VmRSS`` before loading, after a warm-up on a tiny model) and printed as a ratio
(target <= 0.35), with the default allocator and with glibc's mmap threshold fixed at 1 MiB.
Writes ``bench/results/stream.json``.
"""

from __future__ import annotations

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


from _harness import apply_threads, build_llama, size_parser, sizes, write_result  # noqa: E402  (after the sys.path setup)

import fused_stats as fs  # noqa: E402  (after the sys.path setup)

RSS_CHILD = """
import json, sys, torch
sys.path.insert(0, sys.argv[4])
import fused_stats as fs, transformers
from _harness import build_llama
transformers.logging.set_verbosity_error()
torch.set_num_threads(int(sys.argv[3]))
def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
small, batch = build_llama(hidden=64, layers=2, seq=int(sys.argv[5]), batch=int(sys.argv[6]), vocab=int(sys.argv[7]))
fs.Probe(small).step(batch, fs.causal_lm_loss)       # warm-up: imports, first-use allocations
with fs.stream_blocks(small) as st:
    fs.Probe(st.model).step(batch, fs.causal_lm_loss)
del small
open("/proc/self/clear_refs", "w").write("5")        # peak RSS := current RSS
start = rss("VmRSS:")
if sys.argv[2] == "stream":
    with fs.stream_blocks(sys.argv[1]) as st:
        fs.Probe(st.model).step(batch, fs.causal_lm_loss)
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True)
    fs.Probe(model).step(batch, fs.causal_lm_loss)
print(json.dumps({"growth": rss("VmHWM:") - start}))
"""


def peak_growth(folder, how, args, env=None) -> int:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            RSS_CHILD,
            str(folder),
            how,
            str(args.threads or 0),
            str(ROOT / "bench"),
            str(args.seq),
            str(args.batch),
            str(args.vocab),
        ],
        env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["growth"]


def main(argv=None) -> int:
    parser = size_parser(__doc__.split("\n")[0], rounds=5, out_name="stream.json")
    parser.set_defaults(hidden=512, layers=8)
    args = parser.parse_args(argv)
    apply_threads(args)
    model, batch = build_llama(**sizes(args))
    model.eval()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size=f"{max(params // 4, 1) // 2**20 + 1}MB")
        shards = len(list(Path(tmp).glob("model-*-of-*.safetensors")))
        reference = fs.Probe(model)
        reference.step(batch, fs.causal_lm_loss)

        def step_in_memory():
            fs.Probe(model).step(batch, fs.causal_lm_loss)

        host = fs.stream_blocks(model)
        folder = fs.stream_blocks(tmp)
        streamed = {"host": host, "folder": folder}

        def stepper(st):
            return lambda: fs.Probe(st.model).step(batch, fs.causal_lm_loss)

        runs = {"in_memory": step_in_memory, "host": stepper(host), "folder": stepper(folder)}
        times = {k: [] for k in runs}
        for fn in runs.values():  # warm-up
            fn()
        for _ in range(args.rounds):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        # exactness of what was timed: the folder-streamed statistics equal the in-memory ones
        check = fs.Probe(folder.model)
        check.step(batch, fs.causal_lm_loss)
        worst = max(
            abs(check.stats[p].estimate().trace_sigma2 / reference.stats[p].estimate().trace_sigma2 - 1)
            for p in reference.points
        )
        peaks = {k: st.peak_resident_bytes for k, st in streamed.items()}
        block_bytes = folder.block_bytes
        host.close()
        folder.close()
        rss = {how: peak_growth(tmp, how, args) for how in ("memory", "stream")}
        # the same with glibc's mmap threshold fixed at 1 MiB (its dynamic threshold keeps freed
        # activation buffers on the heap, which RSS still counts)
        fixed = {
            how: peak_growth(tmp, how, args, {"MALLOC_MMAP_THRESHOLD_": "1048576"})
            for how in ("memory", "stream")
        }
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "machine": "see README (2-core shared VM)",
        "sizes": sizes(args),
        "threads": args.threads,
        "shards": shards,
        "param_bytes": params,
        "block_bytes": block_bytes,
        "peak_resident_bytes": peaks,
        "median_s": med,
        "ratio_host": med["host"] / med["in_memory"],
        "ratio_folder": med["folder"] / med["in_memory"],
        "rss_growth": rss,
        "rss_ratio": rss["stream"] / rss["memory"],
        "rss_growth_mmap_threshold_1mib": fixed,
        "rss_ratio_mmap_threshold_1mib": fixed["stream"] / fixed["memory"],
        "max_rel_diff_trace_sigma2": worst,
    }
    print(
        f"LLaMA-style hidden {args.hidden}, {args.layers} blocks, batch {args.batch} x {args.seq}, "
        f"{params / 2**20:.1f} MiB of fp32 parameters, {shards} shards, {args.threads} thread(s)"
    )
    print(
        f"probe step: in memory {med['in_memory'] * 1e3:.0f} ms, streamed from host "
        f"{med['host'] * 1e3:.0f} ms ({result['ratio_host']:.2f}x), from the folder "
        f"{med['folder'] * 1e3:.0f} ms ({result['ratio_folder']:.2f}x)   target <= 1.8x"
    )
    print(
        f"peak RSS growth of a step: in memory {rss['memory'] / 2**20:.0f} MiB, streamed "
        f"{rss['stream'] / 2**20:.0f} MiB, ratio {result['rss_ratio']:.2f}   target <= 0.35"
    )
    print(
        f"  with MALLOC_MMAP_THRESHOLD_=1048576: in memory {fixed['memory'] / 2**20:.0f} MiB, "
        f"streamed {fixed['stream'] / 2**20:.0f} MiB, ratio {result['rss_ratio_mmap_threshold_1mib']:.2f}"
    )
    print(
        f"peak materialised block bytes / block bytes: "
        f"{ {k: round(v / block_bytes, 2) for k, v in peaks.items()} } (prefetch 1: <= 2)"
    )
    print(f"streamed vs in-memory trace_sigma2, worst relative difference: {worst:.1e}")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
