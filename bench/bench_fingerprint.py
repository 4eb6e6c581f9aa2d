"""Benchmark: the cost of a report's model fingerprint (:mod:`fused_stats.api.report.identity`).

A randomly initialised LLaMA of about 110M parameters (d = 768, 12 layers, f = 2048, vocab 16000,
untied) on CPU; ``model_fingerprint`` (config digest, parameter count, SHA-256 over the state
dict's bytes in name order) is timed ``--repeats`` times in fp32 and in bf16, and the median
seconds, the bytes hashed and the rate are printed. The cost is the hash of every byte once (plus
a device-to-host copy for a model on a GPU), so it scales with the model's bytes.

Run::

    python bench/bench_fingerprint.py            # --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from fused_stats.api.report.identity import model_fingerprint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=16000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=512,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    count = sum(p.numel() for p in model.parameters())
    print(f"LLaMA, {count / 1e6:.1f}M parameters, on CPU")
    for dtype in (torch.float32, torch.bfloat16):
        model = model.to(dtype)
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            model_fingerprint(model)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        print(
            f"{str(dtype).removeprefix('torch.'):<9} {size / 2**20:7.0f} MiB hashed: median {median:.3f} s "
            f"over {args.repeats} ({size / median / 2**30:.2f} GiB/s)"
        )


if __name__ == "__main__":
    main()
