"""``fused-stats plan``: the tangent's MLP width from the config, its candidate count (every block
output and the input boundary), parameter counts in a unit that shows them, the cross features
labelled as such, and the refused ``--stream-blocks --tangent`` (the probe refuses it too).

Expected byte counts are explicit formulas (``Σ c_i`` is ``d × r`` fp64 with ``r = d + F``, four
scalars, a LLaMA layer ``4 d² + 3 d F + 2 d``); the candidate count is growth's own list of
boundaries of the model transformers builds from the same config.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_cli_errors import fails

import fused_stats as fs
from fused_stats.api.streaming.plan import human_bytes, human_count
from fused_stats.cli import main

from tiny_models import TINY_LLAMA_CONFIG

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
CONFIG = dict(TINY_LLAMA_CONFIG, num_hidden_layers=3)


@pytest.fixture
def llama_dir(here):
    folder = here / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder


def tangent_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("tangent of a new layer"))


def test_tangent_width_and_candidates_come_from_the_config(llama_dir, capsys):
    from fused_stats.api.growth.architecture import describe

    d, f, layers = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["num_hidden_layers"]
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))
    candidates = len(describe(model).boundaries)
    assert candidates == layers + 1  # the block outputs and the embedding boundary
    for argv in (["--tangent"], ["--tangent", str(f)]):
        assert main(["plan", "--model", str(llama_dir), *argv]) == 0
        line = tangent_line(capsys.readouterr().out)
        r = d + f
        per_accumulator = 8 * (d * r + 4)
        layer = 4 * d * d + 3 * d * f + 2 * d
        assert f"MLP width F = {f}" in line and f"r = {r} features, C is {d} x {r}" in line
        assert f"{human_bytes(per_accumulator)} per accumulator" in line
        assert f"{human_bytes(per_accumulator * 2 * candidates)} for {candidates} candidates" in line
        assert f"plus the {candidates} new layers" in line
        # a small layer in thousands, not "0.0M"
        assert f"{layer / 1e3:.4g}k parameters each" in line and "0.0M" not in line
        assert f"{human_bytes(2 * layer * candidates)} in bf16" in line


def test_tangent_width_that_disagrees_with_the_config_is_refused(llama_dir, here, capsys):
    f = CONFIG["intermediate_size"]
    fails(["plan", "--model", llama_dir, "--tangent", f + 1], capsys, here, f"--tangent {f + 1}", f"= {f}")
    fails(["plan", "--preset", "llama-7b", "--tangent", 4096], capsys, here, "4096", "11008")
    # a bare shape has no config to read F from
    fails(["plan", "--dim", 16, "--points", 3, "--tangent"], capsys, here, "--tangent F")


def test_gpt2_config_without_n_inner_has_mlp_width_4d(here, capsys):
    # HF GPT-2 writes n_inner: null for its default 4 * n_embd
    config = {"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 2, "n_inner": None}
    (here / "gpt2.json").write_text(json.dumps(config))
    assert main(["plan", "--model", str(here / "gpt2.json"), "--tangent"]) == 0
    line = tangent_line(capsys.readouterr().out)
    assert "MLP width F = 64" in line and "3 candidates (2 block outputs" in line


def test_preset_tangent_counts_the_input_boundary(capsys):
    assert main(["plan", "--preset", "llama-7b", "--tangent"]) == 0
    line = tangent_line(capsys.readouterr().out)
    layer = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
    assert "33 candidates (32 block outputs and the input boundary)" in line
    assert f"{human_bytes(8 * (4096 * 15104 + 4) * 2 * 33)} for 33" in line
    assert "202.4M parameters each" in line and f"{human_bytes(2 * layer * 33)} in bf16" in line


def test_human_count_units():
    assert [human_count(n) for n in (960, 2592, 202_383_360, 855_638_016, 1_500_000_000)] == [
        "960",
        "2.592k",
        "202.4M",
        "855.6M",
        "1.5G",
    ]


def test_stream_plan_labels_the_cross_features(llama_dir, capsys):
    from fused_stats.api.streaming.plan import plan_streaming

    d, layers = CONFIG["hidden_size"], CONFIG["num_hidden_layers"]
    tokens, samples, rank = 64, 2, 4
    argv = ["plan", "--model", str(llama_dir), "--stream-blocks", "--tokens", str(tokens)]
    assert main([*argv, "--samples", str(samples), "--cross-rank", str(rank)]) == 0
    text = capsys.readouterr().out
    rows, features = layers * samples * d * 8, layers * tokens * rank * 8
    assert f"every point's reduced rows {human_bytes(rows)} + every point's cross features" in text
    assert f"cross features {human_bytes(features)} + accumulators" in text
    assert "blocks of 2.592k parameters" in text
    plan = plan_streaming(llama_dir, tokens, samples=samples, cross_rank=rank)
    assert plan.reduced_bytes == rows + features and plan.cross_feature_bytes == features
    # without --cross-rank: no cross-feature term
    assert main([*argv, "--samples", str(samples)]) == 0
    assert "cross features" not in capsys.readouterr().out


def test_stream_blocks_with_tangent_refused_in_plan_as_in_the_probe(tmp_path, here, capsys):
    line = fails(
        ["plan", "--preset", "llama-7b", "--stream-blocks", "--tangent"], capsys, here, "--stream-blocks"
    )
    cfg = transformers.LlamaConfig(**dict(CONFIG, num_hidden_layers=2))
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64).save_pretrained(tmp_path / "m")
    points = ["model.layers.0", "model.layers.1"]
    with fs.stream_blocks(tmp_path / "m") as st, pytest.raises(fs.FusedStatsError) as refused:
        fs.Probe(st.model, points=points, cross=fs.GrowthProtocol(points, family="layer"))
    reason = "the tangent probe runs the new block on the model's own stream and builds it from the model's weights"
    assert str(refused.value).startswith(reason) and reason in line
