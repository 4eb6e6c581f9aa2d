"""Probe an HF LLaMA-style model at its residual stream: d_align, certificate, misalignment, AG_max.

What it does: builds a small byte-level LLaMA from a ``transformers`` config (or loads a local model
directory with ``--model DIR``), optionally trains it for a few steps on the Python standard
library's own source (no download: every Python install has it), then probes every residual point
with train batches from one set of stdlib files and held-out batches from a disjoint set, and
prints the report. Per-sample loss: mean next-byte cross-entropy of each sequence
(:func:`fused_stats.causal_lm_loss`), so each ``q`` is the gradient of one sequence's loss.

    python examples/probe_llama.py                       # 10 s to a few minutes on 2 busy CPU cores
    python examples/probe_llama.py --train-steps 0       # an untrained model (random init)
    python examples/probe_llama.py --out probe_out       # also writes report.json and plots
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch

import fused_stats as fs


def stdlib_bytes(first: int, count: int) -> bytes:
    """The bytes of ``count`` stdlib modules, starting at the ``first``-th (sorted, so reproducible)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return b"\n".join(f.read_bytes() for f in files[first : first + count])


def batches(data: bytes, seq: int, batch: int, count: int, seed: int):
    """``count`` batches of random windows; the last quarter of each batch is right-padded."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    out = []
    for _ in range(count):
        starts = torch.randint(0, len(tokens) - seq, (batch,), generator=gen)
        ids = torch.stack([tokens[s : s + seq] for s in starts.tolist()])
        mask = torch.ones_like(ids)
        mask[-max(batch // 4, 1) :, seq * 3 // 4 :] = 0  # shorter sequences: padding never counts
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def build(args):
    import transformers

    transformers.logging.set_verbosity_error()
    if args.model:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model)
    torch.manual_seed(args.seed)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=args.width,
        num_hidden_layers=args.depth,
        intermediate_size=4 * args.width,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
    )
    return transformers.LlamaForCausalLM(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a local HF model directory (default: a small LLaMA config)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--probe-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="directory for report.json, report.md and plots")
    args = parser.parse_args()

    model = build(args)
    train_text, test_text = stdlib_bytes(0, 60), stdlib_bytes(100, 30)  # disjoint files
    if args.train_steps:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for batch in batches(train_text, args.seq, args.batch, args.train_steps, args.seed):
            loss = fs.causal_lm_loss(model, batch).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"trained {args.train_steps} steps, last batch loss {loss.item():.3f} nats/byte")

    # fresh windows (new seed) for the probe; second_moment="pool" keeps the per-sample vectors
    # so that the empirical misalignment can be measured next to the certificate
    probe = fs.Probe(model, unit="sample", second_moment="pool")
    probe.run(
        batches(train_text, args.seq, args.batch, args.probe_batches, args.seed + 1),
        fs.causal_lm_loss,
        stream="train",
    )
    probe.run(
        batches(test_text, args.seq, args.batch, args.probe_batches, args.seed + 2),
        fs.causal_lm_loss,
        stream="test",
    )
    report = probe.report(
        meta={
            "width": args.width,
            "depth": args.depth,
            "seed": args.seed,
            "train_steps": args.train_steps,
            "data": "stdlib bytes",
        }
    )
    print(report.to_markdown())
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report.to_json(out / "report.json")
        report.to_markdown_file(out / "report.md")
        report.plot(out / "report.png")
        print(f"wrote {out}/report.json, report.md, report.png")


if __name__ == "__main__":
    main()
