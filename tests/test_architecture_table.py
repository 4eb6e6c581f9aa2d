"""Growth's adapter table, per model_type, against per-sample gradients of the grown model.

Reference: the model grown by ``fs.grow`` (an fp64 copy), one ``torch.autograd.grad`` per sample
over ALL its new parameters (at the origin only the origin parameters have a gradient, so the
reference needs nothing of the adapter), then the unbiased ``|C|²``, its SE, ``z`` and ``p`` by
brute force over index tuples (tests/test_growth_tangent.py). Function preservation: logits of
the grown model, and of its save_pretrained/from_pretrained copy, bit-identical to the original's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from test_growth_tangent import assert_matches, padded_batch, per_sample_loss

import fused_stats as fs
from fused_stats.api.growth import architecture
from fused_stats.api.growth.tangent import GrowthTangent

VOCAB = 40
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


def _config(model_type: str):
    c = dict(COMMON)
    if model_type == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    if model_type in ("gpt_neox", "gpt_neox_serial"):
        c.pop("num_key_value_heads")
        return transformers.GPTNeoXConfig(**c, use_parallel_residual=model_type == "gpt_neox")
    if model_type == "granite":
        return transformers.GraniteConfig(
            **c,
            embedding_multiplier=3.0,
            residual_multiplier=0.37,
            attention_multiplier=0.3,
            logits_scaling=2.0,
        )
    if model_type in ("qwen2", "qwen3"):
        cls = transformers.Qwen2Config if model_type == "qwen2" else transformers.Qwen3Config
        # layer 0 full, layer 1 sliding (window 3 < T): the new block must take its neighbour's type
        return cls(**c, use_sliding_window=True, sliding_window=3, max_window_layers=1, head_dim=8)
    if model_type in ("gemma2", "gemma3_text"):
        cls = transformers.Gemma2Config if model_type == "gemma2" else transformers.Gemma3TextConfig
        return cls(**c, head_dim=8, sliding_window=3, query_pre_attn_scalar=8, attn_logit_softcapping=None)
    if model_type == "gemma":
        return transformers.GemmaConfig(**c, head_dim=8)
    if model_type == "smollm3":
        return transformers.SmolLM3Config(**c, no_rope_layers=[1, 0])
    if model_type in ("stablelm", "stablelm_parallel"):
        return transformers.StableLmConfig(
            **c, qk_layernorm=True, use_parallel_residual=model_type == "stablelm_parallel"
        )
    if model_type == "cohere":
        return transformers.CohereConfig(**c, use_qk_norm=True, logit_scale=0.5)
    if model_type == "exaone4":
        return transformers.Exaone4Config(**c, sliding_window=3, sliding_window_pattern=2, head_dim=8)
    configs = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "olmo": transformers.OlmoConfig,
        "olmo2": transformers.Olmo2Config,
        "phi3": transformers.Phi3Config,
    }
    return configs[model_type](**c)


def make(model_type: str, seed: int = 0):
    """A tiny fp64 CausalLM of ``model_type`` with random norms (not all at 1); sdpa attention:
    eager attention turns a left-padded sample into NaN (its fully masked rows)."""
    torch.manual_seed(seed)
    attention = "eager" if model_type == "gemma2" else "sdpa"  # Gemma2 has no sdpa path
    model = transformers.AutoModelForCausalLM.from_config(_config(model_type), attn_implementation=attention)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model.double().eval()


# name -> (model_type, tolerance of the |C|² comparison); Gemma's norms compute in fp32 even in an
# fp64 model (x.float()), so the reference gradient through its output norm carries fp32 rounding
FAMILIES = {
    "llama": 1e-10,
    "mistral": 1e-10,
    "qwen2": 1e-10,
    "qwen3": 1e-10,
    "gemma": 1e-10,
    "gemma2": 1e-5,
    "gemma3_text": 1e-5,
    "olmo": 1e-10,
    "olmo2": 1e-10,
    "exaone4": 1e-10,
    "granite": 1e-10,
    "phi3": 1e-10,
    "cohere": 1e-10,
    "stablelm": 1e-10,
    "stablelm_parallel": 1e-10,
    "smollm3": 1e-10,
    "gpt2": 1e-10,
    "gpt_neox": 1e-10,
    "gpt_neox_serial": 1e-10,
}
NO_WIDTH = {"gemma2", "gemma3_text", "olmo2", "exaone4"}


def batch_for(name, n, T, seed):
    """Left and right padding; right only for Gemma2, whose eager attention gives NaN at a left
    padded sample's fully masked rows."""
    batch = padded_batch(n, T, seed)
    if name == "gemma2":
        am = batch["attention_mask"]
        batch["attention_mask"] = am.sort(dim=1, descending=True).values
    return batch


def logits(model, batch):
    with torch.no_grad():
        return model(**batch, use_cache=False).logits


def grown_rows(model, protocol, point, batch):
    """Per-sample gradients of every new (or widened) parameter of the fs.grow-grown copy."""
    grown = copy.deepcopy(model)
    result = fs.grow(grown, protocol, at=[point])
    params = dict(grown.named_parameters())
    new = [params[n] for n in result.new_parameters + result.widened]
    for p in grown.parameters():
        p.requires_grad_(False)
    for p in new:
        p.requires_grad_(True)
    rows = []
    for b in range(batch["input_ids"].shape[0]):
        one = {k: v[b : b + 1] for k, v in batch.items()}
        grads = torch.autograd.grad(per_sample_loss(grown, one)[0], new)
        rows.append(torch.cat([g.flatten() for g in grads]))
    return grown, torch.stack(rows)


def assert_close(sat, c, rel):
    if rel == 1e-10:
        assert_matches(sat, c, 1e-9)
        return
    from test_growth_tangent import brute_force

    cross2, _se, z, p = brute_force(c)
    assert abs(sat.cross_frob2 - cross2) <= rel * abs(cross2), (sat.cross_frob2, cross2)
    assert abs(sat.z - z) <= rel * max(1.0, abs(z)) and abs(sat.p_value - p) <= rel
    assert abs(cross2) > 1e-9


@pytest.mark.parametrize("name", list(FAMILIES))
def test_layer_growth_per_family(name, tmp_path):
    """Every boundary, the input boundary first: zero growth keeps the logits bit for bit (also
    after save_pretrained/from_pretrained), and the probe's |C|², SE, z, p equal the unbiased
    values from per-sample gradients of all new parameters of the grown model."""
    model = make(name)
    points = fs.growth_points(model)
    assert len(points) == 3 and points[0] == architecture.describe(model).input_point
    protocol = fs.GrowthProtocol(points, seed=3)
    probe = fs.Probe(model, points=points, cross=protocol, second_moment="dense")
    batch = batch_for(name, 6, 5, seed=11)
    probe.step(batch, per_sample_loss)
    assert probe.cross.checked == set(points)  # the self-check ran at every candidate
    base = logits(model, batch)
    for point in points:
        grown, c = grown_rows(model, protocol, point, batch)
        assert torch.equal(logits(grown, batch), base), point
        assert_close(probe.saturation(point), c, FAMILIES[name])
    grown = copy.deepcopy(model)
    fs.grow(grown, protocol)
    assert torch.equal(logits(grown, batch), base)
    assert_reloads(grown, tmp_path, batch)


def assert_reloads(grown, path, batch):
    """save_pretrained -> from_pretrained: the same config lists and parameters bit for bit; the
    logits to rounding (a model's own reload moves them by ~1e-17 here: qwen3 4.2e-17, measured
    on the ungrown model too, so bit equality of logits is not a property of the reload)."""
    grown.save_pretrained(path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation=grown.config._attn_implementation
    ).eval()
    arch = architecture.describe(grown)
    assert loaded.config.num_hidden_layers == len(grown.get_submodule(arch.containers[0]))
    for key in arch.adapter.layer_lists:
        assert getattr(loaded.config, key, None) == getattr(grown.config, key, None), key
    mine, theirs = grown.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.allclose(logits(loaded, batch), logits(grown, batch), rtol=0, atol=1e-14)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in NO_WIDTH])
def test_mlp_width_per_family(name):
    """New MLP units in every block (the config holds one intermediate size): logits bit-identical
    and the probe at each boundary equal to the per-sample gradients of the new (zero) output
    columns of the block it widens, from the fs.grow-grown model."""
    model = make(name, seed=1)
    points = fs.growth_points(model)[:2]
    protocol = fs.GrowthProtocol(points, family="mlp_width", width=3, seed=2)
    probe = fs.Probe(model, points=points, cross=protocol, second_moment="dense")
    batch = batch_for(name, 6, 5, seed=12)
    probe.step(batch, per_sample_loss)
    grown = copy.deepcopy(model)
    result = fs.grow(grown, protocol)
    # wider matmuls sum in other blocks: zero columns keep the logits to rounding, not bit for bit
    assert torch.allclose(logits(grown, batch), logits(model, batch), rtol=0, atol=1e-14)
    arch = architecture.describe(model)
    outs = {p: grown.get_parameter(f"{result.positions[p]}.{arch.adapter.mlp_output}.weight") for p in points}
    for p in grown.parameters():
        p.requires_grad_(False)
    for p in outs.values():
        p.requires_grad_(True)
    rows = {p: [] for p in points}
    for b in range(6):
        one = {key: v[b : b + 1] for key, v in batch.items()}
        grads = torch.autograd.grad(per_sample_loss(grown, one)[0], list(outs.values()))
        for p, g in zip(points, grads):
            rows[p].append((g[-3:, :] if arch.adapter.conv1d else g[:, -3:]).flatten())
    for p in points:
        assert_matches(probe.saturation(p), torch.stack(rows[p]), 1e-9)


@pytest.mark.parametrize("name", sorted(NO_WIDTH))
def test_mlp_width_refused_where_not_exact(name):
    model = make(name)
    state = copy.deepcopy(model.state_dict())
    points = fs.growth_points(model)[:1]
    protocol = fs.GrowthProtocol(points, family="mlp_width", width=3)
    with pytest.raises(fs.FusedStatsError, match=f"model_type '{name}'"):
        fs.Probe(model, points=points, cross=protocol)
    with pytest.raises(fs.FusedStatsError, match="mlp_width"):
        fs.grow(model, protocol)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_unsupported_model_type_refused_nothing_changed():
    cfg = transformers.LlamaConfig(**COMMON)
    cfg.model_type = "my_llama"  # a custom family built on LLaMA's code: not in the table
    model = transformers.LlamaForCausalLM(cfg).double()
    before = copy.deepcopy(model.state_dict())
    protocol = fs.GrowthProtocol(["model.layers.0"])
    for call in (
        lambda: fs.growth_points(model),
        lambda: fs.grow(model, protocol),
        lambda: fs.Probe(model, points=["model.layers.0"], cross=protocol),
    ):
        with pytest.raises(fs.FusedStatsError, match=r"model_type 'my_llama'.*supported.*'llama'"):
            call()
    assert len(model.model.layers) == 2 and model.config.num_hidden_layers == 2
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize(
    "mutation",
    [
        ("granite", {"branch_scale": None}),
        ("granite", {"input_scale": None}),
        ("gemma2", {"origin_value": 0.0}),
        ("olmo2", {"origin": "zero_maps", "origin_modules": ("self_attn.o_proj", "mlp.down_proj")}),
        ("llama", {"origin_modules": ("self_attn.o_proj",)}),
    ],
)
def test_self_check_catches_a_wrong_adapter_entry(mutation, monkeypatch):
    """An adapter entry that misdescribes the block (a dropped scale, a wrong origin value or
    module) is caught by the self-check at the first step, naming the point and model_type; with
    self_check=False the same probe runs, except for a wrong input scale, which is checked always."""
    model_type, change = mutation
    model = make(model_type)
    wrong = architecture.ADAPTERS[model_type].__class__(
        **{**architecture.ADAPTERS[model_type].__dict__, **change}
    )
    monkeypatch.setitem(architecture.ADAPTERS, model_type, wrong)
    points = fs.growth_points(model)
    checked = points[0] if "input_scale" in change else points[1]

    def new_block(model, protocol, point):
        # the block as the wrong entry builds it, at a function-preserving origin all the same
        from fused_stats.api.growth import blocks

        block = blocks.new_block(model, protocol, point)
        if model_type == "gemma2":
            with torch.no_grad():
                for name in wrong.origin_modules:
                    block.get_submodule(name).weight.fill_(0.0)
        return block

    protocol = fs.GrowthProtocol([checked], seed=1)
    batch = batch_for(model_type, 4, 5, seed=3)
    custom = new_block if model_type == "gemma2" else None
    pattern = rf"self-check failed at '{checked}' \(model_type '{model_type}'\)"
    if "input_scale" in change:  # checked when the source is built: block 0's input vs the point's output
        with pytest.raises(fs.FusedStatsError, match=pattern):
            GrowthTangent(protocol, model)
    else:
        probe = fs.Probe(model, points=[checked], cross=GrowthTangent(protocol, model, new_block=custom))
        with pytest.raises(fs.FusedStatsError, match=pattern):
            probe.step(batch, per_sample_loss)
        assert not probe.table
    if "input_scale" in change:  # a fact of the model's forward: checked with self_check off too
        with pytest.raises(fs.FusedStatsError, match=pattern):
            GrowthTangent(protocol, model, self_check=False)
        return
    off = fs.Probe(
        model,
        points=[checked],
        cross=GrowthTangent(protocol, model, new_block=custom, self_check=False),
    )
    off.step(batch, per_sample_loss)
    assert off.saturation(checked).n == 4


@pytest.mark.parametrize("name", ["qwen2", "smollm3"])
@pytest.mark.parametrize("where", [0, 2])
def test_per_layer_lists_follow_depth_growth(name, where, tmp_path):
    """Growing at the input boundary (the new layer 0 takes layer 0's entries) and after block 0
    (the new layer takes block 0's): every per-layer list in step, from_pretrained works and
    the logits are bit-identical."""
    model = make(name, seed=4)
    lists = architecture.ADAPTERS[name].layer_lists
    before = {key: list(getattr(model.config, key)) for key in lists}
    assert len(set(before["layer_types"])) == 2 or len(set(before.get("no_rope_layers", []))) == 2
    point = fs.growth_points(model)[where]
    batch = padded_batch(5, 6, seed=2)
    base = logits(model, batch)
    grown = copy.deepcopy(model)
    fs.grow(grown, fs.GrowthProtocol([point]))
    # the input boundary: the new block 0 takes block 0's entry; after block 1: block 1's
    position, source = (0, 0) if where == 0 else (where, where - 1)
    for key, values in before.items():
        expected = [*values[:position], values[source], *values[position:]]
        assert list(getattr(grown.config, key)) == expected, key
    assert torch.equal(logits(grown, batch), base)
    assert_reloads(grown, tmp_path, batch)
    # the new block was built from the lists it is given (SmolLM3's RoPE use, Qwen2's window):
    # its origin gradients in the grown model equal those in the reloaded one
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    name_prefix = f"model.layers.{position}."
    grads = []
    for m in (grown, loaded):
        params = [p for n, p in m.named_parameters() if n.startswith(name_prefix) and "o_proj" in n]
        grads.append(torch.autograd.grad(per_sample_loss(m, batch).sum(), params))
    assert all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(*grads))
    assert grads[0][0].abs().max() > 0
    # the new block was built from the lists it is given (SmolLM3's RoPE use, Qwen2's window):
    # its origin gradients in the grown model equal those in the reloaded one
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    name_prefix = f"model.layers.{position}."
    grads = []
    for m in (grown, loaded):
        params = [p for n, p in m.named_parameters() if n.startswith(name_prefix) and "o_proj" in n]
        grads.append(torch.autograd.grad(per_sample_loss(m, batch).sum(), params))
    assert all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(*grads))
    assert grads[0][0].abs().max() > 0


def test_growth_points_of_bare_models_and_resnets():
    from fused_stats.networks.resnet import cifar_resnet20

    model = make("granite")
    assert fs.growth_points(model.model) == ["embed_tokens", "layers.0", "layers.1"]
    gpt2 = make("gpt2")
    assert fs.growth_points(gpt2) == ["transformer.drop", "transformer.h.0", "transformer.h.1"]
    resnet = cifar_resnet20(width=4, seed=0)
    assert fs.growth_points(resnet)[:4] == ["layer1.0", "layer1.1", "layer1.2", "layer2.0"]


def test_streamed_and_meta_device_models_refused():
    """A model of fs.stream_blocks (its blocks wrapped, weights loaded block by block) and a model
    with meta-device weights are refused by the tangent probe and by grow, nothing changed."""
    model = make("llama")
    before = copy.deepcopy(model.state_dict())
    protocol = fs.GrowthProtocol(["model.layers.0"])
    with fs.stream_blocks(model) as streamed:
        for call in (
            lambda: fs.Probe(streamed.model, points=["model.layers.0"], cross=protocol),
            lambda: fs.grow(streamed.model, protocol),
        ):
            with pytest.raises(
                fs.FusedStatsError, match=r"\(llama\): its blocks are wrapped.*fs.stream_blocks"
            ):
                call()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(_config("llama"))
    with pytest.raises(fs.FusedStatsError, match="meta-device"):
        GrowthTangent(protocol, meta)


@pytest.mark.parametrize("key", ["layer_types", "no_rope_layers"])
def test_per_layer_list_of_the_wrong_length_refused(key):
    model = make("smollm3")
    setattr(model.config, key, list(getattr(model.config, key))[:1])
    before = copy.deepcopy(model.config.to_dict())
    with pytest.raises(fs.FusedStatsError, match=rf"config\.{key} lists 1 layers but num_hidden_layers is 2"):
        fs.grow(model, fs.GrowthProtocol(["model.layers.0"]))
    assert len(model.model.layers) == 2 and model.config.to_dict() == before


def test_gemma3_multimodal_refused_with_the_reason():
    text = dict(COMMON, head_dim=8, sliding_window=3, query_pre_attn_scalar=8)
    vision = dict(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=39,
        boi_token_index=38,
        eoi_token_index=37,
    )
    model = transformers.Gemma3ForConditionalGeneration(config)
    point = "model.language_model.layers.0"
    with pytest.raises(
        fs.FusedStatsError, match=r"refuses model_type 'gemma3'.*image features.*'gemma3_text'"
    ):
        fs.grow(model, fs.GrowthProtocol([point]))
    assert len(model.model.language_model.layers) == 2 and config.text_config.num_hidden_layers == 2


@pytest.mark.parametrize("name", ["llama", "exaone4", "gpt2"])
def test_model_cache_is_not_given_to_the_new_block(name):
    """A loss run with use_cache=True hands the blocks the model's Cache (under the keyword the
    family uses: past_key_values, cache); the new block gets none, so the statistics equal those
    of a use_cache=False run."""
    model = make(name, seed=5)
    points = fs.growth_points(model)
    batch = batch_for(name, 4, 5, seed=6)

    def cached_loss(model, batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=True)
        assert out.past_key_values is not None
        logits = out.logits
        am = batch["attention_mask"]
        valid = (am[:, 1:] * am[:, :-1]).to(logits.dtype)
        ce = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), batch["input_ids"][:, 1:], reduction="none"
        )
        return (ce * valid).sum(1) / valid.sum(1)

    stats = []
    for loss in (cached_loss, per_sample_loss):
        probe = fs.Probe(model, points=points, cross=fs.GrowthProtocol(points, seed=2))
        probe.step(batch, loss)
        stats.append([probe.saturation(p).cross_frob2 for p in points])
    assert stats[0] == stats[1] and all(v != 0 for v in stats[0])


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text"])
def test_gemma_post_norm_tangent_exact_with_fp64_norms(name, monkeypatch):
    """Gemma's norms compute in fp32 even in an fp64 model, which limits the comparison above to
    fp32 rounding; with its norm computing in the input's dtype (the same formula, x̂ (1 + w))
    the probe equals the per-sample gradients of all new parameters to 1e-10 at every boundary."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    norm = Gemma2RMSNorm if name == "gemma2" else Gemma3RMSNorm
    monkeypatch.setattr(norm, "forward", lambda self, x: self._norm(x) * (1.0 + self.weight))
    model = make(name, seed=2)
    points = fs.growth_points(model)
    protocol = fs.GrowthProtocol(points, seed=4)
    probe = fs.Probe(model, points=points, cross=protocol, second_moment="dense")
    batch = batch_for(name, 6, 5, seed=13)
    probe.step(batch, per_sample_loss)
    assert max(probe.cross.check_errors.values()) < 1e-12
    for point in points:
        grown, c = grown_rows(model, protocol, point, batch)
        assert torch.equal(logits(grown, batch), logits(model, batch))
        assert_matches(probe.saturation(point), c, 1e-9)
