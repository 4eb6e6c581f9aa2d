"""First probe step of a growth tangent probe with and without the self-check (CPU, 2 threads).

Run from the repository root: ``python bench/bench_tangent_selfcheck.py``; each configuration
runs 3 times with and 3 times without, alternated, and the best of each is printed.
"""

import sys
import time

import torch
import transformers

import fused_stats as fs
from fused_stats.api.growth.tangent import GrowthTangent

sys.path.insert(0, "tests")  # run from the repository root
from test_growth_tangent import per_sample_loss


def run(hidden, inter, heads, B, T, dtype):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    pts = fs.growth_points(model)
    g = torch.Generator().manual_seed(1)
    batch = {
        "input_ids": torch.randint(0, 1000, (B, T), generator=g),
        "attention_mask": torch.ones(B, T, dtype=torch.long),
    }
    best = {True: [], False: []}
    for check in (False, True) * 3:  # alternated: warm-up and noise fall on both
        t0 = time.perf_counter()
        probe = fs.Probe(
            model, points=pts, cross=GrowthTangent(fs.GrowthProtocol(pts), model, self_check=check)
        )
        probe.step(batch, per_sample_loss)
        best[check].append(time.perf_counter() - t0)
    return min(best[True]), min(best[False])


if __name__ == "__main__":
    torch.set_num_threads(2)
    for name, args in [
        ("tiny d=16 f=24 B=6 T=5 fp64", (16, 24, 2, 6, 5, torch.float64)),
        ("d=768 f=3072 12 heads B=4 T=128 fp32", (768, 3072, 12, 4, 128, torch.float32)),
    ]:
        on, off = run(*args)
        print(
            f"{name}: first step with self-check {on:.3f} s, without {off:.3f} s, cost {on - off:+.3f} s ({(on / off - 1) * 100:+.0f}%)"
        )
