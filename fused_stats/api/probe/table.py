"""The probe's accumulator table: ``(kind, stream, point) -> accumulator``, and its views.

A :class:`~fused_stats.Probe` keeps every accumulator in one dict keyed by ``(kind, stream,
point)``: ``kind`` a name of the kind registry (:mod:`fused_stats.api.probe.fold`; built in:
``"grad"``: GradStats, ``"cross"``: CrossStats, ``"norm_hist"``: NormHistogram), ``stream`` one of
:data:`STREAMS`. :class:`TableView` is the live
``point -> accumulator`` mapping of one (kind, stream), which ``probe.stats`` and its siblings are.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence

import torch

from ...errors import FusedStatsError

STREAMS: tuple[str, ...] = ("train", "test")


def check_stream(stream: str) -> str:
    """``stream`` if it is one of :data:`STREAMS`, else refused."""
    if stream not in STREAMS:
        raise FusedStatsError(f"stream must be one of {STREAMS}, got {stream!r}")
    return stream


class MissingEntry(FusedStatsError, KeyError):
    """A point a :class:`TableView` has no accumulator for. Also a ``KeyError``, so ``get``,
    ``in`` and ``pop`` of the mapping protocol keep working."""

    __str__ = Exception.__str__  # KeyError's would print the message in quotes


class TableView(MutableMapping):
    """``point -> accumulator`` of one (kind, stream) of a probe's table (a live view).

    ``points``: the probe's points, named in the error for a point without an entry."""

    def __init__(self, table: dict, kind: str, stream: str, points: Sequence[str] = ()):
        self._table, self.kind, self.stream, self.points = table, kind, stream, list(points)

    def __getitem__(self, point):
        try:
            return self._table[(self.kind, self.stream, point)]
        except KeyError:
            raise MissingEntry(self._missing(point)) from None

    def _missing(self, point) -> str:
        what = f"no {self.kind!r} accumulator for point {point!r} in the {self.stream} stream"
        if self.points and point not in self.points:
            return f"{what}: it is not a point of this probe; points: {self.points}"
        present = list(self)
        if not present:
            return f"{what}: no step has folded a batch into the {self.stream} stream yet"
        return f"{what}; points with one: {present}"

    def __setitem__(self, point, acc) -> None:
        self._table[(self.kind, self.stream, point)] = acc

    def __delitem__(self, point) -> None:
        del self._table[(self.kind, self.stream, point)]

    def __iter__(self) -> Iterator[str]:
        return (p for k, s, p in list(self._table) if k == self.kind and s == self.stream)

    def __len__(self) -> int:
        return sum(1 for k, s, _ in self._table if k == self.kind and s == self.stream)

    def __repr__(self) -> str:
        return f"{{{', '.join(f'{p!r}: {a!r}' for p, a in self.items())}}}"


def probe_device(probe) -> torch.device:
    """Where a probe's new accumulators go (a resumed checkpoint's, an all-reduce's missing ones):
    the device of those it holds, else its model's parameters, else the CPU."""
    for acc in probe.table.values():
        if acc.device is not None:
            return torch.device(acc.device)
    for param in probe.model.parameters():
        return param.device
    return torch.device("cpu")
