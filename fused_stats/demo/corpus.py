"""The demo's corpus: the Python standard library's own ``.py`` source, as bytes.

Role: real text that every Python install already has, so the demo needs no download. Tokens are
raw bytes (vocabulary 256), so no tokenizer is needed either.

* Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, excluding ``site-packages`` /
  ``dist-packages`` (installed third-party code, not the standard library) and ``__pycache__``,
  sorted by relative path.
* Split BY FILE: a file is held out when the first byte of SHA-1(relative path) is below
  ``256 * held_out`` (about 10 % by default). Hashing the path (instead of taking every k-th file
  of the sorted list) keeps a file on the same side whatever else is installed, and keeps the
  held-out set disjoint from training text by construction.
* Windows: each file is cut into non-overlapping windows of ``seq_len`` bytes (a short tail is
  dropped). A seeded permutation of all windows of a split gives the reading order; consuming it
  front to back means no window is ever seen twice (single pass, no epochs, as LLMs are
  pretrained), and every batch mixes windows of many files.
* Probe sets: ``probe_windows`` windows of each split are reserved once (a fixed seeded choice,
  the same for every model and seed) and left out of every training order. Every run is then
  probed on the same text, none of which any model was trained on, so the spread over seeds
  is that of the models, not of the probe text.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import FusedStatsError

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """Sorted ``(relative path, path)`` of the standard library's ``.py`` files."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FusedStatsError(f"standard-library folder {str(root)!r} not found")
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        out.append((rel.as_posix(), path))
    out.sort()
    if not out:
        raise FusedStatsError(f"no .py files under {str(root)!r}")
    return out


def is_held_out(rel: str, held_out: float) -> bool:
    return hashlib.sha1(rel.encode()).digest()[0] < 256 * held_out


@dataclass
class Split:
    """One side of the split: its files and all its ``seq_len``-byte windows."""

    name: str
    files: list[Path]
    windows: np.ndarray  # (W, 2) int64: file index, byte offset


class StdlibCorpus:
    """Byte windows of the standard library's source, split by file into train and held-out.

    Parameters
    ----------
    seq_len : int
        Window length in bytes (= tokens).
    held_out : float
        Approximate fraction of files held out.
    root : path, optional
        Folder to read instead of the standard library (tests).
    """

    PROBE_SEED = 20260101  # fixed: the probe sets do not depend on any run's seed

    def __init__(self, seq_len: int, held_out: float = 0.1, root=None, probe_windows: int = 0):
        if seq_len < 2:
            raise FusedStatsError(f"seq_len must be >= 2, got {seq_len}")
        if not 0 < held_out < 1:
            raise FusedStatsError(f"held_out must be in (0, 1), got {held_out}")
        self.seq_len = seq_len
        files = stdlib_files(root)
        sides: dict[str, list[Path]] = {"train": [], "test": []}
        for rel, path in files:
            sides["test" if is_held_out(rel, held_out) else "train"].append(path)
        self.splits = {}
        for name, paths in sides.items():
            rows = []
            for i, path in enumerate(paths):
                count = path.stat().st_size // seq_len
                if count:
                    rows.append(np.stack([np.full(count, i), np.arange(count) * seq_len], axis=1))
            windows = np.concatenate(rows) if rows else np.zeros((0, 2), dtype=np.int64)
            self.splits[name] = Split(name, paths, windows.astype(np.int64))
        self.reserved = {}
        for name, split in self.splits.items():
            if len(split.windows) <= probe_windows:
                raise FusedStatsError(
                    f"the {name} split has {len(split.windows)} windows of {seq_len} bytes; "
                    f"{probe_windows} probe windows and some training text are needed"
                )
            perm = np.random.default_rng(self.PROBE_SEED).permutation(len(split.windows))
            self.reserved[name] = np.sort(perm[:probe_windows])

    def describe(self) -> str:
        tr, te = self.splits["train"], self.splits["test"]
        return (
            f"{len(tr.files)} train files ({len(tr.windows) * self.seq_len / 1e6:.1f} MB in windows), "
            f"{len(te.files)} held-out files ({len(te.windows) * self.seq_len / 1e6:.1f} MB)"
        )

    def order(self, split: str, seed: int) -> np.ndarray:
        """A seeded permutation of the split's window indices except the probe set (the
        training reading order)."""
        rng = np.random.default_rng(seed)
        perm = rng.permutation(len(self.splits[split].windows))
        return perm[~np.isin(perm, self.reserved[split])]

    def probe_batches(self, split: str, batch_size: int, count: int):
        """``count`` batches of the reserved probe windows of ``split`` (the same for every run)."""
        ids = self.reserved[split]
        if batch_size * count > len(ids):
            raise FusedStatsError(
                f"{batch_size * count} probe windows asked for, {len(ids)} reserved in {split}"
            )
        return [self.read(split, ids[i * batch_size : (i + 1) * batch_size]) for i in range(count)]

    def read(self, split: str, window_ids: np.ndarray) -> torch.Tensor:
        """The windows as a (len(window_ids), seq_len) int64 tensor of byte values."""
        s = self.splits[split]
        out = np.empty((len(window_ids), self.seq_len), dtype=np.int64)
        by_file: dict[int, list[tuple[int, int]]] = {}
        for row, wid in enumerate(window_ids):
            f, off = s.windows[wid]
            by_file.setdefault(int(f), []).append((row, int(off)))
        for f, items in by_file.items():
            with open(s.files[f], "rb") as handle:
                for row, off in items:
                    handle.seek(off)
                    data = handle.read(self.seq_len)
                    if len(data) != self.seq_len:
                        raise FusedStatsError(f"{s.files[f]} changed while reading (window at byte {off})")
                    out[row] = np.frombuffer(data, dtype=np.uint8)
        return torch.from_numpy(out)

    def batches(self, split: str, seed: int, batch_size: int, count: int, start: int = 0):
        """``count`` batches of ``batch_size`` windows, from position ``start`` of the seeded
        order; yields (batch_size, seq_len) int64 tensors."""
        order = self.order(split, seed)
        need = start + batch_size * count
        if need > len(order):
            raise FusedStatsError(
                f"the {split} split has {len(order)} windows of {self.seq_len} bytes; {need} were asked for"
            )
        for i in range(count):
            lo = start + i * batch_size
            yield self.read(split, order[lo : lo + batch_size])
