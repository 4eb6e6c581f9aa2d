"""Facts of the growth plan, protocol and record checked against the grown model itself or the
documented rule: a plan made before a width growth is stale (its seeds count growths), the zero
parameters it names are the entries that are zero in the grown model (GPT-2's Conv1D rows,
LLaMA's columns, Gemma2's norm scales at -1), a block's seed is the SHA-256 rule written in
``SEEDING_RULE``, a negative seed is refused, and a width growth renumbers no earlier entry."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import fused_stats as fs
from fused_stats.api.growth.protocol import SEEDING_RULE, block_seed

from tiny_models import tiny_lm_config

transformers = pytest.importorskip("transformers")


def _model(arch="llama", layers=3, seed=0):
    torch.manual_seed(seed)
    if arch == "gemma2":
        cfg = transformers.Gemma2Config(
            vocab_size=40,
            hidden_size=8,
            intermediate_size=12,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=4,
            max_position_embeddings=16,
        )
        return transformers.Gemma2ForCausalLM(cfg).eval()
    return transformers.AutoModelForCausalLM.from_config(tiny_lm_config(arch, layers=layers)).eval()


def test_a_plan_made_before_a_width_growth_is_stale():
    model = _model(layers=2)
    points = fs.growth_points(model)[:2]  # width growth widens every block alike
    protocol = fs.GrowthProtocol(points, family="mlp_width", width=2, seed=4)
    plan = fs.plan_growth(model, protocol)
    fs.grow(model, protocol)  # same block count: only the record's length changed
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(fs.FusedStatsError, match="stale"):
        fs.grow(model, plan)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert fs.plan_growth(model, protocol).candidate(points[1]).earlier_growths == 1


@pytest.mark.parametrize(
    "arch, module", [("gpt2", "transformer.h.1.mlp.c_proj"), ("llama", "model.layers.1.mlp.down_proj")]
)
def test_the_named_zero_slice_of_a_width_growth_is_the_zero_one(arch, module):
    model = _model(arch, layers=2)
    width = 3
    protocol = fs.GrowthProtocol(fs.growth_points(model)[:2], family="mlp_width", width=width, seed=1)
    (label,) = next(iter(fs.plan_growth(model, protocol).zero_parameters().values()))
    fs.grow(model, protocol)
    w = model.get_submodule(module).weight.detach()
    new_rows, new_cols = w[-width:, :], w[:, -width:]
    # GPT-2's Conv1D stores (in, out): the new hidden units are its last rows; nn.Linear's columns
    zero_side = "rows" if bool((new_rows == 0).all()) else "columns" if bool((new_cols == 0).all()) else None
    mlp_output = ".".join(module.split(".")[-2:])
    assert zero_side is not None and label == f"{mlp_output}.weight[new {zero_side}]", (label, zero_side)


def test_a_norm_scale_origin_is_named_with_its_value_where_it_is_not_zero():
    gemma = _model("gemma2", layers=2)
    protocol = fs.GrowthProtocol(["model.layers.0"], seed=1)
    names = fs.plan_growth(gemma, protocol).zero_parameters()["gemma2"]
    result = fs.grow(gemma, protocol)
    block = gemma.get_submodule(fs.growth_history(gemma)[0]["position"])
    assert result.new_parameters and names
    for name in names:
        module, _, rest = name.partition(".weight")
        scale = block.get_submodule(module).weight.detach()
        assert rest == "[at -1]" and bool((scale == -1).all()), (name, scale)
    llama_names = fs.plan_growth(_model(), protocol).zero_parameters()["llama"]
    assert llama_names and not any("[at" in n for n in llama_names)


@pytest.mark.parametrize("seed, point, earlier", [(0, "model.layers.1", 0), (7, "model.embed_tokens", 2)])
def test_block_seed_is_the_documented_sha256_rule(seed, point, earlier):
    assert "first 8 bytes (little-endian, shifted right by 1" in SEEDING_RULE
    text = json.dumps(["fused_stats.growth.block", seed, point, earlier], separators=(",", ":"))
    digest = hashlib.sha256(text.encode("ascii")).digest()
    expected = int.from_bytes(digest[:8], "little") >> 1
    assert block_seed(seed, point, earlier) == expected
    plan = fs.plan_growth(_model(), fs.GrowthProtocol([point], seed=seed))
    if earlier == 0:
        assert plan.seed(point) == expected


def test_a_negative_seed_is_refused_naming_it():
    with pytest.raises(fs.FusedStatsError, match=r"seed must be an integer >= 0, got -1"):
        fs.GrowthProtocol(["model.layers.0"], seed=-1)


def test_a_width_growth_after_a_depth_growth_renumbers_nothing():
    model = _model()
    fs.grow(model, fs.GrowthProtocol(["model.layers.0"], seed=1))  # new block at model.layers.1
    first = fs.growth_history(model)[0]
    assert first["position"] == "model.layers.1"
    points = fs.growth_points(model)[:4]  # every block of four widened alike
    fs.grow(model, fs.GrowthProtocol(points, family="mlp_width", width=2, seed=2))
    history = fs.growth_history(model)
    assert history[0]["position"] == "model.layers.1"
    assert history[0]["new_parameters"] == first["new_parameters"]
    named = dict(model.named_parameters())
    assert all(n in named for n in history[0]["new_parameters"])
