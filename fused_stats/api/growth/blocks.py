"""The blocks and units growth adds, built once for the prober and for :func:`fused_stats.grow`.

Role: :func:`new_block` builds the block that ``fs.grow`` inserts after a candidate point, and
:func:`new_units` the hidden units ``family="mlp_width"`` adds; both are pure functions of
(growth plan, point, init): the non-zero parts are drawn from a generator seeded by the
candidate's entry of the :class:`~.plan.GrowthPlan` (:func:`block_for`, :func:`units_for`), so the
block the probe measures and the block growth inserts are the same weights. :func:`zeroed_modules` names the
parts that start at zero; their inputs are the features whose
cross-gradient ``C = E[Σ_t q_t x_tᵀ]`` is the first-order gain of the zero block (the per-sample
gradient of a zero linear map ``W`` in ``W x`` is ``q xᵀ``).

* ``family="layer"``: a new instance of the model's own block class (HF: built from
  ``model.config`` and initialised by the model's own ``_init_weights``; ResNet: PyTorch's default
  init, built with ``out_relu=False``: ``x + F(x)``, so that the zero block is the identity on any
  stream and differentiable at its origin), with the adapter's origin modules at their origin for
  ``init="zero"`` (the branch's last maps at zero, or a post-norm branch's output norm scale where
  the norm outputs 0; see :mod:`.architecture`); ``init="copy"`` is an exact copy of the block
  before the boundary (G_stack; a ResNet copy keeps that block's ``out_relu``), ``"random"`` the fresh
  block without zeroing.
* ``family="mlp_width"``: the MLP of the block that *follows* the point grows by
  ``protocol.width`` units: new input rows ``N(0, σ²)`` with the config's ``initializer_range`` σ
  (or along given directions, GradMax), zero new biases, zero new output columns.
* ``family="cross_block"``: the probe's :class:`~fused_stats.api.growth.insert.ZeroBlock`
  (``W_out = 0``, ``W_in`` seeded as above).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from ...errors import FusedStatsError
from ...networks.resnet import BasicBlock
from ..probe.spec import CrossSpec
from .architecture import Adapter, Architecture
from .gradmax import gated_mlp_refusal
from .insert import ZeroBlock
from .plan import GrowthPlan
from .protocol import GrowthProtocol, block_seed, check_init


def candidate_seed(protocol: GrowthProtocol, point: str) -> int:
    """The seed of the non-zero parts of the block at ``point`` on a model the protocol has not
    grown yet (a grown model's: :attr:`.plan.PlannedCandidate.seed`)."""
    protocol.index(point)  # refuses a point that is not a candidate
    return block_seed(protocol.seed, point, 0)


def cross_spec(plan: GrowthPlan, point: str) -> CrossSpec:
    """The :class:`CrossSpec` of the ``cross_block`` family's block at ``point``."""
    return CrossSpec(rank=plan.protocol.width, seed=plan.seed(point) % (2**31))


def _dtype_device(module: nn.Module):
    param = next(module.parameters(), None)
    if param is None:
        return torch.float32, torch.device("cpu")
    return param.dtype, param.device


def stream_width(model: nn.Module, arch: Architecture, neighbour: nn.Module) -> int:
    if arch.transformer:
        return int(model.config.hidden_size)
    return int(neighbour.get_submodule(arch.adapter.origin_modules[0]).num_features)


def config_after_insert(config, adapter: Adapter, position: int, source_index: int):
    """A copy of ``config`` with a block inserted at ``position``: ``num_hidden_layers`` + 1 and
    every per-layer list of the adapter given the entry of block ``source_index`` there (blocks
    such as Qwen2's read their attention window, SmolLM3's its use of RoPE, from them)."""
    config = copy.deepcopy(config)
    for name in adapter.layer_lists:
        values = getattr(config, name, None)
        if values is None:
            continue
        values = list(values)
        values.insert(position, values[source_index])
        setattr(config, name, values)
    config.num_hidden_layers = int(config.num_hidden_layers) + 1
    return config


# The dtype a fresh layer block is drawn in, whatever torch's default dtype is; the block is then
# cast to its neighbour's dtype. A constructor draws in the default dtype, and the same seed gives
# other values in float64 than in float32: without a fixed dtype the block at a name (and the
# |C|_F² measured at it) would depend on torch.set_default_dtype. float32 is torch's own default,
# so blocks drawn under it are unchanged (mlp_width and cross_block draw in float64, then cast).
DRAW_DTYPE = torch.float32


@contextlib.contextmanager
def _drawn_in(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` inside the block, restored after (also on error)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _fresh_block(
    model: nn.Module, arch: Architecture, neighbour: nn.Module, position: int, seed: int, neighbour_index: int
) -> nn.Module:
    with torch.random.fork_rng(devices=[]), _drawn_in(DRAW_DTYPE):
        torch.manual_seed(seed)
        if arch.transformer:
            config = config_after_insert(model.config, arch.adapter, position, neighbour_index)
            block = type(neighbour)(config, position)
            init = getattr(model, "_init_weights", None)
            if init is not None:
                # transformers' own initialisation (std = config.initializer_range, norms at 1)
                for sub in block.modules():
                    init(sub)
        else:
            ch = stream_width(model, arch, neighbour)
            # x + F(x), no trailing ReLU: the identity at F = 0 for any stream x, and smooth there
            # (relu(x + F) has a kink at every x = 0 pixel of a ReLU output: the tangent would not be one)
            if type(neighbour) is BasicBlock:
                block = type(neighbour)(ch, ch, out_relu=False)
            else:
                if ch % type(neighbour).expansion:
                    raise FusedStatsError(f"bottleneck width {ch} is not a multiple of the expansion")
                block = type(neighbour)(ch, ch // type(neighbour).expansion, out_relu=False)
    return block


def _copy_block(arch: Architecture, neighbour: nn.Module, point: str) -> nn.Module:
    if not arch.transformer:
        stride = neighbour.conv1.stride if type(neighbour) is BasicBlock else neighbour.conv2.stride
        if neighbour.downsample is not None or tuple(stride) != (1, 1):
            raise FusedStatsError(
                f"init 'copy' at {point!r}: the block there changes the stream's shape (stride "
                f"{tuple(stride)}, downsample {neighbour.downsample is not None}), so its copy cannot follow it"
            )
    return copy.deepcopy(neighbour)


def zeroed_modules(adapter: Adapter, family: str) -> list[str]:
    """Names (relative to a block) of the submodules set to the origin (:mod:`.architecture`).

    ``family="layer"``: the adapter's origin modules (a pre-norm branch's last maps, a post-norm
    branch's output norms, a ResNet block's last BatchNorm, whose per-sample scale gradient has
    the *normalised* input as feature). ``"mlp_width"``: the MLP's output map (only its new
    input columns are zero). ``"cross_block"``: ``[]``: the zero parameter is the block's own
    ``w_out``, features ``φ(W_in z)``.
    """
    if family == "cross_block":
        return []
    if family == "layer":
        return list(adapter.origin_modules)
    if family == "mlp_width":
        if adapter.mlp_output is None:
            raise FusedStatsError(
                f"family 'mlp_width' is not supported for model_type {adapter.model_type!r}: "
                f"{adapter.mlp_refused or 'its blocks have no MLP'}"
            )
        return [adapter.mlp_output]
    raise FusedStatsError(f"unknown family {family!r}")


def set_origin(block: nn.Module, adapter: Adapter) -> None:
    """Put ``block``'s origin modules at the function-preserving origin of the adapter."""
    with torch.no_grad():
        for mod in adapter.origin_modules:
            sub = block.get_submodule(mod)
            if adapter.origin == "norm_scale":
                sub.weight.fill_(adapter.origin_value)
                continue
            for p in ("weight", "bias"):
                if getattr(sub, p, None) is not None:
                    getattr(sub, p).zero_()


def new_block(model: nn.Module, protocol: GrowthProtocol, point: str, init: str | None = None) -> nn.Module:
    """Exactly the block :func:`fused_stats.grow` inserts after ``point`` (not inserted here):
    :func:`block_for` of the plan of ``model`` under ``protocol`` (a protocol or a plan)."""
    return block_for(GrowthPlan.build(model, protocol), point, init)


def block_for(plan: GrowthPlan, point: str, init: str | None = None) -> nn.Module:
    """The block the candidate ``point`` of ``plan`` describes (not inserted).

    For ``family="mlp_width"`` this is a widened copy of the block that follows ``point`` (the
    one that grows), with :func:`units_for` in place. The result has the dtype and device of the
    neighbouring block and its training mode; the model is not changed.
    """
    protocol, model, arch = plan.protocol, plan.model, plan.architecture
    init = protocol.init if init is None else init
    check_init(protocol.family, init)
    entry = plan.candidate(point)
    b, seed = entry.boundary, entry.seed
    neighbour = model.get_submodule(b.neighbour)
    dtype, device = _dtype_device(neighbour)
    if protocol.family == "cross_block":
        return ZeroBlock(
            stream_width(model, arch, neighbour),
            "block",
            cross_spec(plan, point),
            dtype=dtype,
            device=device,
        )
    if protocol.family == "mlp_width":
        block = copy.deepcopy(model.get_submodule(entry.target))
        widen_block(block, units_for(plan, point), arch.adapter)
        return block
    if init == "copy":
        block = _copy_block(arch, neighbour, point)
    else:
        block = _fresh_block(model, arch, neighbour, b.position, seed, int(b.neighbour.rpartition(".")[2]))
        if init == "zero":
            set_origin(block, arch.adapter)
    if arch.transformer:
        # HF's gradient checkpointing is a per-layer flag set by gradient_checkpointing_enable():
        # a new layer checkpoints like its neighbour, or it would silently keep its activations
        for attr in ("gradient_checkpointing", "_gradient_checkpointing_func"):
            if attr in vars(neighbour):
                setattr(block, attr, vars(neighbour)[attr])
    block = block.to(dtype=dtype, device=device)
    block.train(neighbour.training)
    return block


@dataclass
class NewUnits:
    """The ``width`` new hidden units of one MLP (``family="mlp_width"``).

    ``block``: name of the block whose MLP grows; ``pieces``: parameter name (relative to that
    block) -> (axis, tensor to append along it): new input rows (random or along directions),
    zero new biases, zero new output columns.
    """

    block: str
    width: int
    pieces: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # parameter name -> its equal parts along the axis (a fused map: Phi3's gate_up_proj, 2);
    # each part of the piece goes at the end of the matching part of the old tensor
    chunks: dict[str, int] = field(default_factory=dict)

    def widened(self, name: str, old: torch.Tensor, piece: torch.Tensor | None = None) -> torch.Tensor:
        """``old`` with the new entries of parameter ``name`` (``piece``, by default this
        growth's own) placed at the end of each of its parts."""
        axis, own = self.pieces[name]
        piece = own if piece is None else piece
        parts = self.chunks.get(name, 1)
        piece = piece.to(dtype=old.dtype, device=old.device)
        olds, news = old.chunk(parts, dim=axis), piece.chunk(parts, dim=axis)
        return torch.cat([t for pair in zip(olds, news) for t in pair], dim=axis)


def new_units(
    model: nn.Module, protocol: GrowthProtocol, point: str, directions: torch.Tensor | None = None
) -> NewUnits:
    """:func:`units_for` of the plan of ``model`` under ``protocol`` (a protocol or a plan)."""
    return units_for(GrowthPlan.build(model, protocol), point, directions)


def units_for(plan: GrowthPlan, point: str, directions: torch.Tensor | None = None) -> NewUnits:
    """The hidden units ``mlp_width`` adds to the MLP of the block that follows ``point``.

    New input rows ``N(0, σ²)``, σ the config's ``initializer_range`` (0.02 without one), drawn
    from the candidate's seed in ``plan``; with ``directions`` (k, d), k ≥ ``width``, the first input map's
    new rows are the first ``width`` directions rescaled to the norm ``σ √d`` of a random row (the
    GradMax idea: top singular vectors of the measured cross-gradient maximise the initial gradient
    norm; refused for a gated MLP, where they do not: :mod:`.gradmax`). New biases and new output
    columns are zero, so the function is unchanged.
    """
    protocol, model = plan.protocol, plan.model
    if protocol.family != "mlp_width":
        raise FusedStatsError(f"new_units needs family 'mlp_width', the protocol has {protocol.family!r}")
    entry = plan.candidate(point)
    name = entry.target
    block = model.get_submodule(name)
    adapter = plan.adapter
    zeroed_modules(adapter, "mlp_width")  # refuses a family without width growth
    ins, out = adapter.mlp_inputs, adapter.mlp_output
    k = protocol.width
    d = int(model.config.hidden_size)
    sigma = float(getattr(model.config, "initializer_range", None) or 0.02)
    dtype, device = _dtype_device(block)
    gen = torch.Generator().manual_seed(entry.seed)
    parts = adapter.mlp_chunks
    rows = [torch.randn(k, d, generator=gen, dtype=torch.float64) * sigma for _ in range(len(ins) * parts)]
    if directions is not None:
        gated_mlp_refusal(adapter, f"{point!r} (init_directions)")
        if not isinstance(directions, torch.Tensor) or directions.dim() != 2 or directions.shape[1] != d:
            shape = (
                tuple(directions.shape) if isinstance(directions, torch.Tensor) else type(directions).__name__
            )
            raise FusedStatsError(f"init_directions must be a (k, {d}) tensor of directions, got {shape}")
        if directions.shape[0] < k:
            raise FusedStatsError(
                f"init_directions has {directions.shape[0]} rows, width {k} needs at least {k}"
            )
        dirs = directions[:k].detach().to(torch.float64, copy=True).cpu()
        norms = dirs.norm(dim=1, keepdim=True)
        if not torch.isfinite(dirs).all() or (norms == 0).any():
            raise FusedStatsError("init_directions has a zero or non-finite row")
        rows[0] = dirs / norms * (sigma * d**0.5)
    pieces: dict[str, tuple[int, torch.Tensor]] = {}
    chunks: dict[str, int] = {}
    for i, mod in enumerate(ins):
        sub = block.get_submodule(mod)
        r = torch.cat(rows[i * parts : (i + 1) * parts])  # a fused map: the new rows of each part
        if adapter.conv1d:  # Conv1D: weight (in, out): new output *columns*
            pieces[f"{mod}.weight"] = (1, r.T.to(dtype))
        else:
            pieces[f"{mod}.weight"] = (0, r.to(dtype))
        if getattr(sub, "bias", None) is not None:
            pieces[f"{mod}.bias"] = (0, torch.zeros(k * parts, dtype=dtype))
        if parts > 1:
            chunks[f"{mod}.weight"] = chunks[f"{mod}.bias"] = parts
    if adapter.conv1d:
        pieces[f"{out}.weight"] = (0, torch.zeros(k, d, dtype=dtype))
    else:
        pieces[f"{out}.weight"] = (1, torch.zeros(d, k, dtype=dtype))
    pieces = {n: (ax, t.to(device)) for n, (ax, t) in pieces.items()}
    return NewUnits(name, k, pieces, {n: c for n, c in chunks.items() if n in pieces})


def widened_tensors(block: nn.Module, units: NewUnits) -> dict[str, torch.Tensor]:
    """Parameter name (relative to ``block``) -> the widened value (old values, then new)."""
    return {name: units.widened(name, block.get_parameter(name).detach()) for name in units.pieces}


def widen_block(
    block: nn.Module, units: NewUnits, adapter: Adapter
) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
    """Replace the MLP parameters of ``block`` by widened ones; returns name -> (old, new)."""
    values = widened_tensors(block, units)
    replaced = {}
    for name, value in values.items():
        mod_name, _, pname = name.rpartition(".")
        mod = block.get_submodule(mod_name)
        old = getattr(mod, pname)
        new = nn.Parameter(value, requires_grad=old.requires_grad)
        setattr(mod, pname, new)
        replaced[name] = (old, new)
    _update_sizes(block, units.width, adapter)
    return replaced


def _update_sizes(block: nn.Module, k: int, adapter: Adapter) -> None:
    """Keep the modules' size attributes (read by their forward or repr) in step with the weights."""
    ins, out = adapter.mlp_inputs, adapter.mlp_output
    for mod in ins:
        sub = block.get_submodule(mod)
        if adapter.conv1d:
            sub.nf += k * adapter.mlp_chunks
        else:
            sub.out_features += k * adapter.mlp_chunks
    sub = block.get_submodule(out)
    if adapter.conv1d:
        sub.nx += k
    else:
        sub.in_features += k
    mlp = block.get_submodule("mlp")
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size += k
