"""Zero-block insertion at a residual point.

* :func:`insert_zero_block` adds the :class:`~fused_stats.api.probe.spec.CrossSpec` block (``W_out = 0``) or a zero bias at a point: the point's
  output ``z`` becomes ``z + h(z)``, which equals ``z`` exactly while ``W_out = 0`` (function
  preserving). The block is registered as a child module of the point, so it appears in
  ``model.parameters()`` and can be trained; :func:`remove_inserted_block` undoes the insertion.
* An HF model's ``save_pretrained`` refuses while a block is inserted: the block lives in a forward
  hook that ``from_pretrained`` does not rebuild, so its trained ``W_out`` would be dropped as an
  unexpected key. The state dict keeps it: rebuild the model, insert (``fs.grow`` with the same
  protocol draws the same ``W_in``), then ``load_state_dict``.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from ...errors import FusedStatsError
from ...ops.cross_twin import apply_activation
from ..probe.feature_axis import resolve_feature_dim
from ..probe.spec import CrossSpec

INSERTED_NAME = "fused_stats_inserted"


class ZeroBlock(nn.Module):
    """``h(z) = W_out φ(W_in z)`` with ``W_out = 0`` (or, ``kind="bias"``, ``h(z) = b`` with b = 0)."""

    def __init__(
        self, dim: int, kind: str = "block", spec: CrossSpec | None = None, dtype=torch.float32, device=None
    ):
        super().__init__()
        if kind not in ("bias", "block"):
            raise FusedStatsError(f"kind must be 'bias' or 'block', got {kind!r}")
        self.kind = kind
        if kind == "bias":
            self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype, device=device))
        else:
            spec = spec or CrossSpec()
            self.activation = spec.activation
            w_in = spec.projection(dim, dtype=dtype, device=device)
            self.register_buffer("w_in", w_in)
            self.w_out = nn.Parameter(torch.zeros(dim, w_in.shape[0], dtype=dtype, device=device))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if self.kind == "bias":
            return self.bias.expand_as(z)
        phi = apply_activation(z @ self.w_in.T, self.activation)
        return phi @ self.w_out.T


def _stream(out):
    """The residual-stream tensor inside a module output (a tensor or a tuple whose first item is)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise FusedStatsError(f"cannot find the residual stream in a module output of type {type(out).__name__}")


def _replace_stream(out, new):
    if isinstance(out, torch.Tensor):
        return new
    return type(out)((new, *out[1:])) if isinstance(out, tuple) else [new, *out[1:]]


def insert_zero_block(
    model: nn.Module,
    point: str,
    kind: str = "block",
    spec: CrossSpec | None = None,
    feature_dim: int | None = None,
    dim: int | None = None,
) -> ZeroBlock:
    """Insert a zero-output residual block (or zero bias) after module ``point``; returns it.

    The point's output ``z`` becomes ``z + h(z)``; since ``W_out = 0`` (``b = 0``) every element
    of ``h(z)`` is +0, ``z + 0 = z`` exactly, and the model's outputs are bit-identical.
    ``feature_dim`` is the stream's feature axis (``None``: as the Probe chooses, by
    :func:`fused_stats.api.probe.feature_axis.resolve_feature_dim`); ``dim`` its width (read from the model config or the point's layers when
    omitted). The result keeps the exact strides of ``z``, so the modules downstream see the memory
    format they saw before.
    """
    try:
        module = model.get_submodule(point)
    except AttributeError as exc:
        raise FusedStatsError(f"no module named {point!r} in {type(model).__name__}") from exc
    if hasattr(module, INSERTED_NAME):
        raise FusedStatsError(f"point {point!r} already has an inserted block; remove it first")
    param = next(model.parameters(), None)
    dtype = param.dtype if param is not None else torch.float32
    device = param.device if param is not None else None
    dim = dim or _point_width(model, module, point)
    block = ZeroBlock(dim, kind, spec, dtype=dtype, device=device)
    module.add_module(INSERTED_NAME, block)

    def hook(mod, args, out):
        z = _stream(out)
        fd = resolve_feature_dim(module, z, point, feature_dim, where=" to insert_zero_block")
        zz = z.movedim(fd, -1)
        if zz.shape[-1] != dim:
            raise FusedStatsError(
                f"inserted {kind} at {point!r} has width {dim}, but the stream there has shape "
                f"{tuple(z.shape)} with {zz.shape[-1]} features on axis {fd}; pass feature_dim/dim"
            )
        # written into a tensor with z's exact strides: downstream kernels choose their algorithm
        # by memory format (a conv on a 1x1 map flagged channels-last rounds differently)
        added = torch.empty_like(z)
        added.copy_(z + block(zz).movedim(-1, fd))
        return _replace_stream(out, added)

    block._fused_stats_handle = module.register_forward_hook(hook)
    if callable(getattr(model, "save_pretrained", None)) and "save_pretrained" not in vars(model):
        # an instance attribute: the class's method is untouched and deepcopy rebinds it to the copy
        model.save_pretrained = types.MethodType(_save_pretrained_unless_inserted, model)
    return block


def inserted_points(model: nn.Module) -> list[str]:
    """Names of the points of ``model`` that hold an inserted block."""
    return [
        name for name, m in model.named_modules() if isinstance(getattr(m, INSERTED_NAME, None), ZeroBlock)
    ]


def _save_pretrained_unless_inserted(model: nn.Module, *args, **kwargs):
    points = inserted_points(model)
    if points:
        raise FusedStatsError(
            f"save_pretrained of {type(model).__name__} with inserted blocks at {points}: from_pretrained "
            f"would drop them (keys reported unexpected), losing their trained w_out. Save "
            f"model.state_dict() instead, and to resume load the base model, insert again (fs.grow with "
            f"the same protocol draws the same w_in) and load_state_dict; or remove_inserted_block first"
        )
    return type(model).save_pretrained(model, *args, **kwargs)


def remove_inserted_block(model: nn.Module, point: str) -> None:
    """Undo :func:`insert_zero_block` at ``point``."""
    module = model.get_submodule(point)
    block = getattr(module, INSERTED_NAME, None)
    if block is None:
        raise FusedStatsError(f"point {point!r} has no inserted block")
    block._fused_stats_handle.remove()
    delattr(module, INSERTED_NAME)


def _point_width(model: nn.Module, module: nn.Module, point: str) -> int:
    """The stream width at ``point``, read from a model config or the module's parameters."""
    config = getattr(model, "config", None)
    for key in ("hidden_size", "n_embd", "d_model"):
        if config is not None and getattr(config, key, None):
            return int(getattr(config, key))
    for name in ("out_channels", "num_features", "out_features"):
        for sub in reversed(list(module.modules())):
            if hasattr(sub, name):
                return int(getattr(sub, name))
    raise FusedStatsError(f"cannot infer the width of the stream at {point!r}; pass a CrossSpec with w_in")
