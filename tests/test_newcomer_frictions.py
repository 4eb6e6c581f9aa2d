"""Frictions a new user hit in one walk through the README and docs: a short --text stream runs
with a warning, a model folder without config.json says so, a typo of "residual" is answered
with it, and the docs pages say what they refer to.

References: the counts of the warning from the file's length worked by hand (bytes // seq_len
windows, the last 10 % held out); the docs checks read the pages' text and the package's own
lists (``dataclasses.fields(fs.GrowthProtocol)``, the ``::: fused_stats.X`` lines of the API
pages)."""

# ruff: noqa: F811  (the imported fixture `folder` is the tests' argument of the same name)
from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest
from test_cli_growth import fails, folder  # noqa: F401  (folder: a saved tiny LLaMA and its corpus)
from torch import nn

import fused_stats as fs
from fused_stats.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_short_text_warns_that_the_test_stream_is_smaller_than_asked(folder, capsys):
    # 40 windows of 32 bytes (+5): 36 train, 4 test; ask for 2 batches of 8 in each stream
    argv = ["probe", "--model", folder / "my-llama", "--text", folder / "corpus.txt", "--seq-len", 32]
    argv += ["--batches", 2, "--batch-size", 8, "--trials", 0, "--out", folder / "o", "--no-progress"]
    assert main([str(a) for a in argv]) == 0
    err = capsys.readouterr().err
    assert "the test stream has 4 sequences, fewer than the 16" in err and "K = 4" in err
    assert "train stream" not in err  # 36 >= 16: no warning there


def test_model_folder_without_config_json_says_so(folder, capsys):
    empty = folder / "no-config"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    argv = ["probe", "--model", empty, "--text", folder / "corpus.txt", "--out", folder / "o2"]
    line = fails(argv, capsys, folder, "no config.json")
    assert "model_type key" not in line


def test_a_typo_of_residual_suggests_it():
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    with pytest.raises(fs.FusedStatsError, match='did you mean points="residual"'):
        fs.Probe(model, points="residul")
    with pytest.raises(fs.FusedStatsError, match="top-level modules") as info:
        fs.Probe(model, points="3")  # an ordinary wrong name keeps its module suggestions
    assert "did you mean" not in str(info.value)


def test_cli_page_lists_every_protocol_key_and_links_real_sections():
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    section = text[text.index("## Growth from the command line") :]
    for field in dataclasses.fields(fs.GrowthProtocol):
        assert f"`{field.name}" in section, field.name
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", text, re.M)
    }
    for target in re.findall(r"\]\(#([^)]+)\)", text):
        assert target in anchors, target
    assert not re.search(r'see "[^"]+" (below|above)', text)  # a section named but not linked


def test_suites_page_shows_model_in_runs():
    text = (ROOT / "docs" / "suites.md").read_text(encoding="utf-8")
    block = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    runs = block.split("[[runs]]")[1:]
    assert any(re.search(r'^model = "', r, re.M) for r in runs)


def test_reference_index_lists_every_documented_name():
    index = (ROOT / "docs" / "reference" / "index.md").read_text(encoding="utf-8")
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        for name in re.findall(r"^::: fused_stats\.(\w+)$", page.read_text(encoding="utf-8"), re.M):
            assert f"`{name}`" in index, (page.name, name)


def test_sphinx_roles_become_cross_references_or_code():
    spec = importlib.util.spec_from_file_location(
        "sphinx_roles", ROOT / "docs" / "_hooks" / "sphinx_roles.py"
    )
    roles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(roles)
    text = "See :class:`~fused_stats.Probe`, :meth:`~ProbeResults.saturation` and :func:`fused_stats.advise`."
    assert roles.convert(text) == (
        "See [`Probe`][fused_stats.Probe], `saturation` and [`fused_stats.advise`][fused_stats.advise]."
    )
    for name in fs.__all__:  # every public docstring comes out without a raw role
        doc = getattr(fs, name).__doc__ or ""
        assert not re.search(r":(class|func|meth|mod|attr|data|exc|obj):`", roles.convert(doc)), name


def test_code_blocks_wrap_long_commands():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    sheets = re.findall(r"^extra_css:\n((?:  - .+\n)+)", config, re.M)
    css = "".join((ROOT / "docs" / s.strip()[2:]).read_text() for s in sheets[0].splitlines())
    assert re.search(r"pre > code\s*{[^}]*white-space:\s*pre-wrap", css)


def test_probe_page_defines_d_align():
    text = (ROOT / "docs" / "probe.md").read_text(encoding="utf-8")
    assert "min(d_par, d_2)" in text and "B_align = 1/(1 + n_eff·d_align)" in text
