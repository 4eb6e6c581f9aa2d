"""Small LLaMA-style byte-level decoders for the demo, and their single-pass training loop.

Role: the models whose residual streams the demo probes. Built from ``transformers.LlamaConfig``
(RMSNorm, rotary positions, SwiGLU MLP, pre-norm residual blocks), vocabulary 256 (bytes):

* width ``N`` = ``hidden_size``; ``intermediate_size = 4 N``; heads of size 16 (``N / 16`` heads,
  at least one), so attention is the same per head at every width; untied embeddings.
* Training: AdamW (β = 0.9, 0.95; no weight decay), linear warm-up over the first 10 % of steps,
  then cosine decay to 10 %. Learning rate ``lr(N) = base_lr · 32 / N``: the 1/width scaling that,
  in the small experiments of docs/design.md, section 9, was needed for any width trend to appear (muP-style
  reasoning, Yang et al., "Tensor Programs V", 2022: Adam's update size per weight does not shrink
  with fan-in, so the step on a hidden layer's output grows with N unless lr ∝ 1/N).
* Single pass over fresh text: every batch is new windows of the training split (no epochs).
"""

from __future__ import annotations

import math
import time

import torch

from ..errors import FusedStatsError

HEAD_DIM = 16
VOCAB = 256


def llama_config(width: int, depth: int, seq_len: int):
    try:
        from transformers import LlamaConfig
    except ImportError:
        raise FusedStatsError("the demo needs transformers: pip install 'fused-stats[demo]'") from None
    if width % HEAD_DIM:
        raise FusedStatsError(f"width must be a multiple of {HEAD_DIM}, got {width}")
    if depth < 1:
        raise FusedStatsError(f"depth must be >= 1, got {depth}")
    heads = max(1, width // HEAD_DIM)
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=depth,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_llama(width: int, depth: int, seq_len: int, seed: int):
    from transformers import LlamaForCausalLM

    config = llama_config(width, depth, seq_len)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def lr_for(width: int, base_lr: float) -> float:
    return base_lr * 32.0 / width


def lr_factor(step: int, steps: int, warmup_frac: float = 0.1, floor: float = 0.1) -> float:
    warm = max(1, int(steps * warmup_frac))
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train(model, batches, steps: int, lr: float, progress=None) -> dict:
    """One pass of AdamW over ``steps`` batches of byte windows; returns loss/timing summary."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
    model.train()
    losses = []
    tokens = 0
    start = time.perf_counter()
    for _, ids in zip(range(steps), batches):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        tokens += ids.numel()
        if progress is not None:
            progress.update(1)
    if len(losses) < steps:
        raise FusedStatsError(f"training ran out of text after {len(losses)} of {steps} steps")
    for p in model.parameters():  # Adam state and grads are not needed any more
        p.grad = None
    model.eval()
    tail = losses[-max(1, steps // 10) :]
    return {
        "steps": steps,
        "tokens": tokens,
        "lr": lr,
        "first_loss": losses[0],
        "final_loss": sum(tail) / len(tail),
        "train_seconds": time.perf_counter() - start,
    }


@torch.no_grad()
def eval_loss(model, batches) -> float:
    """Mean next-byte cross-entropy (nats) over the batches."""
    model.eval()
    total, count = 0.0, 0
    for ids in batches:
        total += float(model(input_ids=ids, labels=ids).loss) * ids.numel()
        count += ids.numel()
    return total / count
