"""Refusals found in review of the growth layer: each input below was accepted and then gave a
wrong answer or changed the model before refusing; now each is a FusedStatsError with nothing
changed (model, config, record), or, for the protocol file, the same protocol as the API's."""

from __future__ import annotations

import pytest
import torch
from test_growth_tangent import make_model, per_sample_loss

import fused_stats as fs
from fused_stats.api.growth.protocol_file import protocol_from_table

transformers = pytest.importorskip("transformers")


def lm_batch(gen, B=5, T=6):
    ids = torch.randint(0, 40, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 4:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_a_score_some_candidates_lack_is_refused_not_ranked_by_protocol_order():
    model, stack = make_model("llama", seed=3)
    candidates = ["model.embed_tokens", f"{stack}.0", f"{stack}.1"]
    protocol = fs.GrowthProtocol(candidates, score="adam_first_step")
    probe = fs.Probe(model, cross=protocol)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # a train stream only: <s_M, C_K> has no K
        probe.step(lm_batch(gen), per_sample_loss, stream="train")
    with pytest.raises(fs.FusedStatsError, match=r"'adam_first_step', which is not available.*test stream"):
        fs.advise(probe, protocol)
    # with a test stream the same probe ranks by the score
    for _ in range(3):
        probe.step(lm_batch(gen), per_sample_loss, stream="test")
    advice = fs.advise(probe, protocol)
    drops = [-c.predicted_change_adam for c in advice.ranked]
    assert drops == sorted(drops, reverse=True)


def test_grow_refuses_a_record_it_cannot_append_to_before_the_surgery():
    model, stack = make_model("llama")
    model.config.fused_stats_growth = {"not": "a list"}
    names = [n for n, _ in model.named_parameters()]
    with pytest.raises(fs.FusedStatsError, match="not a list of entries"):
        fs.grow(model, fs.GrowthProtocol([f"{stack}.0"]))
    assert [n for n, _ in model.named_parameters()] == names and model.config.num_hidden_layers == 2


def test_schedules_that_could_never_decide_are_refused_when_built():
    batches = [lm_batch(torch.Generator().manual_seed(1))]
    with pytest.raises(fs.FusedStatsError, match="'mlp_width' widens every block"):
        fs.GrowthSchedule(
            fs.GrowthProtocol(["model.layers.0"], family="mlp_width", width=2), every=2, probe_batches=batches
        )
    with pytest.raises(fs.FusedStatsError, match="needs a train and a test stream"):
        fs.GrowthSchedule(
            fs.GrowthProtocol(["model.layers.0"], score="adam_first_step"), every=2, probe_batches=batches
        )


def test_the_trainer_callback_rebuilt_without_arguments_says_why():
    from fused_stats.integrations.transformers import GrowthScheduleCallback

    with pytest.raises(fs.FusedStatsError, match="restore_callback_states_from_checkpoint"):
        GrowthScheduleCallback()


def test_a_protocol_file_carries_score_and_adam_eps_into_the_digest():
    model, stack = make_model("llama")
    table = {"candidates": [f"{stack}.0", f"{stack}.1"], "score": "signal_fraction", "adam_eps": 1e-6}
    from_file = protocol_from_table(table, "protocol file 't.toml'", model)
    api = fs.GrowthProtocol((f"{stack}.0", f"{stack}.1"), score="signal_fraction", adam_eps=1e-6)
    assert from_file.digest == api.digest != fs.GrowthProtocol((f"{stack}.0", f"{stack}.1")).digest
    with pytest.raises(fs.FusedStatsError, match="score must be one of"):
        protocol_from_table({**table, "score": "loss"}, "protocol file 't.toml'", model)
    with pytest.raises(fs.FusedStatsError, match="adam_eps must be a number"):
        protocol_from_table({**table, "adam_eps": "1e-6"}, "protocol file 't.toml'", model)
