"""The growth plan: every fact growth needs about (model, protocol), derived once.

Role: :meth:`GrowthPlan.build` describes the model (its row of the architecture table,
:func:`.architecture.describe`), runs every check of the protocol on it
(:meth:`.protocol.GrowthProtocol.check`: candidates, family, config, untied parameters), and
resolves each candidate to a :class:`PlannedCandidate`: its :class:`~.architecture.Boundary`, the
module the growth lands in, and the seed of its block's non-zero parts. The tangent probe, ``fs.grow``,
the scores, the schedule and the command line take the plan (or build it once from a protocol) and
read these facts from it; :mod:`.blocks` builds the block a candidate's entry describes.

The seed of a candidate's block is :func:`.protocol.block_seed` of (protocol seed, candidate name,
the growth events at that name already in the model's record, :mod:`.record`): it does not depend
on which other candidates are listed or in which order, and a second growth at one name draws
other weights than the first. A plan is bound to the model as it was when built: after the model
changes (a growth, a block added or removed), :meth:`GrowthPlan.require_current` refuses it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from ...errors import FusedStatsError
from .architecture import Architecture, Boundary, boundary, describe
from .protocol import GrowthProtocol, block_seed, check_init, make_feature_source
from .record import GREW, growth_history


@dataclass(frozen=True)
class PlannedCandidate:
    """One candidate of a plan: where its block goes and what it is drawn from.

    ``target``: the module that holds the growth once made (``family="layer"``: the new block's
    name before renumbering, ``container.position``; ``"mlp_width"``: the block whose MLP
    widens; ``"cross_block"``: the point, which the zero block is hooked onto); ``source``: the
    block the new one is built from (its class and config, or its copy under ``init="copy"``);
    ``earlier_growths``: the growth events at this point in the model's record when the plan was
    made; ``seed``: the seed of the block's non-zero parts.
    """

    point: str
    boundary: Boundary
    target: str
    source: str
    earlier_growths: int
    seed: int

    def to_dict(self) -> dict:
        return {
            "point": self.point,
            "container": self.boundary.container,
            "position": self.boundary.position,
            "target": self.target,
            "source": self.source,
            "earlier_growths": self.earlier_growths,
            "seed": self.seed,
        }


def _structure(model: nn.Module, arch: Architecture, history_length: int) -> dict:
    """What a plan's facts rest on, as plain data (reports and advice keep it): the block count of
    each container and the number of entries in the model's growth record."""
    return {
        "blocks": {c: len(model.get_submodule(c)) for c in arch.containers},
        "record_events": history_length,
    }


def _event(entry: dict) -> str:
    if entry.get("event") != GREW:
        return f"{entry.get('event')} at step {entry.get('step')}"
    return (
        f"grew at {entry.get('point')!r} ({entry.get('family')}, init {entry.get('init')!r}), now "
        f"{entry.get('position')}"
    )


def structure_changes(then: dict, model: nn.Module, now: dict) -> str:
    """What differs between the structure ``then`` and ``model``'s structure ``now``: the block
    counts, and the growth record's events added since (as the record names them now)."""
    parts = []
    for container in sorted(set(then["blocks"]) | set(now["blocks"])):
        a, b = then["blocks"].get(container), now["blocks"].get(container)
        if a != b:
            parts.append(f"{container}: {a} blocks then, {b} now")
    a, b = then["record_events"], now["record_events"]
    if a != b:
        added = growth_history(model)[a:] if b > a else []
        parts.append(
            f"growth record: {a} events then, {b} now"
            + (f" ({'; '.join(map(_event, added))})" if added else "")
        )
    return "; ".join(parts)


@dataclass(frozen=True)
class GrowthPlan:
    """The plan of growing ``model`` under ``protocol`` (module docstring); build it with
    :meth:`build` (or ``fs.plan_growth(model, protocol)``)."""

    model: nn.Module
    protocol: GrowthProtocol
    architecture: Architecture
    candidates: dict[str, PlannedCandidate]
    structure: dict

    @classmethod
    def build(cls, model: nn.Module, protocol: GrowthProtocol) -> GrowthPlan:
        """Describe ``model``, check ``protocol`` on it and resolve every candidate; raises
        :class:`FusedStatsError` (nothing changed) where the protocol cannot be grown there."""
        if isinstance(protocol, GrowthPlan):
            protocol.require_current(model)
            return protocol
        if not isinstance(protocol, GrowthProtocol):
            raise FusedStatsError(f"protocol must be a GrowthProtocol, got {type(protocol).__name__}")
        return cls.from_architecture(model, protocol, describe(model))

    @classmethod
    def from_architecture(cls, model: nn.Module, protocol: GrowthProtocol, arch: Architecture) -> GrowthPlan:
        """:meth:`build` with the model's architecture already described (by a caller that needed
        it first, e.g. to list the growth points for ``candidates = "all"``)."""
        check_init(protocol.family, protocol.init)
        protocol.check(model, arch)
        history = growth_history(model)  # a record fs.grow could not append to is refused here
        candidates = {}
        for point in protocol.candidates:
            b = boundary(arch, model, point)
            # layer: the new block's index; mlp_width: the block whose MLP widens; cross: the point
            target = point if protocol.family == "cross_block" else f"{b.container}.{b.position}"
            earlier = sum(1 for e in history if e.get("event") == GREW and e.get("point") == point)
            candidates[point] = PlannedCandidate(
                point=point,
                boundary=b,
                target=target,
                source=b.neighbour,
                earlier_growths=earlier,
                seed=block_seed(protocol.seed, point, earlier),
            )
        return cls(model, protocol, arch, candidates, _structure(model, arch, len(history)))

    @property
    def adapter(self):
        return self.architecture.adapter

    @property
    def family(self) -> str:
        return self.protocol.family

    def candidate(self, point: str) -> PlannedCandidate:
        """The plan's entry of ``point``; :class:`FusedStatsError` naming the candidates otherwise."""
        entry = self.candidates.get(point) if isinstance(point, str) else None
        if entry is None:
            raise FusedStatsError(
                f"point {point!r} is not a candidate of this growth protocol; candidates: "
                f"{list(self.protocol.candidates)}"
            )
        return entry

    def seed(self, point: str) -> int:
        return self.candidate(point).seed

    def is_current(self, model: nn.Module) -> bool:
        """Whether the plan still describes ``model`` (:meth:`require_current` without the error):
        False for any other model object, even one of the same structure and weights."""
        now = _structure(model, self.architecture, len(growth_history(model)))
        return model is self.model and now == self.structure

    def require_current(self, model: nn.Module) -> None:
        """Refuse the plan for another model, or for its model after a change of structure or a
        growth since the plan was made (its boundaries and seeds would be stale)."""
        if model is not self.model:
            raise FusedStatsError(
                f"this growth plan was made for another {type(self.model).__name__} object, not the "
                f"{type(model).__name__} given: build the plan on the model that grows"
            )
        changed = self.changes(model)
        if changed:
            raise FusedStatsError(
                f"the growth plan is stale: the model changed since it was made ({changed}); build a new plan"
            )

    def changes(self, model: nn.Module) -> str:
        """What changed in ``model``'s structure since the plan was made (:func:`structure_changes`;
        ``""``: nothing)."""
        now = _structure(model, self.architecture, len(growth_history(model)))
        return "" if now == self.structure else structure_changes(self.structure, model, now)

    def check_advice(self, advice, init: str) -> None:
        """Refuse ``advice`` (an :class:`~fused_stats.Advice`) as the evidence of a growth under this
        plan (the model as it is now) at ``init``: advice of another protocol, of another init, or
        measured on the model before it changed, where its candidate names meant other places (a
        growth inserts blocks and renumbers the ones after them). An object with rows only (no
        ``digest``) is taken as given, like a dict."""
        digest = getattr(advice, "digest", None)
        if digest is None:
            return
        if digest != self.protocol.digest:
            # advice measured the blocks of another protocol: recording it here would misattribute it
            raise FusedStatsError(
                f"evidence: the advice was made under protocol {str(digest)[:12]}…, this growth's "
                f"protocol is {self.protocol.digest[:12]}…; give the advice of this protocol's probe"
            )
        measured_init = (getattr(advice, "protocol", None) or {}).get("init")
        if measured_init != init:
            raise FusedStatsError(
                f"evidence: the advice measured blocks of init {measured_init!r}, this growth makes init "
                f"{init!r}; its |C|_F² and p are not those of the blocks grown here: grow with init "
                f"{measured_init!r}, or probe a protocol of init {init!r}"
            )
        measured = getattr(advice, "structure", None)
        if measured is None:
            raise FusedStatsError(
                "evidence: the advice records no model structure (its reports were written by an older "
                "fused_stats), so it cannot be checked against the model as it is now; probe again, or "
                "give the evidence as a dict point -> {cross_frob2, p_value, p_adjusted}"
            )
        if measured != self.structure:
            raise FusedStatsError(
                f"evidence: the advice was measured on the model as it was, and the model changed since "
                f"({structure_changes(measured, self.model, self.structure)}): its numbers are those of "
                "the blocks it measured there, and a growth renumbers the blocks after it, so a candidate's "
                "name may now mean another place; grow every advised point in one fs.grow call, or probe "
                "the grown model again (docs/growth/grow.md, evidence after a growth)"
            )

    def rebound(self, copy: nn.Module) -> GrowthPlan:
        """This plan for ``copy``, a deep copy of the plan's model made since (same structure,
        same record): the facts carry over unchanged."""
        plan = dataclasses.replace(self, model=copy)
        plan.require_current(copy)
        return plan

    def feature_source(self, model: nn.Module):
        """The tangent probe of this plan (what ``fs.Probe(model, cross=plan)`` measures)."""
        self.require_current(model)
        return make_feature_source(self, model)

    def zero_parameters(self) -> dict[str, list[str]]:
        """The parameters of the grown parts that start at the origin, named inside one block by
        this model's architecture row: ``{model_type: [names]}`` (``{"any": ["w_out"]}`` for the
        cross block, ``{}`` when ``init`` is not ``"zero"``). A norm scale whose origin is not 0
        (Gemma's ``x̂ (1 + w)`` at ``w = -1``) is named with that value."""
        protocol, adapter = self.protocol, self.adapter
        if protocol.init != "zero":
            return {}
        if protocol.family == "cross_block":
            return {"any": ["w_out"]}
        if protocol.family == "mlp_width":
            side = "rows" if adapter.conv1d else "columns"  # Conv1D stores (in, out)
            return {adapter.model_type: [f"{adapter.mlp_output}.weight[new {side}]"]}
        block = self.model.get_submodule(next(iter(self.candidates.values())).source)
        names = []
        for module in adapter.origin_modules:
            sub = block.get_submodule(module)
            if adapter.origin == "norm_scale":
                at = "" if adapter.origin_value == 0 else f"[at {adapter.origin_value:g}]"
                names.append(f"{module}.weight{at}")
                continue
            names += [f"{module}.{p}" for p in ("weight", "bias") if getattr(sub, p, None) is not None]
        return {adapter.model_type: names}

    def to_dict(self) -> dict:
        """The plan as plain data: the protocol's digest, the architecture and each candidate."""
        return {
            "protocol_digest": self.protocol.digest,
            "model_type": self.architecture.kind,
            "candidates": [c.to_dict() for c in self.candidates.values()],
            "zero_parameters": self.zero_parameters(),
        }


def plan_growth(model: nn.Module, protocol: GrowthProtocol) -> GrowthPlan:
    """``GrowthPlan.build(model, protocol)``: the plan of growing ``model`` under ``protocol``."""
    return GrowthPlan.build(model, protocol)


__all__ = ["GrowthPlan", "PlannedCandidate", "plan_growth", "structure_changes"]
