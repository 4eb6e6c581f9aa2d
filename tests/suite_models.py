"""Tiny checkpoints for the suite tests: a locally trained BPE tokenizer, LLaMA decoders at three
widths × two depths and one GPT-NeoX model at three "steps", saved as sharded safetensors."""

from __future__ import annotations

import random
from pathlib import Path

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
    "upsilon",
    "phi",
    "chi",
    "psi",
    "omega",
    "residual",
    "stream",
    "gradient",
    "width",
    "depth",
    "block",
    "layer",
    "norm",
]
WIDTHS = (16, 24, 32)
DEPTHS = (1, 2)
STEPS = (0, 100, 200)


def corpus(seed: int, words: int) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(words // 12):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(12)) + ".")
    return "\n".join(lines) + "\n"


def build_tokenizer(text: str):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<eos>"])
    tok.train_from_iterator([text], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def save(model, tokenizer, folder: Path) -> Path:
    model.save_pretrained(folder, max_shard_size="10KB")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def build_all(root: Path) -> dict:
    import torch
    import transformers

    root.mkdir(parents=True, exist_ok=True)
    text = corpus(0, 3000)
    (root / "train.txt").write_text(text)
    (root / "test.txt").write_text(corpus(1, 1500))
    tokenizer = build_tokenizer(text)
    vocab = len(tokenizer)
    folders = {}
    for w in WIDTHS:
        for d in DEPTHS:
            cfg = transformers.LlamaConfig(
                vocab_size=vocab,
                hidden_size=w,
                intermediate_size=2 * w,
                num_hidden_layers=d,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=64,
                tie_word_embeddings=False,
            )
            torch.manual_seed(1000 * w + d)
            folders[f"llama-w{w}-d{d}"] = save(
                transformers.LlamaForCausalLM(cfg), tokenizer, root / "ckpts" / f"llama-w{w}-d{d}"
            )
    for step in STEPS:
        cfg = transformers.GPTNeoXConfig(
            vocab_size=vocab,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
        )
        torch.manual_seed(7 + step)
        folders[f"step{step}"] = save(
            transformers.GPTNeoXForCausalLM(cfg), tokenizer, root / "ckpts" / "neox" / f"step{step}"
        )
    return {"root": root, "tokenizer": tokenizer, "folders": folders}
