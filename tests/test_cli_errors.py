"""Bad input to the ``fused-stats`` command line: every case must end with exit status 2 and exactly
one ``fused-stats: error: ...`` line on stderr that names the bad value, before any file or folder
is written or created (the folder listing before and after is compared). The CLI runs in-process
through ``fused_stats.cli.main``; the working directory is the test's own folder, so default
output folders would show up in the listing too.

Also here: every option's help shows its default, and progress output on a non-terminal stderr
never contains a carriage return.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys

import numpy as np
import pytest
import torch

import fused_stats as fs
from fused_stats.cli import build_parser, main

from tiny_models import TINY_LLAMA_CONFIG as LLAMA


def listing(root) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files
    )


def fails(argv, capsys, root, *needles) -> str:
    """Run the CLI; assert exit 2, one error line containing every needle, nothing created."""
    capsys.readouterr()
    before = listing(root)
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fused-stats: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert listing(root) == before
    return lines[0]


@pytest.fixture
def text_file(here):
    path = here / "corpus.txt"
    path.write_bytes(np.random.default_rng(0).integers(32, 127, size=16 * 40).astype(np.uint8).tobytes())
    return path


def probe_args(model, text, *extra):
    return [
        "probe",
        "--model",
        model,
        "--text",
        text,
        "--batches",
        "1",
        "--batch-size",
        "4",
        "--seq-len",
        "16",
        "--no-progress",
        *extra,
    ]


# ---------------------------------------------------------------------------- argument values
@pytest.mark.parametrize(
    "argv, needles",
    [
        (["synthetic", "--dim", "0"], ["--dim", "0"]),
        (["synthetic", "--batch-size", "3"], ["--batch-size", "3"]),
        (["synthetic", "--dim", "abc"], ["--dim", "'abc'"]),
        (["plan", "--dim", "-4", "--points", "2"], ["--dim", "-4"]),
        (["demo", "--threads", "0"], ["--threads", "0"]),
        (["demo", "--widths", "0"], ["--widths", "0"]),
        (["report", "x.json", "--sweep", "height"], ["--sweep", "height"]),
    ],
)
def test_bad_values_rejected_by_the_parser(argv, needles, here, capsys):
    fails(argv, capsys, here, *needles)


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--test-batches", "0"], ["--test-batches", "0"]),
        (["--batches", "0"], ["--batches", "0"]),
        (["--split", "0", "0"], ["--split", "0"]),
        (["--split", "3", "-1"], ["--split", "-1"]),
        (["--seq-len", "1"], ["--seq-len", "1"]),
        (["--trials", "-5"], ["--trials", "-5"]),
        (["--cross", "0"], ["--cross", "0"]),
        (["--cross", "8,softmax"], ["--cross", "softmax"]),
        (["--cross", "8", "--unit", "flat"], ["--cross", "--unit flat"]),
        (["--mask", "everything"], ["--mask", "everything"]),
        (["--device", "nonsense"], ["--device", "nonsense"]),
        (["--split", "40", "40"], ["--split 40 40", "80"]),  # more than the pooled sequences
    ],
)
def test_probe_bad_values(extra, needles, llama_json, text_file, here, capsys):
    fails(probe_args(llama_json, text_file, "--out", here / "o", *extra), capsys, here, *needles)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_probe_cuda_device_without_cuda(llama_json, text_file, here, capsys):
    fails(
        probe_args(llama_json, text_file, "--out", here / "o", "--device", "cuda"),
        capsys,
        here,
        "--device 'cuda'",
        "CUDA is not available",
    )


# ---------------------------------------------------------------------------- probe outputs
def test_probe_existing_out_refused_before_any_work(llama_json, text_file, here, capsys, monkeypatch):
    import fused_stats.commands.probe as probe_cmd

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(probe_cmd, "load_model", never)
    existing = here / "results.txt"
    existing.write_text("keep me")
    fails(probe_args(llama_json, text_file, "--out", existing), capsys, here, "results.txt", "is a file")
    assert existing.read_text() == "keep me"
    folder = here / "o"
    folder.mkdir()
    (folder / "report.json").write_text("{}")
    fails(probe_args(llama_json, text_file, "--out", folder), capsys, here, "report.json", "--force")
    assert (folder / "report.json").read_text() == "{}"


def test_probe_force_replaces_existing_report(llama_json, text_file, here, capsys):
    folder = here / "o"
    folder.mkdir()
    (folder / "report.json").write_text("{}")
    rc = main([str(a) for a in probe_args(llama_json, text_file, "--out", folder, "--force")])
    assert rc == 0, capsys.readouterr().err
    assert fs.Report.from_json(folder / "report.json").points


def test_probe_rejects_bert_config(here, text_file, capsys):
    from transformers import BertConfig

    path = here / "bert.json"
    BertConfig(
        vocab_size=256, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    ).to_json_file(path)
    fails(probe_args(path, text_file, "--out", here / "o"), capsys, here, "bert.json", "'bert'", "encoder")


def test_probe_rejects_bert_model_folder(here, text_file, capsys):
    from transformers import BertConfig

    folder = here / "bert_model"
    folder.mkdir()
    BertConfig(
        vocab_size=256, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    ).to_json_file(folder / "config.json")
    fails(probe_args(folder, text_file, "--out", here / "o"), capsys, here, "bert_model", "'bert'")


def test_unknown_model_type_is_one_short_line(here, text_file, capsys):
    path = here / "odd.json"
    path.write_text(json.dumps({"model_type": "no_such_model", "hidden_size": 8}))
    line = fails(probe_args(path, text_file, "--out", here / "o"), capsys, here, "'no_such_model'")
    assert len(line) < 300
    folder = here / "odd_model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    line = fails(
        probe_args(folder, text_file, "--out", here / "o"), capsys, here, "'no_such_model'", "odd_model"
    )
    assert len(line) < 300


# ---------------------------------------------------------------------------- report, merge, plan
def _report_file(path, meta):
    acc_train = fs.GradStats(4, second_moment="pool")
    acc_test = fs.GradStats(4, second_moment="pool")
    gen = torch.Generator().manual_seed(3)
    acc_train.update(torch.randn(6, 4, generator=gen, dtype=torch.float64) + 0.5)
    acc_test.update(torch.randn(6, 4, generator=gen, dtype=torch.float64) + 0.5)
    data = {
        "format": "fused_stats.report",
        "version": 1,
        "fused_stats_version": fs.__version__,
        "created": fs.Report.now(),
        "unit": "sample",
        "second_moment": "pool",
        "model": {"class": "Tiny", "num_parameters": 1, "config": {}},
        "points": [
            {
                "name": "p",
                "index": 0,
                "dim": 4,
                "train": acc_train.estimate().to_dict(),
                "test": acc_test.estimate().to_dict(),
                "certificate": None,
                "misalignment": None,
                "realized_alignment": None,
                "saturation": None,
            }
        ],
        "meta": meta,
    }
    return fs.Report(data).to_json(path)


def test_report_sweep_without_width_writes_nothing(here, capsys):
    a = _report_file(here / "a.json", {"width": 16, "seed": 0})
    b = _report_file(here / "b.json", {"depth": 2, "seed": 1})
    fails(
        ["report", a, b, "--sweep", "width", "--out", here / "r"],
        capsys,
        here,
        "--sweep width",
        "meta['width']",
        "b.json",
    )
    fails(["report", a, "--sweep", "width", "--point", "nope", "--out", here / "r"], capsys, here, "'nope'")


def test_merge_into_missing_folder_creates_nothing(here, capsys):
    gen = torch.Generator().manual_seed(5)
    for name in ("a", "b"):
        acc = fs.GradStats(3)
        acc.update(torch.randn(5, 3, generator=gen, dtype=torch.float64))
        acc.save(here / f"{name}.safetensors")
    fails(
        [
            "merge",
            here / "nowhere" / "deeper" / "out.safetensors",
            here / "a.safetensors",
            here / "b.safetensors",
        ],
        capsys,
        here,
        "nowhere",
        "does not exist",
    )
    assert not (here / "nowhere").exists()
    os.makedirs(here / "ckpt_a")
    fails(
        ["merge", here / "missing_dir" / "merged", here / "ckpt_a", here / "ckpt_a"],
        capsys,
        here,
        "missing_dir",
    )


def test_plan_errors_name_options_not_functions(here, capsys):
    line = fails(["plan", "--dim", "64"], capsys, here, "--dim", "--points")
    assert "plan_memory" not in line


# ---------------------------------------------------------------------------- help text
def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_option_has_help_showing_its_default():
    for name, sub in _subparsers(build_parser()).items():
        text = sub.format_help()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.dest)
            if not action.option_strings or action.nargs == 0 or action.required:
                continue  # positionals, required options, and flags that are off unless given
            shown = sub._get_formatter()._expand_help(action)
            assert "default" in shown, (name, action.option_strings, shown)
            if action.default is not None:
                assert str(action.default) in shown, (name, action.option_strings, shown)
        assert "(default:" in text


# ---------------------------------------------------------------------------- progress
class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal():
    from fused_stats.progress import Progress

    tty = _Terminal()
    with Progress(5, "work", stream=tty, unit="steps") as bar:
        for _ in range(5):
            bar.update()
    assert "\r" in tty.getvalue()  # tqdm redraws in place on a terminal
    log = io.StringIO()
    with Progress(5, "work", stream=log, unit="steps", interval=0.0) as bar:
        for _ in range(5):
            bar.update()
    text = log.getvalue()
    assert "\r" not in text and text.splitlines()[-1].startswith("work: 5/5 steps")
    quiet = io.StringIO()
    with Progress(5, "work", stream=quiet, enabled=False) as bar:
        bar.update(5)
    assert quiet.getvalue() == ""


def test_probe_run_follows_the_progress_rule(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 3, generator=gen), torch.randint(0, 2, (5,), generator=gen)) for _ in range(3)]
    probe = fs.Probe(model, points=["0", "2"], second_moment="dense")
    with open(tmp_path / "err.log", "w") as log:  # stderr redirected to a file
        monkeypatch.setattr(sys, "stderr", log)
        assert probe.run(batches, fs.classification_loss) == 3
    text = (tmp_path / "err.log").read_text()
    assert "\r" not in text and text.splitlines()[-1].startswith("probe train: 3/3 batches")
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    probe.run(batches, fs.classification_loss, stream="test", max_batches=2)
    assert "\r" in tty.getvalue() and "probe test" in tty.getvalue()  # a bar on a terminal
    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    probe.run(batches, fs.classification_loss, progress=False)
    assert quiet.getvalue() == ""
    assert probe.stats["0"].n == 30 and probe.test_stats["2"].n == 10


def test_probe_progress_in_a_redirected_stderr_has_no_carriage_return(here, capsys, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    config = LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(here / "model")  # loading it shows HF's bar
    tokens = np.random.default_rng(1).integers(0, 256, size=(20, 12))
    np.save(here / "tokens.npy", tokens)
    # HF's bars on, as in a fresh process (an earlier command in this process may have silenced them)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    hf_logging.enable_progress_bar()
    capsys.readouterr()
    rc = main(
        [
            "probe",
            "--model",
            str(here / "model"),
            "--tokens",
            str(here / "tokens.npy"),
            "--batches",
            "2",
            "--batch-size",
            "4",
            "--out",
            str(here / "o"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "\r" not in err
    assert "probe train: 2/2 batches" in err  # the plain end-of-loop line
