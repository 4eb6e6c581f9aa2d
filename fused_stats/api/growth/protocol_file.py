"""The growth protocol as a TOML file, for the command line (``probe --growth``, ``grow --protocol``).

Role: a protocol file holds the keys of :class:`~fused_stats.GrowthProtocol` at its top level:
``candidates`` (a list of point names, or ``"all"``: :func:`fused_stats.growth_points` of the
model), ``family``, ``init``, ``seed``, ``width``, ``projection``, ``budget = [M, K]``, ``score``,
``adam_eps`` and ``train_batch_size``; a key left out takes the protocol's default (TOML has no null: an unset ``width`` is an absent key).
Every key and type is checked when the file is read, before any model is loaded, with the key
named in the message; ``"all"`` and the candidates' existence need the model
(:meth:`ProtocolFile.resolve`). :func:`protocol_from_table` checks one table, so a section of
another file (a suite's ``[growth]``) can use the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from ...errors import FusedStatsError
from ...tomlfile import read_toml
from .architecture import describe
from .plan import GrowthPlan
from .protocol import FAMILIES, INITS, SCORES, GrowthProtocol

KEYS = (
    "candidates",
    "family",
    "init",
    "seed",
    "width",
    "projection",
    "budget",
    "score",
    "adam_eps",
    "train_batch_size",
)
ALL_CANDIDATES = "all"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_table(table, where: str) -> dict:
    """The protocol keys of ``table`` checked for names and types (``where`` prefixes every
    message, e.g. ``"protocol file 'g.toml'"``); returns a dict of GrowthProtocol arguments with
    ``candidates`` either a tuple of names or ``"all"``."""
    if not isinstance(table, dict):
        raise FusedStatsError(f"{where}: the protocol must be a table of keys, got {type(table).__name__}")
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise FusedStatsError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(KEYS))})")
    if "candidates" not in table:
        raise FusedStatsError(f"{where}: needs 'candidates' (a list of point names, or \"all\")")
    cands = table["candidates"]
    if cands != ALL_CANDIDATES and not (
        isinstance(cands, list) and cands and all(isinstance(c, str) and c for c in cands)
    ):
        raise FusedStatsError(
            f'{where}: candidates must be "all" or a non-empty list of point names, got {cands!r}'
        )
    out: dict = {"candidates": cands if cands == ALL_CANDIDATES else tuple(cands)}
    for key, choices in (("family", FAMILIES), ("init", INITS)):
        if key in table:
            if table[key] not in choices:
                raise FusedStatsError(
                    f"{where}: {key} must be one of {', '.join(map(repr, choices))}, got {table[key]!r}"
                )
            out[key] = table[key]
    if "seed" in table:
        out["seed"] = table["seed"]  # checked by GrowthProtocol itself (build, below)
    for key in ("width", "projection", "train_batch_size"):
        if key in table:
            if not _is_int(table[key]) or table[key] < 1:
                raise FusedStatsError(f"{where}: {key} must be an integer >= 1, got {table[key]!r}")
            out[key] = table[key]
    if "score" in table:
        if table["score"] not in SCORES:
            raise FusedStatsError(
                f"{where}: score must be one of {', '.join(map(repr, SCORES))}, got {table['score']!r}"
            )
        out["score"] = table["score"]
    if "adam_eps" in table:
        eps = table["adam_eps"]
        if not isinstance(eps, (int, float)) or isinstance(eps, bool):
            raise FusedStatsError(f"{where}: adam_eps must be a number, got {eps!r}")
        out["adam_eps"] = float(eps)
    if "budget" in table:
        budget = table["budget"]
        if not (isinstance(budget, list) and len(budget) == 2 and all(_is_int(v) and v >= 1 for v in budget)):
            raise FusedStatsError(f"{where}: budget must be [M, K], two integers >= 1, got {budget!r}")
        out["budget"] = tuple(budget)
    # the rules that need no model (duplicates, family/init/width combinations) are checked now;
    # "all" stands in as one name until the model lists its points
    listed = out["candidates"] if out["candidates"] != ALL_CANDIDATES else (ALL_CANDIDATES,)
    build({**out, "candidates": listed}, where)
    return out


def build(arguments: dict, where: str) -> GrowthProtocol:
    """``GrowthProtocol(**arguments)``, its refusals prefixed with ``where``."""
    try:
        return GrowthProtocol(**arguments)
    except FusedStatsError as exc:
        raise FusedStatsError(f"{where}: {exc}") from None


def protocol_from_table(table, where: str, model: nn.Module | None = None) -> GrowthProtocol:
    """The protocol a table describes; ``candidates = "all"`` needs ``model``, and with ``model``
    every candidate is checked against it (:meth:`GrowthProtocol.check`)."""
    if model is None:
        arguments = check_table(table, where)
        if arguments["candidates"] == ALL_CANDIDATES:
            raise FusedStatsError(f'{where}: candidates = "all" needs the model to list its growth points')
        return build(arguments, where)
    return plan_from_table(table, where, model).protocol


def plan_from_table(table, where: str, model: nn.Module) -> GrowthPlan:
    """The :class:`~.plan.GrowthPlan` on ``model`` of the protocol a table describes (the model
    described once, for ``"all"`` and for the plan alike); refusals prefixed with ``where``."""
    arguments = check_table(table, where)
    try:
        arch = describe(model)
    except FusedStatsError as exc:
        raise FusedStatsError(f"{where}: {exc}") from None
    if arguments["candidates"] == ALL_CANDIDATES:
        arguments = {**arguments, "candidates": tuple(arch.boundaries)}
    protocol = build(arguments, where)
    try:
        return GrowthPlan.from_architecture(model, protocol, arch)
    except FusedStatsError as exc:
        raise FusedStatsError(f"{where}: {exc}") from None


@dataclass(frozen=True)
class ProtocolFile:
    """A checked protocol file; :meth:`resolve` gives its protocol on a model."""

    path: Path
    arguments: dict

    @property
    def where(self) -> str:
        return f"protocol file {str(self.path)!r}"

    @property
    def candidates(self) -> tuple[str, ...] | None:
        """The listed candidates (None for ``"all"``: they depend on the model)."""
        cands = self.arguments["candidates"]
        return None if cands == ALL_CANDIDATES else cands

    def resolve(self, model: nn.Module) -> GrowthProtocol:
        """The protocol on ``model``, every candidate checked against it."""
        return self.plan(model).protocol

    def plan(self, model: nn.Module) -> GrowthPlan:
        """The growth plan of this file's protocol on ``model`` (:func:`plan_from_table`)."""
        return plan_from_table(
            {k: list(v) if isinstance(v, tuple) else v for k, v in self.arguments.items()}, self.where, model
        )


def read_protocol_file(path) -> ProtocolFile:
    """Read and check a protocol file (module docstring); raises naming the file and the key."""
    path = Path(path)
    _, table = read_toml(path, "protocol file")
    where = f"protocol file {str(path)!r}"
    return ProtocolFile(path, check_table(table, where))


__all__ = [
    "ALL_CANDIDATES",
    "KEYS",
    "ProtocolFile",
    "plan_from_table",
    "protocol_from_table",
    "read_protocol_file",
]
