"""fs.advise: ranking, Holm–Bonferroni, certificate at the same point, reports and the CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers

import fused_stats as fs
from fused_stats.api.growth.advise import advise, holm
from fused_stats.cli import main

CANDIDATES = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2"]


@pytest.fixture(scope="module")
def probed():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    protocol = fs.GrowthProtocol(CANDIDATES, seed=1)
    probe = fs.Probe(model, points=CANDIDATES, cross=protocol)
    g = torch.Generator().manual_seed(0)
    for stream in ("train", "test", "train", "test"):
        start = torch.randint(0, 5, (12, 1), generator=g)  # shifted counting: a learnable signal
        probe.step({"input_ids": (start + torch.arange(10)) % 7}, fs.causal_lm_loss, stream=stream)
    return probe, protocol


def step_down(p, alpha):
    """Holm's procedure as a sequence of decisions: reject while p_(j) <= alpha/(m-j+1)."""
    m = len(p)
    rejected = [False] * m
    for j, i in enumerate(sorted(range(m), key=lambda i: p[i])):
        if p[i] > alpha / (m - j):
            break
        rejected[i] = True
    return rejected


def test_advice_reads_the_probe_and_its_saved_report(probed, tmp_path):
    probe, protocol = probed
    live = advise(probe, protocol)
    path = probe.report(misalignment_trials=0).to_json(tmp_path / "r.json")
    saved = advise(str(path))
    assert live.ranked == saved.ranked and live.digest == saved.digest == protocol.digest
    values = [c.cross_frob2 for c in live.ranked]
    assert values == sorted(values, reverse=True)
    for c in live.ranked:
        sat = probe.saturation(c.point)
        assert (c.cross_frob2, c.se, c.p_value, c.n) == (
            sat.cross_frob2,
            sat.cross_frob2_se,
            sat.p_value,
            sat.n,
        )
        assert sat.cross_frob2 > 0 and c.predicted_change == -sat.cross_frob2
        assert c.d_align == probe.estimate(c.point).d_align
        assert c.b_exact == probe.certificate(c.point).b_exact
    at = advise(probe, protocol, M=8, K=8)
    for c in at.ranked:
        assert c.b_exact == pytest.approx(probe.certificate(c.point, 8, 8, stream="train").b_exact, rel=1e-12)
    assert not live.saturated_everywhere  # the counting task leaves a signal at every layer


def test_report_records_the_protocol_verbatim(probed, tmp_path):
    probe, protocol = probed
    data = json.loads(probe.report(misalignment_trials=0).to_json(tmp_path / "r.json").read_text())
    # and the width r = d + f of the full tangent at each candidate (LLaMA: no zero biases)
    ranks = dict.fromkeys(CANDIDATES, 16 + 24)
    # per-candidate first-step scores (checked against per-sample gradients in test_growth_scores.py)
    assert set(data["growth_protocol"].pop("scores")) == set(CANDIDATES)
    assert data["growth_protocol"] == {
        "digest": protocol.digest,
        "protocol": protocol.to_dict(),
        "feature_ranks": ranks,
        # the protocol's zero parameters this LLaMA has: no biases, no other architecture's maps
        "model_zero_parameters": {"llama": ["self_attn.o_proj.weight", "mlp.down_proj.weight"]},
        # the model as measured: its 3 blocks, never grown
        "model_structure": {"blocks": {"model.layers": 3}, "record_events": 0},
    }


def test_projected_gain_is_rescaled_to_one_scale():
    """With projection=k the probe measures |C Pᵀ|², of mean (k/r)|C|² over P; the advisor
    rescales by r/k per candidate (ResNet stages have r = 2C = 8, 16, 32): over many seeds of P the
    rescaled value averages to the unprojected |C|² of the same data, and p is untouched."""
    from fused_stats.networks.resnet import cifar_resnet20

    model = cifar_resnet20(width=4, seed=2, random_batchnorm=True).double()
    points = ["layer1.1", "layer2.1", "layer3.1"]
    g = torch.Generator().manual_seed(4)
    batch = (
        torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64),
        torch.randint(0, 10, (8,), generator=g),
    )
    exact = fs.Probe(model, points=points, cross=fs.GrowthProtocol(points, seed=0))
    exact.step(batch, fs.classification_loss)
    k, draws = 5, []
    for seed in range(48):
        protocol = fs.GrowthProtocol(points, seed=seed, projection=k)
        probe = fs.Probe(model, points=points, cross=protocol)
        probe.step(batch, fs.classification_loss)
        advice = {c.point: c for c in advise(probe, protocol).ranked}
        for point in points:
            r = 2 * model.get_submodule(point).bn2.num_features
            sat = probe.saturation(point)
            c = advice[point]
            assert c.features == r and c.rank == k and c.p_value == sat.p_value
            assert c.cross_frob2 == pytest.approx(r / k * sat.cross_frob2, rel=1e-14)
            assert c.predicted_change == (None if c.cross_frob2 < 0 else -c.cross_frob2)
        draws.append([advice[p].cross_frob2 for p in points])
    draws = torch.tensor(draws, dtype=torch.float64)
    mean, se = draws.mean(0), draws.std(0) / len(draws) ** 0.5
    for i, point in enumerate(points):
        want = exact.saturation(point).cross_frob2
        assert abs(float(mean[i]) - want) <= 4 * float(se[i]), (point, float(mean[i]), want, float(se[i]))
        assert abs(want) > 4 * float(se[i]) / 10  # the check is not between two zeros
    assert "(r/k)|C Pᵀ|_F²" in advise(probe, protocol).to_markdown()


def _with_p(probe, p_values):
    data = copy.deepcopy(probe.report(misalignment_trials=0).data)
    for point, p in zip(data["points"], p_values):
        point["saturation"]["p_value"] = p
    return data


@pytest.mark.parametrize(
    "p_values", [[0.01, 0.04, 0.03, 0.2], [0.011, 0.012, 0.5, 0.013], [0.001, 0.002, 0.003, 0.004]]
)
def test_holm_bonferroni_across_candidates(probed, p_values):
    probe, protocol = probed
    advice = advise(_with_p(probe, p_values), protocol, alpha=0.05)
    by_point = {c.point: c for c in advice.ranked}
    rejected = step_down(p_values, 0.05)
    for name, p, rej in zip(CANDIDATES, p_values, rejected):
        assert by_point[name].p_value == p
        assert by_point[name].saturated == (not rej)
    assert holm([0.01, 0.04, 0.03, 0.2]) == pytest.approx([0.04, 0.09, 0.09, 0.2])
    assert advice.correction == "Holm-Bonferroni" and "Holm-Bonferroni" in advice.to_markdown()


def test_saturated_everywhere_is_said_plainly(probed):
    probe, protocol = probed
    advice = advise(_with_p(probe, [0.2, 0.5, 0.02, 0.9]), protocol)  # 4 × 0.02 > 0.05
    assert advice.saturated_everywhere
    assert advice.to_markdown().count("Saturated everywhere") == 1


def test_bad_input(probed, tmp_path):
    probe, _ = probed
    other = fs.GrowthProtocol(CANDIDATES, seed=2)
    with pytest.raises(fs.FusedStatsError, match="digest"):
        advise(probe, other)
    data = copy.deepcopy(probe.report(misalignment_trials=0).data)
    del data["growth_protocol"]
    with pytest.raises(fs.FusedStatsError, match="no growth protocol"):
        advise(data)
    data = copy.deepcopy(probe.report(misalignment_trials=0).data)
    data["points"] = data["points"][:2]
    with pytest.raises(fs.FusedStatsError, match="without a saturation result"):
        advise(data)
    with pytest.raises(fs.FusedStatsError, match="alpha"):
        advise(probe, alpha=1.5)


def test_cli_advise(probed, tmp_path, capsys):
    probe, protocol = probed
    path = probe.report(misalignment_trials=0).to_json(tmp_path / "r.json")
    out = tmp_path / "advice"
    assert main(["advise", str(path), "--out", str(out)]) == 0
    record = json.loads((out / "advice.json").read_text())
    assert record["digest"] == protocol.digest and record["protocol"] == protocol.to_dict()
    assert [r["point"] for r in record["ranked"]] == [c.point for c in advise(probe).ranked]
    assert (out / "advice.png").stat().st_size > 1000 and "Growth advice" in capsys.readouterr().out
    assert main(["advise", str(tmp_path / "missing.json"), "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_budget_of_the_protocol_sets_the_certificate(probed):
    probe, protocol = probed
    # stored digest of a budget-less protocol (version 2, blocks seeded by name; version 1's: ac10e9a8…)
    assert protocol.digest == "95c1243cc43ce52386031ffaac0b9192508ec43ae8fcc0c1c5d136f17ac5a43c"
    assert "budget" not in protocol.to_dict()
    budgeted = fs.GrowthProtocol(CANDIDATES, seed=1, budget=(9, 5))
    record = budgeted.to_dict()
    assert record["budget"] == [9, 5] and budgeted.digest != protocol.digest
    assert fs.GrowthProtocol.from_dict(json.loads(json.dumps(record))) == budgeted
    # the budget does not enter the measurement: the same statistics recorded under the new protocol
    data = copy.deepcopy(probe.report(misalignment_trials=0).data)
    data["growth_protocol"] = {"digest": budgeted.digest, "protocol": record}
    advice = advise(data)
    assert (advice.M, advice.K) == (9, 5)
    for c in advice.ranked:
        reference = probe.certificate(c.point, 9, 5, stream="train").b_exact
        assert c.b_exact == pytest.approx(reference, rel=1e-12)
        assert c.b_exact != pytest.approx(probe.certificate(c.point).b_exact, rel=1e-6)
    given = advise(data, M=8, K=8)  # explicit sizes win over the declared budget
    for c in given.ranked:
        assert c.b_exact == pytest.approx(probe.certificate(c.point, 8, 8, stream="train").b_exact, rel=1e-12)
    for bad in [(0, 5), (9,), (9, 5.0), "95", (True, 5)]:
        with pytest.raises(fs.FusedStatsError, match="budget"):
            fs.GrowthProtocol(CANDIDATES, budget=bad)


def test_advice_for_mlp_width(probed, tmp_path):
    """mlp_width candidates (not the last block): the saved report's advice carries the probe's
    saturation of the new units, and the width certificate is read where q was measured."""
    probe, _ = probed
    protocol = fs.GrowthProtocol(CANDIDATES[:-1], family="mlp_width", width=4, seed=2)
    wide = fs.Probe(probe.model, points=protocol.candidates, cross=protocol)
    g = torch.Generator().manual_seed(3)
    for stream in ("train", "test", "train", "test"):
        start = torch.randint(0, 5, (12, 1), generator=g)
        wide.step({"input_ids": (start + torch.arange(10)) % 7}, fs.causal_lm_loss, stream=stream)
    path = wide.report(misalignment_trials=0).to_json(tmp_path / "wide.json")
    advice = advise(str(path))
    assert advice.protocol["family"] == "mlp_width"
    for c in advice.ranked:
        sat = wide.saturation(c.point)
        assert (c.cross_frob2, c.p_value, c.rank) == (sat.cross_frob2, sat.p_value, 4)
    # q at the block whose MLP grows: the GradStats of embed_tokens' candidate are layers.0's output
    reference = fs.Probe(probe.model, points=["model.layers.0"])
    g = torch.Generator().manual_seed(3)
    for stream in ("train", "test", "train", "test"):
        start = torch.randint(0, 5, (12, 1), generator=g)
        reference.step({"input_ids": (start + torch.arange(10)) % 7}, fs.causal_lm_loss, stream=stream)
    by_point = {c.point: c for c in advice.ranked}
    assert by_point["model.embed_tokens"].d_align == pytest.approx(
        reference.estimate("model.layers.0").d_align, rel=1e-12
    )


def test_advice_names_why_a_candidate_has_no_test_result():
    """A candidate probed with one sample has no saturation test (it needs two): the error says
    so, and a candidate in no report is named as unprobed."""
    from fused_stats.networks.resnet import cifar_resnet20

    model = cifar_resnet20(width=2, seed=0).double()
    points = ["layer1.0", "layer2.0"]
    protocol = fs.GrowthProtocol(points)
    probe = fs.Probe(model, points=points[:1], cross=protocol)
    probe.step((torch.randn(1, 3, 8, 8, dtype=torch.float64), torch.tensor([3])), fs.classification_loss)
    with pytest.raises(
        fs.FusedStatsError, match=r"\['layer2\.0'\] not in any report.*\['layer1\.0'\] probed, but"
    ):
        advise(probe, protocol)
