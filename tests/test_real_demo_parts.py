"""The real-model demo's parts on a tiny random LLaMA and hand-built inputs (fast, no weights needed).

References, none of them the demo's code:

* the whole demo run on a tiny LLaMA standing in for the pretrained model: the zero bias's train
  mean ``μ_M`` and test mean ``g_K`` by one backward per sequence (a bias added by a hook of this
  file, a token-by-token cross-entropy), then SGD's and AdamW's first step written out by hand
  (``Δ = −η μ`` and ``Δ = −η μ/(|μ| + ε)``), ``η`` from ``target / ⟨−Δ/η, μ⟩``; the boundary the
  docstring names (after block ``round(b·L)``); the sequence counts;
* the token windows' files against the held-out rule written out here (the first byte of the
  path's SHA-1 below 10 % of 256);
* ``step_sizes``, the central and one-sided differences and the per-point ``bounded`` flag on
  hand-computed numbers; the summary lines on a hand-built result;
* a backbone that does not run as a plain stack (it scales ``inputs_embeds``, as Gemma does) is
  refused by ``TailLoss``;
* the ``demo`` command's options reaching the config and the thread count it sets.
"""

from __future__ import annotations

import hashlib
import json
import math
from types import SimpleNamespace

import pytest
import torch

import fused_stats as fs
from fused_stats.cli import main
from fused_stats.demo import corpus, real, real_intervene, real_report
from fused_stats.demo.real import RealDemoConfig

transformers = pytest.importorskip("transformers", reason="the demo's parts need transformers")

L, D, V = 4, 16, 64
EPS = 1e-8  # AdamW's default eps


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=24,
        num_hidden_layers=L,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg).double().eval()


class CharTokenizer:
    """One token per character (mod the vocabulary): enough for windows of real text."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % V for c in text]}


def per_sequence_bias_gradients(model, point: str, windows: torch.Tensor) -> torch.Tensor:
    """``q_i``: the gradient of sequence i's mean next-token loss with respect to a zero bias added
    to ``point``'s output at every position (one backward per sequence)."""
    rows = []
    for ids in windows:
        bias = torch.zeros(D, dtype=torch.float64, requires_grad=True)

        def add(module, args, out, bias=bias):
            return (out[0] + bias, *out[1:]) if isinstance(out, tuple) else out + bias

        handle = model.get_submodule(point).register_forward_hook(add)
        try:
            logits = model(input_ids=ids[None]).logits[0]
        finally:
            handle.remove()
        loss = torch.nn.functional.cross_entropy(logits[:-1], ids[1:])
        rows.append(torch.autograd.grad(loss, bias)[0])
    return torch.stack(rows)


def test_the_demo_on_a_tiny_llama_steps_and_predicts_from_the_train_and_test_means(tmp_path, monkeypatch):
    model = tiny_llama()
    source = tmp_path / "converted"
    source.mkdir()
    (source / "fused_stats_source.json").write_text(json.dumps({"about": "a tiny random LLaMA"}))
    monkeypatch.setattr(fs, "pretrained", lambda spec, **kw: (model, CharTokenizer()))
    model.name_or_path = str(source)  # what from_pretrained sets: the folder the demo reads the manifest of
    targets = (1e-4, 1e-3)
    cfg = RealDemoConfig(
        model="tiny",
        seq_len=12,
        batch_size=2,
        train_batches=3,
        test_batches=2,
        cross_rank=4,
        splits=((1, 1), (2, 2)),
        certificate_split=(2, 2),
        boundaries=(0.75,),
        targets=targets,
        trials=50,
        seed=1,
    )
    result = real.run_real_demo(cfg, tmp_path / "out", progress=False)
    assert result["data"]["train_sequences"] == 6 and result["data"]["test_sequences"] == 4
    point = f"model.layers.{round(0.75 * L) - 1}"  # after block round(b·L), counted from 1
    assert [item["point"] for item in result["interventions"]] == [point, point]
    assert list(result["layer_saturation"]) == [point]

    windows = real.token_windows(CharTokenizer(), 12, {"train": 6, "test": 4}, 1)
    mu = per_sequence_bias_gradients(model, point, windows["train"]).mean(0)
    g = per_sequence_bias_gradients(model, point, windows["test"]).mean(0)
    adam_direction = mu / (mu.abs() + EPS)  # AdamW's first step per unit lr, up to its sign
    bias = next(item for item in result["interventions"] if item["kind"] == "zero bias")
    assert bias["parameters"] == D
    want = {}
    for t in targets:
        eta = t / float(mu @ mu)
        want[("SGD", t)] = (eta, -eta * float(mu @ g))
        eta = t / float(adam_direction @ mu)
        want[("AdamW", t)] = (eta, -eta * float(adam_direction @ g))
    got = {}
    for opt in ("SGD", "AdamW"):
        rows = [r for r in bias["rows"] if r["optimizer"] == opt]
        assert len(rows) == len(targets)
        for t, r in zip(targets, rows):
            got[(opt, t)] = (r["eta"], r["predicted"])
    for key, (eta, predicted) in want.items():
        assert got[key][0] == pytest.approx(eta, rel=1e-6), key
        assert got[key][1] == pytest.approx(predicted, rel=1e-6), key


def test_token_windows_take_test_windows_from_held_out_files_only(tmp_path, monkeypatch):
    files = []
    for k in range(60):
        rel = f"pkg/module_{k}.py"
        path = tmp_path / f"module_{k}.py"
        path.write_text(chr(0x4E00 + k) * 200)  # one character of its own per file
        files.append((rel, path))
    monkeypatch.setattr(corpus, "stdlib_files", lambda root=None: files)
    held_out = {
        chr(0x4E00 + k) for k, (rel, _) in enumerate(files) if hashlib.sha1(rel.encode()).digest()[0] < 25.6
    }
    assert 0 < len(held_out) < 60

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    windows = real.token_windows(Tok(), 8, {"train": 20, "test": len(held_out)}, seed=2)
    test_chars = {chr(int(i)) for row in windows["test"] for i in row}
    train_chars = {chr(int(i)) for row in windows["train"] for i in row}
    assert test_chars == held_out
    assert len(train_chars) == 20 and not train_chars & held_out
    assert windows["train"].shape == (20, 8)


def test_step_sizes_and_the_central_difference_by_hand():
    assert real_intervene.step_sizes({"SGD": 4.0, "AdamW": 0.0}, (1e-3, 1e-2)) == {
        "SGD": [pytest.approx(2.5e-4), pytest.approx(2.5e-3)],
        "AdamW": [],
    }
    # L(s·Δ) = 2 + 3s + 5s² on the parameter's mirror: central (3), one-sided from L(0) = 2 (8)
    state = {}

    def set_params(delta, sign):
        state["s"] = sign * delta["x"]

    central, one_sided = real_intervene._central(
        set_params, lambda: 2 + 3 * state["s"] + 5 * state["s"] ** 2, {"x": 1.0}, 2.0
    )
    assert (central, one_sided) == (3.0, 8.0)


def test_torch_first_step_is_torch_s_own_step():
    grads = {"a": torch.randn(3, 4, dtype=torch.float64), "b": torch.randn(5, dtype=torch.float64)}
    delta = real_intervene.torch_first_step("SGD", grads, 0.1)
    for k in grads:
        assert torch.allclose(delta[k], -0.1 * grads[k])
    delta = real_intervene.torch_first_step("AdamW", grads, 0.1)
    for k in grads:
        assert torch.allclose(delta[k], -0.1 * grads[k] / (grads[k].abs() + EPS))


def fake_probe(b_align: float, b_exact: float, misalignment: float, stderr: float):
    est = SimpleNamespace(n=8, mu_norm2=1.0, d_par=0.5, d_2=0.7, d_align=0.5, not_estimable={}, ag_max=2.0)
    return SimpleNamespace(
        pooled=lambda point: SimpleNamespace(estimate=lambda: est),
        certificate=lambda point, M, K: SimpleNamespace(n_eff=M, b_align=b_align, b_exact=b_exact),
        saturation=lambda point: SimpleNamespace(to_dict=lambda: {"saturated": None}),
        misalignment=lambda point, m, k, trials, seed: SimpleNamespace(
            probability=misalignment, stderr=stderr
        ),
    )


@pytest.mark.parametrize(("misalignment", "bounded"), [(0.3, False), (0.15, True)])
def test_bounded_compares_the_misalignment_with_b_exact(misalignment, bounded):
    cfg = RealDemoConfig(splits=((1, 1), (2, 2)), certificate_split=(2, 2))
    # B_exact 0.1 plus two SE 0.05 is 0.2; B_align 0.5 would take both as bounded
    row = real._point_row(fake_probe(0.5, 0.1, misalignment, 0.05), "p", cfg)
    assert [s["bounded"] for s in row["splits"]] == [bounded, bounded]


def test_summary_lines_count_and_range_by_hand():
    def point(d_align, bounded, saturated, b_exact):
        splits = [{"M": m, "K": m, "bounded": b} for m, b in zip((1, 2), bounded)]
        cert = {"M": 2, "K": 2, "b_exact": b_exact}
        return {
            "d_align": d_align,
            "splits": splits,
            "saturation": {"saturated": saturated},
            "certificate": cert,
        }

    result = {
        "model": {"source": "a tiny model"},
        "data": {"test_loss": 1.0, "test_sequences": 4, "train_sequences": 8, "seq_len": 16},
        "config": {"cross_rank": 4},
        "points": [
            point(0.2, (True, False), False, 0.3),
            point(None, (True, True), None, None),
            point(0.05, (False, True), True, 0.1),
        ],
        "interventions": [
            {
                "kind": "zero bias",
                "rows": [{"optimizer": "SGD", "ratio": 0.99}, {"optimizer": "AdamW", "ratio": 1.01}],
            },
            {
                "kind": "zero layer",
                "rows": [{"optimizer": "SGD", "ratio": None}, {"optimizer": "SGD", "ratio": 1.02}],
            },
        ],
    }
    text = "\n".join(real_report.summary_lines(result))
    assert "d_align over the 3 residual points: 0.05–0.2" in text
    assert "B_exact 0.1–0.3 across the points" in text
    assert "at 4 of 6 (point, M, K) pairs" in text
    assert "1 of 3 points not saturated" in text
    assert (
        "zero layer, SGD first step: measured (central difference) / predicted 1.0200–1.0200 over 2 steps"
        in text
    )
    assert "zero layer, AdamW first step: measured (central difference) / predicted — over 0 steps" in text


def test_tail_loss_refuses_a_backbone_that_is_not_a_plain_stack():
    model = tiny_llama()
    batches = real.batches_of(torch.randint(0, V, (4, 10), generator=torch.Generator().manual_seed(3)), 2)
    base = real.mean_test_loss(model, batches)
    tail = real_intervene.TailLoss(model, "model.layers.1", batches, base)
    assert math.isclose(tail.loss(model, 2), base, rel_tol=1e-12)

    def scale_embeddings(module, args, kwargs):  # what Gemma's backbone does to inputs_embeds
        if kwargs.get("inputs_embeds") is not None:
            kwargs["inputs_embeds"] = kwargs["inputs_embeds"] * 2.0
        return args, kwargs

    handle = model.model.register_forward_pre_hook(scale_embeddings, with_kwargs=True)
    try:
        with pytest.raises(fs.FusedStatsError, match="does not run as a plain stack of blocks"):
            real_intervene.TailLoss(model, "model.layers.1", batches, base)
    finally:
        handle.remove()


def test_demo_options_reach_the_config_and_the_thread_count(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(real, "run_real_demo", lambda cfg, out, progress=None: seen.update(real=cfg))
    from fused_stats.demo import width_study

    monkeypatch.setattr(
        width_study, "run_width_study", lambda cfg, out, progress=None: seen.update(width=cfg)
    )
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.update(threads=n))
    out = str(tmp_path / "out")
    assert (
        main(["demo", "--quick", "--test-batches", "3", "--seq-len", "32", "--out", out, "--no-progress"])
        == 0
    )
    cfg = seen.pop("real")
    assert (cfg.test_batches, cfg.train_batches, cfg.seq_len) == (3, 2, 32)
    assert seen.pop("threads") == 2  # the real model's default
    assert main(["demo", "--width-study", "--quick", "--out", out, "--no-progress"]) == 0
    assert "real" not in seen and "width" in seen and seen["threads"] == 1


def test_demo_help_states_the_real_model_s_defaults():
    from fused_stats.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if getattr(a, "choices", None) and "demo" in a.choices]
    text = " ".join(sub.choices["demo"].format_help().split())
    default, quick = RealDemoConfig(), RealDemoConfig.quick()
    for option, field, what in (
        ("--seq-len", "seq_len", "tokens per sequence"),
        ("--train-batches", "train_batches", "train batches of 4 sequences"),
        ("--test-batches", "test_batches", "test batches of 4 sequences"),
    ):
        want = f"{what} (default: {getattr(default, field)}; --quick: {getattr(quick, field)})"
        assert want in text, (option, want)
    assert default.batch_size == 4
