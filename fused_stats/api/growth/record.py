"""The growth record a grown model carries: one entry per point and growth event.

Role: :func:`fused_stats.grow` appends to ``model.config.fused_stats_growth``, a list of plain
dicts, so ``save_pretrained`` writes it into ``config.json`` and ``from_pretrained`` reads it back
(a model without an HF config, such as the project's ResNets, keeps the list as the attribute
``fused_stats_growth`` of the model). :func:`growth_history` reads it.

Entry keys: ``event`` (``"grew"``, or ``"saturated everywhere"``: a scheduled decision that
found no significant candidate and stopped growing, :func:`record_saturation`), ``point`` (the
candidate grown at; None for saturation), ``family``, ``init``, ``protocol_digest``,
``position`` (the module that now holds the growth), ``new_parameters`` and ``widened`` (full
names in the grown model), and ``step``, ``cross_frob2``, ``p_value``, ``p_adjusted`` where the
caller gave them (None otherwise): the training step and the evidence that motivated the growth;
a saturation entry also holds the advice's ``verdict``. An entry written by
:class:`fused_stats.GrowthSchedule` also holds ``first_step_change`` (the predicted change of the
mean held-out loss from the first optimizer step on the growth, None where it could not be made)
and ``first_step_note`` (how it was made, or why not).

Names stay current: when a later depth growth inserts blocks into a stack, the earlier entries'
``position``, ``new_parameters`` and ``widened`` under that stack are renumbered as the blocks
themselves are (block ``i`` becomes ``i`` plus the new blocks at or before it). ``point`` stays the
candidate's name when it was grown (the name its protocol, ``protocol_digest``, lists). A growth
entry's ``block_id`` (0, 1, 2, … in the order the entries were written) names the grown part
for good, whatever is inserted before it later.
"""

from __future__ import annotations

import copy
import math
import re

from torch import nn

from ...errors import FusedStatsError

RECORD_KEY = "fused_stats_growth"
GREW = "grew"
SATURATED = "saturated everywhere"
EVIDENCE_KEYS = ("cross_frob2", "p_value", "p_adjusted")
# written only where the evidence gives them (fs.GrowthSchedule): the predicted change of the
# first optimizer step on the growth (a number or None) and what it is, or why there is none
FIRST_STEP_KEYS = ("first_step_change", "first_step_note")


def _holder(model: nn.Module):
    config = getattr(model, "config", None)
    return config if config is not None else model


def growth_history(model: nn.Module) -> list[dict]:
    """The model's growth record (a copy), oldest event first; ``[]`` for a model never grown."""
    if not isinstance(model, nn.Module):
        raise FusedStatsError(f"growth_history needs a torch.nn.Module, got {type(model).__name__}")
    record = getattr(_holder(model), RECORD_KEY, None)
    if record is None:
        return []
    if not isinstance(record, list) or not all(isinstance(e, dict) for e in record):
        raise FusedStatsError(
            f"{type(model).__name__}'s {RECORD_KEY} is a {type(record).__name__}, not a list of entries: "
            "it was not written by fs.grow"
        )
    return copy.deepcopy(record)


def check_step_and_evidence(step, evidence, points) -> dict[str, dict]:
    """Validated ``{point: {cross_frob2, p_value, p_adjusted}}`` for the points grown (evidence:
    None, an :class:`~fused_stats.api.growth.advise.Advice`, or a dict point -> dict of those keys);
    raises before anything changes."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise FusedStatsError(f"step must be None or a non-negative int, got {step!r}")
    if evidence is None:
        return {}
    if hasattr(evidence, "ranked"):  # an Advice: its rows for the points grown
        rows = {c.point: c for c in evidence.ranked}
        missing = [p for p in points if p not in rows]
        if missing:
            raise FusedStatsError(f"evidence: the advice has no row for the grown points {missing}")
        evidence = {p: {key: getattr(rows[p], key) for key in EVIDENCE_KEYS} for p in points}
    if not isinstance(evidence, dict):
        raise FusedStatsError(
            f"evidence must be None, an Advice or a dict point -> {{{', '.join(EVIDENCE_KEYS)}}}, "
            f"got {type(evidence).__name__}"
        )
    out = {}
    for point, values in evidence.items():
        if point not in points:
            raise FusedStatsError(
                f"evidence names {point!r}, which is not grown here (grown: {list(points)})"
            )
        if not isinstance(values, dict) or set(values) - set(EVIDENCE_KEYS + FIRST_STEP_KEYS):
            raise FusedStatsError(
                f"evidence for {point!r} must be a dict with keys among {EVIDENCE_KEYS + FIRST_STEP_KEYS}, "
                f"got {values!r}"
            )
        clean = {}
        for key, value in values.items():
            if key == "first_step_note":
                if not isinstance(value, str):
                    raise FusedStatsError(
                        f"evidence first_step_note for {point!r} must be a str, got {value!r}"
                    )
                clean[key] = value
                continue
            if value is not None and (
                not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            ):
                raise FusedStatsError(f"evidence {key} for {point!r} must be a finite number, got {value!r}")
            clean[key] = None if value is None else float(value)
        out[point] = clean
    return out


def record_growth(model: nn.Module, result, step=None, evidence: dict | None = None) -> list[dict]:
    """Append one entry per point of ``result`` (a :class:`~fused_stats.api.growth.grow.GrowthResult`)
    to the model's record; ``evidence`` as returned by :func:`check_step_and_evidence`. Returns the
    entries added."""
    evidence = evidence or {}
    record = _renumbered(growth_history(model), result)
    next_id = 1 + max((e["block_id"] for e in record if isinstance(e.get("block_id"), int)), default=-1)
    added = []
    for point, position in result.positions.items():
        prefix = position + "."
        entry = {
            "event": GREW,
            "point": point,
            "family": result.family,
            "init": result.init,
            "protocol_digest": result.protocol_digest,
            "position": position,
            "new_parameters": [n for n in result.new_parameters if n.startswith(prefix)],
            "widened": [n for n in result.widened if n.startswith(prefix)],
            "step": step,
        }
        given = evidence.get(point, {})
        for key in EVIDENCE_KEYS:
            entry[key] = given.get(key)
        entry.update((key, given[key]) for key in FIRST_STEP_KEYS if key in given)
        entry["block_id"] = next_id + len(added)
        added.append(entry)
    setattr(_holder(model), RECORD_KEY, record + copy.deepcopy(added))
    return added


def _renumbered(record: list[dict], result) -> list[dict]:
    """The earlier entries with the names under each stack that ``result`` (depth growth) inserted
    into moved to the blocks' new indices: old block ``i`` is the ``i``-th index of the grown
    stack that holds no new block."""
    if result.family != "layer":
        return record  # width growth and cross blocks insert no block into a stack
    inserted: dict[str, set[int]] = {}
    for position in result.positions.values():
        container, _, index = position.rpartition(".")
        inserted.setdefault(container, set()).add(int(index))
    for container, new in inserted.items():
        for entry in record:
            entry["position"] = _moved(entry.get("position"), container, new)
            for key in ("new_parameters", "widened"):
                if isinstance(entry.get(key), list):
                    entry[key] = [_moved(n, container, new) for n in entry[key]]
    return record


def _moved(name, container: str, new: set[int]):
    """``name`` with its block index under ``container`` moved past the new blocks' indices."""
    match = re.match(rf"{re.escape(container)}\.(\d+)(?=\.|$)", name) if isinstance(name, str) else None
    if match is None:
        return name
    old, index = int(match.group(1)), 0
    while True:  # the old-th index of the grown stack that holds no new block
        while index in new:
            index += 1
        if old == 0:
            return f"{container}.{index}{name[match.end() :]}"
        old, index = old - 1, index + 1


def record_saturation(model: nn.Module, protocol, step, verdict: str) -> dict:
    """Append the decision "saturated everywhere" (no candidate of ``protocol`` significant at
    ``step``; the model is unchanged) to the model's record; returns the entry."""
    check_step_and_evidence(step, None, ())
    entry = {
        "event": SATURATED,
        "point": None,
        "family": protocol.family,
        "init": protocol.init,
        "protocol_digest": protocol.digest,
        "position": None,
        "new_parameters": [],
        "widened": [],
        "step": step,
        **{key: None for key in EVIDENCE_KEYS},
        "verdict": str(verdict),
    }
    _append(model, [entry])
    return entry


def _append(model: nn.Module, entries: list[dict]) -> None:
    setattr(_holder(model), RECORD_KEY, growth_history(model) + copy.deepcopy(entries))


__all__ = [
    "FIRST_STEP_KEYS",
    "GREW",
    "RECORD_KEY",
    "SATURATED",
    "growth_history",
    "record_growth",
    "record_saturation",
]
