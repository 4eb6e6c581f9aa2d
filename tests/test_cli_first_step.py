"""First-step predictions from the command line: ``probe --growth ... --optimizer`` prints
fs.predicted_change per candidate; ``advise --optimizer`` prints the change at the given lr where
the reports' per-unit-step numbers give it (SGD, Adam at the advice's eps) and those numbers. References: fs.predicted_change on a probe built in Python over
the same windows with the same torch optimizer; Nesterov SGD's first step against (1 + μ)·lr times
the report's per-unit-step SGD number (the rule worked by hand: the first buffer is g, the step
g + μ·g). Bad options: exit 2, one error line, nothing written, before the model loads."""

# ruff: noqa: F811  (the imported fixture `folder` is the tests' argument of the same name)
from __future__ import annotations

import re

import pytest
import torch
from test_cli_growth import (  # noqa: F401  (folder: the saved tiny LLaMA and its corpus)
    SEQ_LEN,
    fails,
    folder,
    load,
    probe_argv,
    windows,
    write_protocol,
)

import fused_stats as fs
from fused_stats.cli import main

pytest.importorskip("transformers")

PROTOCOL = 'candidates = ["model.layers.0", "model.layers.1"]\nseed = 1\n'
BATCH_SIZE = 8  # the probe command's default


def printed(out: str) -> dict[str, float]:
    section = out[out.index("first-step prediction for") :]
    return {m[1]: float(m[2]) for m in re.finditer(r"^  (\S+): ([-+0-9.e]+)", section, re.M)}


def reference_probe(folder, protocol):
    model = load(folder / "my-llama")
    probe = fs.Probe(model, cross=protocol)
    train, test = windows(folder / "corpus.txt")
    for stream, rows in (("train", train), ("test", test)):
        for i in range(0, min(len(rows), 2 * BATCH_SIZE), BATCH_SIZE):
            batch = rows[i : i + BATCH_SIZE]
            probe.step(
                {"input_ids": batch, "labels": batch}, fs.causal_lm_loss, stream=stream, mask="attention"
            )
    return model, probe


def test_probe_prints_the_prediction_of_the_named_optimizer(folder, capsys):
    path = write_protocol(folder, PROTOCOL)
    options = [
        "--optimizer",
        "adamw",
        "--lr",
        "1e-3",
        "--eps",
        "1e-6",
        "--betas",
        "0.8,0.99",
        "--weight-decay",
        "0.1",
    ]
    assert main([str(a) for a in probe_argv(folder, path, *options)]) == 0
    ours = printed(capsys.readouterr().out)
    protocol = fs.GrowthProtocol(["model.layers.0", "model.layers.1"], seed=1)
    model, probe = reference_probe(folder, protocol)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, betas=(0.8, 0.99), weight_decay=0.1)
    reference = fs.predicted_change(probe, optimizer)
    assert set(ours) == set(reference)
    for point, prediction in reference.items():
        assert ours[point] == pytest.approx(prediction.change, rel=1e-5), point


def test_nesterov_sgd_is_one_plus_mu_times_the_unit_step_number(folder, capsys):
    path = write_protocol(folder, PROTOCOL)
    options = ["--optimizer", "sgd", "--lr", "0.01", "--momentum", "0.9", "--nesterov"]
    assert main([str(a) for a in probe_argv(folder, path, *options)]) == 0
    ours = printed(capsys.readouterr().out)
    advice = fs.advise(folder / "out" / "report.json")
    for c in advice.ranked:
        assert ours[c.point] == pytest.approx(1.9 * 0.01 * c.predicted_change_sgd, rel=1e-5), c.point


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_advise_prints_the_change_at_the_given_lr_as_the_probe_predicts_it(folder, capsys, optimizer):
    """advise --optimizer X --lr: the numbers at that lr equal the ones probe --growth prints from
    the live tangents with torch's own optimizer (fs.predicted_change), and the per-unit numbers
    follow."""
    path = write_protocol(folder, PROTOCOL)
    options = ["--optimizer", optimizer, "--lr", "1e-3"]
    assert main([str(a) for a in probe_argv(folder, path, *options)]) == 0
    from_probe = printed(capsys.readouterr().out)
    report = folder / "out" / "report.json"
    argv = ["advise", report, "--out", folder / "adv", "--no-plot", *options]
    assert main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    from_advise = printed(out)
    assert set(from_advise) == set(from_probe) and len(from_probe) == 2
    for point, value in from_probe.items():
        assert from_advise[point] == pytest.approx(value, rel=1e-5), point
    assert "fused-stats probe --growth" in out and (folder / "adv" / "advice.json").is_file()
    for c in fs.advise(report).ranked:
        assert f"  {c.point}: sgd {c.predicted_change_sgd:+.6g}, adam {c.predicted_change_adam:+.6g}" in out


@pytest.mark.parametrize(
    "options, needles",
    [
        (["--lr", "1e-3"], ["--lr", "name it with --optimizer"]),
        (["--optimizer", "adam"], ["needs --lr"]),
        (["--optimizer", "sgd", "--lr", "1e-3", "--betas", "0.9,0.99"], ["SGD has no setting --betas"]),
        (["--optimizer", "adam", "--lr", "1e-3", "--momentum", "0.9"], ["Adam has no setting --momentum"]),
        (["--optimizer", "sgd", "--lr", "1e-3", "--nesterov"], ["--nesterov needs --momentum > 0"]),
    ],
)
def test_bad_optimizer_options_are_refused_before_the_model_loads(
    options, needles, folder, capsys, monkeypatch
):
    import fused_stats.commands.probe as probe_cmd

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(probe_cmd, "load_model", never)
    path = write_protocol(folder, PROTOCOL)
    fails(probe_argv(folder, path, *options), capsys, folder, *needles)


@pytest.mark.parametrize(
    "protocol, extra, needles",
    [
        (PROTOCOL + "projection = 4\n", [], ["needs the exact tangents"]),
        (PROTOCOL + "train_batch_size = 12\n", [], ["--batch-size must divide 12, got 8"]),
    ],
)
def test_probe_refuses_a_prediction_it_cannot_make(protocol, extra, needles, folder, capsys, monkeypatch):
    import fused_stats.commands.probe as probe_cmd

    monkeypatch.setattr(probe_cmd, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    path = write_protocol(folder, protocol)
    fails(probe_argv(folder, path, "--optimizer", "adam", "--lr", "1e-3", *extra), capsys, folder, *needles)


def test_probe_without_growth_refuses_the_optimizer(folder, capsys):
    argv = ["probe", "--model", folder / "my-llama", "--text", folder / "corpus.txt", "--seq-len", SEQ_LEN]
    fails(
        [*argv, "--optimizer", "adam", "--lr", "1e-3", "--out", folder / "o"],
        capsys,
        folder,
        "needs --growth",
    )
