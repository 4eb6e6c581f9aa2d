"""The kind registry: which accumulators a probe keeps at each point, how each is made and what it reads.

:data:`REGISTRY` maps an accumulator kind to a :class:`Kind`: when a probe keeps it,
how it is made, and what it reads (``"grad"``: ``prepare(grad, mask, unit, feature_dim)``;
``"cross"``: ``prepare(grad, mask=mask, unit=unit, features=φ)`` from the features computed in the forward).
A new statistic is one :func:`register_kind` call; the folds (:mod:`fused_stats.api.probe.fold`)
never branch on a kind's name.
Built in: ``"grad"`` (:class:`~fused_stats.GradStats`, always), ``"cross"``
(:class:`~fused_stats.CrossStats`, with ``cross=``), ``"norm_hist"``
(:class:`~fused_stats.accumulators.NormHistogram`, with ``norm_histogram=``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...accumulators import CrossStats, GradStats, NormHistogram
from ...errors import FusedStatsError
from .spec import cross_w_in

__all__ = [
    "BUILTIN_KINDS",
    "REGISTRY",
    "Kind",
    "cross_accumulator",
    "point_of",
    "register_kind",
    "unregister_kind",
]


@dataclass(frozen=True)
class Kind:
    """One accumulator kind of a probe's table.

    ``enabled(probe)``: whether the probe keeps it; ``make(probe, name, dim, dtype, device)``: an
    empty accumulator for a point (``name`` as in messages, ``dtype`` of a cross block's ``W_in``);
    ``reads``: ``"grad"`` (the point's gradient) or ``"cross"`` (gradient and forward features).
    """

    name: str
    enabled: Callable
    make: Callable
    reads: str = "grad"


REGISTRY: dict[str, Kind] = {}
BUILTIN_KINDS: tuple[str, ...] = ("grad", "cross", "norm_hist")


def register_kind(kind: Kind) -> None:
    """Add (or replace) a kind; every probe that ``enabled`` says keeps it folds it at every point
    (its accumulator: ``prepare``/``commit``/``commit_many`` of the protocol, section 3.2)."""
    if kind.reads not in ("grad", "cross"):
        raise FusedStatsError(f"Kind.reads must be 'grad' or 'cross', got {kind.reads!r}")
    REGISTRY[kind.name] = kind


def unregister_kind(name: str) -> None:
    """Remove a kind added by :func:`register_kind` (the built-in ones stay)."""
    if name in BUILTIN_KINDS:
        raise FusedStatsError(f"the built-in kind {name!r} cannot be removed")
    REGISTRY.pop(name, None)


register_kind(
    Kind(
        "grad",
        lambda probe: True,
        lambda probe, name, dim, dtype, device: GradStats(
            int(dim),
            probe.second_moment,
            probe.pool_capacity,
            device=device,
            backend=probe.backend,
            nonfinite="raise",
            name=name,
        ),
    )
)


def cross_accumulator(probe, name: str, dim, dtype, device) -> CrossStats:
    """The CrossStats of ``name``: the CrossSpec's or the source's projection, or, for a feature
    source without one, features given (its ``feature_rank`` features, nothing stored for w_in)."""
    point = point_of(name)
    dtype = dtype or torch.float32
    w_in, activation = cross_w_in(probe.cross, point, int(dim), dtype, device)
    rank = probe.cross.feature_rank(point) if w_in is None else None
    return CrossStats(int(dim), w_in, activation, device, probe.backend, name, rank=rank, dtype=dtype)


register_kind(
    Kind(
        "cross",
        lambda probe: probe.cross is not None,
        lambda probe, name, dim, dtype, device: cross_accumulator(probe, name, dim, dtype, device),
        reads="cross",
    )
)
register_kind(
    Kind(
        "norm_hist",
        lambda probe: probe.norm_histogram is not None,
        lambda probe, name, dim, dtype, device: NormHistogram(
            int(dim), device=device or "cpu", backend=probe.backend, name=name, **(probe.norm_histogram or {})
        ),
    )
)


def point_of(name: str) -> str:
    """The point of an accumulator named by :meth:`fused_stats.Probe.new_accumulator` (the test
    stream's carry a ``" [test]"`` suffix)."""
    return name.removesuffix(" [test]")
