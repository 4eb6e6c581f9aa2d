"""The cross statistics under ``mask="labels"``: exact per-sample gradients of a zero block.

A zero-output block writes into the stream at every position, so the per-sample gradient of its
``W_out`` is ``Σ_t q_t x_tᵀ`` over every real position, prompt positions included (their gradient
is not zero: later targets depend on them). The gradient statistics keep the labels mask (only
supervised positions are summed into ``q_b``); the cross statistics must not.

Reference: one ``torch.autograd.grad`` per sample of a hand-written per-sequence loss (mean
shifted cross-entropy over the supervised targets) with respect to the zero parameters of the
block, inserted by hand (a forward hook adding ``tanh(z W_inᵀ) W_outᵀ`` for a CrossSpec; the
probe's own block object inserted into a copy of the model for a GrowthProtocol), and the
brute-force |C|², SE, z and p over distinct tuples of those rows (tests/test_growth_tangent.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_growth_tangent import ZEROED, assert_matches, make_model

import fused_stats as fs

from tiny_models import padded_lm_batch

transformers = pytest.importorskip("transformers")
F64 = torch.float64
PROMPTS = [3, 2, 4, 1, 3, 2]
LENGTHS = [7, 6, 8, 5, 8, 7]


def labelled_batch():
    return padded_lm_batch(torch.Generator().manual_seed(5), LENGTHS, 8, 40, prompts=PROMPTS)


def sequence_loss(model, ids, labels):
    """Mean shifted cross-entropy of one unpadded sequence over its supervised targets."""
    logits = model(input_ids=ids[None], use_cache=False).logits[0]
    keep = labels[1:] != -100
    ce = F.cross_entropy(logits[:-1], labels[1:].clamp(min=0), reduction="none")
    return ce[keep].mean()


def per_sample_rows(model, batch, params):
    rows = []
    for b, length in enumerate(LENGTHS):
        ids, labels = batch["input_ids"][b, :length], batch["labels"][b, :length]
        grads = torch.autograd.grad(sequence_loss(model, ids, labels), params)
        rows.append(torch.cat([g.flatten() for g in grads]))
    return torch.stack(rows)


def test_crossspec_tangent_sums_over_prompt_positions():
    model, stack = make_model("llama", seed=2)
    point, d = f"{stack}.0", 12
    spec = fs.CrossSpec(rank=5, activation="tanh", seed=4)
    probe = fs.Probe(model, points=[point], cross=spec, second_moment="dense")
    batch = labelled_batch()
    probe.step(batch, fs.causal_lm_loss, mask="labels")
    w_in = spec.projection(d, dtype=F64)
    w_out = torch.zeros(d, 5, dtype=F64, requires_grad=True)

    def add_block(module, args, out):
        z = out[0] if isinstance(out, tuple) else out
        y = z + torch.tanh(z @ w_in.T) @ w_out.T
        return (y, *out[1:]) if isinstance(out, tuple) else y

    handle = model.get_submodule(point).register_forward_hook(add_block)
    try:
        c = per_sample_rows(model, batch, [w_out])
    finally:
        handle.remove()
    assert_matches(probe.saturation(point), c, 1e-8)
    assert probe.stats[point].n == len(LENGTHS)


@pytest.mark.parametrize("point_index", [0, 1])
def test_growth_tangent_sums_over_prompt_positions(point_index):
    model, stack = make_model("llama", seed=3)
    point = f"{stack}.{point_index}"
    probe = fs.Probe(model, points=[point], cross=fs.GrowthProtocol([point], seed=1), second_moment="dense")
    batch = labelled_batch()
    probe.step(batch, fs.causal_lm_loss, mask="labels")
    grown = copy.deepcopy(model)
    layers = grown.get_submodule(stack)
    layers.insert(point_index + 1, copy.deepcopy(probe.cross.blocks[point]))
    grown.config.num_hidden_layers += 1
    for p in grown.parameters():
        p.requires_grad_(False)
    new = layers[point_index + 1]
    params = [p for name in ZEROED["llama"] for p in new.get_submodule(name).parameters()]
    assert all(bool((p == 0).all()) for p in params)
    for p in params:
        p.requires_grad_(True)
    # the probe's rows are (d_out, d_in) of each zero map side by side: the same inner products
    c = per_sample_rows(grown, batch, params)
    assert_matches(probe.saturation(point), c, 1e-8)


def test_the_gradient_statistics_keep_the_labels_mask():
    """q_b sums the supervised positions only, as before (``lm_reference(label_positions=True)``)."""
    from per_sample_reference import assert_estimate_matches, lm_reference

    model, stack = make_model("llama", seed=2)
    points = [f"{stack}.0", f"{stack}.1"]
    probe = fs.Probe(model, points=points, cross=fs.CrossSpec(rank=3), second_moment="dense")
    batch = labelled_batch()
    probe.step(batch, fs.causal_lm_loss, mask="labels")
    rows = lm_reference(model, batch, points, "sample", label_positions=True)
    for p in points:
        assert_estimate_matches(probe.estimate(p), rows[p], rel=1e-9, context=p)


def test_position_samples_keep_the_labels_positions():
    """unit="position": each supervised position is a sample of both statistics (a position's
    ``q_t x_tᵀ`` is no parameter's gradient; the sample set stays the gradient statistics')."""
    model, stack = make_model("llama", seed=2)
    point = f"{stack}.0"
    probe = fs.Probe(model, points=[point], cross=fs.CrossSpec(rank=3), unit="position")
    batch = labelled_batch()
    probe.step(batch, fs.causal_lm_loss, mask="labels")
    supervised = int((batch["labels"][:, 1:] != -100).sum())
    assert probe.stats[point].n == probe.cross_stats[point].n == supervised
