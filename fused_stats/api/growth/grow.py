"""Growing the real architecture in place: :func:`grow` and its optimizer extension.

Role: ``fs.grow(model, protocol, at=[points])`` inserts the blocks of
:func:`~fused_stats.api.growth.blocks.new_block` after the given points (``family="layer"``),
widens the MLPs of the blocks that follow them (``"mlp_width"``) or hooks the probe's zero block
in (``"cross_block"``). Everything is built and checked before the model is touched, so a rejected
call leaves model, config and optimizer as they were.

After depth growth the block stack is renumbered (each attention module's ``layer_idx``, its
KV-cache slot, becomes its new index) and the HF config follows (``num_hidden_layers``; every
per-layer list of the adapter, ``layer_types``, ``no_rope_layers``, gets the entry of the block the
new one is built from: the block before it, block 0 at the input boundary), so ``generate`` with a cache and
``save_pretrained`` -> ``from_pretrained`` work on the grown model. Width growth updates the
config's intermediate size, which HF configs hold once: all blocks must grow alike.

The grown model gets its own copy of its config (every module of ``model`` that held the config
object holds the copy), so other models built from the same config object keep their depth and
width.

Optimizer (the zero-state update rule of :mod:`.protocol`): new parameters join the param group
of their counterpart in the neighbouring block (``cross_block``: of the neighbour's first matrix
parameter), with no state, which is how torch's SGD and Adam/AdamW start a parameter (SGD: the
first momentum buffer is the first gradient; Adam: zero moments, step 0), so their first step
after growth is a fresh optimizer's first step. Inside its group a new parameter is inserted
after the group's last parameter that precedes it in ``model.parameters()``, so a group built in
model order stays in model order: an optimizer built the same way over the saved and reloaded
model (HF Trainer's decay / no-decay groups) matches index for index, and ``load_state_dict`` of
the grown optimizer's state resumes it. Widened parameters keep their slot: their state tensors
are carried into the old slice of a zero tensor of the new shape, and the scalar ``step`` is
kept, so the new slice has zero moments but shares the tensor's step count; with ``t`` the count
of its first update after growth (the kept count plus one), Adam's bias corrections make that update ``(1-β₁)/(1-β₁ᵗ) · √((1-β₂ᵗ)/(1-β₂))`` times a zero-state
start's (ε → 0). No construction with one step count per tensor is exact for all later steps
(the bias correction multiplies the new gradients' terms by a factor that depends on ``t``), so
this is the rule the protocol records for ``mlp_width``. Weight decay of a new parameter is zero
at a zero origin, but not at a non-zero one (Gemma2/3's post-norm scale ``w = −1``, decayed
toward 0, moves the block off its origin): such a parameter joins a copy of its counterpart's
group with ``weight_decay = 0`` (the first such group, appended to the optimizer, that matches
the counterpart's in every other setting), so a step with a zero gradient leaves it, and the
block's function, exactly as they were. An optimizer none of whose parameters
belong to the block being grown next to, or holding state of another shape than the parameter's
(a factored second moment), is refused before anything changes.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from ...errors import FusedStatsError
from . import batchnorm
from .architecture import Architecture, Boundary
from .blocks import block_for, cross_spec, stream_width, units_for, widen_block
from .insert import INSERTED_NAME, insert_zero_block
from .plan import GrowthPlan
from .protocol import GrowthProtocol, _intermediate_size, check_init
from .record import check_step_and_evidence, record_growth


@dataclass
class GrowthResult:
    """What :func:`grow` changed.

    ``new_parameters``: full names (in the grown model) of the parameters that did not exist
    before; ``widened``: full names of parameters replaced by wider ones; ``positions``: point ->
    name of the block that now holds the growth (the inserted block, or the widened one);
    ``optimizer_groups``: full name -> index of the optimizer's param group, for each new
    parameter that joined a group and each widened parameter that kept its slot in one (a new
    parameter whose counterpart the optimizer does not hold, a frozen one, is left out);
    ``optimizer_extended``: whether any parameter joined or was replaced in the optimizer.
    """

    family: str
    init: str
    protocol_digest: str
    positions: dict[str, str] = field(default_factory=dict)
    new_parameters: list[str] = field(default_factory=list)
    widened: list[str] = field(default_factory=list)
    optimizer_groups: dict[str, int] = field(default_factory=dict)

    @property
    def optimizer_extended(self) -> bool:
        return bool(self.optimizer_groups)

    def to_dict(self) -> dict:
        return {
            "family": self.family,
            "init": self.init,
            "protocol_digest": self.protocol_digest,
            "positions": dict(self.positions),
            "new_parameters": list(self.new_parameters),
            "widened": list(self.widened),
            "optimizer_groups": dict(self.optimizer_groups),
            "optimizer_extended": self.optimizer_extended,
        }


def _check_optimizer(model: nn.Module, optimizer) -> None:
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise FusedStatsError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    own = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in own:
                raise FusedStatsError(
                    f"optimizer param group {g}, parameter {i} (shape {tuple(p.shape)}, {p.dtype}) is not a "
                    f"parameter of {type(model).__name__}: pass the optimizer built over this model"
                )


def _locate(optimizer, param) -> tuple[int, int] | None:
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p is param:
                return g, i
    return None


def _held_by(optimizer, block_name: str, block: nn.Module) -> None:
    """Refuse an optimizer that holds none of ``block``'s parameters: the new parameters next to
    it would have no group to join (and an optimizer over other parameters is not extended)."""
    if not any(_locate(optimizer, p) is not None for p in block.parameters()):
        raise FusedStatsError(
            f"the optimizer holds none of the parameters of {block_name!r}, so the parameters grown "
            f"there have no param group to join; pass the optimizer that trains that block, or "
            f"optimizer=None and build one after growth"
        )


def _plan_joins(
    optimizer, block_name: str, block: nn.Module, new: dict[str, nn.Parameter], counterpart
) -> dict:
    """New parameter (full name) -> (parameter, its group index) before anything changes.

    ``counterpart(rel)``: the neighbour's parameter whose group the new parameter ``rel`` joins;
    one the optimizer does not hold (frozen) leaves the new parameter out too.
    """
    _held_by(optimizer, block_name, block)
    joins = {}
    for name, (rel, param) in new.items():
        g = _counterpart_group(optimizer, block_name, name, counterpart(rel))
        if g is not None:
            joins[name] = (param, g)
    return joins


def _counterpart_group(optimizer, block_name: str, name: str, sibling) -> int | None:
    """The group of the counterpart ``sibling`` of new parameter ``name`` (None: not held)."""
    if sibling is None:
        raise FusedStatsError(
            f"new parameter {name!r} has no counterpart in {block_name!r} whose param group it could join"
        )
    where = _locate(optimizer, sibling)
    return None if where is None else where[0]


@dataclass(frozen=True)
class PlannedJoin:
    """Where one parameter of a growth lands in the optimizer (:func:`planned_groups`)."""

    group: int | None  # the index in optimizer.param_groups after fs.grow (None: not trained)
    settings: dict | None = field(default=None, repr=False)  # that group's (of a copy, if appended)
    shared: nn.Parameter | None = field(default=None, repr=False)  # a widened tensor's old self


def planned_groups(
    model: nn.Module, protocol: GrowthProtocol | GrowthPlan, point: str, optimizer, rels
) -> dict:
    """The join rule of :func:`grow`, without growing: for each parameter ``rel`` of the growth at
    ``point`` alone (relative to the new block; for ``mlp_width`` to the widened block; ``"w_out"``
    for ``cross_block``), a :class:`PlannedJoin`: the index in ``optimizer.param_groups`` the
    parameter has after ``fs.grow`` (None: left out, its counterpart frozen; a group that growth
    appends, the ``weight_decay = 0`` copy for a non-zero origin, by the index it will have), that
    group's settings, and for a widened tensor the tensor whose optimizer state (and step count)
    its new slice shares (None: a new parameter, no state). The optimizer is not changed."""
    plan = protocol if isinstance(protocol, GrowthPlan) else GrowthPlan.build(model, protocol)
    protocol = plan.protocol
    b = plan.candidate(point).boundary
    groups = optimizer.param_groups
    if protocol.family == "mlp_width":
        name = f"{b.container}.{b.position}"
        block = model.get_submodule(name)
        _held_by(optimizer, f"{name}.mlp", block.get_submodule("mlp"))
        out = {}
        for rel in rels:
            param = block.get_parameter(rel)
            where = _locate(optimizer, param)
            out[rel] = PlannedJoin(None) if where is None else PlannedJoin(where[0], groups[where[0]], param)
        return out
    neighbour = model.get_submodule(b.neighbour)
    if protocol.family == "cross_block":
        g = _cross_group(optimizer, b.neighbour, neighbour)
        return {rel: PlannedJoin(g, None if g is None else groups[g]) for rel in rels}
    _held_by(optimizer, b.neighbour, neighbour)
    siblings = dict(neighbour.named_parameters())
    no_decay = nonzero_origin_parameters(protocol, plan.architecture)
    # grow's own steps on a copy of the group list: the new parameters in model order, each one
    # of non-zero origin into the no-decay copy of its group (appended to the copy, if new)
    planned = [dict(group) for group in groups]
    order = {rel: i for i, rel in enumerate(siblings)}
    out = {}
    for rel in sorted(set(rels) | set(no_decay), key=lambda r: order.get(r, len(order))):
        g = _counterpart_group(optimizer, b.neighbour, rel, siblings.get(rel))
        if g is not None and rel in no_decay:
            g = _without_decay(planned, g)
        out[rel] = PlannedJoin(g, None if g is None else planned[g])
    return {rel: out[rel] for rel in rels}


def nonzero_origin_parameters(protocol: GrowthProtocol, arch: Architecture) -> tuple[str, ...]:
    """Names (relative to a new block) of the origin parameters whose origin value is not zero
    (Gemma2/3's post-norm scales, ``-1``): weight decay would move them off the origin."""
    adapter = arch.adapter
    if protocol.family != "layer" or getattr(adapter, "origin", None) != "norm_scale":
        return ()
    if float(adapter.origin_value) == 0.0:
        return ()
    return tuple(f"{m}.weight" for m in adapter.origin_modules)


def _without_decay(param_groups: list, g: int) -> int:
    """The index of a group that is group ``g`` with ``weight_decay = 0``: ``g`` itself when its
    decay is zero, else the first group appended by an earlier call that matches, else a new one
    appended to ``param_groups`` (its settings copied from ``g``, no parameters yet).
    ``param_groups``: the optimizer's own list (:func:`grow`), or a copy of it (:func:`planned_groups`,
    which finds the index without changing the optimizer)."""
    group = param_groups[g]
    if not group.get("weight_decay"):
        return g
    settings = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    settings["weight_decay"] = 0.0
    for i, other in enumerate(param_groups):
        if i != g and {k: v for k, v in other.items() if k not in ("params", "param_names")} == settings:
            return i
    clone = dict(settings, params=[])
    if "param_names" in group:
        clone["param_names"] = []
    param_groups.append(clone)
    return len(param_groups) - 1


def _join_in_model_order(optimizer, model: nn.Module, joins: dict, result, no_decay=()) -> None:
    """Insert each new parameter into its group after the group's last parameter that precedes it
    in ``model.parameters()`` (at the front when none does); those named in ``no_decay`` into
    their group's ``weight_decay = 0`` copy (:func:`_without_decay`)."""
    rank = {id(p): i for i, p in enumerate(model.parameters())}
    for name, (param, g) in sorted(joins.items(), key=lambda item: rank[id(item[1][0])]):
        if name in no_decay:
            g = _without_decay(optimizer.param_groups, g)
        group = optimizer.param_groups[g]
        params = group["params"]
        earlier = [i for i, p in enumerate(params) if rank[id(p)] < rank[id(param)]]
        at = earlier[-1] + 1 if earlier else 0
        params.insert(at, param)
        if "param_names" in group:
            group["param_names"].insert(at, name)
        result.optimizer_groups[name] = g
    # an optimizer built from named_parameters() keeps one name per slot: renumbered blocks get
    # their new names, so the names it saves are the grown model's
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        if "param_names" in group:
            group["param_names"] = [names[id(p)] for p in group["params"]]


def _own_config(model: nn.Module):
    """Give ``model`` (and each of its modules that held the same config object) a copy of its
    config; returns the function that puts the original back (for a refused call)."""
    config = getattr(model, "config", None)
    if config is None or isinstance(config, (int, float, str, bool)):
        return lambda: None
    holders = [m for m in model.modules() if m.__dict__.get("config") is config]
    own = copy.deepcopy(config)
    for m in holders:
        m.config = own

    def restore():
        for m in holders:
            m.config = config

    return restore


def _normalise_at(protocol: GrowthProtocol, at) -> list[str]:
    if at is None:
        return list(protocol.candidates)
    if isinstance(at, str):
        at = [at]
    try:
        points = list(at)
    except TypeError:
        raise FusedStatsError(f"at must be a point name or a list of them, got {type(at).__name__}") from None
    if not points:
        raise FusedStatsError("at is empty: name at least one candidate point")
    for p in points:
        protocol.index(p)  # raises naming the point when it is not a candidate
    dup = sorted({p for p in points if points.count(p) > 1})
    if dup:
        raise FusedStatsError(f"at lists points twice: {dup}")
    return points


def _insert(container: nn.Module, position: int, block: nn.Module) -> None:
    if isinstance(container, nn.ModuleList):
        container.insert(position, block)
        return
    # Sequential has no insert: re-key its children "0", "1", ... in the new order
    children = list(container)
    children.insert(position, block)
    container._modules = OrderedDict((str(i), m) for i, m in enumerate(children))


def _renumber(stack: nn.Module) -> None:
    """Each block's ``layer_idx`` (its KV-cache slot) becomes its index in the stack."""
    for i, block in enumerate(stack):
        for sub in block.modules():
            if isinstance(getattr(sub, "layer_idx", None), int):
                sub.layer_idx = i


def grow(
    model: nn.Module,
    protocol: GrowthProtocol | GrowthPlan,
    at=None,
    init: str | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    init_directions=None,
    step: int | None = None,
    evidence=None,
    batchnorm_stats=None,
) -> GrowthResult:
    """Grow ``model`` in place at the points ``at`` (default: all candidates) under ``protocol``
    (a :class:`~fused_stats.GrowthProtocol`, whose plan on ``model`` is built here, or a
    :class:`~fused_stats.GrowthPlan` made on ``model`` as it is now).

    ``init`` overrides ``protocol.init`` (``"zero"``, ``"copy"``, ``"random"``); ``optimizer``
    (built over ``model``) is extended by the new parameters (see the module docstring);
    ``init_directions`` (``mlp_width`` only): a (k, d) tensor, or a dict point -> tensor, of
    directions for the new input rows (:func:`~fused_stats.api.growth.blocks.new_units`).
    Every point grown adds an entry to the model's growth record (:mod:`.record`,
    ``fs.growth_history``), with ``step`` (the training step, if any) and ``evidence`` (an
    :class:`~fused_stats.api.growth.advise.Advice`, or a dict point -> ``{cross_frob2, p_value,
    p_adjusted}``) that motivated it; an Advice made under another protocol (digest), for another
    ``init``, or on the model before it last changed (:meth:`.plan.GrowthPlan.check_advice`) is
    refused.
    ``batchnorm_stats`` (ResNet ``family="layer"``): the probe that measured ``protocol`` (or a
    dict point -> BatchNorm name -> (mean, var)); each new block gets the running statistics the
    probe calibrated and measured it with (:mod:`.batchnorm`); None: a new block keeps fresh
    statistics (mean 0, variance 1).
    Returns a :class:`GrowthResult`. Raises :class:`FusedStatsError`, with nothing changed, for
    a point that is not a candidate / block boundary, an unsupported family or config, tied
    parameters, partial width growth of a model whose config holds one intermediate size, or an
    optimizer holding parameters that are not the model's, none of the grown-next-to block's (the
    widened MLP's), or state of another shape than a widened parameter. The model gets its own
    copy of its config (the config object it shared with others is left as it was).
    """
    plan = protocol if isinstance(protocol, GrowthPlan) else None
    protocol = protocol.protocol if plan is not None else protocol
    if not isinstance(protocol, GrowthProtocol):
        raise FusedStatsError(
            f"protocol must be a GrowthProtocol or a GrowthPlan, got {type(protocol).__name__}"
        )
    init = protocol.init if init is None else init
    check_init(protocol.family, init)
    points = _normalise_at(protocol, at)
    # every fact of (model, protocol) comes from the plan: described and checked once
    plan = GrowthPlan.build(model, protocol if plan is None else plan)
    _check_optimizer(model, optimizer)
    if init_directions is not None and protocol.family != "mlp_width":
        raise FusedStatsError(f"init_directions is for family 'mlp_width', not {protocol.family!r}")
    bounds = [plan.candidate(p).boundary for p in points]
    if hasattr(evidence, "ranked"):
        plan.check_advice(evidence, init)  # its protocol, init and the model structure it measured
    motive = check_step_and_evidence(step, evidence, points)
    calibrated = batchnorm.resolve(batchnorm_stats, plan, points, init)
    result = GrowthResult(protocol.family, init, protocol.digest)
    restore_config = _own_config(model)
    try:
        if protocol.family == "layer":
            _grow_layers(plan, bounds, init, optimizer, result, calibrated)
        elif protocol.family == "mlp_width":
            _grow_width(plan, bounds, optimizer, init_directions, result)
        else:
            _grow_cross(plan, bounds, optimizer, result)
    except FusedStatsError:
        restore_config()  # the family functions refuse before they change the model
        raise
    record_growth(model, result, step=step, evidence=motive)
    return result


def _grow_layers(plan: GrowthPlan, bounds: list[Boundary], init, optimizer, result, calibrated=None) -> None:
    model, arch = plan.model, plan.architecture
    # built first: a failure (e.g. "copy" after a downsampling block) changes nothing
    blocks = {b.point: block_for(plan, b.point, init=init) for b in bounds}
    for point, stats in (calibrated or {}).items():
        batchnorm.apply(blocks[point], stats, point)
    siblings = {}
    for b in bounds:
        neighbour = model.get_submodule(b.neighbour)
        siblings[b.point] = dict(neighbour.named_parameters())
    joins, no_decay = {}, set()
    if optimizer is not None:
        for b in bounds:
            name = f"{b.container}.{_final_index(bounds, b)}"
            new = {f"{name}.{rel}": (rel, p) for rel, p in blocks[b.point].named_parameters()}
            no_decay.update(f"{name}.{rel}" for rel in nonzero_origin_parameters(plan.protocol, arch))
            joins.update(
                _plan_joins(
                    optimizer, b.neighbour, model.get_submodule(b.neighbour), new, siblings[b.point].get
                )
            )
    config = getattr(model, "config", None)
    # per-layer config lists (layer_types, no_rope_layers, ...): the new block takes the entry of
    # the block it is built from (its neighbour: the block before, block 0 at the input boundary)
    lists = {}
    if config is not None and arch.transformer:
        for key in arch.adapter.layer_lists:
            if getattr(config, key, None) is not None:
                lists[key] = list(getattr(config, key))
    by_container: dict[str, list[Boundary]] = {}
    for b in bounds:
        by_container.setdefault(b.container, []).append(b)
    for container, items in by_container.items():
        stack = model.get_submodule(container)
        for b in sorted(items, key=lambda b: b.position, reverse=True):
            source = int(b.neighbour.rpartition(".")[2])
            for values in lists.values():
                values.insert(b.position, values[source])
            _insert(stack, b.position, blocks[b.point])
        if arch.transformer:
            _renumber(stack)
    if config is not None and arch.transformer:
        config.num_hidden_layers = int(config.num_hidden_layers) + len(bounds)
        for key, values in lists.items():
            setattr(config, key, values)
        # the new blocks were built from (or copied with) a config of their own: they read the
        # model's from now on, as every other block does (one config, saved once)
        for block in blocks.values():
            for sub in block.modules():
                if type(sub.__dict__.get("config")) is type(config):
                    sub.config = config
    for b in bounds:
        name = f"{b.container}.{_final_index(bounds, b)}"
        result.positions[b.point] = name
        result.new_parameters.extend(f"{name}.{rel}" for rel, _ in blocks[b.point].named_parameters())
    if optimizer is not None:
        _join_in_model_order(optimizer, model, joins, result, no_decay)


def _final_index(bounds: list[Boundary], b: Boundary) -> int:
    """Index the new block at ``b`` has after all of ``bounds`` are inserted: its position plus
    the new blocks of the same container before it."""
    return b.position + sum(1 for o in bounds if o.container == b.container and o.position < b.position)


def _grow_width(plan: GrowthPlan, bounds, optimizer, init_directions, result) -> None:
    model, protocol, arch = plan.model, plan.protocol, plan.architecture
    config = getattr(model, "config", None)
    stack = model.get_submodule(bounds[0].container)
    grown = {b.position for b in bounds}
    if config is not None and grown != set(range(len(stack))):
        missing = [f"{bounds[0].container}.{i}" for i in range(len(stack)) if i not in grown]
        raise FusedStatsError(
            f"width growth of only some blocks: the config holds one intermediate size, and the blocks "
            f"{missing} would keep the old one; grow every block alike (add the boundaries before them to at)"
        )
    if isinstance(init_directions, dict):
        unknown = sorted(set(init_directions) - {b.point for b in bounds})
        if unknown:
            raise FusedStatsError(f"init_directions names points not grown here: {unknown}")
        directions = {b.point: init_directions.get(b.point) for b in bounds}
    else:
        if init_directions is not None and len(bounds) > 1:
            raise FusedStatsError("init_directions for several points must be a dict point -> (k, d) tensor")
        directions = {b.point: init_directions for b in bounds}
    units = {b.point: units_for(plan, b.point, directions=directions[b.point]) for b in bounds}
    if optimizer is not None:
        for b in bounds:
            _check_carriable(optimizer, model, units[b.point])
    for b in bounds:
        block_name = units[b.point].block
        replaced = widen_block(model.get_submodule(block_name), units[b.point], arch.adapter)
        result.positions[b.point] = block_name
        for rel, (old, new) in replaced.items():
            result.widened.append(f"{block_name}.{rel}")
            if optimizer is not None:
                where = _carry_state(optimizer, old, new, units[b.point], rel)
                if where is not None:
                    result.optimizer_groups[f"{block_name}.{rel}"] = where[0]
    if config is not None:
        size = _intermediate_size(config, arch.adapter.mlp_size) + protocol.width
        keys = (arch.adapter.mlp_size,) if arch.adapter.mlp_size else ("intermediate_size", "ffn_hidden_size")
        key = next((k for k in keys if hasattr(config, k)), "n_inner")
        setattr(config, key, size)


def _check_carriable(optimizer, model: nn.Module, units) -> None:
    """Refuse, before anything changes, an optimizer that holds none of the MLP's parameters or
    whose state of one of them is neither a scalar nor of the parameter's shape (which slice of a
    factored moment is new is not defined)."""
    block = model.get_submodule(units.block)
    _held_by(optimizer, f"{units.block}.mlp", block.get_submodule("mlp"))
    for rel in units.pieces:
        param = block.get_parameter(rel)
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise FusedStatsError(
                    f"optimizer state {key!r} of {units.block}.{rel} has shape {tuple(value.shape)}, the "
                    f"parameter {tuple(param.shape)}: width growth carries only state of the parameter's "
                    f"shape (or scalars) into the widened tensor"
                )


def _carry_state(optimizer, old: nn.Parameter, new: nn.Parameter, units, rel: str):
    """``new`` takes ``old``'s slot; its state is ``old``'s in the old slice, zero in the new one.
    Returns the (group, index) of the slot, or None when the optimizer does not hold ``old``."""
    where = _locate(optimizer, old)
    if where is None:
        return None
    g, i = where
    optimizer.param_groups[g]["params"][i] = new
    state = optimizer.state.pop(old, None)
    if not state:
        return where
    carried = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == old.shape:
            carried[key] = units.widened(
                rel, value, torch.zeros_like(units.pieces[rel][1], dtype=value.dtype)
            )
        else:
            carried[key] = value
    optimizer.state[new] = carried
    return where


def _grow_cross(plan: GrowthPlan, bounds, optimizer, result) -> None:
    model, arch = plan.model, plan.architecture
    taken = [b.point for b in bounds if hasattr(model.get_submodule(b.point), INSERTED_NAME)]
    if taken:  # checked for all points first: no half-done insertion
        raise FusedStatsError(f"points {taken} already have an inserted block; remove it first")
    groups = {}
    if optimizer is not None:
        for b in bounds:
            groups[b.point] = _cross_group(optimizer, b.neighbour, model.get_submodule(b.neighbour))
    joins = {}
    for b in bounds:
        neighbour = model.get_submodule(b.neighbour)
        dim = stream_width(model, arch, neighbour)
        feature_dim = None if arch.transformer else 1
        block = insert_zero_block(
            model, b.point, spec=cross_spec(plan, b.point), feature_dim=feature_dim, dim=dim
        )
        name = f"{b.point}.{INSERTED_NAME}"
        result.positions[b.point] = name
        result.new_parameters.append(f"{name}.w_out")
        if optimizer is not None:
            joins[f"{name}.w_out"] = (block.w_out, groups[b.point])
    if optimizer is not None:
        _join_in_model_order(optimizer, model, joins, result)


def _cross_group(optimizer, block_name: str, block: nn.Module) -> int:
    """The group ``w_out`` joins: that of the neighbour's first matrix parameter the optimizer
    holds (``w_out`` is a weight matrix: decay groups hold matrices, no-decay groups norms and biases)."""
    _held_by(optimizer, block_name, block)
    for param in block.parameters():
        where = _locate(optimizer, param)
        if param.dim() >= 2 and where is not None:
            return where[0]
    raise FusedStatsError(
        f"the optimizer holds no matrix parameter of {block_name!r}, so the cross block's w_out has no "
        f"param group like its own to join"
    )
