"""The growth record (``config.fused_stats_growth``, ``fs.growth_history``).

References: the new parameters of each event are found independently, as the grown model's
parameters that are none of the original tensors (by identity) and sit under the event's
position; the record must survive ``save_pretrained``/``from_pretrained`` as it was written;
refused calls (bad step, evidence for a point not grown, non-finite evidence) leave the model,
its config and its record as they were.
"""

from __future__ import annotations

import types

import pytest
import torch
from test_grow_surgery import llama

import fused_stats as fs
from fused_stats.networks.resnet import cifar_resnet20

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def new_names_by_identity(model, before: set[int]) -> set[str]:
    return {name for name, p in model.named_parameters() if id(p) not in before}


def test_each_growth_event_is_recorded_and_survives_save_and_reload(tmp_path):
    model = llama()
    original = {id(p) for p in model.parameters()}
    points = ["model.embed_tokens", "model.layers.1"]
    protocol = fs.GrowthProtocol(points, family="layer")
    evidence = {"model.layers.1": {"cross_frob2": 2.5e-4, "p_value": 0.003, "p_adjusted": 0.006}}
    result = fs.grow(model, protocol, step=120, evidence=evidence)
    history = fs.growth_history(model)
    assert [e["point"] for e in history] == points
    new = new_names_by_identity(model, original)
    for entry in history:
        assert entry["event"] == "grew" and entry["family"] == "layer" and entry["init"] == "zero"
        assert entry["protocol_digest"] == protocol.digest and entry["step"] == 120
        assert entry["position"] == result.positions[entry["point"]]
        under = {n for n in new if n.startswith(entry["position"] + ".")}
        assert under and set(entry["new_parameters"]) == under
        assert entry["widened"] == []
    assert sum(len(e["new_parameters"]) for e in history) == len(new)
    assert history[0]["cross_frob2"] is None and history[0]["p_value"] is None
    assert history[1]["cross_frob2"] == 2.5e-4 and history[1]["p_adjusted"] == 0.006
    # a second event appends, oldest first (width growth: every block's MLP, so every boundary
    # before a block)
    widths = fs.growth_points(model)[:-1]
    fs.grow(model, fs.GrowthProtocol(widths, family="mlp_width", width=3), step=200)
    history = fs.growth_history(model)
    assert [e["step"] for e in history] == [120] * 2 + [200] * len(widths)
    assert [e["point"] for e in history[2:]] == widths
    assert history[2]["position"] == "model.layers.0" and history[-1]["position"] == "model.layers.4"
    for entry in history[2:]:
        assert entry["family"] == "mlp_width" and entry["new_parameters"] == []
        assert entry["widened"] and all(n.startswith(entry["position"] + ".mlp.") for n in entry["widened"])
    model.save_pretrained(tmp_path / "grown")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "grown", dtype=torch.float64)
    assert fs.growth_history(reloaded) == history
    # a copy: editing it leaves the model's record alone
    fs.growth_history(reloaded)[0]["point"] = "x"
    assert fs.growth_history(reloaded) == history


def test_evidence_from_an_advice_and_a_resnet_record_on_the_model():
    model = cifar_resnet20(width=4, seed=2).double().eval()
    point = "layer1.0"
    rows = (
        types.SimpleNamespace(point="layer2.1", cross_frob2=1.0, p_value=0.5, p_adjusted=0.9),
        types.SimpleNamespace(point=point, cross_frob2=3.25, p_value=1e-4, p_adjusted=2e-4),
    )
    fs.grow(
        model,
        fs.GrowthProtocol([point, "layer2.1"], family="layer"),
        at=point,
        evidence=types.SimpleNamespace(ranked=rows),
    )
    (entry,) = fs.growth_history(model)
    assert entry["point"] == point and entry["position"] == "layer1.1"
    assert (entry["cross_frob2"], entry["p_value"], entry["p_adjusted"]) == (3.25, 1e-4, 2e-4)
    assert entry["step"] is None and all(n.startswith("layer1.1.") for n in entry["new_parameters"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"step": -1}, "step must be"),
        ({"step": 2.0}, "step must be"),
        ({"step": True}, "step must be"),
        ({"evidence": {"model.layers.0": {"cross_frob2": 1.0}}}, "not grown here"),
        ({"evidence": {"model.layers.1": {"cross_frob2": float("nan")}}}, "finite number"),
        ({"evidence": {"model.layers.1": {"loss": 1.0}}}, "keys among"),
        ({"evidence": {"model.layers.1": {"p_value": True}}}, "finite number"),
        ({"evidence": types.SimpleNamespace(ranked=())}, "no row for the grown points"),
        ({"evidence": [1.0]}, "evidence must be"),
    ],
)
def test_bad_step_or_evidence_is_refused_with_nothing_changed(kwargs, message):
    model = llama(layers=2)
    names = [n for n, _ in model.named_parameters()]
    config = model.config
    protocol = fs.GrowthProtocol(["model.layers.0", "model.layers.1"], family="layer")
    with pytest.raises(fs.FusedStatsError, match=message):
        fs.grow(model, protocol, at="model.layers.1", **kwargs)
    assert [n for n, _ in model.named_parameters()] == names
    assert model.config is config and config.num_hidden_layers == 2
    assert fs.growth_history(model) == [] and not hasattr(config, "fused_stats_growth")


def test_a_record_not_written_by_grow_is_refused():
    model = llama(layers=1)
    model.config.fused_stats_growth = {"point": "model.layers.0"}
    with pytest.raises(fs.FusedStatsError, match="not a list of entries"):
        fs.growth_history(model)


def test_a_record_with_a_non_dict_entry_is_refused():
    model = llama(layers=1)
    model.config.fused_stats_growth = [{"point": "model.layers.0"}, "model.layers.0"]
    with pytest.raises(fs.FusedStatsError, match="not a list of entries"):
        fs.growth_history(model)


def test_step_zero_is_recorded_and_positions_sharing_a_prefix_keep_their_own_parameters():
    # 11 blocks, grown after blocks 0 and 9: the new blocks sit at model.layers.1 and model.layers.11,
    # and "model.layers.1" is a string prefix of "model.layers.11"
    model = llama(layers=11)
    original = {id(p) for p in model.parameters()}
    fs.grow(model, fs.GrowthProtocol(["model.layers.0", "model.layers.9"], family="layer"), step=0)
    history = fs.growth_history(model)
    assert [e["position"] for e in history] == ["model.layers.1", "model.layers.11"]
    assert [e["step"] for e in history] == [0, 0]
    new = new_names_by_identity(model, original)
    for entry in history:
        assert set(entry["new_parameters"]) == {n for n in new if n.startswith(entry["position"] + ".")}
    assert sum(len(e["new_parameters"]) for e in history) == len(new)


def test_a_saturation_entry_is_the_documented_dict_and_a_bad_step_is_refused():
    from fused_stats.api.growth.record import record_saturation

    model = llama(layers=2)
    protocol = fs.GrowthProtocol(["model.layers.0", "model.layers.1"], family="layer")
    with pytest.raises(fs.FusedStatsError, match="step must be"):
        record_saturation(model, protocol, -3, "none significant")
    assert fs.growth_history(model) == []
    record_saturation(model, protocol, 7, "none significant")
    assert fs.growth_history(model) == [
        {
            "event": "saturated everywhere",
            "point": None,
            "family": "layer",
            "init": "zero",
            "protocol_digest": protocol.digest,
            "position": None,
            "new_parameters": [],
            "widened": [],
            "step": 7,
            "cross_frob2": None,
            "p_value": None,
            "p_adjusted": None,
            "verdict": "none significant",
        }
    ]
