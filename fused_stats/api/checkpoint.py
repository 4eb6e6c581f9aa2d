"""Probe checkpoints: save / load every accumulator of a probe, resumable runs, offline merge.

A probe keeps one :class:`~fused_stats.GradStats` per insertion point and stream (``probe.stats``
for the training stream, ``probe.test_stats`` for the held-out one). A checkpoint directory holds
complete *snapshots* and a pointer to the newest::

    directory/
        LATEST                  the name of the newest complete snapshot (replaced atomically)
        ckpt-00000003/
            manifest.json       format, version, step counts, streams, point names, dims, files
            train-0000.safetensors, test-0000.safetensors, ...   (GradStats.save format)

A snapshot is written into a temporary folder beside it, every file fsync'ed, the manifest last;
the folder is then renamed to its final name and only then is ``LATEST`` replaced (temp file +
``os.replace``). A process killed at any moment therefore leaves either the previous snapshot or
the new one as ``LATEST``, never a mix. Loading checks the manifest's format and version, every
file's SHA-256 and its ``n`` against the manifest, and reads everything before touching the probe,
so a damaged checkpoint raises :class:`FusedStatsError` and leaves the probe as it was.

:func:`run_with_checkpoints` drives ``probe.step`` over an iterable of batches, saving every ``every``
batches; called again on the same directory (after a crash), it restores the snapshot and skips the
batches that snapshot already holds. The skip assumes the iterable yields the same batches in the
same order on every run (a seeded loader), as any exact resume must.

:func:`merge_checkpoints` merges the snapshots of separate jobs (e.g. shards of a data set) point by
point; the merged statistics equal those of one run over all shards (DESIGN section 2, merging).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..accumulators import GradStats
from ..accumulators.persistence import write_atomic
from ..errors import FusedStatsError

FORMAT = "fused_stats.ProbeCheckpoint"
VERSION = 1
STREAMS = {"train": "stats", "test": "test_stats"}  # stream -> the probe's attribute
LATEST = "LATEST"
PREFIX = "ckpt-"


# ---------------------------------------------------------------------------- helpers
def probe_accumulators(probe) -> dict[tuple[str, str], GradStats]:
    """``{(stream, point): GradStats}`` of every stream a probe has (``stats``, ``test_stats``)."""
    out = {}
    for stream, attr in STREAMS.items():
        table = getattr(probe, attr, None)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise FusedStatsError(
                f"probe.{attr} must be a dict point -> GradStats, got {type(table).__name__}")
        for name, acc in table.items():
            if not isinstance(acc, GradStats):
                raise FusedStatsError(
                    f"probe.{attr}[{name!r}] is a {type(acc).__name__}, expected GradStats")
            out[(stream, name)] = acc
    return out


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    # the rename of a file is durable only once its directory entry is flushed
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
            "manifest.json (the folder was removed or damaged)")
    return snap


def has_checkpoint(directory) -> bool:
    return (Path(directory) / LATEST).is_file()


# ---------------------------------------------------------------------------- writing
def write_snapshot(directory, accs: dict[tuple[str, str], GradStats], consumed: dict | None = None,
                   extra: dict | None = None) -> Path:
    """Write ``accs`` as a new snapshot of ``directory`` and point ``LATEST`` at it (module doc)."""
    from .. import __version__

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    latest_snapshot(directory)  # a damaged pointer is reported, not silently replaced
    # past every snapshot folder, also one renamed into place by a writer killed before it could
    # update LATEST (that folder is complete but was never published; it is removed below)
    serials = [int(e.name[len(PREFIX):]) for e in directory.iterdir()
               if e.is_dir() and e.name.startswith(PREFIX) and e.name[len(PREFIX):].isdigit()]
    serial = max(serials, default=0) + 1
    final = directory / f"{PREFIX}{serial:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}.", dir=directory))
    try:
        points = []
        counters: dict[str, int] = {}
        for (stream, name) in sorted(accs):
            acc = accs[(stream, name)]
            index = counters.get(stream, 0)
            counters[stream] = index + 1
            filename = f"{stream}-{index:04d}.safetensors"
            acc.save(tmp / filename)
            points.append({
                "stream": stream, "name": name, "file": filename, "dim": acc.dim, "n": acc.n,
                "mode": acc.mode, "second_moment": acc.second_moment,
                "sha256": _file_sha256(tmp / filename),
            })
        manifest = {
            "format": FORMAT, "version": VERSION, "fused_stats_version": __version__,
            "serial": serial,
            "consumed": dict(consumed or {}),
            "streams": sorted({stream for stream, _ in accs}),
            "point_names": sorted({name for _, name in accs}),
            "points": points,
        }
        if extra:
            manifest.update(extra)
        write_atomic(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(directory / LATEST, final.name.encode())
    _fsync_dir(directory)
    # older snapshots and temp folders left by killed writers are no longer needed
    for entry in directory.iterdir():
        if entry.name != final.name and entry.is_dir() and (
                entry.name.startswith(PREFIX) or entry.name.startswith(".tmp-" + PREFIX)):
            shutil.rmtree(entry, ignore_errors=True)
    return final


# plain per-probe bookkeeping (dicts of ints keyed by stream or point) saved with the states
PROBE_COUNTERS = ("steps", "skipped_steps", "dims", "feature_dims")


def _probe_counters(probe) -> dict:
    out = {}
    for attr in PROBE_COUNTERS:
        value = getattr(probe, attr, None)
        if isinstance(value, dict) and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                for k, v in value.items()):
            out[attr] = dict(value)
    return out


def save_probe_state(probe, directory, consumed: dict | None = None) -> Path:
    """Checkpoint every accumulator of ``probe`` into ``directory``; returns the snapshot folder.

    ``consumed``: batches already fed per stream (``{"train": k, "test": j}``), used by
    :func:`run_with_checkpoints` to resume; stored in the manifest with the probe's step counters.
    """
    accs = probe_accumulators(probe)
    counters = _probe_counters(probe)
    points = list(getattr(probe, "points", None) or [])
    return write_snapshot(directory, accs, consumed=consumed,
                          extra={"probe": counters, "probe_points": points})


# ---------------------------------------------------------------------------- reading
def read_manifest(snapshot: Path) -> dict:
    path = Path(snapshot) / "manifest.json"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FusedStatsError(f"checkpoint manifest {str(path)!r} is unreadable: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FusedStatsError(
            f"{str(path)!r} is not a {FORMAT} manifest "
            f"(format={manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if manifest.get("version") != VERSION:
        raise FusedStatsError(
            f"{str(path)!r} has checkpoint version {manifest.get('version')!r}; this fused_stats "
            f"reads version {VERSION}")
    if not isinstance(manifest.get("points"), list):
        raise FusedStatsError(f"{str(path)!r} lists no points")
    return manifest


def read_snapshot(directory, device=None, backend: str = "auto"):
    """``(manifest, {(stream, point): GradStats})`` of the newest snapshot; everything is checked.

    ``device``: where the states go (default CPU), or a callable ``(stream, point) -> device``.
    """
    snap = latest_snapshot(directory)
    if snap is None:
        raise FusedStatsError(f"no checkpoint in {str(directory)!r} (no {LATEST} file)")
    manifest = read_manifest(snap)
    accs = {}
    for entry in manifest["points"]:
        try:
            stream, name, filename = entry["stream"], entry["name"], entry["file"]
        except (KeyError, TypeError) as exc:
            raise FusedStatsError(f"checkpoint {str(snap)!r}: bad point entry {entry!r}") from exc
        path = snap / filename
        if Path(filename).name != filename or not path.is_file():
            raise FusedStatsError(f"checkpoint {str(snap)!r}: point {name!r} ({stream}) file "
                                  f"{filename!r} is missing")
        if _file_sha256(path) != entry.get("sha256"):
            raise FusedStatsError(
                f"checkpoint {str(snap)!r}: {filename!r} (point {name!r}, {stream}) does not match "
                "the manifest's SHA-256 (damaged or replaced)")
        where = device(stream, name) if callable(device) else device
        acc = GradStats.load(path, device=where, backend=backend)
        if acc.dim != entry.get("dim") or acc.n != entry.get("n"):
            raise FusedStatsError(
                f"checkpoint {str(snap)!r}: {filename!r} holds dim={acc.dim}, n={acc.n}; the "
                f"manifest says dim={entry.get('dim')}, n={entry.get('n')}")
        accs[(stream, name)] = acc
    return manifest, accs


def _install(probe, accs: dict[tuple[str, str], GradStats], manifest: dict) -> None:
    """Put loaded accumulators into the probe, after checking all of them (all or nothing)."""
    current = probe_accumulators(probe)
    points = getattr(probe, "points", None)
    for key, loaded in accs.items():
        stream, name = key
        if points is not None and name not in points:
            raise FusedStatsError(
                f"checkpoint point {name!r} ({stream}) is not a point of this probe; its points: "
                f"{list(points)}")
        if stream not in STREAMS:
            raise FusedStatsError(f"checkpoint stream {stream!r} is not one of {tuple(STREAMS)}")
        if getattr(probe, STREAMS[stream], None) is None:
            raise FusedStatsError(f"the probe has no {STREAMS[stream]!r} for stream {stream!r}")
        mine = current.get(key)
        if mine is not None and (mine.dim, mine.second_moment, mine.pool_capacity) != (
                loaded.dim, loaded.second_moment, loaded.pool_capacity):
            raise FusedStatsError(
                f"checkpoint point {name!r} ({stream}) has dim={loaded.dim}, "
                f"second_moment={loaded.second_moment!r}, pool_capacity={loaded.pool_capacity}; the "
                f"probe's has dim={mine.dim}, second_moment={mine.second_moment!r}, "
                f"pool_capacity={mine.pool_capacity}")
    extra = sorted(set(current) - set(accs))
    if any(current[key].n for key in extra):
        raise FusedStatsError(
            f"the probe holds data at {[f'{s}:{n}' for s, n in extra if current[(s, n)].n]}, which "
            "the checkpoint does not have (was it written by a probe with other points?)")
    counters = {}
    raw = manifest.get("probe") or {}
    try:
        for attr in PROBE_COUNTERS:
            if attr in raw:
                counters[attr] = {str(k): int(v) for k, v in dict(raw[attr]).items()}
    except (TypeError, ValueError) as exc:
        raise FusedStatsError(f"checkpoint manifest has a malformed 'probe' entry {raw!r}: {exc}") from exc
    # ---- commit: nothing below rejects the checkpoint
    backend = getattr(probe, "backend", None)
    for key, loaded in accs.items():
        stream, name = key
        mine = current.get(key)
        if mine is None:
            if backend is not None:
                loaded.backend = backend
            getattr(probe, STREAMS[stream])[name] = loaded
        else:
            # in place, so references the probe keeps to its accumulators stay valid
            mine._adopt(loaded)
    for key in extra:  # empty accumulators the checkpoint does not know
        getattr(probe, STREAMS[key[0]]).pop(key[1])
    for attr, value in counters.items():
        mine = getattr(probe, attr, None)
        if isinstance(mine, dict):
            mine.clear()
            mine.update(value)


def _probe_device(probe):
    """Where a probe's new accumulators would live: ``probe.device`` or its model's parameters."""
    device = getattr(probe, "device", None)
    if device is not None:
        return device
    model = getattr(probe, "model", None)
    if model is not None and hasattr(model, "parameters"):
        for param in model.parameters():
            return param.device
    return None


def load_probe_state(probe, directory, device=None) -> dict:
    """Restore every accumulator of ``probe`` from the newest snapshot in ``directory``.

    Each state goes to the device of the probe's accumulator it replaces (else ``device``, else
    the probe's model's device, else CPU). Returns the manifest (``consumed``, the probe's
    counters under ``probe``, point names, ...). The probe is changed only if the whole snapshot
    reads and checks correctly.
    """
    current = probe_accumulators(probe)
    fallback = device if device is not None else _probe_device(probe)

    def where(stream, name):
        mine = current.get((stream, name))
        return mine.device if mine is not None and mine.device is not None else fallback

    manifest, accs = read_snapshot(directory, device=where)
    _install(probe, accs, manifest)
    return manifest


# ---------------------------------------------------------------------------- driver
def run_with_checkpoints(probe, batches, loss_fn, directory, every: int = 100,
                         stream: str = "train", **step_kwargs) -> int:
    """Feed ``batches`` to ``probe.step`` with a checkpoint every ``every`` batches; resumable.

    If ``directory`` already holds a checkpoint, the probe is restored from it and the number of
    ``stream`` batches it holds is skipped from the start of ``batches`` (which must therefore
    yield the same batches in the same order as in the interrupted run). A final checkpoint is
    written at the end. ``step_kwargs`` (e.g. ``mask=``) go to ``probe.step``. Calling it once per stream on the same directory (``"train"`` then
    ``"test"``) keeps both streams' progress. Returns the number of ``stream`` batches consumed.
    """
    if stream not in STREAMS:
        raise FusedStatsError(f"stream must be one of {tuple(STREAMS)}, got {stream!r}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise FusedStatsError(f"every must be a positive int (batches between checkpoints), got {every!r}")
    consumed: dict[str, int] = {}
    if has_checkpoint(directory):
        manifest = load_probe_state(probe, directory)
        consumed = {str(k): int(v) for k, v in (manifest.get("consumed") or {}).items()}
    done = consumed.get(stream, 0)
    iterator = iter(batches)
    for skipped in range(done):
        try:
            next(iterator)
        except StopIteration:
            raise FusedStatsError(
                f"the checkpoint in {str(directory)!r} holds {done} {stream} batches but the batch "
                f"iterable ended after {skipped}: not the same data as the checkpointed run") from None
    since_save = 0
    for batch in iterator:
        probe.step(batch, loss_fn, stream=stream, **step_kwargs)
        done += 1
        since_save += 1
        if since_save == every:
            consumed[stream] = done
            save_probe_state(probe, directory, consumed)
            since_save = 0
    if since_save or not has_checkpoint(directory):
        consumed[stream] = done
        save_probe_state(probe, directory, consumed)
    return done


# ---------------------------------------------------------------------------- offline merge
def merge_checkpoints(out_directory, directories) -> Path:
    """Merge the newest snapshots of several probe checkpoints (separate jobs) into a new one.

    Every input must hold the same (stream, point) pairs; the accumulators of each pair are merged
    exactly (:meth:`GradStats.merge`) and the result is written as a snapshot of ``out_directory``
    whose manifest sums the inputs' ``consumed`` counts and lists them under ``merged_from``.
    All inputs are read and checked before anything is written.
    """
    directories = [Path(d) for d in directories]
    if not directories:
        raise FusedStatsError("merge needs at least one input checkpoint")
    loaded = [read_snapshot(d) for d in directories]
    keys = set(loaded[0][1])
    for directory, (_, accs) in zip(directories[1:], loaded[1:]):
        if set(accs) != keys:
            missing = sorted(keys - set(accs))
            extra = sorted(set(accs) - keys)
            raise FusedStatsError(
                f"checkpoint {str(directory)!r} does not hold the same points as "
                f"{str(directories[0])!r}: missing {missing}, extra {extra}")
    merged = {}
    for key in sorted(keys):
        acc = loaded[0][1][key].copy()
        for _, accs in loaded[1:]:
            acc.merge(accs[key])
        merged[key] = acc
    consumed: dict[str, int] = {}
    counters = dict(loaded[0][0].get("probe") or {})
    for key in ("steps", "skipped_steps"):
        counters.pop(key, None)
    for manifest, _ in loaded:
        for stream, count in (manifest.get("consumed") or {}).items():
            consumed[stream] = consumed.get(stream, 0) + int(count)
        for key in ("steps", "skipped_steps"):  # step counts add up like the samples do
            for stream, count in ((manifest.get("probe") or {}).get(key) or {}).items():
                table = counters.setdefault(key, {})
                table[stream] = table.get(stream, 0) + int(count)
    return write_snapshot(out_directory, merged, consumed=consumed, extra={
        "probe": counters, "probe_points": loaded[0][0].get("probe_points", []),
        "merged_from": [str(d.resolve()) for d in directories]})
