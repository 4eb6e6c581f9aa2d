"""Advice names the parameters a new block really starts at its origin with, and is refused as
evidence for another protocol.

The names of a post-norm model (Gemma2, OLMo2: the branch output passes a norm after its last
map) are its two output norms' scales, not the attention / MLP output maps of the pre-norm
table: checked by hand-written names, and against the grown block itself (the named scales sit
at the origin value everywhere; the output maps the old table named are not zero).
"""

from __future__ import annotations

import pytest
import torch
from test_architecture_table import batch_for, make

import fused_stats as fs
from fused_stats.api.growth.advise import advise

POINTS = ["model.layers.0", "model.layers.1"]
NORM_SCALES = ["post_attention_layernorm.weight", "post_feedforward_layernorm.weight"]


def _probed(model_type):
    model = make(model_type)
    protocol = fs.GrowthProtocol(POINTS, seed=1)
    probe = fs.Probe(model, cross=protocol)
    for seed in (0, 1):
        probe.step(batch_for(model_type, 6, 7, seed), fs.causal_lm_loss)
    return model, protocol, probe


@pytest.mark.parametrize(
    "model_type,names,origin",
    [
        ("gemma2", [f"{n}[at -1]" for n in NORM_SCALES], -1.0),
        ("olmo2", NORM_SCALES, 0.0),
    ],
)
def test_post_norm_advice_names_the_norm_scales(model_type, names, origin):
    model, protocol, probe = _probed(model_type)
    report = probe.report(misalignment_trials=0).data
    assert report["growth_protocol"]["model_zero_parameters"] == {model_type: names}
    advice = advise(report)
    assert advice.zero_parameters == {model_type: names}
    text = advice.to_markdown()
    assert "post_attention_layernorm.weight" in text and "o_proj" not in text and "down_proj" not in text
    # the grown block: the named scales at the origin, the maps the pre-norm table names are not zero
    fs.grow(model, protocol, at=["model.layers.1"])
    block = model.model.layers[2]
    for name in NORM_SCALES:
        weight = block.get_parameter(name)
        assert torch.equal(weight, torch.full_like(weight, origin))
    assert bool((block.self_attn.o_proj.weight != 0).any()) and bool((block.mlp.down_proj.weight != 0).any())


def test_pre_norm_advice_keeps_the_output_maps():
    _, _, probe = _probed("llama")
    assert advise(probe).zero_parameters == {"llama": ["self_attn.o_proj.weight", "mlp.down_proj.weight"]}


def test_advice_of_another_protocol_is_refused_as_evidence():
    model, protocol, probe = _probed("llama")
    advice = advise(probe)
    other = fs.GrowthProtocol(POINTS, seed=2)  # the same points, other blocks
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(fs.FusedStatsError, match="advice was made under protocol"):
        fs.grow(model, other, at=["model.layers.1"], evidence=advice)
    after = list(model.parameters())
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    assert fs.growth_history(model) == []
    fs.grow(model, protocol, at=["model.layers.1"], evidence=advice)
    (entry,) = fs.growth_history(model)
    row = next(c for c in advice.ranked if c.point == "model.layers.1")
    assert entry["protocol_digest"] == advice.digest and entry["cross_frob2"] == row.cross_frob2
