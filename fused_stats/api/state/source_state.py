"""A feature source's own state in a probe checkpoint (:mod:`.checkpoint`).

Role: growth's ResNet tangent keeps, beside the accumulators, the BatchNorm statistics each
candidate's new block was calibrated with on its first batch; every later batch is measured with
them, so a resumed probe must get them back (it would otherwise calibrate again on its next
batch and measure another block). A feature source that has such state offers
``checkpoint_tensors()`` (flat tensors) and ``restore_checkpoint_tensors(flat, sampled)`` (checks,
then returns the commit). The tensors go into ``feature-source.safetensors`` (versioned,
checksummed), listed among the manifest's points as kind ``"feature_source"`` with its SHA-256: a
reader that does not know the kind refuses the checkpoint instead of resuming with other
statistics, and a snapshot without the entry reads as before.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ...accumulators.persistence import read_checked, save_checked
from ...errors import FusedStatsError

SOURCE_KIND, SOURCE_FILE = "feature_source", "feature-source.safetensors"
SOURCE_FORMAT, SOURCE_VERSION = "fused_stats.FeatureSourceState", 1


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def probe_source_state(probe) -> dict[str, torch.Tensor]:
    """The tensors of ``probe``'s feature source (``{}``: it keeps none)."""
    own = getattr(probe.cross, "checkpoint_tensors", None)
    return own() if callable(own) else {}


def write_source_file(folder: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write ``tensors`` into ``folder``; returns the manifest's points entry."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_checked(folder / SOURCE_FILE, tensors, {"format": SOURCE_FORMAT, "version": str(SOURCE_VERSION)})
    entry = {"kind": SOURCE_KIND, "stream": "-", "name": "-", "file": SOURCE_FILE}
    return {**entry, "sha256": _sha256(folder / SOURCE_FILE)}


def read_source_file(snap: Path, entry: dict, seen: bool) -> dict[str, torch.Tensor]:
    """The tensors of the manifest entry ``entry`` of snapshot ``snap``, all checked."""
    path = snap / entry["file"]
    if seen or entry["file"] != SOURCE_FILE or not path.is_file():
        raise FusedStatsError(f"checkpoint {str(snap)!r}: bad feature-source entry {entry!r}")
    if _sha256(path) != entry.get("sha256"):
        raise FusedStatsError(
            f"checkpoint {str(snap)!r}: {SOURCE_FILE!r} does not match the manifest's SHA-256 "
            "(damaged or replaced)"
        )
    return read_checked(path, SOURCE_FORMAT, SOURCE_VERSION)[0]


def source_commit(probe, accs: dict, source: dict):
    """Check a checkpoint's feature-source ``source`` against ``probe`` (``accs``: its
    accumulators); returns the commit (None: nothing to restore)."""
    restore = getattr(probe.cross, "restore_checkpoint_tensors", None)
    if callable(restore):
        # the points where the checkpoint holds tangent samples were measured with its state
        sampled = sorted({key[2] for key, acc in accs.items() if key[0] == "cross" and acc.n})
        return restore(dict(source), sampled)
    if source:
        raise FusedStatsError(
            "the checkpoint holds a feature source's state (growth's BatchNorm calibration), but "
            "this probe's cross= keeps none; build the probe as the checkpointed run was"
        )
    return None


def check_same_source(directories: list[Path], sources: list[dict]) -> dict:
    """The inputs of a merge must share one feature-source state (returned)."""
    first = sources[0]
    for directory, other in zip(directories[1:], sources[1:]):
        # e.g. ResNet blocks calibrated on each job's own first batch: their |C|² are of other blocks
        if set(other) != set(first) or any(not torch.equal(other[k], first[k]) for k in first):
            raise FusedStatsError(
                f"checkpoint {str(directory)!r} was measured with another feature-source state than "
                f"{str(directories[0])!r} (growth's BatchNorm calibration: each job calibrated on its "
                "own first batch); their statistics are of different blocks and do not merge"
            )
    return first
