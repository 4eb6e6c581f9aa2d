"""The accumulator protocol: every statistic declares its state once, the rest is derived.

An accumulator class lists its state tensors as :class:`Field` entries (name, shape as a function
of the accumulator and its counters, dtype, reduction) and its plain counters (``n``, labels such
as ``unit``) in ``COUNTERS``; torchmetrics' ``add_state(name, default, dist_reduce_fx)`` is the
model. From that declaration :class:`Accumulator` derives

* ``state_dict()`` / ``load_state_dict()`` (loaded tensors live in fresh allocations), ``copy()``
  and ``same_state()`` (equality, for tests and all-or-nothing checks);
* ``save()`` / ``load()``: safetensors, versioned, SHA-256 over tensors and metadata, written
  atomically; every tensor's shape and dtype is checked against the declaration on load;
* ``merge()``: one alignment hook (``_align``: e.g. moving centred sums to a common centre), then
  per field ``sum`` (add), ``max`` (maximum), ``rows`` (append) and ``gram`` (the Gram matrix of a
  ``rows`` field, extended by the new rows' inner products);
* ``all_reduce()`` over ``torch.distributed``: one all-gathered settings row (so a disagreement
  raises the same error on every rank, before anything changes), the alignment hook, then one SUM
  of every ``sum`` field, one MAX of every ``max`` field, an all-gather of ``rows`` fields and a
  rebuild of their ``gram``.

Reductions of :class:`Field`: ``sum``, ``max``, ``rows``, ``gram``, ``same`` (equal on every
accumulator combined: a configuration tensor, or a centre the alignment hook made common; kept)
and ``local`` (this accumulator's own, never combined). Incompatibility is always reported by
raising :class:`~fused_stats.FusedStatsError`; every accumulator has the same
``prepare(...) -> Prepared`` / ``commit(Prepared)`` split and ``nonfinite=`` policy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from ..errors import FusedStatsError
from . import persistence

F64 = torch.float64
Reduction = Literal["sum", "max", "rows", "gram", "same", "local"]
Nonfinite = Literal["raise", "skip"]
NONFINITE_POLICIES: tuple[str, ...] = ("raise", "skip")


class IncompatibleStates(FusedStatsError):
    """Two states that cannot be combined; ``differences`` lists what differs (``"dim 4 vs 5"``)."""

    def __init__(self, message: str, differences: list[str] | None = None):
        super().__init__(message)
        self.differences = list(differences or [])


def _always(acc, state) -> bool:
    return True


@dataclass(frozen=True)
class Field:
    """One declared state tensor.

    ``shape(acc, counters)``: its shape from the accumulator's settings (``dim``, ...) and the
    counters of the state it belongs to (e.g. ``n`` for a pool). ``dtype=None`` accepts any
    floating dtype (a configuration tensor such as a projection). ``present(acc, counters)``:
    whether the state holds it (a representation may hold a dense matrix or a pool). ``rows``: for
    a ``gram`` field, the name of the ``rows`` field it is the Gram matrix of.
    """

    name: str
    shape: Callable[[Any, Mapping], tuple]
    reduction: Reduction = "sum"
    dtype: torch.dtype | None = F64
    present: Callable[[Any, Mapping], bool] = _always
    rows: str | None = None
    optional: bool = False  # may be absent even where present() holds (e.g. a carried sample)


@dataclass
class Prepared:
    """A validated, reduced batch waiting for ``commit`` on the accumulator that prepared it.

    ``base_n``: the accumulator's ``n`` when prepared (a stale batch is refused); ``batch``: the
    ops-layer sums (None when the batch holds no sample); ``finite``: whether every sum is finite
    (``commit`` applies the accumulator's ``nonfinite`` policy otherwise); ``unit``, ``centre``:
    the batch's unit and, for centred statistics, the centre it was reduced about.
    """

    unit: str
    base_n: int
    batch: Any
    finite: bool = True
    centre: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return 0 if self.batch is None else int(self.batch.n)


@dataclass
class StackedPrepared:
    """One batch for each of several accumulators (the points of a probe), reduced by one set of
    batched calls and held stacked (``tensors``, leading dimension = accumulator), waiting for the
    class's ``commit_many``. ``base_n``: each accumulator's ``n`` when prepared; ``finite``:
    whether each one's sums are finite."""

    unit: str
    base_n: tuple[int, ...]
    finite: list[bool]
    tensors: tuple

    def folds_into(self, accs) -> bool:
        """Whether ``commit`` would fold every batch into ``accs`` as they stand: all finite, none
        stale, distinct accumulators."""
        return (
            all(self.finite)
            and len(accs) == len(self.base_n)
            and all(a.n == n for a, n in zip(accs, self.base_n))
            and len({id(a) for a in accs}) == len(accs)
        )


def state_differences(a: Mapping, b: Mapping) -> list[str]:
    """The entries in which two ``state_dict()`` results differ (empty: bit-identical)."""
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key, "<missing>"), b.get(key, "<missing>")
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.dtype == y.dtype
                and x.shape == y.shape
                and x.device == y.device
                and torch.equal(x, y)
            ):
                out.append(key)
        elif x != y:
            out.append(key)
    return out


def extend_gram(gram: torch.Tensor, rows: torch.Tensor, new_rows: torch.Tensor, backend: str) -> torch.Tensor:
    """The Gram matrix of ``cat(rows, new_rows)`` from ``gram = rows rowsᵀ`` (a new tensor)."""
    from .. import ops

    cross = ops.gram_rows(new_rows, rows, backend)  # (B, N)
    inner = ops.gram_rows(new_rows, new_rows, backend)  # (B, B)
    N, B = rows.shape[0], new_rows.shape[0]
    out = torch.empty(N + B, N + B, dtype=F64, device=gram.device)
    out[:N, :N] = gram
    out[N:, :N] = cross
    out[:N, N:] = cross.T
    out[N:, N:] = inner
    return out


REGISTRY: dict[str, type] = {}  # kind -> accumulator class, filled by the subclasses


def accumulator_class(kind: str) -> type:
    """The accumulator class of ``kind`` ("grad", "cross", "norm_hist", ...)."""
    try:
        return REGISTRY[kind]
    except KeyError:
        raise FusedStatsError(f"unknown accumulator kind {kind!r}; known: {sorted(REGISTRY)}") from None


class Accumulator:
    """Base of every accumulator (module docstring). Subclasses set the class attributes and
    implement ``prepare``/``commit``, ``config``/``from_config``, ``_check_counters``,
    ``check_compatible`` and, when the plain per-field combination needs a common frame, ``_align``.
    """

    KIND: ClassVar[str]  # the probe table's kind ("grad", "cross", ...)
    FORMAT: ClassVar[str]  # the saved file's ``format`` entry
    VERSION: ClassVar[int] = 1
    FIELDS: ClassVar[tuple[Field, ...]]
    # counter name -> "sum" (integers added), "sum_list" (lists added elementwise) or "label"
    # (a string or None: the value of the accumulators that hold samples)
    COUNTERS: ClassVar[dict[str, str]]
    COUNTER_DEFAULTS: ClassVar[dict] = {}  # for counters that files of older writers lack

    name: str | None
    device: torch.device | None
    backend: str

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if isinstance(cls.__dict__.get("KIND"), str):
            REGISTRY[cls.KIND] = cls

    def describe(self) -> dict:
        """A few plain facts about the state for manifests and listings (hook)."""
        return {}

    def block_digest(self) -> int:
        """A digest of settings that ranks must share beyond ``dim`` (hook; 0: none)."""
        return 0

    def factory_dtype(self) -> torch.dtype | None:
        """The dtype a fresh accumulator of this block is built with (hook; None: default)."""
        return None

    # ------------------------------------------------------------------ declared state
    def _where(self) -> str:
        return f" at point {self.name!r}" if getattr(self, "name", None) else ""

    def _admits(self, prepared: Prepared, nonfinite_message: str) -> bool:
        """Whether ``commit`` folds ``prepared``: FusedStatsError for a stale batch (prepared at
        another ``n``); False for an empty batch, and for a non-finite one under
        ``nonfinite="skip"`` (counted in ``skipped_batches``); FusedStatsError for a non-finite one
        otherwise, with ``nonfinite_message`` (``{where}``, ``{n}``: this accumulator, the
        batch's samples)."""
        if prepared.base_n != self.n:
            raise FusedStatsError(
                f"stale prepared batch{self._where()}: prepared at n={prepared.base_n}, the state "
                f"now has n={self.n}; prepare it again"
            )
        if prepared.n == 0:
            return False
        if not prepared.finite:
            if self.nonfinite == "skip":
                self.skipped_batches += 1
                return False
            raise FusedStatsError(nonfinite_message.format(where=self._where(), n=prepared.n))
        return True

    @classmethod
    def commit_many(cls, accumulators, prepared) -> None:
        """``commit`` each accumulator's prepared batch, in order (the points of a probe): the
        same states as committing them one by one. A subclass may fold the batches of several
        accumulators with fewer calls where every batch is one ``commit`` would fold
        (:meth:`_all_fold`)."""
        for acc, p in zip(accumulators, prepared):
            acc.commit(p)

    @staticmethod
    def _all_fold(accs, prepared, devices) -> bool:
        """Whether every batch would be folded by ``commit`` as it stands (none stale, empty or
        non-finite) into distinct accumulators, all on one of ``devices``: then the order of the
        commits does not matter and nothing is refused."""
        return (
            len({id(a) for a in accs}) == len(accs)
            and len(set(devices)) == 1
            and all(
                isinstance(p, Prepared) and p.finite and p.batch is not None and p.base_n == a.n and p.n
                for a, p in zip(accs, prepared)
            )
        )

    def counters(self) -> dict:
        """The plain (non-tensor) part of the state."""
        return {
            key: (list(getattr(self, key)) if kind == "sum_list" else getattr(self, key))
            for key, kind in self.COUNTERS.items()
        }

    def present_fields(self, counters: Mapping | None = None) -> list[Field]:
        """The declared fields a state with ``counters`` holds."""
        counters = self.counters() if counters is None else counters
        return [f for f in self.FIELDS if f.present(self, counters)]

    def state_dict(self) -> dict:
        """Counters and clones of every declared tensor (None where the representation has none)."""
        out = self.counters()
        present = {f.name for f in self.present_fields(out)}
        for f in self.FIELDS:
            value = getattr(self, f.name)
            out[f.name] = value.detach().clone() if f.name in present and value is not None else None
        return out

    def _state_label(self, counters: Mapping) -> str:
        """``dim=..., n=...`` for the messages of a damaged state."""
        return ", ".join(f"{k}={counters.get(k)!r}" for k in self.COUNTERS)

    def check_state(self, state: Mapping, where: str) -> None:
        """Raise :class:`FusedStatsError` unless ``state`` is a valid state of this accumulator:
        counters (``_check_counters``) and every present field's shape and dtype."""
        counters = {key: state.get(key) for key in self.COUNTERS}
        self._check_counters(counters, where)
        names = {f.name for f in self.FIELDS}
        unknown = sorted(k for k in state if k not in names and k not in self.COUNTERS)
        if unknown:
            raise FusedStatsError(f"{where} holds unexpected tensors {unknown}")
        present = self.present_fields(counters)
        missing = [f.name for f in present if state.get(f.name) is None and not f.optional]
        if missing:
            held = sorted(k for k in state if k not in self.COUNTERS and state[k] is not None)
            raise FusedStatsError(f"{where} holds tensors {held} and lacks tensors {missing}")
        extra = sorted(f.name for f in self.FIELDS if f not in present and state.get(f.name) is not None)
        if extra:
            raise FusedStatsError(
                f"{where} is inconsistent: holds tensors {extra}, which a state with "
                f"{self._state_label(counters)} does not have"
            )
        for f in present:
            value = state.get(f.name)
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                raise FusedStatsError(f"{where}: {f.name} is a {type(value).__name__}, not a tensor")
            shape = tuple(f.shape(self, counters))
            dtype_ok = value.is_floating_point() if f.dtype is None else value.dtype == f.dtype
            if tuple(value.shape) != shape or not dtype_ok:
                wanted = "floating point" if f.dtype is None else str(f.dtype).replace("torch.", "")
                raise FusedStatsError(
                    f"{where} is inconsistent: {f.name} has shape {tuple(value.shape)} and dtype "
                    f"{value.dtype}, expected {shape} {wanted} for {self._state_label(counters)}"
                )

    def _check_counters(self, counters: Mapping, where: str) -> None:
        """Raise unless the counters are consistent (hook; the base checks nothing)."""

    def load_state_dict(self, state: Mapping, device=None, check: bool = True) -> None:
        """Replace the state by ``state`` (a ``state_dict()``), after checking it against the
        declaration. Every tensor is copied into a fresh allocation on ``device`` (default: this
        accumulator's device, else the tensors' own): the caller's tensors are never kept."""
        if check:
            self.check_state(state, f"state for {type(self).__name__}{self._where()}")
        target = torch.device(device) if device is not None else self.device
        counters = {key: state.get(key) for key in self.COUNTERS}
        present = {f.name for f in self.present_fields(counters)}
        tensors = {}
        for f in self.FIELDS:
            value = state.get(f.name) if f.name in present else None
            if value is None:
                tensors[f.name] = None
                continue
            where = target if target is not None else value.device
            tensors[f.name] = persistence.fresh_copy(value.detach().to(where))
        for key, kind in self.COUNTERS.items():
            value = state.get(key)
            setattr(self, key, list(value) if kind == "sum_list" else value)
        for key, value in tensors.items():
            setattr(self, key, value)
        if target is not None:
            self.device = target
        else:
            held = next((v for v in tensors.values() if v is not None), None)
            if held is not None:
                self.device = held.device
        self._after_load()

    def _after_load(self) -> None:
        """Hook after ``load_state_dict`` (derived attributes)."""

    def same_state(self, other) -> bool:
        """Whether ``other`` (an accumulator or a ``state_dict()``) holds a bit-identical state."""
        theirs = other.state_dict() if isinstance(other, Accumulator) else other
        return not state_differences(self.state_dict(), theirs)

    # ------------------------------------------------------------------ construction
    def config(self) -> dict:
        """Plain constructor settings (saved in a file's ``config`` entry)."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: Mapping, tensors: Mapping, device=None, backend: str = "auto"):
        """An empty accumulator with ``config`` (``tensors``: the file's tensors, for settings
        that are tensors, e.g. a projection)."""
        raise NotImplementedError

    def copy(self):
        """An independent accumulator with the same settings and state."""
        out = self.from_config(self.config(), self.state_dict(), self.device, self.backend)
        out.load_state_dict(self.state_dict(), check=False)
        out.device = self.device
        return out

    # ------------------------------------------------------------------ persistence
    def save(self, path) -> None:
        """Write settings and state atomically to ``path`` (safetensors; versioned, SHA-256 over
        the tensors and the metadata)."""
        state = self.state_dict()
        tensors = {
            f.name: state[f.name].to("cpu").contiguous() for f in self.FIELDS if state[f.name] is not None
        }
        meta = {
            "format": self.FORMAT,
            "version": str(self.VERSION),
            "config": json.dumps(self.config()),
            "state": json.dumps({key: state[key] for key in self.COUNTERS}),
        }
        persistence.save_checked(path, tensors, meta)

    @classmethod
    def load(cls, path, device=None, backend: str = "auto"):
        """Read a state written by :meth:`save` onto ``device`` (default CPU). Format, version,
        checksum, counters and every tensor's shape and dtype are checked; loading never
        executes code."""
        tensors, meta = persistence.read_checked(path, cls.FORMAT, cls.VERSION)
        where = f"{cls._file_label()} {str(path)!r}"
        try:
            config = json.loads(meta["config"])
            counters = json.loads(meta["state"])
            if not isinstance(config, dict) or not isinstance(counters, dict):
                raise TypeError("config and state must be JSON objects")
            target = torch.device(device) if device is not None else torch.device("cpu")
            acc = cls.from_config(config, tensors, target, backend)
            state = {
                key: cls._read_counter(counters, key)
                for key in cls.COUNTERS
                if key in counters or key not in cls.COUNTER_DEFAULTS
            }
            state = {**cls.COUNTER_DEFAULTS, **state}
        except (KeyError, ValueError, TypeError) as exc:  # FusedStatsError is a ValueError too
            raise FusedStatsError(f"{where} has unreadable or invalid metadata: {exc}") from exc
        state.update(tensors)
        acc.check_state(state, where)
        acc.load_state_dict(state, device=target, check=False)
        return acc

    @classmethod
    def _file_label(cls) -> str:
        return "state file"

    @classmethod
    def _read_counter(cls, counters: Mapping, key: str):
        value = counters[key]
        kind = cls.COUNTERS[key]
        if kind == "sum":
            return int(value)
        if kind == "sum_list":
            return [int(v) for v in value]
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{key} must be a string or null, got {value!r}")
        return value

    def setting_differences(self, other) -> list[str]:
        """Why ``other``'s state cannot stand in for this accumulator's (e.g. when a checkpoint
        is loaded), as ``"key mine vs theirs"``: a different kind, a different plain
        constructor setting (``config()``; the name and the ``nonfinite`` policy aside, which do
        not change what the state means), or a different ``unit`` where both are set. Tensor settings (a projection) are compared by ``check_compatible``."""
        if type(other) is not type(self):
            return [f"kind {self.KIND!r} vs {getattr(other, 'KIND', type(other).__name__)!r}"]
        mine, theirs = self.config(), other.config()
        out = [
            f"{key} {mine.get(key)!r} vs {theirs.get(key)!r}"
            for key in sorted(set(mine) | set(theirs))
            if key not in ("name", "nonfinite") and mine.get(key) != theirs.get(key)
        ]
        # the unit (every Prepared batch has one) fixes what a sample is; other labels, such as
        # a representation, may differ between equal statistics
        a, b = getattr(self, "unit", None), getattr(other, "unit", None)
        if a is not None and b is not None and a != b:
            out.append(f"unit {a!r} vs {b!r}")
        return out

    # ------------------------------------------------------------------ merging
    def check_compatible(self, other) -> None:
        """Raise :class:`FusedStatsError` naming why ``other`` cannot be merged into this one."""
        raise NotImplementedError

    def _combined_counters(self, mine: Mapping, theirs: Mapping) -> dict:
        out = {}
        for key, kind in self.COUNTERS.items():
            if kind == "sum":
                out[key] = mine[key] + theirs[key]
            elif kind == "sum_list":
                out[key] = [a + b for a, b in zip(mine[key], theirs[key])]
            else:
                out[key] = mine[key] if mine[key] is not None else theirs[key]
        return out

    def _align(self, other) -> tuple[dict, dict | None, dict]:
        """``(mine, theirs, counters)``: the two states in a common frame (``state_dict()``s,
        ``other``'s a copy) and the counters of the merged state. ``theirs=None`` means ``mine``
        already is the merged state. The default: no alignment."""
        mine, theirs = self.state_dict(), other.state_dict()
        return mine, theirs, self._combined_counters(mine, theirs)

    def merge(self, other):
        """Add ``other``'s samples to this accumulator (exact; ``other`` is not modified).

        Raises :class:`FusedStatsError` (and changes nothing) when the two are incompatible."""
        self.check_compatible(other)
        mine, theirs, counters = self._align(other)
        if theirs is None:
            self.load_state_dict(mine, check=False)
            return self
        merged = dict(counters)
        present = {f.name for f in self.present_fields(counters)}
        for f in self.FIELDS:
            a, b = mine.get(f.name), theirs.get(f.name)
            if f.name not in present:
                merged[f.name] = None
            elif f.reduction == "sum":
                merged[f.name] = a + b
            elif f.reduction == "max":
                merged[f.name] = torch.maximum(a, b)
            elif f.reduction == "rows":
                merged[f.name] = torch.cat([a, b.to(a.dtype)], dim=0)
            elif f.reduction == "gram":
                merged[f.name] = extend_gram(a, mine[f.rows], theirs[f.rows], self.backend)
            else:  # same, local: this accumulator's
                merged[f.name] = a
        # everything is computed before anything is assigned: a failure leaves the state as it was
        self.load_state_dict(merged, check=False)
        return self

    # ------------------------------------------------------------------ all-reduce
    def settings_row(self) -> list[int]:
        """Integers every rank publishes before an all-reduce (settings and counters)."""
        raise NotImplementedError

    def check_settings(self, table: torch.Tensor) -> None:
        """Raise (identically on every rank) unless the ranks' rows of ``table`` can be reduced."""
        raise NotImplementedError

    def _reduce_start(self, table: torch.Tensor, group, device) -> tuple[dict, dict]:
        """``(state, counters)``: this rank's state in the common frame of the reduce (may run
        collectives, e.g. a broadcast centre) and the counters of the reduced state."""
        raise NotImplementedError

    def _row_counts(self, table: torch.Tensor) -> list[int]:
        """Rows each rank contributes to a ``rows`` field (hook; only needed with such fields)."""
        raise NotImplementedError

    def all_reduce(self, group=None):
        """Replace this accumulator, on every rank of ``group``, by the merge over all ranks.

        A collective: every rank calls it (in the same order for several accumulators). A
        disagreement found in the exchanged settings raises on every rank and leaves the state
        as it was; so does a failed collective (the state is replaced only at the end)."""
        from . import distributed

        distributed.require_initialised()
        device = distributed.comm_device(group, self.device)
        table = distributed.gather_rows(self.settings_row(), group, device)
        self.check_settings(table)
        state, counters = self._reduce_start(table, group, device)
        reduced = distributed.reduce_fields(self, state, counters, table, group, device)
        self.load_state_dict(reduced, check=False)
        return self
