"""MkDocs hook: the command-line reference, generated from the argparse parser at build time.

A page that holds the marker ``<!-- cli-reference -->`` gets, in its place, one section per
sub-command of ``fused_stats.cli.build_parser()`` with the command's ``--help`` text, so the
reference cannot drift from the parser. The repository root goes first on ``sys.path`` so the
build documents this checkout, not another installed copy.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MARKER = "<!-- cli-reference -->"


def cli_reference() -> str:
    import argparse

    from fused_stats.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    parts = ["```text", parser.format_help().rstrip(), "```", ""]
    for name, command in sub.choices.items():
        parts += [f"### `fused-stats {name}`", "", (helps.get(name) or "").rstrip(".") + ".", ""]
        parts += ["```text", command.format_help().rstrip(), "```", ""]
    return "\n".join(parts)


def on_config(config, **kwargs):
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return config


def on_page_markdown(markdown, page, config, files, **kwargs):
    if MARKER not in markdown:
        return markdown
    # argparse wraps help text at the terminal width; a fixed width keeps the page stable
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        return markdown.replace(MARKER, cli_reference())
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
