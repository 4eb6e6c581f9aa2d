"""fused_stats as the statistics backend inside an nnsight trace.

An HF LLaMA built from a config (random weights, fp64: no download) is wrapped in
``nnsight.NNsight``. Inside ``with model.trace(input_ids=...)`` the per-sequence losses are
formed from the traced logits, their sum is differentiated (``with loss.backward():``), and the
gradient that reaches each decoder layer's output (the residual stream after that block) is
folded into a ``fs.GradStats`` right there: nothing per-sample is saved out of the trace.
nnsight hands gradients over in backward order, so the layers are visited deepest first.

Checks, exit code 1 on disagreement: the same statistics from ``fs.Probe`` on the underlying
module, and from a per-sample loop (one backward per sequence, rows stacked, U-statistics from the
rows); the tolerance is 1e-9 relative (they agree to about 1e-15 here).

    python examples/probe_nnsight.py          # hidden 64, 4 layers, 64 sequences
    python examples/probe_nnsight.py --tiny   # what the tests run
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from probe_transformer_lens import relative_difference, require_peer

import fused_stats as fs


def per_sequence_losses(logits, ids):
    """``ℓ_b``: the mean next-token cross-entropy of each sequence (no padding here)."""
    B, T, V = logits.shape
    token = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none")
    return token.view(B, T - 1).mean(dim=1)


def main(argv=None) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    NNsight = require_peer("nnsight").NNsight

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the tests)")
    args = parser.parse_args(argv)
    layers, d, vocab, T, n, B = (2, 16, 37, 8, 12, 4) if args.tiny else (4, 64, 500, 32, 64, 16)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=d,
        intermediate_size=2 * d,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=T,
    )
    hf = LlamaForCausalLM(cfg).to(torch.float64)
    model = NNsight(hf)
    tokens = torch.randint(0, vocab, (n, T))

    # fused_stats inside the nnsight trace
    stats = {i: fs.GradStats(d, second_moment="dense", name=f"layer {i}") for i in range(layers)}
    for ids in tokens.split(B):
        with model.trace(input_ids=ids):
            outputs = [model.model.layers[i].output for i in range(layers)]
            losses = per_sequence_losses(model.output.logits, ids)
            with losses.sum().backward():
                for i in reversed(range(layers)):  # gradients arrive deepest layer first
                    stats[i].update(outputs[i].grad)  # (B, T, d) -> q_b = Σ_t ∂ℓ_b/∂z_bt
        hf.zero_grad(set_to_none=True)

    # check 1: fs.Probe on the same module
    probe = fs.Probe(hf, second_moment="dense")
    for ids in tokens.split(B):
        probe.step({"input_ids": ids}, fs.causal_lm_loss)

    # check 2: one backward per sequence
    rows = {i: [] for i in range(layers)}
    for b in range(n):
        seen = {}
        hooks = [
            hf.model.layers[i].register_forward_hook(
                lambda m, a, out, i=i, seen=seen: seen.__setitem__(
                    i, out[0] if isinstance(out, tuple) else out
                )
            )
            for i in range(layers)
        ]
        try:
            loss = per_sequence_losses(hf(input_ids=tokens[b : b + 1]).logits, tokens[b : b + 1])[0]
        finally:
            for h in hooks:
                h.remove()
        grads = torch.autograd.grad(loss, [seen[i] for i in range(layers)])
        for i in range(layers):
            rows[i].append(grads[i][0].sum(0).numpy())

    import numpy as np

    worst = 0.0
    print(f"{'point':>16} {'d_align':>11} {'|mu|^2':>11}  max rel. diff (nnsight, Probe vs per-sample)")
    for i in range(layers):
        estimates = (stats[i].estimate(), probe.stats[f"model.layers.{i}"].estimate())
        diff = relative_difference(np.stack(rows[i]), estimates)
        worst = max(worst, diff)
        est = stats[i].estimate()
        print(f"{'model.layers.' + str(i):>16} {est.d_align:11.4g} {est.mu_norm2:11.4g}  {diff:.2e}")
    if worst > 1e-9:
        print(f"DISAGREE: nnsight trace / Probe / per-sample loop differ by {worst:.2e}")
        return 1
    print(f"the nnsight trace, fs.Probe and the per-sample loop agree (max rel. diff {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
