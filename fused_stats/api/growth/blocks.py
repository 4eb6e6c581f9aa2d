"""The blocks and units growth adds, built once for the prober and for :func:`fused_stats.grow`.

Role: :func:`new_block` builds the block that ``fs.grow`` inserts after a candidate point, and
:func:`new_units` the hidden units ``family="mlp_width"`` adds; both are pure functions of
(model architecture, protocol, point, init): the non-zero parts are drawn from a generator seeded
by ``(protocol.seed, protocol.index(point))`` (:func:`candidate_seed`), so the block the probe
measures and the block growth inserts are the same weights. :func:`zero_parameters` and
:func:`zeroed_modules` name the parts that start at zero; their inputs are the features whose
cross-gradient ``C = E[Σ_t q_t x_tᵀ]`` is the first-order gain of the zero block (the per-sample
gradient of a zero linear map ``W`` in ``W x`` is ``q xᵀ``).

* ``family="layer"``: a new instance of the model's own block class (HF: built from
  ``model.config`` and initialised by the model's own ``_init_weights``; ResNet: PyTorch's default
  init), with the branch's last maps zeroed for ``init="zero"`` (see :mod:`.architecture`);
  ``init="copy"`` is a copy of the block before the boundary (G_stack), ``"random"`` the fresh
  block without zeroing.
* ``family="mlp_width"``: the MLP of the block that *follows* the point grows by
  ``protocol.width`` units: new input rows ``N(0, σ²)`` with the config's ``initializer_range`` σ
  (or along given directions, GradMax), zero new biases, zero new output columns.
* ``family="cross_block"``: the probe's :class:`~fused_stats.api.growth.insert.ZeroBlock`
  (``W_out = 0``, ``W_in`` seeded as above).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ...errors import FusedStatsError
from ..probe.spec import CrossSpec
from .architecture import MLP_PARTS, ZEROED_MODULES, Architecture, _kind_of_block, boundary
from .insert import ZeroBlock
from .protocol import GrowthProtocol, check_init


def candidate_seed(protocol: GrowthProtocol, point: str) -> int:
    """The seed of the non-zero parts of the block at ``point``: from (seed, candidate index)."""
    text = f"fused_stats.growth/{protocol.seed}/{protocol.index(point)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def cross_spec(protocol: GrowthProtocol, point: str) -> CrossSpec:
    """The :class:`CrossSpec` of the ``cross_block`` family's block at ``point``."""
    return CrossSpec(rank=protocol.width, seed=candidate_seed(protocol, point) % (2**31))


def _dtype_device(module: nn.Module):
    param = next(module.parameters(), None)
    if param is None:
        return torch.float32, torch.device("cpu")
    return param.dtype, param.device


def stream_width(model: nn.Module, arch: Architecture, neighbour: nn.Module) -> int:
    if arch.transformer:
        return int(model.config.hidden_size)
    last = neighbour.bn2 if arch.block_kind == "resnet_basic" else neighbour.bn3
    return int(last.num_features)


def _config_after_insert(config, position: int, neighbour_index: int):
    """The config a block at ``position`` is built from: a ``layer_types`` list gets the
    neighbour's type there (blocks such as Qwen2's read their attention window from it)."""
    types = getattr(config, "layer_types", None)
    if not types:
        return config
    config = copy.deepcopy(config)
    types = list(types)
    types.insert(position, types[neighbour_index])
    config.num_hidden_layers = len(types)
    config.layer_types = types
    return config


def _fresh_block(
    model: nn.Module, arch: Architecture, neighbour: nn.Module, position: int, seed: int, neighbour_index: int
) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch.transformer:
            block = type(neighbour)(_config_after_insert(model.config, position, neighbour_index), position)
            init = getattr(model, "_init_weights", None)
            if init is not None:
                # transformers' own initialisation (std = config.initializer_range, norms at 1)
                for sub in block.modules():
                    init(sub)
        else:
            ch = stream_width(model, arch, neighbour)
            if arch.block_kind == "resnet_basic":
                block = type(neighbour)(ch, ch)
            else:
                if ch % type(neighbour).expansion:
                    raise FusedStatsError(f"bottleneck width {ch} is not a multiple of the expansion")
                block = type(neighbour)(ch, ch // type(neighbour).expansion)
    return block


def _copy_block(arch: Architecture, neighbour: nn.Module, point: str) -> nn.Module:
    if not arch.transformer:
        stride = neighbour.conv1.stride if arch.block_kind == "resnet_basic" else neighbour.conv2.stride
        if neighbour.downsample is not None or tuple(stride) != (1, 1):
            raise FusedStatsError(
                f"init 'copy' at {point!r}: the block there changes the stream's shape (stride "
                f"{tuple(stride)}, downsample {neighbour.downsample is not None}), so its copy cannot follow it"
            )
    return copy.deepcopy(neighbour)


def zeroed_modules(block: nn.Module, family: str) -> list[str]:
    """Names (relative to ``block``) of the submodules whose weights start at zero.

    ``family="layer"``: the branch's last maps (LLaMA ``self_attn.o_proj``, ``mlp.down_proj``;
    GPT-2 ``attn.c_proj``, ``mlp.c_proj``; NeoX ``attention.dense``, ``mlp.dense_4h_to_h``;
    ResNet ``bn2`` / ``bn3``, whose per-sample weight gradient has the *normalised* input as
    feature). ``"mlp_width"``: the MLP's output map (only its new input columns are zero).
    ``"cross_block"``: ``[]``: the zero parameter is the block's own ``w_out``, features
    ``φ(W_in z)``.
    """
    if family == "cross_block":
        return []
    kind = _kind_of_block(block)
    if kind is None:
        raise FusedStatsError(f"{type(block).__name__} is not a block growth knows")
    if family == "layer":
        return list(ZEROED_MODULES[kind])
    if family == "mlp_width":
        if kind not in MLP_PARTS:
            raise FusedStatsError(f"family 'mlp_width' is not supported for {type(block).__name__} (no MLP)")
        return [MLP_PARTS[kind][1]]
    raise FusedStatsError(f"unknown family {family!r}")


def zero_parameters(model: nn.Module, protocol: GrowthProtocol, point: str) -> list[str]:
    """Names, relative to the new block (the grown block for ``mlp_width``), of the parameters
    that start at zero with ``init="zero"``: for ``mlp_width`` only their new slice is zero."""
    arch = protocol.check(model)
    b = boundary(arch, model, point)
    if protocol.family == "cross_block":
        return ["w_out"]
    name = f"{b.container}.{b.position}" if protocol.family == "mlp_width" else b.neighbour
    block = model.get_submodule(name)
    names = []
    for mod in zeroed_modules(block, protocol.family):
        sub = block.get_submodule(mod)
        for p in ("weight",) if protocol.family == "mlp_width" else ("weight", "bias"):
            if getattr(sub, p, None) is not None:
                names.append(f"{mod}.{p}")
    return names


def new_block(model: nn.Module, protocol: GrowthProtocol, point: str, init: str | None = None) -> nn.Module:
    """Exactly the block :func:`fused_stats.grow` inserts after ``point`` (not inserted here).

    For ``family="mlp_width"`` this is a widened copy of the block that follows ``point`` (the
    one that grows), with :func:`new_units` in place. The result has the dtype and device of the
    neighbouring block and its training mode; the model is not changed.
    """
    init = protocol.init if init is None else init
    check_init(protocol.family, init)
    arch = protocol.check(model)
    b = boundary(arch, model, point)
    seed = candidate_seed(protocol, point)
    neighbour = model.get_submodule(b.neighbour)
    dtype, device = _dtype_device(neighbour)
    if protocol.family == "cross_block":
        return ZeroBlock(
            stream_width(model, arch, neighbour),
            "block",
            cross_spec(protocol, point),
            dtype=dtype,
            device=device,
        )
    if protocol.family == "mlp_width":
        target = f"{b.container}.{b.position}"
        block = copy.deepcopy(model.get_submodule(target))
        widen_block(block, new_units(model, protocol, point))
        return block
    if init == "copy":
        block = _copy_block(arch, neighbour, point)
    else:
        block = _fresh_block(model, arch, neighbour, b.position, seed, int(b.neighbour.rpartition(".")[2]))
        if init == "zero":
            with torch.no_grad():
                for mod in zeroed_modules(block, "layer"):
                    sub = block.get_submodule(mod)
                    for p in ("weight", "bias"):
                        if getattr(sub, p, None) is not None:
                            getattr(sub, p).zero_()
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


def new_units(
    model: nn.Module, protocol: GrowthProtocol, point: str, directions: torch.Tensor | None = None
) -> NewUnits:
    """The hidden units ``mlp_width`` adds to the MLP of the block that follows ``point``.

    New input rows ``N(0, σ²)``, σ the config's ``initializer_range`` (0.02 without one), drawn
    from :func:`candidate_seed`; with ``directions`` (k, d), k ≥ ``width``, the first input map's
    new rows are the first ``width`` directions rescaled to the norm ``σ √d`` of a random row (the
    GradMax idea: top singular vectors of the measured cross-gradient maximise the initial gradient
    norm). New biases and new output columns are zero, so the function is unchanged.
    """
    if protocol.family != "mlp_width":
        raise FusedStatsError(f"new_units needs family 'mlp_width', the protocol has {protocol.family!r}")
    arch = protocol.check(model)
    b = boundary(arch, model, point)
    name = f"{b.container}.{b.position}"
    block = model.get_submodule(name)
    kind = _kind_of_block(block)
    ins, out = MLP_PARTS[kind]
    k = protocol.width
    d = int(model.config.hidden_size)
    sigma = float(getattr(model.config, "initializer_range", None) or 0.02)
    dtype, device = _dtype_device(block)
    gen = torch.Generator().manual_seed(candidate_seed(protocol, point))
    rows = [torch.randn(k, d, generator=gen, dtype=torch.float64) * sigma for _ in ins]
    if directions is not None:
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
    for mod, r in zip(ins, rows):
        sub = block.get_submodule(mod)
        if kind == "gpt2":  # Conv1D: weight (in, out): new output *columns*
            pieces[f"{mod}.weight"] = (1, r.T.to(dtype))
        else:
            pieces[f"{mod}.weight"] = (0, r.to(dtype))
        if getattr(sub, "bias", None) is not None:
            pieces[f"{mod}.bias"] = (0, torch.zeros(k, dtype=dtype))
    if kind == "gpt2":
        pieces[f"{out}.weight"] = (0, torch.zeros(k, d, dtype=dtype))
    else:
        pieces[f"{out}.weight"] = (1, torch.zeros(d, k, dtype=dtype))
    pieces = {n: (ax, t.to(device)) for n, (ax, t) in pieces.items()}
    return NewUnits(name, k, pieces)


def widened_tensors(block: nn.Module, units: NewUnits) -> dict[str, torch.Tensor]:
    """Parameter name (relative to ``block``) -> the widened value (old values, then new)."""
    out = {}
    for name, (axis, piece) in units.pieces.items():
        old = block.get_parameter(name)
        out[name] = torch.cat([old.detach(), piece.to(dtype=old.dtype, device=old.device)], dim=axis)
    return out


def widen_block(block: nn.Module, units: NewUnits) -> dict[str, tuple[nn.Parameter, nn.Parameter]]:
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
    _update_sizes(block, units.width)
    return replaced


def _update_sizes(block: nn.Module, k: int) -> None:
    """Keep the modules' size attributes (read by their forward or repr) in step with the weights."""
    kind = _kind_of_block(block)
    ins, out = MLP_PARTS[kind]
    for mod in ins:
        sub = block.get_submodule(mod)
        if kind == "gpt2":
            sub.nf += k
        else:
            sub.out_features += k
    sub = block.get_submodule(out)
    if kind == "gpt2":
        sub.nx += k
    else:
        sub.in_features += k
    mlp = block.get_submodule("mlp")
    if hasattr(mlp, "intermediate_size"):
        mlp.intermediate_size += k
