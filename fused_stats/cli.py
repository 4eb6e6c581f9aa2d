"""The ``fused-stats`` command line; each sub-command lives in :mod:`fused_stats.commands`.

Every bad value ends the command with exit status 2 and one line on stderr,
``fused-stats: error: ...``, before any file or folder is written or created: argument values are
checked by argparse (types in :mod:`fused_stats.commands.args`), everything else the commands check
with :class:`fused_stats.FusedStatsError` before they start working.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .commands import COMMANDS
from .errors import FusedStatsError


class UsageError(Exception):
    """A bad command line (raised by :class:`Parser` instead of printing usage and exiting)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` after an option's help unless the help already names its default
    or the option is a flag (off unless given)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" in text
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or not action.option_strings
            or action.nargs == 0
        ):
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error`` raises :class:`UsageError` for :func:`main`."""

    def error(self, message):
        hint = f" (see '{self.prog} --help')"
        raise UsageError(message + hint)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fused-stats",
        formatter_class=HelpFormatter,
        description="Exact streaming activation-gradient statistics (d_align, certificate, saturation).",
    )
    parser.add_argument("--version", action="version", version=f"fused-stats {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    for name in COMMANDS:
        importlib.import_module(f"fused_stats.commands.{name}").register(sub)
    for command in sub.choices.values():
        command.formatter_class = HelpFormatter
    return parser


def _one_line(text: str, limit: int = 600) -> str:
    """Error text as one line (messages from libraries may span many lines)."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            # argparse's convention for a missing required argument: usage, then exit status 2
            parser.print_help()
            raise UsageError(f"choose a command: {', '.join(COMMANDS)} (see 'fused-stats --help')")
        return int(args.func(args) or 0)
    except (UsageError, FusedStatsError) as exc:
        print(f"fused-stats: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # one line, not a traceback: every file a command writes is written whole or not at all
        print("fused-stats: interrupted (Ctrl-C); no file was left half-written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
