"""``curvature_gain``'s ``gᵀHg`` and its ``None`` gains (fused_stats/api/growth/scores.py).

References: per-sample gradients and per-sample Hessians of the grown model's new parameters in
fp64 (torch.autograd.functional on each sample's loss, independent of the code under test), and
the brute force over ordered triples of distinct samples ``g_iᵀ H_k g_j``, whose mean is
``gᵀ E[H] g``; hand-made losses whose halves' gradients are exactly zero or opposite.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_growth_scores import WithValues, batches, fp64_rms_norm, grown_at, tiny_llama

import fused_stats as fs

transformers = pytest.importorskip("transformers")
POINT = "model.layers.1"


@pytest.fixture(autouse=True)
def fp64_norms(monkeypatch):
    # LlamaRMSNorm computes in fp32; its rounding (1e-8 relative) would blur fp64 comparisons
    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", fp64_rms_norm)


def per_sample_gradients_and_hessians(model, protocol, ids):
    """Row ``i``: the gradient of sample ``i``'s loss on the new parameters (flattened), and its
    Hessian there, on a grown copy under eager attention (as curvature_gain's copy runs)."""
    grown, new = grown_at(model, protocol, POINT)
    grown.set_attn_implementation("eager")
    names = [n for n, p in grown.named_parameters() if any(p is q for q in new)]
    shapes, sizes = [p.shape for p in new], [p.numel() for p in new]
    flat = torch.cat([p.detach().reshape(-1) for p in new])

    def loss_of(values, i):
        named = dict(zip(names, (v.reshape(s) for v, s in zip(values.split(sizes), shapes))))
        return fs.causal_lm_loss(WithValues(grown, named), {"input_ids": ids[i : i + 1]})[0]

    grads, hessians = [], []
    for i in range(ids.shape[0]):
        grads.append(torch.autograd.functional.jacobian(lambda v, i=i: loss_of(v, i), flat))
        hessians.append(torch.autograd.functional.hessian(lambda v, i=i: loss_of(v, i), flat, vectorize=True))
    return torch.stack(grads), torch.stack(hessians)


def test_ghg_is_unbiased_over_distinct_samples_where_the_plug_in_is_not():
    """Four samples, one per batch, in each of the 24 orders: the mean of ``ghg`` over the
    orders is the mean of ``g_iᵀ H_k g_j`` over ordered triples of distinct samples, exactly
    (every term of the estimate pairs three distinct samples, each order equally likely). The
    plug-in ``ḡᵀH̄ḡ`` (the old estimate, the same in every order) and the two halves with the
    Hessian of all samples, ``⟨ḡ_A, H̄ ḡ_B⟩``, are not that."""
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2)
    ids = batches(11, 1, size=4)[0]["input_ids"]
    grads, hessians = per_sample_gradients_and_hessians(model, protocol, ids)
    n = ids.shape[0]
    terms = torch.einsum("ia,kab,jb->ikj", grads, hessians, grads)
    triples = [float(terms[i, k, j]) for i, k, j in itertools.permutations(range(n), 3)]
    brute = sum(triples) / len(triples)
    values, grad_sq = [], []
    for order in itertools.permutations(range(n)):
        data = [{"input_ids": ids[i : i + 1]} for i in order]
        result = fs.curvature_gain(model, protocol, POINT, data, fs.causal_lm_loss)
        values.append(result.ghg)
        grad_sq.append(result.grad_sq)
    assert len(values) == 24 and len(triples) == 24
    assert sum(values) / len(values) == pytest.approx(brute, rel=1e-9)
    gram = grads @ grads.T
    assert sum(grad_sq) / len(grad_sq) == pytest.approx(
        float(gram.sum() - gram.trace()) / (n * (n - 1)), rel=1e-9
    )
    g_bar, h_bar = grads.mean(0), hessians.mean(0)
    plug_in = float(g_bar @ h_bar @ g_bar)
    pooled = grads @ h_bar @ grads.T
    pairs_pooled_hessian = float(pooled.sum() - pooled.trace()) / (n * (n - 1))
    for other in (plug_in, pairs_pooled_hessian):  # the test tells them apart
        assert abs(other - brute) > 0.05 * abs(brute)


def flagged_loss(scale: float):
    """``loss_fn`` over ``(flag, inputs)`` batches: ``"plain"`` the per-sample loss ``l``;
    ``"flat"`` ``scale·(l − l₀)²`` with ``l₀ = l`` detached (zero gradient, Hessian
    ``2·scale·∇l∇lᵀ``); ``"off"`` ``0·l`` (zero gradient and Hessian); ``"opposite"`` ``−l + scale·(l − l₀)²`` (gradient ``−∇l``); ``"concave"``
    ``l − scale·(l − l₀)²`` (gradient ``∇l``, Hessian ``H − 2·scale·∇l∇lᵀ``)."""

    def loss_fn(model, batch):
        flag, inputs = batch
        loss = fs.causal_lm_loss(model, inputs)
        bump = (loss - loss.detach()) ** 2
        return {
            "plain": loss,
            "flat": scale * bump,
            "off": 0.0 * loss,
            "opposite": -loss + scale * bump,
            "concave": loss - scale * bump,
        }[flag]

    return loss_fn


@pytest.mark.parametrize(
    ("flags", "expected_grad_sq", "reason"),
    [
        (("plain", "flat", "plain"), "zero", "no gradient detected"),
        (("plain", "opposite", "plain"), "minus", "no gradient detected"),
        (("concave", "concave", "concave"), "plus", "no minimum along g"),
        (("plain", "plain", "off"), "half", "no minimum along g"),
    ],
)
def test_no_gain_where_the_halves_disagree_or_there_is_no_minimum(flags, expected_grad_sq, reason):
    """``⟨g_A, g_B⟩ ≤ 0`` (exactly 0: half B's gradient is zero; below 0: it is the opposite of
    half A's) gives no gain, with a reason, although ``gᵀHg > 0`` there; ``gᵀHg ≤ 0`` with
    ``⟨g_A, g_B⟩ > 0`` gives none either. ``|g|²`` against the plain loss's mean gradient on the
    same samples (batch 0 = A's samples = B's)."""
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2)
    inputs = batches(4, 1, size=4)[0]
    result = fs.curvature_gain(model, protocol, POINT, [(f, inputs) for f in flags], flagged_loss(300.0))
    grown, new = grown_at(model, protocol, POINT)
    grown.set_attn_implementation("eager")
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(fs.causal_lm_loss(grown, inputs).mean(), new)])
    half = float(g @ g) / 2  # A: batch 0 and batch 2, whose gradient is zero
    want = {"zero": 0.0, "minus": -float(g @ g), "plus": float(g @ g), "half": half}[expected_grad_sq]
    assert result.grad_sq == pytest.approx(want, rel=1e-9, abs=0.0)
    if expected_grad_sq == "plus":
        assert result.ghg < 0
    elif expected_grad_sq == "half":
        # every term holds batch 2's zero gradient or its zero Hessian
        assert result.ghg == 0.0
    else:
        assert result.ghg > 0  # only |g|² stands in the way of a gain
    assert result.gain is None
    assert reason in result.reason
    assert result.to_dict()["reason"] == result.reason


def test_ghg_of_a_hand_made_hessian():
    """Batches (plain, flat, plain) of the same m samples: the groups' mean gradients are ``g``,
    0, ``g``, so only batch 1's Hessian ``2·scale·Σ_i ∇l_i∇l_iᵀ`` between groups 0 and 2 counts:
    ``gᵀHg = 2·scale·Σ_i (g·∇l_i)² / (3m)`` (the sum over the batches' Hessians divided by the
    sample count), ``∇l_i`` from one backward per sample."""
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2)
    inputs = batches(4, 1, size=4)[0]
    flags = ("plain", "flat", "plain")
    result = fs.curvature_gain(model, protocol, POINT, [(f, inputs) for f in flags], flagged_loss(300.0))
    grown, new = grown_at(model, protocol, POINT)
    grown.set_attn_implementation("eager")
    m = inputs["input_ids"].shape[0]
    rows = []
    for i in range(m):
        loss = fs.causal_lm_loss(grown, {"input_ids": inputs["input_ids"][i : i + 1]})[0]
        rows.append(torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, new)]))
    rows = torch.stack(rows)
    g = rows.mean(0)
    assert result.n == 3 * m
    assert result.ghg == pytest.approx(2 * 300.0 * float(((rows @ g) ** 2).sum()) / (3 * m), rel=1e-9)


def test_a_gain_carries_no_reason():
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2)
    inputs = batches(4, 1, size=4)[0]
    result = fs.curvature_gain(model, protocol, POINT, [("plain", inputs)] * 3, flagged_loss(300.0))
    assert result.grad_sq > 0 and result.ghg > 0
    assert result.gain == pytest.approx(result.grad_sq**2 / (2 * result.ghg), rel=1e-12)
    assert result.reason is None


def test_fewer_than_three_batches_are_refused():
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2)
    with pytest.raises(fs.FusedStatsError, match=r"at least 3 batches.*got 2"):
        fs.curvature_gain(model, protocol, POINT, batches(4, 2, size=2), fs.causal_lm_loss)
