"""Probe statistics on real architectures against per-sample loops.

Reference: for every sample, its own forward and ONE backward of its own loss (fp64, plain hooks
that only record outputs, trainable parameters, padding stripped from the sequence), the
gradients at each point turned into per-sample vectors by explicit sums, then the U-statistics
over ordered distinct index tuples (tests/per_sample_reference.py; exact rational arithmetic for
n <= 12). The probe sees PADDED batches (attention_mask zeros, labels -100 on padding and on
"prompt" tokens) in several steps, and the model in train mode (dropout on for GPT-2), which the
probe must switch to eval. Models are tiny HF configs (hidden 16, 2 layers, vocab 64) in fp64 with
a large initializer range so that every block changes the stream.
"""

from __future__ import annotations

import pytest
import torch

import fused_stats as fs
from fused_stats.networks.resnet import cifar_resnet20, tiny_resnet

import per_sample_reference as R
from tiny_models import padded_lm_batch, split

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 64


def build_lm(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, initializer_range=0.3)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **common,
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "neox":
        cfg = transformers.GPTNeoXConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
            **common,
        )
        model = transformers.GPTNeoXForCausalLM(cfg)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=16, n_layer=2, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0, **common
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        raise AssertionError(kind)
    return model.double().train()


def lm_batch(gen, lengths, T, prompts):
    return padded_lm_batch(gen, lengths, T, VOCAB, prompts)


LM_POINTS = {
    "llama": ["model.layers.0", "model.layers.1"],
    "neox": ["gpt_neox.layers.0", "gpt_neox.layers.1"],
    "gpt2": ["transformer.h.0", "transformer.h.1"],
}


@pytest.mark.parametrize("kind", ["llama", "neox", "gpt2"])
@pytest.mark.parametrize("unit", ["sample", "position"])
def test_lm_points_match_per_sample_loop(kind, unit, gen):
    model = build_lm(kind)
    assert fs.residual_points(model) == LM_POINTS[kind]
    if unit == "sample":  # n = 10 sequences: exact brute force
        lengths, prompts, sizes = [7, 4, 7, 3, 6, 7, 5, 7, 2, 6], [0, 1, 2, 0, 0, 3, 1, 0, 0, 2], [4, 6]
    else:  # n = 29 positions
        lengths, prompts, sizes = [6, 4, 6, 3, 5, 5], [0, 1, 2, 0, 1, 0], [2, 4]
    batch = lm_batch(gen, lengths, 7 if unit == "sample" else 6, prompts)
    probe = fs.Probe(model, unit=unit, second_moment="pool")
    for part in split(batch, sizes):
        probe.step(part, fs.causal_lm_loss)
    assert model.training  # restored
    ref = R.lm_reference(model, batch, LM_POINTS[kind], unit)
    for p in LM_POINTS[kind]:
        R.assert_estimate_matches(probe.stats[p].estimate(), ref[p], context=f"{kind} {unit} {p}")


def test_lm_labels_default_to_input_ids_with_padding_ignored(gen):
    """No 'labels' key: causal_lm_loss must take input_ids as labels and skip padded targets."""
    model = build_lm("neox", seed=4)
    batch = lm_batch(gen, [7, 2, 5, 7, 4, 6], 7, [0] * 6)
    del batch["labels"]
    probe = fs.Probe(model, second_moment="pool")
    probe.step(batch, fs.causal_lm_loss)
    ref = R.lm_reference(model, batch, LM_POINTS["neox"], "sample")
    for p in LM_POINTS["neox"]:
        R.assert_estimate_matches(probe.stats[p].estimate(), ref[p], context=f"default labels {p}")


def test_lm_position_label_mask_matches_reference(gen):
    """mask='labels': only positions that predict a supervised token (labels[t+1] != -100) are
    samples; none of them has a zero gradient (the last real token, which predicts nothing, is out)."""
    model = build_lm("llama", seed=1)
    batch = lm_batch(gen, [6, 5, 6, 4, 6], 6, [2, 1, 3, 0, 2])
    probe = fs.Probe(model, unit="position", second_moment="pool")
    probe.step(batch, fs.causal_lm_loss, mask="labels")
    ref = R.lm_reference(model, batch, LM_POINTS["llama"], "position", label_positions=True)
    lengths = batch["attention_mask"].sum(1).tolist()
    targets = sum(int((batch["labels"][b, 1:n] != -100).sum()) for b, n in enumerate(lengths))
    assert ref["model.layers.0"].shape[0] == targets == probe.stats["model.layers.0"].n
    for p in LM_POINTS["llama"]:
        assert (ref[p].norm(dim=1) > 0).all()
    for p in LM_POINTS["llama"]:
        R.assert_estimate_matches(probe.stats[p].estimate(), ref[p], context=f"labels {p}")


@pytest.mark.parametrize(
    "unit,batch_size,side,points",
    [
        ("sample", 10, 8, "residual"),
        ("position", 5, 3, ["layer1.0", "layer2.0", "layer3.2"]),  # n = 45, 20, 5
        ("flat", 8, 4, "residual"),
    ],
)
def test_cifar_resnet20_matches_per_sample_loop(unit, batch_size, side, points, gen):
    model = cifar_resnet20(width=4, seed=0, random_batchnorm=True).double().train()
    x = torch.randn(batch_size, 3, side, side, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (batch_size,), generator=gen)
    probe = fs.Probe(model, points=points, unit=unit, second_moment="pool")
    half = batch_size // 2
    probe.step((x[:half], y[:half]), fs.classification_loss)
    probe.step((x[half:], y[half:]), fs.classification_loss)
    assert model.training
    names = probe.points
    assert names == (fs.residual_points(model) if points == "residual" else points)
    ref = R.conv_reference(model, x, y, names, unit)
    for p in names:
        R.assert_estimate_matches(probe.stats[p].estimate(), ref[p], context=f"resnet20 {unit} {p}")


def test_torchvision_style_resnet_matches_per_sample_loop(gen):
    model = tiny_resnet("basic", (1, 1, 1, 1), width=4, seed=0, random_batchnorm=True).double()
    points = fs.residual_points(model)
    assert points == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
    x = torch.randn(9, 3, 32, 32, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (9,), generator=gen)
    probe = fs.Probe(model, second_moment="pool")
    probe.step((x, y), fs.classification_loss)
    ref = R.conv_reference(model, x, y, points, "sample")
    for p in points:
        R.assert_estimate_matches(probe.stats[p].estimate(), ref[p], context=f"tiny resnet {p}")


def _assert_same_estimates(a, b, rel=1e-9, context=""):
    for key in (
        "n",
        "mu_norm2",
        "mu_norm4",
        "mu_sigma_mu",
        "trace_sigma2",
        "trace_sigma",
        "ag_max",
        "ag_mean",
    ):
        va, vb = getattr(a, key), getattr(b, key)
        assert abs(va - vb) <= rel * max(abs(va), abs(vb), 1e-300), f"{context}: {key} {va} vs {vb}"


@pytest.mark.parametrize("unit", ["sample", "position"])
def test_batch_size_invariance_lm(unit, gen):
    """Eight padded sequences as one batch of 8 or as eight batches of 1: same statistics."""
    model = build_lm("llama", seed=2)
    batch = lm_batch(gen, [7, 3, 7, 5, 6, 7, 4, 7], 7, [0, 1, 2, 0, 3, 0, 1, 2])
    one = fs.Probe(model, unit=unit, second_moment="dense")
    one.step(batch, fs.causal_lm_loss)
    many = fs.Probe(model, unit=unit, second_moment="dense")
    for part in split(batch, [1] * 8):
        many.step(part, fs.causal_lm_loss)
    for p in one.points:
        _assert_same_estimates(one.stats[p].estimate(), many.stats[p].estimate(), context=p)


def test_batch_size_invariance_resnet(gen):
    model = cifar_resnet20(width=4, seed=3, random_batchnorm=True).double()
    x = torch.randn(8, 3, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (8,), generator=gen)
    one = fs.Probe(model, second_moment="pool")
    one.step((x, y), fs.classification_loss)
    many = fs.Probe(model, second_moment="pool")
    for b in range(8):
        many.step((x[b : b + 1], y[b : b + 1]), fs.classification_loss)
    for p in one.points:
        _assert_same_estimates(one.stats[p].estimate(), many.stats[p].estimate(), context=p)
