"""Shared scaffolding of the CPU benchmarks: the LLaMA-style model and batch they time, their
command-line size options, the thread setting and the JSON result file.

The model: an HF ``LlamaForCausalLM`` from a config (hidden ``h``, SwiGLU width ``8h/3`` rounded to
8, head size 64), random token ids, a quarter of the sequences right-padded over their last
quarter (``attention_mask`` 0, labels -100), so masks are exercised as in real batches.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def build_llama(hidden=256, layers=4, seq=128, batch=8, vocab=2048, seed=0):
    """``(model, batch)``: a float32 LLaMA-style model and one padded batch (module docstring)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 64, 1),
        vocab_size=vocab,
        max_position_embeddings=seq,
    )
    model = transformers.LlamaForCausalLM(cfg).float()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for b in range(0, batch, 4):  # a quarter of the sequences are padded
        mask[b, seq * 3 // 4 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return model, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def size_parser(description: str, rounds: int, out_name: str) -> argparse.ArgumentParser:
    """Options shared by the scripts: rounds, model sizes, threads, output JSON."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default); 1 keeps the ratio stable on a busy machine",
    )
    parser.add_argument("--out", default=str(RESULTS / out_name))
    return parser


def sizes(args) -> dict:
    return dict(hidden=args.hidden, layers=args.layers, seq=args.seq, batch=args.batch, vocab=args.vocab)


def apply_threads(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def write_result(out, result: dict) -> None:
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out}")
