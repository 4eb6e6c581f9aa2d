"""Argument types shared by the sub-commands: each rejects a bad value with a message that names it
(argparse prefixes the option, e.g. ``argument --dim: must be an integer >= 1, got 0``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def int_at_least(low: int):
    """An argparse type: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def int_list(low: int):
    """An argparse type for ``"32,64"`` or ``"32 64"``: integers >= ``low``."""
    one = int_at_least(low)

    def parse(text: str) -> tuple:
        parts = text.replace(",", " ").split()
        if not parts:
            raise argparse.ArgumentTypeError(f"needs integers >= {low}, got {text!r}")
        return tuple(one(v) for v in parts)

    return parse


def check_out_folder(out, force: bool, option: str = "--out") -> Path:
    """The one output-folder rule of ``probe``, ``report``, ``demo`` and ``grow-demo``: ``out`` may
    be missing or an empty folder; a folder that holds anything is refused unless ``force`` (then
    files of the same names are replaced, others kept); a file is always refused. Raises
    :class:`FusedStatsError` before anything is written."""
    from ..errors import FusedStatsError

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FusedStatsError(f"{option} {str(out)!r} is a file; the command writes a folder")
    if force or not out.is_dir():
        return out
    held = sorted(p.name for p in out.iterdir())
    if held:
        shown = ", ".join(repr(n) for n in held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise FusedStatsError(
            f"{option} {str(out)!r} holds {shown} already; pass --force to write into it "
            "(files of the same names are replaced) or choose an empty folder"
        )
    return out
