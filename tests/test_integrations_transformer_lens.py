"""TransformerLens: a HookedTransformer built from a config (fp64), probed at its residual points
(found by hook name), against a per-sample loop with one backward per sequence; the loss helper
on a positional-input model; the example script."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformer_lens")

import fused_stats as fs

from example_scripts import run_script
from per_sample_reference import assert_estimate_matches


def hooked(seed=0, layers=3):
    import warnings

    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=layers,
        d_model=12,
        n_ctx=10,
        d_head=3,
        n_heads=4,
        d_vocab=23,
        act_fn="gelu",
        dtype=torch.float64,
        seed=seed,
        device="cpu",
        normalization_type="LN",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return HookedTransformer(cfg)


def per_sample_rows(model, ids, labels, points):
    """One backward per sequence, gradients read at the hook points by TransformerLens' own
    backward hooks; q_b = the sum over the sequence's positions."""
    rows = {p: [] for p in points}
    for b in range(ids.shape[0]):
        grads = {}

        def keep(grad, hook, grads=grads):
            grads[hook.name] = grad.detach().clone()

        for p in points:
            model.add_hook(p, keep, dir="bwd")
        logits = model(ids[b : b + 1])[0]
        terms = [
            -torch.log_softmax(logits[t], -1)[labels[b, t + 1]]
            for t in range(ids.shape[1] - 1)
            if labels[b, t + 1] != -100
        ]
        torch.stack(terms).mean().backward()
        model.reset_hooks()
        model.zero_grad()
        for p in points:
            rows[p].append(grads[p][0].sum(0))
    return {p: torch.stack(r) for p, r in rows.items()}


def test_hooked_transformer_residual_points_per_sample(gen):
    model = hooked()
    points = fs.residual_points(model)
    assert points == [f"blocks.{i}.hook_resid_post" for i in range(3)]
    ids = torch.randint(0, 23, (9, 10), generator=gen)
    labels = ids.clone()
    labels[:, :3] = -100  # an unsupervised prompt
    labels[2, 3:6] = -100
    probe = fs.Probe(model, second_moment="dense")
    for part in (slice(0, 4), slice(4, 9)):
        probe.step({"input_ids": ids[part], "labels": labels[part]}, fs.causal_lm_loss)
    rows = per_sample_rows(model, ids, labels, points)
    for p in points:
        assert_estimate_matches(probe.stats[p].estimate(), rows[p], rel=1e-9, context=p)


def test_loss_helper_styles(gen):
    model = hooked(layers=1)
    ids = torch.randint(0, 23, (3, 6), generator=gen)
    # positional-input model: the tokens go in positionally, the per-sample losses are TL's own
    per_token = model(ids, return_type="loss", loss_per_token=True)
    assert torch.allclose(fs.causal_lm_loss(model, ids), per_token.mean(1), rtol=1e-12, atol=0)

    class Positional(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(23, 23)

        def forward(self, tokens):
            return self.emb(tokens)

    with pytest.raises(fs.FusedStatsError, match="does not accept \\['attention_mask'\\]"):
        fs.causal_lm_loss(Positional(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    class Keywords(torch.nn.Module):
        def forward(self, input_ids, *, segment_ids):
            return torch.nn.functional.one_hot(input_ids, 23).double()

    with pytest.raises(fs.FusedStatsError, match=r"as keywords.*segment_ids"):
        fs.causal_lm_loss(Keywords(), {"input_ids": ids})


def test_example_transformer_lens_runs():
    out = run_script("probe_transformer_lens.py", "--tiny")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "agree" in out.stdout
