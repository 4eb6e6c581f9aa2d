"""``bench/bench_real.py`` at a tiny size: a small LLaMA saved as an HF folder stands in for the real
model (no tokenizer: bytes). The timed cases run, the JSON holds per-round ratios, the probes fold
every sample, the floor step leaves the weights as it found them, the peak-RSS child measures one
step, and the candidates are evenly spaced growth boundaries."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

import fused_stats as fs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import bench_real

    return bench_real


def tiny_llama(layers=2, hidden=32, vocab=300, seed=0):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg).float()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama().save_pretrained(path)
    return path


def test_real_bench_writes_per_round_ratios(bench, folder, tmp_path, capsys):
    out = tmp_path / "real.json"
    argv = ["--model", str(folder), "--batch", "2", "--seq", "16", "--rounds", "2", "--threads", "1"]
    bench.main([*argv, "--candidates", "3", "--no-rss", "--out", str(out)])
    result = json.loads(out.read_text())
    timing = result["timings_by_threads"]["1"]
    assert set(timing["summary"]) == {bench.TRAIN, bench.FLOOR, bench.PROBE, bench.CROSS, bench.GROWTH}
    for name, summary in timing["summary"].items():
        wall, train = timing["wall_s"][name], timing["wall_s"][bench.TRAIN]
        assert len(wall) == 2
        assert summary["per_round_ratio"] == pytest.approx([wall[0] / train[0], wall[1] / train[1]])
        assert summary["median_ratio"] == pytest.approx(statistics.median(summary["per_round_ratio"]))
    # the warm-up slice (2 sequences) and two rounds of 2 sequences, at every point of every probe
    for name in (bench.PROBE, bench.CROSS, bench.GROWTH):
        assert result["probes"][name]["samples"] == 2 + 2 * 2
    assert result["probes"][bench.PROBE]["points"] == ["model.layers.0", "model.layers.1"]
    assert result["probes"][bench.GROWTH]["points"] == fs.growth_points(tiny_llama())
    assert result["rss_bytes"] is None
    printed = capsys.readouterr().out
    assert "round 2/2" in printed and "1 thread(s)" in printed and "<= 0.7" in printed


def test_candidates_are_evenly_spaced_with_both_ends(bench):
    points = fs.growth_points(tiny_llama(layers=30, hidden=16))
    assert len(points) == 31  # the input boundary and one after each block
    # 6 of 31: every sixth, by hand
    assert bench.candidates(tiny_llama(layers=30, hidden=16), 6) == [
        points[i] for i in (0, 6, 12, 18, 24, 30)
    ]
    assert bench.candidates(tiny_llama(layers=2), 6) == fs.growth_points(tiny_llama(layers=2))


def test_floor_step_restores_the_weights_and_computes_no_weight_gradient(bench):
    model = tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(1))
    step = bench.floor_step_fn(model, "model.layers.0")
    step({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    for name, p in model.named_parameters():
        assert p.requires_grad and p.grad is None, name
        assert torch.equal(p, before[name]), name
    assert not model.model.layers[0]._forward_hooks


@pytest.mark.parametrize("kind", ["probe", "stream"])
def test_rss_child_measures_one_step(bench, folder, tmp_path, kind):
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    batch_file = tmp_path / "batch.pt"
    torch.save({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}, batch_file)
    rss = bench.rss_child(kind, folder, str(batch_file))
    assert rss["peak"] >= rss["start"] > 0 and rss["base"] > 0
    if kind == "stream":
        assert rss["block_bytes"] > 0 and rss["peak_resident_bytes"] >= rss["block_bytes"]


def test_rss_ratios_by_hand(bench, capsys):
    mib = 2**20
    rss = {
        "train": {"base": 100 * mib, "start": 900 * mib, "peak": 1000 * mib},
        "probe": {"base": 100 * mib, "start": 400 * mib, "peak": 500 * mib},
        "stream": {"base": 100 * mib, "start": 150 * mib, "peak": 250 * mib},
    }
    ratios = bench.print_rss(rss, weight_bytes=300 * mib)
    assert ratios == {
        "probe_over_train_peak": 0.5,
        "stream_above_interpreter_over_weights": 0.5,
        "stream_over_probe_peak": 0.5,
    }
    assert "target <= 1" in capsys.readouterr().out
