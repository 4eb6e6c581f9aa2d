"""Quickstart: every public entry point of fused_stats on a tiny LLaMA-style model, in seconds.

Builds a random-init LLaMA from a ``transformers`` config, probes its residual points on train and
held-out batches (random token ids: this shows the calls, not a finding), then prints the width
statistics (d_align, certificate, empirical misalignment, realized alignment), the depth statistic
(saturation test of a zero-output block) and a direct intervention table. It is the README's
"Using it from Python" snippet, runnable.

    python examples/quickstart.py
"""

from __future__ import annotations

import torch
import transformers

import fused_stats as fs


def main() -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(cfg)

    def batches(k):
        return [
            {
                "input_ids": torch.randint(0, 64, (8, 16)),
                "attention_mask": torch.ones(8, 16, dtype=torch.long),
            }
            for _ in range(k)
        ]

    train_batches, heldout_batches = batches(4), batches(4)
    # "pool" keeps every per-sample vector (needed for the split Monte Carlo); "auto" keeps a pool
    # only while it is smaller than the dense d x d matrix (here: 19 samples at d = 32)
    probe = fs.Probe(
        model,
        points="residual",
        unit="sample",
        second_moment="pool",
        cross=fs.CrossSpec(rank=64, activation="gelu"),
    )
    for batch in train_batches:
        probe.step(batch, fs.causal_lm_loss)
    for batch in heldout_batches:
        probe.step(batch, fs.causal_lm_loss, stream="test")
    point = fs.residual_points(model)[-1]
    est = probe.stats[point].estimate()  # the train stream alone
    print(f"{point} (train stream): n={est.n} mu_norm2={est.mu_norm2:.3g} d_align={est.d_align:.3g}")
    print("pooled train + test moments:", probe.certificate(point))
    print("splits of the pooled samples:", probe.misalignment(point, trials=10_000))
    print("realized alignment (train mean . test mean)", probe.realized_alignment(point))
    print(probe.saturation(point, alpha=0.05))
    print(probe.report(meta={"width": 32}).to_markdown())

    block = fs.insert_zero_block(model, point, kind="block", spec=fs.CrossSpec(rank=16))
    print("inserted", sum(p.numel() for p in block.parameters()), "zero-initialised parameters")
    fs.remove_inserted_block(model, point)
    result = fs.intervene(
        model,
        point,
        train_batches,
        heldout_batches,
        eta=[1.0, 0.1, 0.01],
        kind="bias",
        loss_fn=fs.causal_lm_loss,
    )
    print(result.to_markdown())


if __name__ == "__main__":
    main()
