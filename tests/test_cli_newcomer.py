"""The ``fused-stats`` commands as a new user meets them: the exit status without a command, the
``--mask`` help, one output-folder rule for probe / report / demo, a width sweep of reports that
``probe`` wrote, the default second moment with ``--trials``, a 2-D token file cut to ``--seq-len``,
and one tokenizer rule for the in-memory and the streamed model. The CLI page's example block (docs/cli.md), run top to
bottom, is in ``test_readme_cli_block``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")


import fused_stats as fs
from fused_stats.cli import main

from tiny_models import TINY_LLAMA_CONFIG as LLAMA

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def text_file(here):
    path = here / "corpus.txt"
    path.write_bytes(np.random.default_rng(1).integers(32, 127, size=16 * 60).astype(np.uint8).tobytes())
    return path


def probe_args(model, text, out, *extra):
    return [
        "probe", "--model", str(model), "--text", str(text), "--batches", "3", "--test-batches", "1",
        "--batch-size", "4", "--seq-len", "16", "--no-progress", "--out", str(out), *extra,
    ]  # fmt: skip


def test_no_command_exits_2_with_the_commands_named(capsys):
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert "usage: fused-stats" in out
    assert err.startswith("fused-stats: error: choose a command: ") and "probe" in err and "report" in err


def test_probe_help_tells_attention_and_none_apart(capsys):
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    attention = re.search(r"'attention' = (.*?), 'none'", text).group(1)
    none = re.search(r"'none' = (.*?) \(default", text).group(1)
    assert attention != none and "attention_mask" in attention and "padding included" in none


# ---------------------------------------------------------------------------- --out
def _two_reports(here):
    from test_cli_errors import _report_file

    return _report_file(here / "a.json", {"width": 16, "seed": 0}), _report_file(
        here / "b.json", {"width": 32, "seed": 1}
    )


@pytest.mark.parametrize("command", ["probe", "report", "demo"])
def test_every_command_refuses_a_non_empty_out_unless_forced(command, here, llama_json, text_file, capsys):
    out = here / "o"
    out.mkdir()
    for name in ("c.txt", "a.txt", "b.txt"):
        (out / name).write_text("keep")
    if command == "probe":
        argv = probe_args(llama_json, text_file, out)
    elif command == "report":
        argv = ["report", *(str(p) for p in _two_reports(here)), "--out", str(out), "--no-plots"]
    else:
        argv = ["demo", "--quick", "--out", str(out), "--no-progress"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"fused-stats: error: --out {str(out)!r} holds 'a.txt', 'b.txt', 'c.txt' already; pass --force "
        "to write into it (files of the same names are replaced) or choose an empty folder"
    )
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "b.txt", "c.txt"]
    if command != "demo":  # the demo with --force is the CLI page block's (test_readme_cli_block)
        assert main([*argv, "--force"]) == 0, capsys.readouterr().err
        assert (out / "a.txt").read_text() == "keep" and len(list(out.iterdir())) > 3


# ---------------------------------------------------------------------------- probe
def test_report_sweep_width_of_probe_reports_takes_the_config(here, text_file, capsys):
    paths = []
    for width in (16, 32):
        cfg = here / f"w{width}.json"
        cfg.write_text(json.dumps({**LLAMA, "hidden_size": width}))
        out = here / f"run{width}"
        assert main(probe_args(cfg, text_file, out, "--trials", "0")) == 0, capsys.readouterr().err
        paths.append(out / "report.json")
    reports = [fs.Report.from_json(p) for p in paths]
    assert all("width" not in r.meta for r in reports)  # the probe records no meta["width"]
    capsys.readouterr()
    assert (
        main(["report", *map(str, paths), "--sweep", "width", "--out", str(here / "sw"), "--no-plots"]) == 0
    )
    out = capsys.readouterr().out
    table = out[out.index("== sweep over width ==") :].splitlines()
    rows = {line.split()[0]: line for line in table if line.split() and line.split()[0] in ("16", "32")}
    assert set(rows) == {"16", "32"}  # the x values are the configs' hidden sizes
    for width, r in zip(("16", "32"), reports):
        d_align = r.points[-1]["train"]["d_align"]
        assert fs.api.report.document.fmt(d_align, ".3g") in rows[width]


def test_default_second_moment_pools_for_the_misalignment(here, llama_json, text_file, capsys):
    """12 train sequences at d = 16: past auto's switch point, so only a pool keeps the samples
    the misalignment resamples. The default pools; an explicit 'auto' names the fix."""
    from fused_stats.accumulators.grad_stats import auto_pool_limit

    assert auto_pool_limit(16) < 12
    assert main(probe_args(llama_json, text_file, here / "d", "--trials", "200")) == 0
    report = fs.Report.from_json(here / "d" / "report.json")
    assert report.data["second_moment"] == "pool"
    assert all(p["misalignment"] is not None for p in report.points)
    capsys.readouterr()
    assert (
        main(probe_args(llama_json, text_file, here / "a", "--trials", "200", "--second-moment", "auto")) == 0
    )
    err = capsys.readouterr().err
    assert "no empirical misalignment at model.layers.0" in err and "--second-moment pool" in err
    assert main(probe_args(llama_json, text_file, here / "z", "--trials", "0")) == 0
    assert fs.Report.from_json(here / "z" / "report.json").data["second_moment"] == "auto"


def test_two_dimensional_token_file_is_cut_to_seq_len_and_says_so(here, llama_json, capsys):
    rows = torch.randint(0, 256, (30, 40), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    path = here / "rows.pt"
    torch.save(rows, path)
    argv = ["probe", "--model", str(llama_json), "--tokens", str(path), "--batches", "2",
            "--batch-size", "4", "--seq-len", "16", "--no-progress", "--out", str(here / "o"), "--trials", "0"]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "holds (30, 40) sequences; using the first --seq-len 16 tokens of each: (30, 16)" in err
    assert fs.Report.from_json(here / "o" / "report.json").meta["seq_len"] == 16


def test_one_tokenizer_rule_for_the_loaded_and_the_streamed_model(here, monkeypatch):
    """A folder whose only tokenizer file is a SentencePiece ``tokenizer.model`` gets its
    tokenizer in both modes (the streamed branch used to miss that file name)."""
    import transformers

    import fused_stats.commands.probe as probe_cmd

    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    )
    folder = here / "m"
    model.save_pretrained(folder)
    (folder / "tokenizer.model").write_bytes(b"stand-in")
    asked = []
    sentinel = object()
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: asked.append(Path(path)) or sentinel
    )
    _, loaded, _ = probe_cmd.load_model(str(folder), 0, "float32")
    _, streamed, _ = probe_cmd.load_streamed(str(folder), torch.device("cpu"), "float32")
    assert loaded is sentinel and streamed is sentinel and asked == [folder, folder]
    (folder / "tokenizer.model").unlink()
    assert probe_cmd.load_model(str(folder), 0, "float32")[1] is None
    assert probe_cmd.load_streamed(str(folder), torch.device("cpu"), "float32")[1] is None
