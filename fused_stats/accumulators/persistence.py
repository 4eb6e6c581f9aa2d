"""State files: safetensors, versioned, checksummed, written atomically.

A file holds only tensors and string metadata (no pickle, so loading never runs code). The
metadata carries ``format``, ``version``, the constructor arguments (``config``), the counters
(``state``) and a SHA-256 over the tensors' bytes (in sorted name order) and every other metadata
entry (so an edit of, say, ``n`` in the header is caught too); loading recomputes it. Writes go
to a temporary file in the same folder, are fsync'ed, then renamed over the target (atomic on
POSIX). Every loaded tensor is copied into a fresh allocation (:func:`fresh_copy`).

What the tensors must look like is the accumulator's declaration
(:mod:`fused_stats.accumulators.base`): ``Accumulator.save``/``load`` call :func:`save_checked` and
:func:`read_checked` and check every tensor's shape and dtype against it, so a truncated or edited
file is reported as damaged instead of silently giving wrong statistics. :func:`peek_format`
tells which kind of state a file holds without checking or loading it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch

from ..errors import FusedStatsError


def tensors_checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None) -> str:
    """SHA-256 over the tensors (sorted by name) and the metadata entries other than ``sha256``."""
    digest = hashlib.sha256()
    if meta is not None:
        digest.update(json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode())
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


def fsync_dir(path) -> None:
    """Flush a folder's entries: a rename (or a new file) in it is durable only after that."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory handles: the rename is done either way
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path, text: str) -> Path:
    """:func:`write_atomic` of UTF-8 text (reports, markdown, summaries); returns the path."""
    path = Path(path)
    write_atomic(path, text.encode("utf-8"))
    return path


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
    fsync_dir(path.parent)


def save_checked(path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Write ``tensors`` (CPU, contiguous) with ``meta`` plus its SHA-256 as one safetensors file,
    atomically. ``meta`` must already hold ``format`` and ``version``."""
    from safetensors.torch import save

    meta = dict(meta)
    meta["sha256"] = tensors_checksum(tensors, meta)
    write_atomic(Path(path), save(tensors, metadata=meta))


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
            values = (
                {key: fresh_copy(handle.get_tensor(key)) for key in handle.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)
                if tensors
                else {}
            )
    except FusedStatsError:
        raise
    except Exception as exc:  # safetensors raises several types for damaged headers/data
        raise FusedStatsError(
            f"state file {str(path)!r} is damaged or not a safetensors file: {exc}"
        ) from exc
    return values, meta


def peek_format(path) -> str | None:
    """The ``format`` entry of a state file's metadata (None if it has none); nothing is checked."""
    return _open(path, tensors=False)[1].get("format")


def read_checked(path, format: str, version: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a state file, after format, version and checksum checks."""
    tensors, meta = _open(path)
    path = Path(path)
    if meta.get("format") != format:
        raise FusedStatsError(f"{str(path)!r} is not a {format} state (format={meta.get('format')!r})")
    if meta.get("version") != str(version):
        raise FusedStatsError(
            f"{str(path)!r} has state version {meta.get('version')!r}; this fused_stats reads "
            f"version {version}"
        )
    if tensors_checksum(tensors, meta) != meta.get("sha256"):
        raise FusedStatsError(f"state file {str(path)!r} failed its checksum (damaged or edited)")
    return tensors, meta
