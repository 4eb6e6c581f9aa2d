"""``mask="labels"`` when the padding carries labels (``labels = input_ids.clone()``, pads not −100).

The rule (written out here, from the HF causal-LM convention): position ``t`` emits a supervised
prediction when ``labels[t+1] ≠ −100`` AND ``attention_mask[t] = 1`` AND ``attention_mask[t+1] = 1``.
With right padding and labels on the pads, the last real token of a padded sequence has a label on
its right neighbour (a pad), so only the attention check at ``t+1`` keeps it out; it predicts nothing
and its gradient is exactly zero, so counting it would inflate ``n`` and bias every estimate.

Checks with ``unit="position"``: ``n`` equals the count of such positions; the statistics are
identical (``==``) to those obtained with that mask passed explicitly, and equal to the per-position
gradients of one backward per sequence (padding stripped, tests/per_sample_reference.py) at those
positions.
"""

from __future__ import annotations

import pytest
import torch

import fused_stats as fs

import per_sample_reference as R

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 40


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=16,
        initializer_range=0.3,
    )
    return transformers.LlamaForCausalLM(cfg).double()


def padded_batch_with_labelled_pads(gen, lengths, T):
    """Right padding; ``labels = input_ids.clone()``: the pads carry real token ids as labels."""
    B = len(lengths)
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    attn = torch.zeros(B, T, dtype=torch.long)
    for b, length in enumerate(lengths):
        attn[b, :length] = 1
    return {"input_ids": ids, "attention_mask": attn, "labels": ids.clone()}


def emitting(batch) -> torch.Tensor:
    labels, attn = batch["labels"], batch["attention_mask"]
    keep = torch.zeros(labels.shape, dtype=torch.bool)
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            keep[b, t] = bool(labels[b, t + 1] != -100 and attn[b, t] == 1 and attn[b, t + 1] == 1)
    return keep


def test_labels_mask_drops_the_last_real_token_when_pads_carry_labels(gen):
    model = tiny_llama()
    batch = padded_batch_with_labelled_pads(gen, [6, 3, 5, 6, 2], T=6)
    keep = emitting(batch)
    assert int(keep.sum()) == 5 + 2 + 4 + 5 + 1
    points = fs.residual_points(model)
    by_rule = fs.Probe(model, unit="position", second_moment="dense")
    by_rule.step(batch, fs.causal_lm_loss, mask="labels")
    explicit = fs.Probe(model, unit="position", second_moment="dense")
    explicit.step(batch, fs.causal_lm_loss, mask=keep)
    ref = R.lm_reference(model, batch, points, "position", label_positions=True)
    for p in points:
        est = by_rule.stats[p].estimate()
        assert est.n == int(keep.sum()), (p, est.n, int(keep.sum()))
        assert est == explicit.stats[p].estimate(), p
        R.assert_estimate_matches(est, ref[p], context=p)
