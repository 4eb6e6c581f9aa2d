"""Probe checkpoints: save / load every accumulator of a probe, resumable runs, offline merge
(the snapshot folders and their LATEST pointer: :mod:`.snapshot_dir`).

A probe keeps one table of accumulators keyed by ``(kind, stream, point)`` (``probe.table``:
GradStats of kind ``"grad"``, and, as configured, CrossStats of kind ``"cross"``, norm
histograms of kind ``"norm_hist"``); a checkpoint holds every entry of it. A checkpoint
directory holds complete *snapshots* and a pointer to the newest::

    directory/
        LATEST                  the name of the newest complete snapshot (replaced atomically)
        ckpt-00000003/
            manifest.json       format, version, step counts, streams, point names, dims, files
            train-0000.safetensors, test-0000.safetensors, ...   (GradStats.save format)
            cross-train-0000.safetensors, ...                    (CrossStats.save format)

Every manifest entry names its ``kind`` (an entry without one is ``"grad"``), so the format stays
version 1: a reader that does not know a kind meets its file as a state of the wrong format and
refuses it. A kind added with ``register_kind`` whose accumulator is an existing class (a second,
dense GradStats) also names that class's kind (``"class"``), by which its file is read.

A feature source's own state (growth's ResNet tangent: the BatchNorm statistics its blocks were
calibrated with) is saved and restored with the accumulators, all or nothing (:mod:`.source_state`).

A snapshot is written into a temporary folder beside it, every file fsync'ed, the manifest last;
the folder is then renamed to its final name and only then is ``LATEST`` replaced (temp file +
``os.replace``). A process killed at any moment therefore leaves either the previous snapshot or
the new one as ``LATEST``, never a mix. Loading checks the manifest's format and version, every
file's SHA-256 and its ``n`` against the manifest, and reads everything before touching the probe,
so a damaged checkpoint raises :class:`FusedStatsError` and leaves the probe as it was. A
checkpoint's cross statistics must be those of the probe's own block (``CrossSpec``: dim, rank,
activation, ``w_in``), and a probe with ``cross=`` refuses a checkpoint that holds samples at a point
but no cross statistics there (the resumed ``|C|_F²`` would silently miss those batches).

:func:`run_with_checkpoints` drives ``probe.step`` over an iterable of batches, saving every ``every``
batches; called again on the same directory (after a crash), it restores the snapshot and skips the
batches that snapshot already holds. The skip assumes the iterable yields the same batches in the
same order on every run (a seeded loader), as any exact resume must.

:func:`merge_checkpoints` merges the snapshots of separate jobs (e.g. shards of a data set) point by
point; the merged statistics equal those of one run over all shards (docs/design.md, section 2,
merging; cross statistics are plain sums, so their merge is an addition).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ...accumulators.base import REGISTRY as ACCUMULATOR_CLASSES
from ...accumulators.base import IncompatibleStates, accumulator_class
from ...accumulators.cross_stats import CrossStats
from ...accumulators.persistence import fsync_dir, write_atomic
from ...errors import FusedStatsError
from ..probe.spec import cross_w_in
from ..probe.table import probe_device
from .snapshot_dir import LATEST, PREFIX, file_sha256, has_checkpoint, latest_snapshot
from .source_state import (
    SOURCE_KIND,
    check_same_source,
    probe_source_state,
    read_source_file,
    source_commit,
    write_source_file,
)

FORMAT = "fused_stats.ProbeCheckpoint"
VERSION = 1
STREAMS = ("train", "test")


# ---------------------------------------------------------------------------- helpers
def probe_state(probe) -> dict:
    """``{(kind, stream, point): accumulator}`` of everything a checkpoint holds (a copy of the
    table's mapping; the accumulators are the probe's own)."""
    out = {}
    for key, acc in probe.table.items():
        # a kind added with register_kind may reuse an accumulator class (saved as "class")
        cls = accumulator_class(key[0] if key[0] in ACCUMULATOR_CLASSES else getattr(acc, "KIND", key[0]))
        if not isinstance(acc, cls):
            raise FusedStatsError(
                f"the probe's {key[0]} accumulator at {key[2]!r} ({key[1]}) is a "
                f"{type(acc).__name__}, expected {cls.__name__}"
            )
        out[key] = acc
    return out


def _keyed(accs: dict) -> dict:
    # (stream, point) keys, as GradStats-only callers give them, are "grad" entries
    return {(key if len(key) == 3 else ("grad", *key)): acc for key, acc in accs.items()}


def _label(key) -> str:
    kind, stream, name = key
    return f"{name!r} ({stream}{'' if kind == 'grad' else ', ' + kind})"


# ---------------------------------------------------------------------------- writing
def write_snapshot(
    directory,
    accs: dict,
    consumed: dict | None = None,
    extra: dict | None = None,
    source_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``accs`` as a new snapshot of ``directory`` and point ``LATEST`` at it (module doc).

    ``accs``: ``{(kind, stream, point): accumulator}`` (or ``{(stream, point): GradStats}``);
    ``source_state``: the feature source's own tensors (none: no such file)."""
    from ..._version import __version__

    accs = _keyed(accs)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    latest_snapshot(directory)  # a damaged pointer is reported, not silently replaced
    # past every snapshot folder, also one renamed into place by a writer killed before it could
    # update LATEST (that folder is complete but was never published; it is removed below)
    serials = [
        int(e.name[len(PREFIX) :])
        for e in directory.iterdir()
        if e.is_dir() and e.name.startswith(PREFIX) and e.name[len(PREFIX) :].isdigit()
    ]
    serial = max(serials, default=0) + 1
    final = directory / f"{PREFIX}{serial:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}.", dir=directory))
    try:
        points = []
        counters: dict[str, int] = {}
        # GradStats first (the order and file names of a checkpoint without cross statistics)
        for key in sorted(accs, key=lambda k: (k[0] != "grad", k)):
            kind, stream, name = key
            acc = accs[key]
            prefix = stream if kind == "grad" else f"{kind}-{stream}"
            index = counters.get(prefix, 0)
            counters[prefix] = index + 1
            filename = f"{prefix}-{index:04d}.safetensors"
            acc.save(tmp / filename)
            entry = {
                "kind": kind,
                # the accumulator class, where a kind added with register_kind reuses one
                **({} if kind == acc.KIND else {"class": acc.KIND}),
                "stream": stream,
                "name": name,
                "file": filename,
                "dim": acc.dim,
                "n": acc.n,
                **acc.describe(),
            }
            entry["sha256"] = file_sha256(tmp / filename)
            points.append(entry)
        if source_state:
            points.append(write_source_file(tmp, source_state))
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "fused_stats_version": __version__,
            "serial": serial,
            "consumed": dict(consumed or {}),
            "streams": sorted({stream for _, stream, _ in accs}),
            "point_names": sorted({name for _, _, name in accs}),
            "points": points,
        }
        if extra:
            manifest.update(extra)
        write_atomic(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        fsync_dir(tmp)
        os.replace(tmp, final)
        fsync_dir(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomic(directory / LATEST, final.name.encode())
    fsync_dir(directory)
    # older snapshots and temp folders left by killed writers are no longer needed
    for entry in directory.iterdir():
        if (
            entry.name != final.name
            and entry.is_dir()
            and (entry.name.startswith(PREFIX) or entry.name.startswith(".tmp-" + PREFIX))
        ):
            shutil.rmtree(entry, ignore_errors=True)
    return final


# plain per-probe bookkeeping (dicts of ints keyed by stream or point) saved with the states
PROBE_COUNTERS = ("steps", "skipped_steps", "dims", "feature_dims")


def _probe_counters(probe) -> dict:
    out = {}
    for attr in PROBE_COUNTERS:
        value = getattr(probe, attr)
        if all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in value.items()
        ):
            out[attr] = dict(value)
    return out


def save_probe_state(probe, directory, consumed: dict | None = None) -> Path:
    """Checkpoint every accumulator of ``probe`` into ``directory``; returns the snapshot folder.

    ``consumed``: batches already fed per stream (``{"train": k, "test": j}``), used by
    :func:`run_with_checkpoints` to resume; stored in the manifest with the probe's step counters.
    """
    accs = probe_state(probe)
    counters = _probe_counters(probe)
    points = list(probe.points)
    return write_snapshot(
        directory,
        accs,
        consumed=consumed,
        extra={"probe": counters, "probe_points": points},
        source_state=probe_source_state(probe),
    )


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
            f"(format={manifest.get('format') if isinstance(manifest, dict) else None!r})"
        )
    if manifest.get("version") != VERSION:
        raise FusedStatsError(
            f"{str(path)!r} has checkpoint version {manifest.get('version')!r}; this fused_stats "
            f"reads version {VERSION}"
        )
    if not isinstance(manifest.get("points"), list):
        raise FusedStatsError(f"{str(path)!r} lists no points")
    return manifest


def read_snapshot(directory, device=None, backend: str = "auto"):
    """``(manifest, {(kind, stream, point): accumulator})`` of the newest snapshot; everything is
    checked.

    ``device``: where the states go (default CPU), or a callable ``(kind, stream, point) -> device``.
    """
    manifest, accs, _ = read_snapshot_with_source(directory, device, backend)
    return manifest, accs


def read_snapshot_with_source(directory, device=None, backend: str = "auto"):
    """:func:`read_snapshot` and the feature source's tensors (``{}`` where the snapshot has none)."""
    snap = latest_snapshot(directory)
    if snap is None:
        raise FusedStatsError(f"no checkpoint in {str(directory)!r} (no {LATEST} file)")
    manifest = read_manifest(snap)
    accs, source = {}, None
    for entry in manifest["points"]:
        try:
            stream, name, filename = entry["stream"], entry["name"], entry["file"]
            kind = entry.get("kind", "grad")
        except (KeyError, TypeError, AttributeError) as exc:
            raise FusedStatsError(f"checkpoint {str(snap)!r}: bad point entry {entry!r}") from exc
        if kind == SOURCE_KIND:
            source = read_source_file(snap, entry, seen=source is not None)
            continue
        try:
            cls = accumulator_class(entry.get("class", kind))
        except FusedStatsError as exc:
            raise FusedStatsError(
                f"checkpoint {str(snap)!r}: point {name!r} ({stream}) has kind {kind!r}: {exc}"
            ) from None
        key = (kind, stream, name)
        if key in accs:
            raise FusedStatsError(f"checkpoint {str(snap)!r} lists point {_label(key)} twice")
        path = snap / filename
        if Path(filename).name != filename or not path.is_file():
            raise FusedStatsError(
                f"checkpoint {str(snap)!r}: point {name!r} ({stream}) file {filename!r} is missing"
            )
        if file_sha256(path) != entry.get("sha256"):
            raise FusedStatsError(
                f"checkpoint {str(snap)!r}: {filename!r} (point {name!r}, {stream}) does not match "
                "the manifest's SHA-256 (damaged or replaced)"
            )
        where = device(*key) if callable(device) else device
        acc = cls.load(path, device=where, backend=backend)
        if acc.dim != entry.get("dim") or acc.n != entry.get("n"):
            raise FusedStatsError(
                f"checkpoint {str(snap)!r}: {filename!r} holds dim={acc.dim}, n={acc.n}; the "
                f"manifest says dim={entry.get('dim')}, n={entry.get('n')}"
            )
        accs[key] = acc
    return manifest, accs, source or {}


def _check_settings_fit(probe, key, loaded, mine) -> None:
    """The checkpoint's accumulator must have the settings of the one the probe holds at
    ``key``, or else of the one it would create there (:meth:`Accumulator.setting_differences`)."""
    kind, stream, name = key
    reference = mine
    if reference is None and kind in probe.kinds:
        reference = probe.new_accumulator(kind, stream, name, loaded.dim)
    if reference is None:
        return
    diffs = reference.setting_differences(loaded)
    if diffs:
        raise FusedStatsError(
            f"checkpoint point {_label(key)} was written with other settings than this probe's: "
            f"{'; '.join(diffs)} (probe vs checkpoint); build the probe as the checkpointed run was"
        )


def _check_cross_fits(probe, key, loaded: CrossStats, mine: CrossStats | None) -> None:
    """The checkpoint's cross statistics must belong to the probe's own zero-output block."""
    _, stream, name = key
    spec = probe.cross
    if spec is None:
        raise FusedStatsError(
            f"checkpoint holds cross-gradient statistics at point {name!r} ({stream}), but this "
            "probe was built without cross=; build it with the CrossSpec of the checkpointed run"
        )
    if mine is not None:
        try:
            loaded.check_compatible(mine)
            diffs = []
        except IncompatibleStates as exc:  # loaded onto the probe's device: no device difference
            diffs = [d for d in exc.differences if not d.startswith("device")]
    else:  # compare with the block the probe would build at this point
        diffs = []
        try:
            # a CrossSpec's W_in, or a feature source's (growth's tangent: identity or projection)
            w_in, activation = cross_w_in(spec, name, loaded.dim, loaded.factory_dtype(), None)
            if w_in is None:
                rank = spec.feature_rank(name)
                # features given; a file written with the identity w_in of the same rank (before
                # features-given mode) holds the same statistics and loads as it was written
                if loaded.w_in is not None and loaded.rank == rank:
                    w_in = torch.eye(rank, dtype=loaded.w_in.dtype)
        except FusedStatsError as exc:
            diffs.append(str(exc))
        else:
            if loaded.activation != activation:
                diffs.append(f"activation {loaded.activation!r} vs {activation!r}")
            if w_in is None or loaded.w_in is None:
                if (w_in is None) != (loaded.w_in is None):
                    diffs.append("w_in (features given vs a projection)")
                elif loaded.rank != rank:
                    diffs.append(f"rank {loaded.rank} vs {rank}")
            elif tuple(w_in.shape) != tuple(loaded.w_in.shape):
                diffs.append(f"rank {loaded.rank} vs {w_in.shape[0]}")
            elif not torch.equal(w_in.cpu(), loaded.w_in.cpu()):
                diffs.append("w_in values (another seed or w_in)")
        if loaded.unit is not None and loaded.unit != probe.unit:
            diffs.append(f"unit {loaded.unit!r} vs {probe.unit!r}")
    if diffs:
        raise FusedStatsError(
            f"checkpoint cross statistics at point {name!r} ({stream}) are not those of this "
            "probe's block; they differ in (checkpoint vs probe) " + "; ".join(diffs)
        )


def _install(probe, accs: dict, manifest: dict, source: dict | None = None) -> None:
    """Put loaded accumulators (and the feature source's state) into the probe, after checking
    all of them (all or nothing)."""
    accs = _keyed(accs)
    table = probe.table
    current = probe_state(probe)
    points = probe.points
    for key, loaded in accs.items():
        kind, stream, name = key
        if name not in points:
            raise FusedStatsError(
                f"checkpoint point {name!r} ({stream}) is not a point of this probe; its points: "
                f"{list(points)}"
            )
        if stream not in STREAMS:
            raise FusedStatsError(f"checkpoint stream {stream!r} is not one of {tuple(STREAMS)}")
        mine = current.get(key)
        if kind == "cross":
            _check_cross_fits(probe, key, loaded, mine)
        if kind != "cross":
            _check_settings_fit(probe, key, loaded, mine)
    if probe.cross is not None:
        # samples without their cross statistics: a resumed |C|^2 would miss those batches
        lacking = [
            f"{name} ({stream})"
            for kind, stream, name in accs
            if kind == "grad" and accs[(kind, stream, name)].n and ("cross", stream, name) not in accs
        ]
        if lacking:
            raise FusedStatsError(
                f"the checkpoint holds samples at {lacking} but no cross-gradient statistics there "
                "(written by a probe without cross=?); this probe has cross= and would report "
                "|C|_F^2 of only the batches after the resume"
            )
    kept = probe.kinds
    for kind, stream, name in accs:
        if kind not in kept and kind != "cross":  # cross: refused above, naming cross=
            raise FusedStatsError(
                f"checkpoint holds {kind} statistics at point {name!r} ({stream}), but this "
                f"probe does not keep {kind} statistics; build it as the checkpointed run was"
            )
    for kind in kept:
        lacking = [
            f"{name} ({stream})"
            for k, stream, name in accs
            if kind not in ("grad", "cross")
            and k == "grad"
            and accs[(k, stream, name)].n
            and (kind, stream, name) not in accs
        ]
        if lacking:
            raise FusedStatsError(
                f"the checkpoint holds samples at {lacking} but no {kind} statistics there; "
                f"this probe keeps {kind} statistics and would count only the batches after "
                "the resume"
            )
    extra = sorted(set(current) - set(accs))
    if any(current[key].n for key in extra):
        raise FusedStatsError(
            f"the probe holds data at {[_label(k) for k in extra if current[k].n]}, which "
            "the checkpoint does not have (was it written by a probe with other points?)"
        )
    counters = {}
    raw = manifest.get("probe") or {}
    try:
        for attr in PROBE_COUNTERS:
            if attr in raw:
                counters[attr] = {str(k): int(v) for k, v in dict(raw[attr]).items()}
    except (TypeError, ValueError) as exc:
        raise FusedStatsError(f"checkpoint manifest has a malformed 'probe' entry {raw!r}: {exc}") from exc
    commit_source = source_commit(probe, accs, source or {})
    # ---- commit: nothing below rejects the checkpoint
    for key, loaded in accs.items():
        kind, stream, name = key
        mine = current.get(key)
        if mine is None:
            loaded.backend = probe.backend
            table[key] = loaded
        else:
            # in place, so references the probe keeps to its accumulators stay valid
            mine.load_state_dict(loaded.state_dict(), check=False)
    for key in extra:  # empty accumulators the checkpoint does not know
        del table[key]
    for attr, value in counters.items():
        mine = getattr(probe, attr)
        mine.clear()
        mine.update(value)
    if commit_source is not None:
        commit_source()


def load_probe_state(probe, directory, device=None) -> dict:
    """Restore every accumulator of ``probe`` (its whole table) from the newest snapshot in
    ``directory``.

    Each state goes to the device of the probe's accumulator it replaces (else ``device``, else
    the probe's model's device, else CPU). Returns the manifest (``consumed``, the probe's
    counters under ``probe``, point names, ...). The probe is changed only if the whole snapshot
    reads and checks correctly.
    """
    current = probe_state(probe)
    fallback = device if device is not None else probe_device(probe)

    def where(kind, stream, name):
        mine = current.get((kind, stream, name))
        return mine.device if mine is not None and mine.device is not None else fallback

    manifest, accs, source = read_snapshot_with_source(directory, device=where)
    _install(probe, accs, manifest, source)
    return manifest


# ---------------------------------------------------------------------------- driver
def run_with_checkpoints(
    probe, batches, loss_fn, directory, every: int = 100, stream: str = "train", **step_kwargs
) -> int:
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
                f"iterable ended after {skipped}: not the same data as the checkpointed run"
            ) from None
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

    Every input must hold the same (kind, stream, point) entries and feature-source state
    (:mod:`.source_state`); the accumulators of each are
    merged exactly (each accumulator's ``merge``) and the result is written
    as a snapshot of ``out_directory`` whose manifest sums the inputs' ``consumed`` counts and
    lists them under ``merged_from``. All inputs are read, checked and merged before anything is
    written; an incompatible pair raises naming the point and the input.
    """
    directories = [Path(d) for d in directories]
    if not directories:
        raise FusedStatsError("merge needs at least one input checkpoint")
    with_source = [read_snapshot_with_source(d) for d in directories]
    loaded = [(manifest, accs) for manifest, accs, _ in with_source]
    source = check_same_source(directories, [s for _, _, s in with_source])
    keys = set(loaded[0][1])
    for directory, (_, accs) in zip(directories[1:], loaded[1:]):
        if set(accs) != keys:
            missing = sorted(_label(k) for k in keys - set(accs))
            extra = sorted(_label(k) for k in set(accs) - keys)
            raise FusedStatsError(
                f"checkpoint {str(directory)!r} does not hold the same points as "
                f"{str(directories[0])!r}: missing {missing}, extra {extra}"
            )
    merged = {}
    for key in sorted(keys):
        acc = loaded[0][1][key].copy()
        for directory, (_, accs) in zip(directories[1:], loaded[1:]):
            try:
                acc.merge(accs[key])
            except FusedStatsError as exc:
                raise FusedStatsError(
                    f"merging point {_label(key)} of {str(directory)!r} into that of "
                    f"{str(directories[0])!r}: {exc}"
                ) from exc
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
    return write_snapshot(
        out_directory,
        merged,
        consumed=consumed,
        extra={
            "probe": counters,
            "probe_points": loaded[0][0].get("probe_points", []),
            "merged_from": [str(d.resolve()) for d in directories],
        },
        source_state=source,
    )
