"""Small shared pieces of the probe tests: a tanh residual block and padded causal-LM batches
(HF conventions: labels aligned with input_ids)."""

from __future__ import annotations

import torch
from torch import nn


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
