"""What a run file was computed from: the key that decides whether a finished run still holds.

A run's key is the suite file's SHA-256, the SHA-256 of the train and test windows it saw, the
checkpoint's identity, the package version and the SHA-256 of the checked ``[growth]`` section
(canonical JSON; None without one); a run file whose key differs from the plan's is stale and the
run is probed again.

The checkpoint identity is a SHA-256 over ``config.json``'s bytes and, for every weight file of
the folder (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt`` and their
``*.index.json``), its name, size and modification time in nanoseconds. Weights are identified
by metadata, not content: hashing a 7B checkpoint reads ~14 GB, which every resume of every shard
would pay again, while a rewrite of a weight file (a new save, a copy, a download) changes its
mtime. A copy that keeps mtimes (``cp -p``, ``rsync -t``) of *different* weights of the same size
at the same path is the one change this misses.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..._version import __version__
from ...errors import FusedStatsError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
KEY_FIELDS = ("suite_sha256", "data", "checkpoint", "fused_stats", "growth")


def _weight_file(path: Path) -> bool:
    name = path.name
    if name.endswith(".index.json"):
        name = name[: -len(".index.json")]
    return any(name.endswith(suffix) for suffix in WEIGHT_SUFFIXES)


def checkpoint_identity(folder: Path) -> str:
    """SHA-256 of ``config.json``'s bytes and each weight file's (name, size, mtime_ns)."""
    folder = Path(folder)
    digest = hashlib.sha256()
    try:
        digest.update(b"config.json\0" + (folder / "config.json").read_bytes() + b"\0")
        files = sorted(p for p in folder.iterdir() if p.is_file() and _weight_file(p))
        for file in files:
            stat = file.stat()
            digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    except OSError as exc:
        raise FusedStatsError(f"checkpoint {str(folder)!r}: cannot read its files ({exc})") from None
    return digest.hexdigest()


def growth_identity(growth: dict | None) -> str | None:
    """SHA-256 of the checked [growth] section's canonical JSON (None without one)."""
    if growth is None:
        return None
    text = json.dumps(growth, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def run_key(suite_sha256: str, windows_sha256: dict, folder: Path, growth: dict | None = None) -> dict:
    """The key a run file must carry to count as finished (module docstring)."""
    return {
        "suite_sha256": suite_sha256,
        "data": dict(windows_sha256),
        "checkpoint": checkpoint_identity(folder),
        "fused_stats": __version__,
        "growth": growth_identity(growth),
    }


def stale_because(old: dict | None, key: dict) -> str | None:
    """Why a run file's key ``old`` does not match ``key`` (None when it matches)."""
    if not isinstance(old, dict):
        return "its run file has no key"
    why = {
        "suite_sha256": "the suite file changed",
        "data": "the data windows changed",
        "checkpoint": "the checkpoint's files changed",
        "fused_stats": f"it ran under fused_stats {old.get('fused_stats')}, this is {key['fused_stats']}",
        "growth": "the [growth] section changed",
    }
    changed = [why[field] for field in KEY_FIELDS if old.get(field) != key.get(field)]
    return "; ".join(changed) or None
