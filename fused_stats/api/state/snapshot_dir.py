"""Snapshot folders of a probe checkpoint and the ``LATEST`` pointer to the newest complete one.

A checkpoint directory holds complete snapshots (``ckpt-00000003/``, each with its
``manifest.json``) and ``LATEST``, a file naming the newest; :mod:`.checkpoint` writes a snapshot
whole before it replaces ``LATEST``, so the pointer only ever names a complete folder. This module
finds that folder and hashes its files; what a snapshot holds is :mod:`.checkpoint`'s business.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ...errors import FusedStatsError

LATEST = "LATEST"
PREFIX = "ckpt-"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def latest_snapshot(directory) -> Path | None:
    """The newest complete snapshot folder of ``directory``, or None if there is none."""
    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not name.startswith(PREFIX) or "/" in name or name in (".", ".."):
        raise FusedStatsError(f"checkpoint pointer {str(pointer)!r} names {name!r}, not a snapshot")
    snap = directory / name
    if not (snap / "manifest.json").is_file():
        raise FusedStatsError(
            f"checkpoint {str(directory)!r}: LATEST names {name!r} but {str(snap)!r} has no "
            "manifest.json (the folder was removed or damaged)"
        )
    return snap


def has_checkpoint(directory) -> bool:
    return (Path(directory) / LATEST).is_file()
