"""Saving and loading accumulator state: safetensors, versioned, checksummed, written atomically.

A file holds only tensors and string metadata (no pickle, so loading never runs code). The
metadata carries ``format``, ``version``, the constructor arguments, ``n`` and a SHA-256 over the
tensors' bytes (in sorted name order) and every other metadata entry (so an edit of, say, ``n`` in
the header is caught too); loading recomputes it, and checks every tensor's shape against ``dim``,
``n`` and the mode, so a truncated or edited file is reported as damaged instead of silently giving
wrong statistics. Writes go to a temporary file in
the same folder, are fsync'ed, then renamed over the target (atomic on POSIX).

The helpers :func:`tensors_checksum`, :func:`write_atomic`, :func:`save_checked` and
:func:`read_checked` (the latter two parameterised by ``format``/``version``) are shared with the
other accumulators' files (:class:`~fused_stats.accumulators.cross_stats.CrossStats`);
:func:`peek_format` tells which kind of state a file holds without checking or loading it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from ..errors import FusedStatsError

FORMAT = "fused_stats.GradStats"
VERSION = 1
TENSOR_KEYS = ("centre", "s", "t", "a1", "a2", "norm_max", "norm_sum", "S", "pool", "gram")


def tensors_checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> str:
    """SHA-256 over the tensors (sorted by name) and the metadata entries other than ``sha256``."""
    digest = hashlib.sha256()
    if meta is not None:
        digest.update(json.dumps({k: v for k, v in meta.items() if k != "sha256"},
                                 sort_keys=True).encode())
    for key in sorted(tensors):
        value = tensors[key].detach().to("cpu").contiguous().reshape(-1)
        digest.update(key.encode())
        digest.update(str(value.dtype).encode())
        digest.update(str(tuple(value.shape)).encode())
        digest.update(value.view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    return digest.hexdigest()


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def write_atomic(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` so that a reader sees the old file or the whole new one: a
    temporary file in the same folder, fsync'ed, given the permissions an ordinary new file would
    get (mkstemp makes it owner-only), renamed over ``path``, then the folder fsync'ed so the
    rename itself survives a crash."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        folder = os.open(path.parent, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory handles: the rename is done either way
        return
    try:
        os.fsync(folder)
    except OSError:
        pass
    finally:
        os.close(folder)


def state_to_tensors(acc) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state as CPU tensors plus string metadata (no checksum yet)."""
    tensors = {}
    if acc.n:
        for key in TENSOR_KEYS:
            value = getattr(acc, key)
            if value is not None:
                tensors[key] = value.detach().to("cpu").contiguous()
    meta = {
        "format": FORMAT,
        "version": str(VERSION),
        "config": json.dumps({
            "dim": acc.dim, "second_moment": acc.second_moment,
            "pool_capacity": acc.pool_capacity, "nonfinite": acc.nonfinite, "name": acc.name,
        }),
        "state": json.dumps({"n": acc.n, "mode": acc.mode, "unit": acc.unit,
                             "skipped_batches": acc.skipped_batches}),
    }
    return tensors, meta


def save_checked(path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Write ``tensors`` (CPU, contiguous) with ``meta`` plus its SHA-256 as one safetensors file,
    atomically. ``meta`` must already hold ``format`` and ``version``."""
    from safetensors.torch import save

    meta = dict(meta)
    meta["sha256"] = tensors_checksum(tensors, meta)
    write_atomic(Path(path), save(tensors, metadata=meta))


def save_grad_stats(acc, path) -> None:
    tensors, meta = state_to_tensors(acc)
    save_checked(path, tensors, meta)


def fresh_copy(value: torch.Tensor) -> torch.Tensor:
    """``value`` copied into a new, allocator-aligned, contiguous tensor.

    safetensors hands out views into its file buffer at whatever byte offset the header left, and
    BLAS kernels (MKL's dgemm on AMD EPYC, for one) round differently on differently aligned
    operands: state that kept living in such a view would continue a run in other last bits than
    the live accumulator it was saved from. Every loaded tensor therefore gets its own allocation.
    """
    fresh = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    fresh.copy_(value)
    return fresh


def _open(path, tensors: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FusedStatsError(f"no state file at {str(path)!r}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            meta = handle.metadata() or {}
            values = ({key: fresh_copy(handle.get_tensor(key)) for key in handle.keys()}
                      if tensors else {})
    except FusedStatsError:
        raise
    except Exception as exc:  # safetensors raises several types for damaged headers/data
        raise FusedStatsError(f"state file {str(path)!r} is damaged or not a safetensors file: {exc}") from exc
    return values, meta


def peek_format(path) -> str | None:
    """The ``format`` entry of a state file's metadata (None if it has none); nothing is checked."""
    return _open(path, tensors=False)[1].get("format")


def read_checked(path, format: str = FORMAT, version: int = VERSION
                 ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a state file, after format, version and checksum checks."""
    tensors, meta = _open(path)
    path = Path(path)
    if meta.get("format") != format:
        raise FusedStatsError(f"{str(path)!r} is not a {format} state (format={meta.get('format')!r})")
    if meta.get("version") != str(version):
        raise FusedStatsError(
            f"{str(path)!r} has state version {meta.get('version')!r}; this fused_stats reads "
            f"version {version}")
    if tensors_checksum(tensors, meta) != meta.get("sha256"):
        raise FusedStatsError(f"state file {str(path)!r} failed its checksum (damaged or edited)")
    return tensors, meta


def load_grad_stats(path, device=None, backend="auto"):
    from .grad_stats import GradStats

    tensors, meta = read_checked(path)
    where = f"state file {str(path)!r}"
    try:
        config = json.loads(meta["config"])
        state = json.loads(meta["state"])
        acc = GradStats(config["dim"], config["second_moment"], config["pool_capacity"], device,
                        backend, config["nonfinite"], config["name"])
        skipped, unit, n, mode = (int(state["skipped_batches"]), state["unit"], int(state["n"]),
                                  state["mode"])
    except (KeyError, ValueError, TypeError) as exc:  # FusedStatsError is a ValueError too
        raise FusedStatsError(f"{where} has unreadable or invalid metadata: {exc}") from exc
    unknown = sorted(set(tensors) - set(TENSOR_KEYS))
    if unknown:
        raise FusedStatsError(f"{where} holds unexpected tensors {unknown}")
    allowed_modes = {"dense": ("dense",), "pool": ("pool",), "auto": ("pool", "dense")}
    if n < 0 or mode not in allowed_modes[acc.second_moment] or unit not in (None, "sample", "position", "flat"):
        raise FusedStatsError(
            f"{where} is inconsistent: n={n}, mode={mode!r}, unit={unit!r} for "
            f"second_moment={acc.second_moment!r}")
    acc.skipped_batches = skipped
    acc.unit = unit
    if n:
        target = torch.device(device) if device is not None else torch.device("cpu")
        needed = ("centre", "s", "t", "a1", "a2", "norm_max", "norm_sum") + (
            ("S",) if mode == "dense" else ("pool", "gram"))
        missing = [key for key in needed if key not in tensors]
        if missing:
            raise FusedStatsError(f"{where} lacks tensors {missing}")
        d = acc.dim
        shapes = {"centre": (d,), "s": (d,), "t": (d,), "a1": (), "a2": (), "norm_max": (),
                  "norm_sum": (), "S": (d, d), "pool": (n, d), "gram": (n, n)}
        for key in needed:
            value = tensors[key]
            if tuple(value.shape) != shapes[key] or value.dtype != torch.float64:
                raise FusedStatsError(
                    f"{where} is inconsistent: {key} has shape {tuple(value.shape)} and dtype "
                    f"{value.dtype}, expected {shapes[key]} float64 for dim={d}, n={n}, mode={mode!r}")
        acc.mode, acc.n, acc.device = mode, n, target
        for key in needed:
            setattr(acc, key, tensors[key].to(target))
    return acc
