"""A candidate's block is drawn from its own name: (protocol seed, candidate name, earlier growths).

Bit-identity by construction: the block at a boundary is built from the same seed by the same
ops whatever other candidates are listed, so its weights and the |C|_F² measured at it are
compared with ``torch.equal`` / ``==``, not a tolerance. A second growth at one name draws
another block than the first, and the probe built between the two growths measures exactly the
block the second one inserts. Protocol records of version 1 (blocks seeded by position) are
refused when loaded, as are reports and advice files that carry one.
"""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
import torch

import fused_stats as fs
from fused_stats.api.growth.advise import advise
from fused_stats.api.growth.blocks import new_block, new_units

from tiny_models import tiny_lm_config

transformers = pytest.importorskip("transformers")

POINT = "model.layers.1"
LISTS = (
    [POINT],
    ["model.embed_tokens", "model.layers.0", POINT],
    [POINT, "model.layers.2", "model.embed_tokens", "model.layers.0"],
)


def _llama(dtype=torch.float32):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_lm_config("llama", layers=3)).to(dtype).eval()


def _batches(count=3, B=6, T=9, vocab=40):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (B, T), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _same_state(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_block_at_a_point_does_not_depend_on_the_other_candidates():
    model = _llama()
    states = [_state(new_block(model, fs.GrowthProtocol(c, seed=3), POINT)) for c in LISTS]
    assert all(_same_state(states[0], s) for s in states[1:])
    wide = [
        new_units(model, fs.GrowthProtocol(c, family="mlp_width", width=4, seed=3), POINT) for c in LISTS[:2]
    ]
    assert wide[0].pieces.keys() == wide[1].pieces.keys()
    assert all(torch.equal(wide[0].pieces[k][1], wide[1].pieces[k][1]) for k in wide[0].pieces)
    # another seed or another name draws another block (the comparison above can fail)
    other_seed = _state(new_block(model, fs.GrowthProtocol([POINT], seed=4), POINT))
    other_name = _state(
        new_block(model, fs.GrowthProtocol(["model.layers.0", POINT], seed=3), "model.layers.0")
    )
    assert not _same_state(states[0], other_seed) and not _same_state(states[0], other_name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cross_frob2_at_a_point_is_bit_identical_whatever_else_is_listed(dtype):
    values = []
    for candidates in LISTS:
        model = _llama(dtype)
        probe = fs.Probe(model, cross=fs.GrowthProtocol(candidates, seed=3))
        for batch in _batches():
            probe.step(batch, fs.causal_lm_loss)
        sat = probe.saturation(POINT)
        values.append((sat.cross_frob2, sat.cross_frob2_se, probe.cross_stats[POINT].c_sum.clone()))
    first = values[0]
    for other in values[1:]:
        assert other[0] == first[0] and other[1] == first[1] and torch.equal(other[2], first[2])
    assert first[0] != 0


def test_a_second_growth_at_one_name_draws_another_block_and_the_probe_predicted_it():
    model = _llama()
    protocol = fs.GrowthProtocol(["model.embed_tokens", POINT], seed=3)
    first_probe = fs.Probe(model, cross=protocol)
    first_probe.step(_batches(1)[0], fs.causal_lm_loss)
    probed_first = _state(first_probe.cross.block(POINT))
    fs.grow(model, protocol, at=[POINT])
    first = _state(model.model.layers[2])
    assert _same_state(probed_first, first)
    # between the growths: the probe measures the block the second growth will insert
    second_probe = fs.Probe(model, cross=protocol)
    second_probe.step(_batches(1)[0], fs.causal_lm_loss)
    probed_second = _state(second_probe.cross.block(POINT))
    fs.grow(model, protocol, at=[POINT])
    second = _state(model.model.layers[2])  # the newest block, before the first (now layers.3)
    assert _same_state(_state(model.model.layers[3]), first)
    assert _same_state(probed_second, second)
    random_parts = [k for k in first if "q_proj" in k or "gate_proj" in k]
    assert random_parts and all(not torch.equal(first[k], second[k]) for k in random_parts)
    # the count is per name: the other candidate's block is the one of a model never grown there
    assert _same_state(
        _state(new_block(model, protocol, "model.embed_tokens")),
        _state(new_block(_llama(), protocol, "model.embed_tokens")),
    )


def _version_1(record: dict) -> dict:
    """The record the version-1 code wrote for the same fields (no seeding entry)."""
    old = {k: v for k, v in record.items() if k != "seeding"}
    old["version"] = 1
    return old


def test_version_1_protocol_records_are_refused():
    protocol = fs.GrowthProtocol(["model.layers.0", POINT], seed=2)
    record = protocol.to_dict()
    assert record["version"] == 2 and "name" in record["seeding"]
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    assert protocol.digest == hashlib.sha256(text.encode("ascii")).hexdigest()
    assert fs.GrowthProtocol.from_dict(json.loads(json.dumps(record))) == protocol
    with pytest.raises(fs.FusedStatsError, match=r"version 1.*position"):
        fs.GrowthProtocol.from_dict(_version_1(record))
    with pytest.raises(fs.FusedStatsError, match="version"):
        fs.GrowthProtocol.from_dict({**record, "version": 3})


def test_a_report_or_advice_of_the_old_format_is_refused(tmp_path):
    model = _llama()
    protocol = fs.GrowthProtocol(["model.embed_tokens", POINT], seed=2)
    probe = fs.Probe(model, cross=protocol)
    for batch in _batches(2):
        probe.step(batch, fs.causal_lm_loss)
    data = copy.deepcopy(probe.report(misalignment_trials=0).data)
    advise(data)  # the current format is read
    old = _version_1(data["growth_protocol"]["protocol"])
    text = json.dumps(old, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    data["growth_protocol"]["protocol"] = old
    data["growth_protocol"]["digest"] = hashlib.sha256(text.encode("ascii")).hexdigest()
    with pytest.raises(fs.FusedStatsError, match="version 1"):
        advise(data)
    with pytest.raises(fs.FusedStatsError, match="version 1"):
        advise(data, protocol)


def _drawn_under(default_dtype, model, protocol, point):
    before = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        block = new_block(model, protocol, point)
        assert torch.get_default_dtype() == default_dtype  # the draw puts it back
    finally:
        torch.set_default_dtype(before)
    return _state(block)


@pytest.mark.parametrize("kind", ["llama", "resnet"])
def test_the_block_at_a_name_does_not_depend_on_the_default_dtype(kind):
    """The same seed drawn in float64 gives other values than in float32: a block drawn under a
    float64 default must still be the float32-default one (cast to the model's dtype)."""
    from test_resnet_origin import build

    if kind == "llama":
        model, point = _llama(torch.float64), POINT
    else:
        model, point = build("tiny_basic")[0], "layer1.1"
    protocol = fs.GrowthProtocol([point], init="random", seed=3)  # every part drawn, none zeroed
    single = _drawn_under(torch.float32, model, protocol, point)
    double = _drawn_under(torch.float64, model, protocol, point)
    drawn = [k for k, v in single.items() if v.is_floating_point() and v.numel() > 1 and v.std() > 0]
    assert drawn and all(single[k].dtype == torch.float64 for k in drawn)
    assert _same_state(single, double), max((single[k] - double[k]).abs().max().item() for k in drawn)
    # the reference: the float32-default draw is the block of a float32 model, cast
    fp32 = _state(new_block(copy.deepcopy(model).float(), protocol, point))
    assert all(torch.equal(fp32[k].double(), single[k]) for k in drawn)
