"""Small shared pieces of the probe tests: a tiny llama config, a tanh residual block, padded
causal-LM batches (HF conventions: labels aligned with input_ids), and a two-block
masked-mean-pool classifier with its loss and random masked batches."""

from __future__ import annotations

import torch
from torch import nn

# A two-layer llama of hidden size 16 as a HF ``config.json`` dict (the CLI's ``--model`` input).
TINY_LLAMA_CONFIG = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}


class TanhBlock(nn.Module):
    """``x + tanh(W x + b)``: a residual block whose output is a probe point."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


def padded_lm_batch(gen, lengths, T, vocab, prompts=None):
    """Right-padded batch of ``len(lengths)`` sequences of ``T`` positions: padding gets random
    token ids (they must never matter) and label -100, and the first ``prompts[b]`` tokens of
    sequence ``b`` are an unsupervised prompt (label -100)."""
    B = len(lengths)
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    mask = torch.zeros(B, T, dtype=torch.long)
    labels = ids.clone()
    for b, length in enumerate(lengths):
        mask[b, :length] = 1
        labels[b, length:] = -100
        if prompts is not None:
            labels[b, : prompts[b]] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def split(batch, sizes):
    """Consecutive sub-batches of ``sizes`` samples."""
    out, start = [], 0
    for size in sizes:
        out.append({k: v[start : start + size] for k, v in batch.items()})
        start += size
    return out


class MaskedPoolNet(nn.Module):
    """(B, T, 4) inputs -> two tanh residual blocks (the points ``blocks.0``, ``blocks.1``) ->
    masked mean pool over positions -> 3 classes."""

    def __init__(self, d, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList([TanhBlock(d) for _ in range(2)])
        self.out = nn.Linear(d, 3)

    def forward(self, x, mask):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.out((h * m).sum(1) / m.sum(1).clamp_min(1.0))


def masked_pool_loss(model, batch):
    """Per-sample cross entropy of a :class:`MaskedPoolNet` on a :func:`masked_seq_batches` batch."""
    logits = model(batch["x"], batch["attention_mask"])
    return nn.functional.cross_entropy(logits, batch["y"], reduction="none")


def masked_seq_batches(seed: int, count: int, size: int, T: int):
    """``count`` batches of ``size`` sequences of ``T`` positions for :class:`MaskedPoolNet`:
    inputs ``x``, a random ``attention_mask`` (the first position always kept) and labels ``y``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        mask = torch.rand(size, T, generator=gen) < 0.8
        mask[:, 0] = True
        out.append(
            {
                "x": torch.randn(size, T, 4, generator=gen) + 0.5,
                "attention_mask": mask,
                "y": torch.randint(0, 3, (size,), generator=gen),
            }
        )
    return out


def tiny_lm_config(arch: str, layers: int = 3, d: int = 16, vocab: int = 40):
    """A tiny HF config of ``arch`` ("llama", "neox" or "gpt2"): 4 heads, MLP width 24 (GPT-2: 4 d),
    32 positions, a ``vocab``-token vocabulary."""
    import transformers

    if arch == "llama":
        return transformers.LlamaConfig(
            vocab_size=vocab,
            hidden_size=d,
            intermediate_size=24,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    if arch == "neox":
        return transformers.GPTNeoXConfig(
            vocab_size=vocab,
            hidden_size=d,
            intermediate_size=24,
            num_hidden_layers=layers,
            num_attention_heads=4,
            max_position_embeddings=32,
        )
    return transformers.GPT2Config(
        vocab_size=vocab, n_embd=d, n_layer=layers, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0
    )
