"""Zero-block insertion: exactly function preserving, and wired where claimed.

* Before any update, inserting a zero-output block (``W_out = 0``) or a zero bias at every
  residual point of LLaMA / GPT-NeoX / GPT-2 configs and of two ResNets leaves the outputs
  bit-identical (``torch.equal``) to the model without it, in eval and with a fixed seed in train.
* Removal restores the module tree, the state dict (same keys, equal tensors) and the outputs.
* Independent reference for the wiring: with a non-zero ``W_out`` (or bias) the model's output
  equals that of the bare model with a plain forward hook, written here, that adds
  ``W_out φ(W_in z)`` along the feature axis of the point's output (channels for NCHW maps).
* Bad input (unknown point, double insertion, unknown kind, removal without insertion) raises
  FusedStatsError and leaves the model as it was.
"""

from __future__ import annotations

import pytest
import torch

import fused_stats as fs
from fused_stats.networks.resnet import cifar_resnet20, tiny_resnet

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB = 50
F64 = torch.float64


def build(kind: str, dtype=torch.float32):
    torch.manual_seed(3)
    common = dict(vocab_size=VOCAB, initializer_range=0.3)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                hidden_size=12,
                intermediate_size=24,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                max_position_embeddings=32,
                **common,
            )
        )
    elif kind == "neox":
        model = transformers.GPTNeoXForCausalLM(
            transformers.GPTNeoXConfig(
                hidden_size=12,
                intermediate_size=24,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=32,
                **common,
            )
        )
    elif kind == "gpt2":
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_embd=12, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0, **common
            )
        )
    elif kind == "resnet20":
        model = cifar_resnet20(width=4, seed=3)
    elif kind == "tiny_resnet":
        model = tiny_resnet(block="bottleneck", width=4, seed=3)
    else:
        raise AssertionError(kind)
    return model.to(dtype).eval()


def inputs(kind: str, gen, dtype=torch.float32):
    if "resnet" in kind:
        return {"x": torch.randn(3, 3, 16, 16, generator=gen).to(dtype)}
    ids = torch.randint(0, VOCAB, (3, 7), generator=gen)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def run(model, batch) -> torch.Tensor:
    if "x" in batch:
        return model(batch["x"])
    return model(**batch).logits


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same_state(model, before):
    after = model.state_dict()
    assert list(after) == list(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k


KINDS = ["llama", "neox", "gpt2", "resnet20", "tiny_resnet"]


@pytest.mark.parametrize("arch", KINDS)
@pytest.mark.parametrize("kind", ["block", "bias"])
def test_insertion_is_bit_identical(arch, kind, gen):
    model = build(arch)
    batch = inputs(arch, gen)
    with torch.no_grad():
        want = run(model, batch)
    state = snapshot(model)
    modules = [n for n, _ in model.named_modules()]
    spec = fs.CrossSpec(rank=5, activation="gelu", seed=1)
    for point in fs.residual_points(model):
        block = fs.insert_zero_block(model, point, kind=kind, spec=spec)
        assert any(p is next(iter(block.parameters())) for p in model.parameters())
        with torch.no_grad():
            got = run(model, batch)
        assert torch.equal(got, want), f"{arch} {kind} at {point}: max diff {(got - want).abs().max()}"
        # the same with autograd on (the block's output enters the graph)
        got_grad = run(model, batch)
        assert torch.equal(got_grad.detach(), want)
        fs.remove_inserted_block(model, point)
    assert [n for n, _ in model.named_modules()] == modules
    assert_same_state(model, state)
    with torch.no_grad():
        assert torch.equal(run(model, batch), want)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_insertion_bit_identical_in_train_mode(arch, gen):
    """Dropout active (GPT-2 has it): same RNG state, same outputs with and without the block."""
    model = build(arch).train()
    batch = inputs(arch, gen)
    torch.manual_seed(11)
    want = run(model, batch).detach()
    fs.insert_zero_block(
        model, fs.residual_points(model)[0], kind="block", spec=fs.CrossSpec(rank=4, activation="relu")
    )
    torch.manual_seed(11)
    got = run(model, batch).detach()
    assert torch.equal(got, want)


def _manual_hook(w_out, w_in, activation, feature_dim, bias=None):
    """Independent reference: z -> z + W_out φ(W_in z) along ``feature_dim`` (or z + b)."""
    acts = {
        "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / 2**0.5)),
        "relu": lambda x: x.clamp_min(0),
        "tanh": torch.tanh,
    }

    def hook(module, args, out):
        z = out[0] if isinstance(out, tuple) else out
        zz = z.movedim(feature_dim, -1)
        if bias is not None:
            h = zz * 0 + bias
        else:
            h = torch.einsum(
                "dr,...r->...d", w_out, acts[activation](torch.einsum("ri,...i->...r", w_in, zz))
            )
        new = (zz + h).movedim(-1, feature_dim)
        return (new, *out[1:]) if isinstance(out, tuple) else new

    return hook


@pytest.mark.parametrize("arch", ["llama", "neox", "resnet20"])
@pytest.mark.parametrize("kind", ["block", "bias"])
def test_nonzero_block_matches_manual_hook(arch, kind, gen):
    model = build(arch, F64)
    batch = inputs(arch, gen, F64)
    point = fs.residual_points(model)[1]
    activation = {"llama": "gelu", "neox": "tanh", "resnet20": "relu"}[arch]
    spec = fs.CrossSpec(rank=3, activation=activation, seed=5)
    block = fs.insert_zero_block(model, point, kind=kind, spec=spec)
    dim = block.bias.shape[0] if kind == "bias" else block.w_out.shape[0]
    with torch.no_grad():
        if kind == "bias":
            block.bias.copy_(torch.randn(dim, generator=gen, dtype=F64))
        else:
            block.w_out.copy_(torch.randn(dim, 3, generator=gen, dtype=F64))
        got = run(model, batch)
    w_out = None if kind == "bias" else block.w_out.detach().clone()
    bias = block.bias.detach().clone() if kind == "bias" else None
    w_in = None if kind == "bias" else block.w_in.clone()
    fs.remove_inserted_block(model, point)
    if kind == "block":
        # the block's W_in is the spec's seeded N(0, 1/d) projection
        assert torch.equal(w_in, spec.projection(dim, dtype=F64))
    fd = 1 if arch == "resnet20" else -1
    handle = model.get_submodule(point).register_forward_hook(_manual_hook(w_out, w_in, activation, fd, bias))
    with torch.no_grad():
        want = run(model, batch)
    handle.remove()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        assert not torch.allclose(run(model, batch), got)  # the block did change the function


def test_bad_input_leaves_model_unchanged(gen):
    model = build("llama")
    batch = inputs("llama", gen)
    with torch.no_grad():
        want = run(model, batch)
    state = snapshot(model)
    point = fs.residual_points(model)[0]
    with pytest.raises(fs.FusedStatsError, match="no module named 'nope'"):
        fs.insert_zero_block(model, "nope")
    with pytest.raises(fs.FusedStatsError, match="kind"):
        fs.insert_zero_block(model, point, kind="mlp")
    with pytest.raises(fs.FusedStatsError, match="has no inserted block"):
        fs.remove_inserted_block(model, point)
    with pytest.raises(fs.FusedStatsError, match="activation"):
        fs.CrossSpec(activation="softplus")
    with pytest.raises(fs.FusedStatsError, match="w_in"):
        fs.insert_zero_block(model, point, spec=fs.CrossSpec(w_in=torch.randn(3, 7)))
    fs.insert_zero_block(model, point)
    with pytest.raises(fs.FusedStatsError, match="already has an inserted block"):
        fs.insert_zero_block(model, point, kind="bias")
    fs.remove_inserted_block(model, point)
    with pytest.raises(fs.FusedStatsError, match="width"):
        fs.insert_zero_block(model, point, kind="bias", dim=5)
        with torch.no_grad():
            run(model, batch)
    fs.remove_inserted_block(model, point)
    assert_same_state(model, state)
    with torch.no_grad():
        assert torch.equal(run(model, batch), want)
