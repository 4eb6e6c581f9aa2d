"""The probe's accumulator table: ``(kind, stream, point) -> accumulator``, and its views.

A :class:`~fused_stats.Probe` keeps every accumulator in one dict keyed by ``(kind, stream,
point)``: ``kind`` one of :data:`KINDS` (``"grad"``: GradStats, ``"cross"``: CrossStats,
``"norm_hist"``: NormHistogram), ``stream`` one of :data:`STREAMS`. :class:`TableView` is the live
``point -> accumulator`` mapping of one (kind, stream), which ``probe.stats`` and its siblings are.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

STREAMS: tuple[str, ...] = ("train", "test")
KINDS: tuple[str, ...] = ("grad", "cross", "norm_hist")  # the accumulator kinds a probe can hold


class TableView(MutableMapping):
    """``point -> accumulator`` of one (kind, stream) of a probe's table (a live view)."""

    def __init__(self, table: dict, kind: str, stream: str):
        self._table, self.kind, self.stream = table, kind, stream

    def __getitem__(self, point):
        return self._table[(self.kind, self.stream, point)]

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
