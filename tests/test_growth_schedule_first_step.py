"""fs.GrowthSchedule's first-step prediction against realised first steps: the probe batches split
by parity, one half's step on the grown copy scored on the other half's mean loss (a tiny fp64
LLaMA, η = 1e-4); the same number from two two-stream probes through fs.predicted_change; None with
the reason for an optimizer without a rule (training goes on); the growth record's entry; states
written before the prediction existed."""

from __future__ import annotations

import copy

import pytest
import torch
from test_first_step_optimizers import (  # noqa: F401  (fp64_norms: the module's autouse fixture)
    ETA,
    PER_GROUP,
    POINT,
    batches,
    fp64_norms,
    groups,
    probed,
    realised_adam_mean,
    realised_layer_change,
    tiny_llama,
)

import fused_stats as fs

OPT = torch.optim
MAKERS = {
    "adam_per_group": lambda m: groups(m, lambda gs: OPT.Adam(gs, lr=ETA), **PER_GROUP),
    "sgd_nesterov": lambda m: OPT.SGD(m.parameters(), lr=ETA, momentum=0.9, nesterov=True),
    "rmsprop": lambda m: OPT.RMSprop(m.parameters(), lr=ETA),
}


def scheduled_event(model, protocol, data, make):
    grown = copy.deepcopy(model)
    schedule = fs.GrowthSchedule(protocol, at_steps=[3], probe_batches=data, alpha=0.5)
    event = schedule.maybe_grow(grown, 3, optimizer=make(grown))
    return grown, schedule, event


@pytest.mark.parametrize("case", sorted(MAKERS))
def test_the_event_predicts_the_realised_split_steps(case):
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2)
    data = batches(0, 4)
    grown, _, event = scheduled_event(model, protocol, data, MAKERS[case])
    assert event["event"] == "grew" and event["point"] == POINT, event
    even, odd = data[0::2], data[1::2]
    realised = [
        realised_layer_change(model, protocol, s, t, MAKERS[case]) for s, t in ((even, odd), (odd, even))
    ]
    mean = sum(realised) / 2
    assert mean != 0.0
    assert abs(event["first_step_change"] / mean - 1) < 0.01, (event, realised)
    # the same number through the public route: two probes, each half once the train stream
    reference = [
        fs.predicted_change(fs.advise(probed(model, protocol, s, t), protocol), MAKERS[case](model))[POINT]
        for s, t in ((even, odd), (odd, even))
    ]
    assert event["first_step_change"] == pytest.approx(sum(r.change for r in reference) / 2, rel=1e-10)
    assert type(MAKERS[case](model)).__name__ in event["first_step_note"]
    # the model's record carries the event's prediction
    (entry,) = fs.growth_history(grown)
    assert entry["first_step_change"] == event["first_step_change"]
    assert entry["first_step_note"] == event["first_step_note"]


def test_the_adam_prediction_at_a_training_batch_size_is_for_one_batch_of_each_half():
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2, train_batch_size=6)
    data = batches(0, 6)  # one probe step is one batch of B = 6
    _, _, event = scheduled_event(model, protocol, data, lambda m: OPT.Adam(m.parameters(), lr=ETA))
    even, odd = data[0::2], data[1::2]
    # each half's B-sized batches, one Adam step each, scored on the other half
    realised = (
        realised_adam_mean(model, protocol, even, odd) + realised_adam_mean(model, protocol, odd, even)
    ) / 2
    assert abs(event["first_step_change"] / realised - 1) < 0.01, (event, realised)


@pytest.mark.parametrize("case", ["adam_per_group", "sgd_nesterov"])
def test_unequal_halves_of_an_odd_number_of_probe_batches(case):
    """Five probe batches: half A (batches 0, 2, 4) holds 18 samples, half B (1, 3) 12. Each half's
    mean tangent is over its own count: the event is the mean of torch's realised steps on one
    half scored on the other's mean loss, and the two-probe route's number."""
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2)
    data = batches(5, 5)
    _, _, event = scheduled_event(model, protocol, data, MAKERS[case])
    even, odd = data[0::2], data[1::2]
    assert (len(even), len(odd)) == (3, 2)
    realised = [
        realised_layer_change(model, protocol, s, t, MAKERS[case]) for s, t in ((even, odd), (odd, even))
    ]
    assert abs(event["first_step_change"] / (sum(realised) / 2) - 1) < 0.01, (event, realised)
    reference = [
        fs.predicted_change(fs.advise(probed(model, protocol, s, t), protocol), MAKERS[case](model))[POINT]
        for s, t in ((even, odd), (odd, even))
    ]
    assert event["first_step_change"] == pytest.approx(sum(r.change for r in reference) / 2, rel=1e-10)


def test_unequal_halves_at_a_training_batch_size():
    """Five probe steps of B = 6: three one-batch Adam steps in half A, two in half B, each half's
    mean over its own sub-batches, scored on the other half's mean loss."""
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2, train_batch_size=6)
    data = batches(5, 5)
    _, _, event = scheduled_event(model, protocol, data, lambda m: OPT.Adam(m.parameters(), lr=ETA))
    even, odd = data[0::2], data[1::2]
    realised = (
        realised_adam_mean(model, protocol, even, odd) + realised_adam_mean(model, protocol, odd, even)
    ) / 2
    assert abs(event["first_step_change"] / realised - 1) < 0.01, (event, realised)


def test_an_optimizer_without_a_rule_records_none_and_why_and_grows():
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2)
    grown, schedule, event = scheduled_event(
        model, protocol, batches(0, 4), lambda m: OPT.ASGD(m.parameters())
    )
    assert event["event"] == "grew" and event["first_step_change"] is None
    assert "ASGD" in event["first_step_note"] and "torch.optim.RAdam" in event["first_step_note"]
    assert grown.config.num_hidden_layers == 3 and fs.growth_history(grown)[0]["first_step_change"] is None
    assert "fused_stats/growth/first_step_change" not in schedule.metrics(event)


def test_one_probe_batch_gives_no_split_and_says_so():
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2)
    *_, event = scheduled_event(model, protocol, batches(0, 1, size=12), MAKERS["sgd_nesterov"])
    assert event["event"] == "grew" and event["first_step_change"] is None
    assert "at least 2 train steps" in event["first_step_note"]


def test_the_prediction_is_logged_and_old_states_load():
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2)
    _, schedule, event = scheduled_event(model, protocol, batches(0, 4), MAKERS["adam_per_group"])
    assert schedule.metrics(event)["fused_stats/growth/first_step_change"] == event["first_step_change"]
    state = schedule.state_dict()
    assert state["events"][0]["first_step_change"] == event["first_step_change"]
    # a state written before the prediction existed: its events lack the keys and still log
    old = {k: v for k, v in event.items() if not k.startswith("first_step_")}
    fresh = fs.GrowthSchedule(protocol, at_steps=[3], probe_batches=batches(0, 4))
    fresh.load_state_dict({"protocol_digest": protocol.digest, "events": [old], "stopped": True})
    assert fresh.events == [old] and "fused_stats/growth/first_step_change" not in fresh.metrics(old)
    assert fresh.metrics(old)["fused_stats/growth/cross_frob2"] == event["cross_frob2"]


def test_evidence_with_a_bad_first_step_note_is_refused():
    model = tiny_llama()
    with pytest.raises(fs.FusedStatsError, match="first_step_note"):
        fs.grow(model, fs.GrowthProtocol([POINT]), evidence={POINT: {"first_step_note": 3}})
    with pytest.raises(fs.FusedStatsError, match="first_step_change"):
        fs.grow(model, fs.GrowthProtocol([POINT]), evidence={POINT: {"first_step_change": float("nan")}})
    assert fs.growth_history(model) == [] and model.config.num_hidden_layers == 2
