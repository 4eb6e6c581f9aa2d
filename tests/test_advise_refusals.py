"""fs.advise refuses what its test does not cover, and each output says which test it reports.

References: hand-set saturation records (known p-values and estimates, Holm worked by hand),
an independent SHA-256 over the state dict's bytes, and models built twice from one seed."""

from __future__ import annotations

import copy
import hashlib
import json
import math

import pytest
import torch
import transformers

import fused_stats as fs
from fused_stats.api.growth.advise import advise
from fused_stats.api.report.document import Report
from fused_stats.api.report.identity import model_fingerprint, zero_parameters_in
from fused_stats.cli import main

CANDIDATES = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2"]
FOREIGN_MAPS = ("attn.c_proj", "attention.dense", "dense_4h_to_h", "bn2", "bn3", ".bias")


def tiny_llama(seed: int = 0, hidden: int = 16):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=hidden,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(cfg).double().eval()


def probe_run(model, points, protocol, unit="sample", steps=4):
    """A probe of ``points`` under ``protocol`` on the shifted-counting task (a learnable signal)."""
    probe = fs.Probe(model, points=points, cross=protocol, unit=unit)
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        start = torch.randint(0, 5, (12, 1), generator=g)
        batch = {"input_ids": (start + torch.arange(10)) % 7}
        probe.step(batch, fs.causal_lm_loss, stream="train" if i % 2 == 0 else "test")
    return probe


@pytest.fixture(scope="module")
def protocol():
    return fs.GrowthProtocol(CANDIDATES, seed=1)


@pytest.fixture(scope="module")
def report(protocol):
    return probe_run(tiny_llama(), CANDIDATES, protocol).report(misalignment_trials=0).data


def with_saturation(data, values: dict) -> dict:
    """``data`` with the saturation records' fields set per point (``{point: {field: value}}``)."""
    data = copy.deepcopy(data)
    for point in data["points"]:
        point["saturation"].update(values.get(point["name"], {}))
    return data


# ------------------------------------------------------------------ unit="position"
def test_unit_position_is_refused_by_advise_and_the_cli(protocol, tmp_path, capsys):
    probe = probe_run(tiny_llama(), CANDIDATES, protocol, unit="position")
    with pytest.raises(fs.FusedStatsError, match=r"unit='position'.*not independent samples.*unit='sample'"):
        advise(probe, protocol)
    path = probe.report(misalignment_trials=0).to_json(tmp_path / "position.json")
    out = tmp_path / "advice"
    assert main(["advise", str(path), "--out", str(out)]) == 2
    assert "unit='position'" in capsys.readouterr().err and not out.exists()


# ------------------------------------------------------------------ the verdict
def test_verdict_names_the_top_significant_candidate_not_the_top_raw_one(report, protocol):
    # layers.0 has the largest raw |C|^2 but p = 0.4; Holm over 4: 4 x 0.001 = 0.004 (layers.1),
    # 3 x 0.002 = 0.006 (layers.2) rejected, then 2 x 0.3 = 0.6 not: of the two significant ones
    # layers.2 has the larger |C|^2
    data = with_saturation(
        report,
        {
            "model.embed_tokens": {"cross_frob2": 0.5, "p_value": 0.3},
            "model.layers.0": {"cross_frob2": 10.0, "p_value": 0.4},
            "model.layers.1": {"cross_frob2": 1.0, "p_value": 0.001},
            "model.layers.2": {"cross_frob2": 2.0, "p_value": 0.002},
        },
    )
    advice = advise(data, protocol)
    verdict = advice.verdict
    assert "Not saturated at 2 of 4 candidates" in verdict and "model.layers.2, model.layers.1." in verdict
    assert "gain: model.layers.2 (|C|_F² = 2," in verdict and "model.layers.0" not in verdict
    assert advice.to_markdown().count(verdict) == 1
    assert advice.ranked[0].point == "model.layers.0" and advice.ranked[0].saturated
    assert advice.top.point == "model.layers.2"
    assert advice.top.p_adjusted == pytest.approx(0.006, rel=1e-12)


def test_saturated_everywhere_names_alpha(report, protocol):
    data = with_saturation(report, {p: {"p_value": 0.03 + 0.01 * i} for i, p in enumerate(CANDIDATES)})
    advice = advise(data, protocol, alpha=0.1)  # smallest Holm p: 4 x 0.03 = 0.12 > 0.1
    assert advice.verdict.startswith("Saturated everywhere at alpha=0.1:")
    assert not any(p in advice.verdict for p in CANDIDATES)
    assert advice.top is None


# ------------------------------------------------------------------ a negative estimate
def test_negative_estimate_reads_no_detectable_gain(report, protocol):
    data = with_saturation(
        report,
        {"model.layers.1": {"cross_frob2": -0.25, "p_value": 0.7}, "model.layers.2": {"cross_frob2": 0.0}},
    )
    advice = advise(data, protocol)
    by_point = {c.point: c for c in advice.ranked}
    assert by_point["model.layers.1"].predicted_change is None
    assert by_point["model.layers.2"].predicted_change == 0.0  # a zero estimate is not negative
    row = next(line for line in advice.to_markdown().splitlines() if "| model.layers.1 |" in line)
    # column 14: the predicted change per unit SGD step (the first-step columns follow it)
    assert row.split("|")[14].strip() == "no detectable gain"
    assert json.loads(json.dumps(advice.to_dict()))["ranked"][-1]["predicted_change"] is None


# ------------------------------------------------------------------ which test each output reports
def test_each_output_says_which_test_it_reports(report, protocol):
    record = report["points"][1]["saturation"]
    assert record["test"].startswith("unadjusted one-sided z-test")
    markdown = Report(report).to_markdown()
    assert "- saturation (unadjusted one-sided z-test" in markdown
    advice = advise(report, protocol)
    assert advice.to_dict()["test"] == "one-sided z-test of H0: C = 0, Holm-adjusted across the candidates"
    assert "Holm-adjusted across the candidates" in advice.to_markdown()
    assert "Holm-adjusted across the candidates" in advice.verdict


# ------------------------------------------------------------------ fingerprints
def independent_digest(model) -> str:
    """SHA-256 over name, dtype, shape and bytes of each state-dict tensor, names sorted."""
    sha = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        t = state[name]
        sha.update(f"{name}|{str(t.dtype)[6:]}|{list(t.shape)}\n".encode())
        sha.update(t.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


def test_every_report_records_the_model_fingerprint(report):
    model = tiny_llama()
    fingerprint = report["model"]["fingerprint"]
    assert fingerprint["parameters_digest"] == independent_digest(model)
    assert fingerprint["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert fingerprint == model_fingerprint(tiny_llama())  # built again from the seed: same model
    tied = tiny_llama()
    tied.lm_head.weight = tied.model.embed_tokens.weight
    distinct = sum(p.numel() for p in model.parameters()) - model.lm_head.weight.numel()
    assert model_fingerprint(tied)["num_parameters"] == distinct  # a tied weight counted once
    # one value changed by one ulp changes the digest; the config digest ignores where it loaded from
    nudged = tiny_llama()
    with torch.no_grad():
        w = nudged.model.layers[1].mlp.up_proj.weight
        w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(math.inf, dtype=w.dtype))
    assert model_fingerprint(nudged)["parameters_digest"] != fingerprint["parameters_digest"]
    nudged.config._name_or_path = "/somewhere/else"
    assert model_fingerprint(nudged)["config_digest"] == fingerprint["config_digest"]
    assert Report(json.loads(json.dumps(report))).model["fingerprint"] == fingerprint
    bad = copy.deepcopy(report)
    bad["model"]["fingerprint"]["parameters_digest"] = 7
    with pytest.raises(fs.FusedStatsError, match="parameters_digest"):
        Report(bad)
    del bad["model"]["fingerprint"]["config_digest"]
    with pytest.raises(fs.FusedStatsError, match=r"fingerprint'\] lacks keys \['config_digest'\]"):
        Report(bad)


def test_a_model_without_its_values_has_no_digest_and_is_not_combined(report, protocol):
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(tiny_llama().config)
    fingerprint = model_fingerprint(meta)
    assert (
        fingerprint["parameters_digest"] is None and "meta tensor" in fingerprint["parameters_digest_missing"]
    )
    first, second = halves(report)
    second["model"]["fingerprint"] = fingerprint
    with pytest.raises(fs.FusedStatsError, match="report 1 has no digest of the parameter values"):
        advise([first, second], protocol)
    del second["model"]["fingerprint"]
    with pytest.raises(fs.FusedStatsError, match="report 1 records no model fingerprint"):
        advise([first, second], protocol)


def halves(data):
    """The report cut into two reports of two candidates each (as if probed in two runs)."""
    first, second = copy.deepcopy(data), copy.deepcopy(data)
    first["points"] = [p for p in data["points"] if p["name"] in CANDIDATES[:2]]
    second["points"] = [p for p in data["points"] if p["name"] in CANDIDATES[2:]]
    return first, second


def test_reports_of_one_model_from_two_runs_are_combined(report, protocol):
    first = probe_run(tiny_llama(), CANDIDATES[:2], protocol).report(misalignment_trials=0).data
    second = probe_run(tiny_llama(), CANDIDATES[2:], protocol).report(misalignment_trials=0).data
    combined = advise([first, second], protocol)
    assert combined.ranked == advise(report, protocol).ranked


@pytest.mark.parametrize(
    ("other", "named"),
    [
        (lambda: tiny_llama(seed=1), r"parameter values \(digest [0-9a-f]{12}… vs [0-9a-f]{12}…"),
        (lambda: tiny_llama(hidden=24), r"configuration \(digest .*hidden_size 16 vs 24.*parameter count"),
    ],
    ids=["other_seed", "other_width"],
)
def test_reports_of_different_models_are_refused(report, protocol, other, named):
    first = halves(report)[0]
    second = probe_run(other(), CANDIDATES[2:], protocol).report(misalignment_trials=0).data
    with pytest.raises(
        fs.FusedStatsError, match="reports 0 and 1 were measured on different models: " + named
    ):
        advise([first, second], protocol)


# ------------------------------------------------------------------ what the documents show
def test_a_protocol_probes_report_names_the_protocol(report, protocol):
    markdown = Report(report).to_markdown()
    line = next(x for x in markdown.splitlines() if x.startswith("- growth protocol"))
    assert f"`{protocol.digest[:12]}`" in line and "family `layer`" in line
    assert all(f"`{c}`" in line for c in CANDIDATES)


def test_advice_markdown_shows_the_digest_and_this_models_zero_maps_only(report, protocol):
    markdown = advise(report, protocol).to_markdown()
    assert protocol.digest in markdown and "```json" not in markdown
    line = next(x for x in markdown.splitlines() if x.startswith("Zero parameters"))
    assert (
        line
        == "Zero parameters of the new blocks in this model: llama: `self_attn.o_proj.weight`, `mlp.down_proj.weight`."
    )
    head = markdown.split("| rank |")[0]
    assert not [m for m in FOREIGN_MAPS if m in head]
    # protocol, digest, candidates, model structure, zero maps, the d_align reading: no dumps
    assert len(head.splitlines()) < 18


def test_zero_parameters_of_a_table_that_this_model_has():
    table = {
        "llama": ["mlp.down_proj.weight[new columns]", "mlp.down_proj.bias[new columns]"],
        "gpt2": ["mlp.c_proj.weight[new rows]"],
        "resnet_basic": ["bn2.weight", "bn2.bias"],
        "other": ["layernorm.weight"],  # a suffix of input_layernorm.weight, not a module of it
        "any": ["w_out"],
    }
    assert zero_parameters_in(table, tiny_llama()) == {
        "llama": ["mlp.down_proj.weight[new columns]"],
        "any": ["w_out"],  # the probe's own block: not a parameter of the model, always shown
    }


def test_a_nan_se_reads_se_not_estimable(report, protocol):
    data = with_saturation(report, {"model.layers.0": {"cross_frob2_se": math.nan}})
    markdown = advise(data, protocol).to_markdown()
    row = next(line for line in markdown.splitlines() if "| model.layers.0 |" in line)
    assert "| SE not estimable at this n |" in row and "nan" not in row


# ------------------------------------------------------------------ the CLI's output folder
def test_cli_advise_refuses_a_folder_that_holds_files(report, tmp_path, capsys):
    path = Report(report).to_json(tmp_path / "r.json")
    out = tmp_path / "advice"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["advise", str(path), "--out", str(out), "--no-plot"]) == 2
    assert "--force" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert main(["advise", str(path), "--out", str(out), "--no-plot", "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["advice.json", "advice.md", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"
