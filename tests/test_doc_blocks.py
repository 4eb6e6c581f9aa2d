"""The code a reader copies from README.md and docs/ works as shown.

* Every ```python block runs, in a temporary working directory, one namespace per block; a page
  whose blocks build on each other says so with ``<!-- blocks: sequential -->`` (then its blocks
  run in order in one namespace). A block is left out only when the line before it is
  ``<!-- skip: REASON -->`` with a reason (a GPU, a checkpoint folder, a fragment of a file).
* Every ``fused-stats COMMAND --option`` in a shell block or an inline code span names a real
  sub-command of the parser in ``fused_stats/cli.py`` and options that command has.
* The README's relative links point at files (and headings) that exist, and every public name of
  ``fused_stats.__all__`` has an API reference entry.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import linecache
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fused_stats
from fused_stats.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)")
SKIP = re.compile(r"^\s*<!--\s*skip\b(.*?)-->\s*$")
SEQUENTIAL = "<!-- blocks: sequential -->"
SHELL_LANGS = {"bash", "sh", "shell", "console"}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the skip mark's text after "skip", None without a mark

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page (indented ones too, dedented), with the skip mark before each."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2).lower()
        j = i + 1
        while j < len(lines) and not (lines[j].startswith(indent + "```") and lines[j].strip() == "```"):
            j += 1
        body = [
            line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : j]
        ]
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mark = SKIP.match(before)
        out.append(Block(page, i + 1, lang, "\n".join(body) + "\n", mark.group(1) if mark else None))
        i = j + 1
    return out


def python_pages() -> list[Path]:
    return [page for page in PAGES if any(b.lang == "python" for b in blocks(page))]


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_the_parser_finds_the_readme_blocks():
    found = [b for b in blocks(ROOT / "README.md") if b.lang == "python"]
    assert len(found) >= 4, [b.where for b in found]  # one per use: backend, large LLM, suite, growth
    assert all(b.skip is None for b in found), "the README's snippets must run"


def test_every_skip_mark_has_a_reason_and_a_python_block():
    problems = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        marked = {b.line for b in blocks(page) if b.skip is not None}
        for number, line in enumerate(lines, 1):
            mark = SKIP.match(line)
            if not mark:
                continue
            reason = mark.group(1).strip()
            if not reason.startswith(":") or len(reason[1:].strip()) < 8:
                problems.append(f"{page_id(page)}:{number}: skip mark without a reason: {line.strip()}")
            following = next((k for k in range(number, len(lines)) if lines[k].strip()), None)
            if (
                following is None
                or following + 1 not in marked
                or not lines[following].lstrip().startswith("```python")
            ):
                problems.append(f"{page_id(page)}:{number}: skip mark not right before a ```python block")
    assert not problems, "\n".join(problems)


@pytest.fixture
def quiet_process(tmp_path, monkeypatch):
    """A temporary cwd, the Agg backend, one torch thread, the global RNG restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    threads, state = torch.get_num_threads(), torch.random.get_rng_state()
    torch.set_num_threads(1)
    yield tmp_path
    torch.set_num_threads(threads)
    torch.random.set_rng_state(state)


@pytest.mark.parametrize("page", python_pages(), ids=page_id)
def test_python_blocks_run(page, quiet_process):
    sequential = SEQUENTIAL in page.read_text(encoding="utf-8")
    namespace: dict = {}
    ran = 0
    for block in blocks(page):
        if block.lang != "python" or block.skip is not None:
            continue
        if not sequential:
            namespace = {}
        namespace["__name__"] = "__main__"
        # leading newlines keep the page's line numbers in a traceback; the block's own source is
        # registered under its own name, so tools that read a function's source back (inspect,
        # import-time type checkers) get Python, not the Markdown page
        source = "\n" * block.line + block.code
        name = f"{page}:{block.line}"
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        code = compile(source, name, "exec")
        output = io.StringIO()
        try:
            with contextlib.redirect_stdout(output):
                exec(code, namespace)
        except BaseException:
            pytest.fail(
                f"{block.where}: the block raised\n{traceback.format_exc()}\n{output.getvalue()[-2000:]}"
            )
        ran += 1
    if not ran:
        pytest.skip(f"{page_id(page)}: every python block is marked skipped")


# ---------------------------------------------------------------------------------------- CLI
def subcommands() -> dict[str, set[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    top = {s for a in parser._actions for s in a.option_strings}
    commands = {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}
    return {"": top, **commands}


COMMAND = re.compile(r"(?:fused-stats|-m fused_stats\.cli)\s+([^\s`|;&>)\"']+)([^`|;&>)\"#]*)")
OPTION = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def shell_lines(text: str) -> list[str]:
    """Logical lines of a shell block: continuations joined, comments dropped."""
    text = text.replace("\\\n", " ")
    return [line.split(" #", 1)[0] for line in text.splitlines() if not line.lstrip().startswith("#")]


def command_uses() -> list[tuple[str, str, list[str]]]:
    """(where, command, options) for every fused-stats call in shell blocks and inline code."""
    uses = []
    for page in PAGES:
        for block in blocks(page):
            if block.lang in SHELL_LANGS:
                for line in shell_lines(block.code):
                    for m in COMMAND.finditer(line):
                        uses.append((block.where, m.group(1), OPTION.findall(m.group(2))))
        prose = re.sub(r"^(\s*)```.*?^\1```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
        for span in re.findall(r"`([^`\n]+)`", prose):
            for m in COMMAND.finditer(span):
                uses.append((page_id(page), m.group(1), OPTION.findall(m.group(2))))
    return uses


def test_documented_commands_and_options_exist():
    known = subcommands()
    uses = command_uses()
    assert len(uses) > 30, len(uses)  # the pages do show commands: the scan works
    problems = []
    for where, command, options in uses:
        if command.startswith("-"):  # fused-stats --help / --version
            options, command = [command, *options], ""
        if command not in known:
            problems.append(
                f"{where}: 'fused-stats {command}' is not a command ({', '.join(sorted(known)[1:])})"
            )
            continue
        allowed = known[command] | {"--help"}
        problems += [
            f"{where}: 'fused-stats {command}' has no option {o}" for o in options if o not in allowed
        ]
    assert not problems, "\n".join(problems)


def test_every_command_is_documented_on_the_cli_page():
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    assert "<!-- cli-reference -->" in text  # the build inserts each command's --help there
    shown = {command for _, command, _ in command_uses()}
    missing = set(subcommands()) - {""} - shown
    assert not missing, f"commands no page shows an example of: {sorted(missing)}"


# ---------------------------------------------------------------------------------- references
def test_readme_links_resolve():
    from markdown.extensions.toc import slugify

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        if not file.exists():
            problems.append(f"{target}: no file {path}")
            continue
        if anchor:
            headings = re.findall(r"^#+\s+(.*?)\s*$", file.read_text(encoding="utf-8"), re.M)
            if anchor not in {slugify(h, "-") for h in headings}:
                problems.append(f"{target}: no heading #{anchor} in {path}")
    assert not problems, "\n".join(problems)


def test_every_public_name_has_a_reference_entry():
    entries = set()
    for page in (DOCS / "reference").glob("*.md"):
        entries |= set(re.findall(r"^::: fused_stats\.(\w+)\s*$", page.read_text(encoding="utf-8"), re.M))
    missing = set(fused_stats.__all__) - {"__version__"} - entries
    assert not missing, f"public names without an API reference entry: {sorted(missing)}"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300


def test_skip_detection_sees_a_marked_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- skip: needs a GPU -->\n```python\nraise SystemExit\n```\n\n```python\nx = 1\n```\n"
    )
    found = blocks(page)
    assert [(b.line, b.skip) for b in found] == [(4, ": needs a GPU "), (8, None)]
