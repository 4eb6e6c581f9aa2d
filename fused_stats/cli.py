"""The ``fused-stats`` command line; each sub-command lives in :mod:`fused_stats.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .commands import COMMANDS
from .errors import FusedStatsError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fused-stats",
        description="Exact streaming activation-gradient statistics (d_align, certificate, saturation).")
    parser.add_argument("--version", action="version", version=f"fused-stats {__version__}")
    sub = parser.add_subparsers(dest="command")
    for name in COMMANDS:
        importlib.import_module(f"fused_stats.commands.{name}").register(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except FusedStatsError as exc:
        print(f"fused-stats: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
