"""Growth of the families added to the adapter table, against per-sample gradients of the grown model.

The references are those of tests/test_architecture_table.py: the fs.grow-grown fp64 model, one
``torch.autograd.grad`` per sample over all its new (or widened) parameters, and the unbiased
``|C|²``, SE, ``z``, ``p`` by brute force over index tuples. Per family (and per structural
variant: Falcon's parallel / serial attention and MLP, one or two input norms, multi-query or
grouped keys, ALiBi; GPT-BigCode's multi-query or multi-head fused ``c_attn``): zero depth growth
at every boundary, the input boundary first, keeps the logits bit for bit and survives
save_pretrained/from_pretrained; width growth where the adapter has it; a grown model with a
non-zero new layer generates the same tokens with and without its KV cache, and its cached last
step equals recomputing the whole sequence (a KV-cache slot per layer, renumbered).

:data:`FAMILIES` and :data:`WIDTH` are read by tools/growth_coverage.py for docs/growth/coverage.md.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import transformers
from test_architecture_table import VOCAB, assert_close, assert_reloads, grown_rows, logits
from test_growth_tangent import assert_matches, padded_batch, per_sample_loss

import fused_stats as fs
from fused_stats.api.growth import architecture

transformers.logging.set_verbosity_error()

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_TOKENS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_FALCON = dict(_TOKENS, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=24)


def _config(name: str):
    """The tiny config of test variant ``name`` (its model_type: the config's)."""
    falcon = {
        # Falcon-7B's layout: parallel attention and MLP on one input norm, multi-query keys
        "falcon": dict(parallel_attn=True, new_decoder_architecture=False, multi_query=True),
        # serial: input_layernorm, then post_attention_layernorm before the MLP; a head per key
        "falcon_serial": dict(
            parallel_attn=False, new_decoder_architecture=False, multi_query=False, bias=True
        ),
        # Falcon-40B's layout: ln_attn and ln_mlp, 2 key/value groups
        "falcon_new": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=2),
        # new decoder architecture with one input norm shared by attention and MLP
        "falcon_new_one_norm": dict(new_decoder_architecture=True, num_kv_heads=1, num_ln_in_parallel_attn=1),
        # ALiBi position bias (carried in the attention mask) and biases on the zeroed maps
        "falcon_alibi": dict(alibi=True, bias=True, parallel_attn=True, multi_query=True),
    }
    if name in falcon:
        return transformers.FalconConfig(**_FALCON, **falcon[name])
    if name in ("gpt_bigcode", "gpt_bigcode_mha"):
        return transformers.GPTBigCodeConfig(
            **_TOKENS, n_embd=16, n_layer=2, n_head=2, n_inner=24, n_positions=32,
            multi_query=name == "gpt_bigcode", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    if name == "starcoder2":
        # LayerNorms with bias, biases on every map, a sliding window shorter than the batch
        return transformers.Starcoder2Config(**COMMON, use_bias=True, sliding_window=3)
    if name == "helium":
        return transformers.HeliumConfig(**COMMON, head_dim=8)
    if name in GENERIC:
        return transformers.CONFIG_MAPPING[name](**COMMON, **GENERIC[name])
    raise KeyError(name)


# families whose tiny config is COMMON plus these fields (head_dim 8 where the config reads one)
GENERIC = {
    "phi3": {},
    "glm": dict(head_dim=8),
    "glm4": dict(head_dim=8),
    "olmo3": dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"]),
    "seed_oss": dict(head_dim=8, attention_bias=True),
    "ernie4_5": dict(head_dim=8),
    "internlm3": dict(head_dim=8, bias=True, qkv_bias=True),
    "cohere2": dict(head_dim=8, sliding_window=3, layer_types=["sliding_attention", "full_attention"]),
    "exaone": {},
    "arcee": dict(head_dim=8),
    "apertus": dict(head_dim=8),
    "nemotron": dict(head_dim=8),
    "bitnet": dict(head_dim=8),
    "persimmon": {},
    "phi": dict(qk_layernorm=True),
    "gptj": dict(n_inner=24, rotary_dim=4),
    "codegen": dict(n_inner=24, rotary_dim=4),
    "bloom": {},
    "mpt": {},
    "mamba": dict(state_size=4, expand=2, conv_kernel=3),
}
# families without an sdpa path: eager attention, whose fully masked rows (left padding) are NaN
EAGER = {"bloom", "mpt", "mamba"}


def make(name: str, seed: int = 0):
    """A tiny fp64 CausalLM of variant ``name``, its norms' scales and shifts random (not 1, 0)."""
    torch.manual_seed(seed)
    attention = "eager" if name in EAGER else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(_config(name), attn_implementation=attention)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ("norm" in n or "ln" in n) and p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model.double().eval()


# test variant -> tolerance of the |C|² comparison (1e-10: assert_matches, also SE, z, p)
FAMILIES = {
    "falcon": 1e-10,
    "falcon_serial": 1e-10,
    "falcon_new": 1e-10,
    "falcon_new_one_norm": 1e-10,
    "falcon_alibi": 1e-10,
    "gpt_bigcode": 1e-10,
    "gpt_bigcode_mha": 1e-10,
    "starcoder2": 1e-10,
    "helium": 1e-10,
    **{name: 1e-10 for name in GENERIC if name != "phi3"},
}
# variants whose width growth is tested here (phi3: its depth growth is in test_architecture_table)
WIDTH = [
    "falcon", "falcon_serial", "falcon_new", "gpt_bigcode", "starcoder2", "helium", "phi3", "glm",
    "seed_oss", "ernie4_5", "internlm3", "cohere2", "exaone", "arcee", "apertus", "nemotron",
    "persimmon", "phi", "gptj", "codegen",
]  # fmt: skip


def batch_for(name, n, T, seed):
    """Left and right padding; right only where attention is eager."""
    batch = padded_batch(n, T, seed)
    if name in EAGER:
        batch["attention_mask"] = batch["attention_mask"].sort(dim=1, descending=True).values
    return batch


def model_type(name: str) -> str:
    return _config(name).model_type


@pytest.mark.parametrize("name", list(FAMILIES))
def test_layer_growth(name, tmp_path):
    """Every boundary, the input boundary first: the zero block keeps the logits bit for bit, also
    after save_pretrained/from_pretrained, and the probe's |C|², SE, z, p equal the unbiased values
    from per-sample gradients of all new parameters of the grown model."""
    model = make(name)
    points = fs.growth_points(model)
    assert len(points) == 3 and points[0] == architecture.describe(model).input_point
    protocol = fs.GrowthProtocol(points, seed=3)
    probe = fs.Probe(model, points=points, cross=protocol, second_moment="dense")
    batch = batch_for(name, 6, 5, seed=11)
    probe.step(batch, per_sample_loss)
    assert probe.cross.checked == set(points)
    base = logits(model, batch)
    for point in points:
        grown, c = grown_rows(model, protocol, point, batch)
        assert torch.equal(logits(grown, batch), base), point
        assert_close(probe.saturation(point), c, FAMILIES[name])
    grown = copy.deepcopy(model)
    fs.grow(grown, protocol)
    assert torch.equal(logits(grown, batch), base)
    assert_reloads(grown, tmp_path, batch)


@pytest.mark.parametrize("name", WIDTH)
def test_mlp_width(name, tmp_path):
    """New MLP units in every block: logits kept (to rounding: wider matmuls), the config's MLP
    size grown, the probe at two boundaries equal to the per-sample gradients of the new (zero)
    output columns of the block it widens, and the grown model reloads from save_pretrained."""
    model = make(name, seed=1)
    points = fs.growth_points(model)[:2]
    protocol = fs.GrowthProtocol(points, family="mlp_width", width=3, seed=2)
    probe = fs.Probe(model, points=points, cross=protocol, second_moment="dense")
    batch = batch_for(name, 6, 5, seed=12)
    probe.step(batch, per_sample_loss)
    grown = copy.deepcopy(model)
    result = fs.grow(grown, protocol)
    assert torch.allclose(logits(grown, batch), logits(model, batch), rtol=0, atol=1e-14)
    adapter = architecture.describe(model).adapter
    outs = {p: grown.get_parameter(f"{result.positions[p]}.{adapter.mlp_output}.weight") for p in points}
    size = _mlp_size(model.config, adapter.mlp_size)
    assert {w.shape[1] for w in outs.values()} == {size + 3}
    assert _mlp_size(grown.config, adapter.mlp_size) == size + 3
    for p in grown.parameters():
        p.requires_grad_(False)
    for p in outs.values():
        p.requires_grad_(True)
    rows = {p: [] for p in points}
    for b in range(6):
        one = {key: v[b : b + 1] for key, v in batch.items()}
        grads = torch.autograd.grad(per_sample_loss(grown, one)[0], list(outs.values()))
        for p, g in zip(points, grads):
            rows[p].append(g[:, -3:].flatten())
    for p in points:
        assert_matches(probe.saturation(p), torch.stack(rows[p]), 1e-9)
    assert_reloads(grown, tmp_path, batch)


def _mlp_size(config, name=None) -> int:
    for key in (name,) if name else ("intermediate_size", "ffn_hidden_size", "n_inner"):
        if getattr(config, key, None) is not None:
            return int(getattr(config, key))
    raise AssertionError(config)


def test_phi3_fused_gate_up_rows_go_into_both_halves():
    """Phi3's gate_up_proj after width growth: [old gate; new gate; old up; new up], the new rows
    those of blocks.new_units (gate first), and the MLP equals the hand-written gated MLP on the
    widened weights: ``down(silu(gate u) ⊙ (up u))``."""
    from fused_stats.api.growth.blocks import new_units

    model = make("phi3", seed=5)
    f = model.config.intermediate_size
    points = fs.growth_points(model)[:2]
    protocol = fs.GrowthProtocol(points, family="mlp_width", width=3, seed=4)
    units = new_units(model, protocol, points[1])
    old = model.model.layers[1].mlp.gate_up_proj.weight.detach().clone()
    _, piece = units.pieces["mlp.gate_up_proj.weight"]
    grown = copy.deepcopy(model)
    fs.grow(grown, protocol)
    mlp = grown.model.layers[1].mlp
    w = mlp.gate_up_proj.weight
    assert w.shape == (2 * (f + 3), 16) and mlp.gate_up_proj.out_features == 2 * (f + 3)
    assert torch.equal(w[:f], old[:f]) and torch.equal(w[f : f + 3], piece[:3])
    assert torch.equal(w[f + 3 : 2 * f + 3], old[f:]) and torch.equal(w[2 * f + 3 :], piece[3:])
    assert not torch.equal(piece[:3], piece[3:])
    u = torch.randn(2, 5, 16, dtype=torch.float64)
    gate, up = w[: f + 3], w[f + 3 :]
    by_hand = (torch.nn.functional.silu(u @ gate.T) * (u @ up.T)) @ mlp.down_proj.weight.T
    with torch.no_grad():
        torch.testing.assert_close(mlp(u), by_hand, rtol=1e-12, atol=1e-14)


def generate(model, batch, use_cache):
    with torch.no_grad():
        return model.generate(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            max_new_tokens=4,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=0,
        )


def _left_padded(name, seed):
    """Left padding, but for eager attention (its fully masked rows are NaN)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 6), generator=g)
    mask = torch.ones(3, 6, dtype=torch.long)
    if name not in EAGER:
        mask[1, :2] = 0
        mask[2, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


# families whose cache is not a past_key_values Cache (Mamba's cache_params): generate only
NO_STEP = {"mamba"}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_generate_with_cache_after_growth(name):
    """Zero growth generates the ungrown model's tokens (cache on); random growth at the input
    boundary and after block 0 changes the function, and then cached generation equals uncached
    generation and the cached last step's logits equal recomputing the whole sequence."""
    model = make(name, seed=6)
    batch = _left_padded(name, 7)
    points = fs.growth_points(model)[:2]
    before = generate(model, batch, True)
    zero = copy.deepcopy(model)
    fs.grow(zero, fs.GrowthProtocol(points, seed=1))
    assert torch.equal(generate(zero, batch, True), before)
    grown = copy.deepcopy(model)
    fs.grow(grown, fs.GrowthProtocol(points, init="random", seed=1))
    assert not torch.allclose(logits(grown, batch), logits(model, batch))
    cached = generate(grown, batch, True)
    assert torch.equal(cached, generate(grown, batch, False))
    if name in NO_STEP:
        return
    mask = torch.cat([batch["attention_mask"], torch.ones(3, 4, dtype=torch.long)], 1)
    with torch.no_grad():
        full = grown(input_ids=cached[:, :-1], attention_mask=mask[:, :-1]).logits[:, -1]
        prefix = grown(input_ids=cached[:, :-2], attention_mask=mask[:, :-2], use_cache=True)
        step = grown(
            input_ids=cached[:, -2:-1],
            attention_mask=mask[:, :-1],
            past_key_values=prefix.past_key_values,
            use_cache=True,
        ).logits[:, -1]
    # fp64 models, but some families (MPT) take their attention softmax in fp32: about 1e-8
    # relative between the two paths; a wrong cache slot moves the logits by O(1)
    torch.testing.assert_close(step, full, rtol=1e-6, atol=1e-8)


# families whose width growth is refused (the adapter's reason), tested below
WIDTH_REFUSED = ["glm4", "olmo3", "bitnet", "bloom", "mpt", "mamba"]


@pytest.mark.parametrize("name", WIDTH_REFUSED)
def test_mlp_width_refused(name):
    """Width growth refused with the adapter's reason, by the probe and by grow, nothing changed."""
    model = make(name)
    state = copy.deepcopy(model.state_dict())
    points = fs.growth_points(model)[:1]
    protocol = fs.GrowthProtocol(points, family="mlp_width", width=3)
    reason = architecture.ADAPTERS[model_type(name)].mlp_refused
    with pytest.raises(fs.FusedStatsError, match=f"model_type '{model_type(name)}'"):
        fs.Probe(model, points=points, cross=protocol)
    with pytest.raises(fs.FusedStatsError, match=re.escape(reason)):
        fs.grow(model, protocol)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


# refused model_type -> the config fields a tiny model of it needs beyond COMMON
REFUSED_CONFIGS = {
    "mixtral": dict(num_local_experts=2, num_experts_per_tok=1),
    "qwen2_moe": dict(
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8, shared_expert_intermediate_size=8
    ),
    "qwen3_moe": dict(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8),
    "olmoe": dict(num_experts=2, num_experts_per_tok=1),
    "doge": {},
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "opt": dict(ffn_dim=24, word_embed_proj_dim=16),
    "xglm": dict(ffn_dim=24),
    "biogpt": {},
}


@pytest.mark.parametrize("name", list(REFUSED_CONFIGS))
def test_refused_with_reason(name):
    """A tiny model of each refused family: growth_points, grow and the tangent probe name the
    model_type and the table's reason, and the model and its config keep their depth."""
    config = transformers.CONFIG_MAPPING[name](**COMMON, **REFUSED_CONFIGS[name])
    model = transformers.AutoModelForCausalLM.from_config(config)
    stack = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    point = next(n for n, m in model.named_modules() if m is stack) + ".0"
    protocol = fs.GrowthProtocol([point])
    pattern = rf"refuses model_type '{name}'.*{re.escape(architecture.REFUSED[name])}"
    for call in (
        lambda: fs.growth_points(model),
        lambda: fs.grow(model, protocol),
        lambda: fs.Probe(model, points=[point], cross=protocol),
    ):
        with pytest.raises(fs.FusedStatsError, match=pattern):
            call()
    assert len(stack) == 2 and model.config.num_hidden_layers == 2


def test_bloom_residual_after_the_norm_refused():
    """BLOOM with apply_residual_connection_post_layernorm: a zero block would output its input
    norm, not its input; refused naming the option, nothing changed."""
    config = transformers.BloomConfig(**_TOKENS, hidden_size=16, n_layer=2, n_head=2)
    config.apply_residual_connection_post_layernorm = True
    model = transformers.BloomForCausalLM(config).double()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(fs.FusedStatsError, match="apply_residual_connection_post_layernorm=True"):
        fs.grow(model, fs.GrowthProtocol(["transformer.h.0"]))
    assert len(model.transformer.h) == 2 and model.config.num_hidden_layers == 2
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_phi3_width_growth_carries_adam_state_into_both_halves():
    """Adam's moments of the fused gate_up_proj follow its rows: old state bit for bit in each
    half, zero state at the new rows of each half."""
    model = make("phi3", seed=7)
    f = model.config.intermediate_size
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    per_sample_loss(model, padded_batch(4, 5, seed=8)).sum().backward()
    optimizer.step()
    old_param = model.model.layers[0].mlp.gate_up_proj.weight
    before = {k: v.clone() for k, v in optimizer.state[old_param].items() if torch.is_tensor(v) and v.dim()}
    points = fs.growth_points(model)[:2]
    fs.grow(model, fs.GrowthProtocol(points, family="mlp_width", width=3), optimizer=optimizer)
    state = optimizer.state[model.model.layers[0].mlp.gate_up_proj.weight]
    for key, old in before.items():
        new = state[key]
        assert new.shape == (2 * (f + 3), 16), key
        assert torch.equal(new[:f], old[:f]) and torch.equal(new[f + 3 : 2 * f + 3], old[f:]), key
        assert not new[f : f + 3].any() and not new[2 * f + 3 :].any(), key
        assert old[f:].abs().sum() > 0, key
