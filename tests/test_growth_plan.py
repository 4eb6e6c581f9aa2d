"""The growth plan: (model, protocol) described and checked once, and read from there.

Counted from outside: every call of ``architecture.describe`` and of ``GrowthProtocol.check`` is
seen by a profile hook on their code objects (whatever name a module imported them under), so
one ``fs.grow`` and one probe build plus its first step each describe the model once and check
the protocol once. A plan made before the model changed is refused.
"""

from __future__ import annotations

import sys

import pytest
import torch

import fused_stats as fs
from fused_stats.api.growth import architecture

from tiny_models import tiny_lm_config

transformers = pytest.importorskip("transformers")


def _llama(layers=3, seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_lm_config("llama", layers=layers)).eval()


def _counted(fn) -> dict[str, int]:
    calls = {"describe": 0, "check": 0}
    codes = {architecture.describe.__code__: "describe", fs.GrowthProtocol.check.__code__: "check"}

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            calls[codes[frame.f_code]] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def _batch(seed=1, B=4, T=8, vocab=40):
    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


POINTS = ["model.embed_tokens", "model.layers.0", "model.layers.1"]


@pytest.mark.parametrize(
    "family,extra", [("layer", {}), ("mlp_width", {"width": 2}), ("cross_block", {"width": 3})]
)
def test_one_describe_and_one_check_per_grow(family, extra):
    protocol = fs.GrowthProtocol(POINTS, family=family, **extra)
    model = _llama()
    optimizer = torch.optim.AdamW(model.parameters()) if family != "mlp_width" else None
    counts = _counted(lambda: fs.grow(model, protocol, optimizer=optimizer))
    assert counts == {"describe": 1, "check": 1}


def test_one_describe_and_one_check_per_probe_build_and_step():
    protocol = fs.GrowthProtocol(POINTS)
    model = _llama()

    def probe_and_step():
        probe = fs.Probe(model, cross=protocol)
        probe.step(_batch(), fs.causal_lm_loss)

    assert _counted(probe_and_step) == {"describe": 1, "check": 1}


def test_a_plan_is_followed_without_describing_again():
    protocol = fs.GrowthProtocol(POINTS)
    model = _llama()
    plan = fs.plan_growth(model, protocol)
    assert isinstance(plan, fs.GrowthPlan) and list(plan.candidates) == POINTS
    assert plan.candidate("model.layers.1").boundary.position == 2
    assert plan.candidate("model.embed_tokens").boundary.position == 0

    def probe_then_grow():
        probe = fs.Probe(model, cross=plan)
        probe.step(_batch(), fs.causal_lm_loss)
        fs.grow(model, plan, at=["model.layers.1"])

    assert _counted(probe_then_grow) == {"describe": 0, "check": 0}
    assert len(model.model.layers) == 4


def test_a_stale_plan_or_one_of_another_model_is_refused():
    protocol = fs.GrowthProtocol(POINTS)
    model, other = _llama(), _llama()
    plan = fs.plan_growth(model, protocol)
    with pytest.raises(fs.FusedStatsError, match="made for another"):
        fs.grow(other, plan)
    assert len(other.model.layers) == 3
    fs.grow(model, protocol, at=["model.layers.0"])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(fs.FusedStatsError, match="stale"):
        fs.grow(model, plan, at=["model.layers.1"])
    with pytest.raises(fs.FusedStatsError, match="stale"):
        fs.Probe(model, cross=plan)
    after = list(model.parameters())
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


def test_plan_record_names_each_candidate():
    protocol = fs.GrowthProtocol(["model.layers.2", "model.embed_tokens"], seed=5)
    record = fs.plan_growth(_llama(), protocol).to_dict()
    assert record["protocol_digest"] == protocol.digest and record["model_type"] == "llama"
    by_point = {c["point"]: c for c in record["candidates"]}
    assert by_point["model.layers.2"]["position"] == 3 and by_point["model.layers.2"]["source"] == (
        "model.layers.2"
    )
    assert by_point["model.embed_tokens"]["position"] == 0
    assert by_point["model.embed_tokens"]["source"] == "model.layers.0"
    assert all(c["earlier_growths"] == 0 for c in record["candidates"])


def test_the_first_step_prediction_follows_the_probes_plan():
    protocol = fs.GrowthProtocol(POINTS)
    model = _llama()
    probe = fs.Probe(model, cross=protocol)
    probe.step(_batch(1), fs.causal_lm_loss, stream="train")
    probe.step(_batch(2), fs.causal_lm_loss, stream="test")
    advice = fs.advise(probe, protocol)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert _counted(lambda: fs.predicted_change(advice, optimizer)) == {"describe": 0, "check": 0}
    # after the model grew, the probe's tangents are of the model as it was: refused, naming the change
    fs.grow(model, protocol, at=["model.layers.1"])
    with pytest.raises(fs.FusedStatsError, match="3 blocks then, 4 now"):
        fs.predicted_change(advice, optimizer)


def test_a_schedule_decision_with_its_prediction_and_growth_plans_once():
    protocol = fs.GrowthProtocol(POINTS)
    model = _llama()
    schedule = fs.GrowthSchedule(protocol, at_steps=[1], probe_batches=[_batch(1), _batch(2)], alpha=0.99)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    events = []
    assert _counted(lambda: events.append(schedule.maybe_grow(model, 1, optimizer))) == {
        "describe": 1,
        "check": 1,
    }
    assert events[0]["event"] == "grew" and events[0]["first_step_change"] is not None


def test_a_suite_growth_run_describes_the_model_once():
    from types import SimpleNamespace

    from fused_stats.api.suite.single_run import growth_plan

    growth = {"candidates": [0, 0.5, 1.0], "family": "layer", "init": "zero", "seed": 0}
    Spec = SimpleNamespace(growth=dict(growth, width=None, projection=None, budget=None, alpha=0.05))
    model = _llama()
    plans = []
    assert _counted(lambda: plans.append(growth_plan(Spec, model))) == {"describe": 1, "check": 1}
    plan, depths = plans[0]
    assert list(plan.candidates) == ["model.embed_tokens", "model.layers.1", "model.layers.2"]
    assert depths == {"0": "model.embed_tokens", "0.5": "model.layers.1", "1.0": "model.layers.2"}
    assert _counted(lambda: fs.Probe(model, cross=plan)) == {"describe": 0, "check": 0}
