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


def refuse_existing(paths, force: bool, what: str = "output") -> None:
    """Raise :class:`FusedStatsError` when any of ``paths`` exists and ``force`` is off."""
    from ..errors import FusedStatsError

    existing = [str(p) for p in paths if Path(p).exists()]
    if existing and not force:
        raise FusedStatsError(
            f"{what} {', '.join(repr(e) for e in existing)} already exists; pass --force to replace it"
        )
