"""Reading the TOML files the project takes (suite files, growth protocol files).

:func:`read_toml` returns the file's bytes (callers hash them) and its parsed table; a file that
cannot be read or parsed is a :class:`FusedStatsError` naming the file and its kind.
"""

from __future__ import annotations

from pathlib import Path

from .errors import FusedStatsError


def read_toml(path, kind: str) -> tuple[bytes, dict]:
    """``(bytes, table)`` of the TOML file ``path``; ``kind`` names it in errors (``"suite file"``)."""
    path = Path(path)
    try:
        payload = path.read_bytes()
    except OSError as exc:
        raise FusedStatsError(f"cannot read {kind} {str(path)!r}: {exc}") from None
    try:
        import tomllib
    except ImportError:  # Python 3.10: the same parser as a package
        try:
            import tomli as tomllib
        except ImportError:
            raise FusedStatsError(f"{kind}s need Python >= 3.11 (tomllib) or: pip install tomli") from None
    try:
        table = tomllib.loads(payload.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise FusedStatsError(f"{kind} {str(path)!r} is not valid TOML: {exc}") from None
    return payload, table


__all__ = ["read_toml"]
