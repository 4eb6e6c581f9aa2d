"""The batch view the gradient accumulators share: ``grad`` (B, d), (B, *positions, d), a
feature axis elsewhere (``feature_dim``) or ``unit="flat"``, validated and viewed as (B, T, d),
with its mask as (B, T) bool; every refusal a :class:`FusedStatsError` naming the point."""

from __future__ import annotations

import math

import torch

from ..errors import FusedStatsError


def batch_view(grad, mask, unit: str, feature_dim: int, *, dim: int, units, fed, device, where: str):
    """``(g, m)``: ``grad`` as (B, T, dim) and ``mask`` as (B, T) bool or None. ``units``: the
    units the accumulator takes; ``fed``: the unit its state holds (None before the first batch);
    ``device``: its device (None: any); ``where``: the point, for messages."""
    if not isinstance(grad, torch.Tensor):
        raise FusedStatsError(f"grad{where} must be a torch.Tensor, got {type(grad).__name__}")
    if not grad.is_floating_point():
        raise FusedStatsError(f"grad{where} must be a floating-point tensor, got dtype {grad.dtype}")
    if grad.device.type == "meta":  # shapes only: there are no values to accumulate
        raise FusedStatsError(
            f"grad{where} is on the meta device (shape {tuple(grad.shape)}, no data); expected a "
            f"tensor on {device or 'a real device'}"
        )
    if unit not in units:
        raise FusedStatsError(f"unit must be one of {units}, got {unit!r}")
    if fed is not None and unit != fed:
        raise FusedStatsError(f"this accumulator{where} was fed unit={fed!r}; got unit={unit!r}")
    if device is not None and grad.device != device:
        raise FusedStatsError(f"grad{where} is on {grad.device}, the accumulator on {device}")
    if unit == "flat":
        if grad.dim() < 1:
            raise FusedStatsError(f"grad{where} needs a batch dimension, got shape {tuple(grad.shape)}")
        size = math.prod(grad.shape[1:])
        if size != dim:
            raise FusedStatsError(
                f"unit='flat'{where}: one sample of shape {tuple(grad.shape[1:])} has {size} "
                f"elements, expected dim={dim} (grad shape {tuple(grad.shape)})"
            )
        if mask is not None:
            raise FusedStatsError(f"unit='flat'{where} takes no mask (got shape {tuple(mask.shape)})")
        return grad.reshape(grad.shape[0], 1, dim), None
    if grad.dim() < 2:
        raise FusedStatsError(
            f"grad{where} must have shape (B, d) or (B, *positions, d), got {tuple(grad.shape)}"
        )
    if not isinstance(feature_dim, int) or isinstance(feature_dim, bool):
        raise FusedStatsError(f"feature_dim must be an int, got {feature_dim!r}")
    fd = feature_dim if feature_dim >= 0 else grad.dim() + feature_dim
    if not 1 <= fd < grad.dim():
        raise FusedStatsError(
            f"feature_dim={feature_dim} is not a non-batch dimension of grad{where} with shape "
            f"{tuple(grad.shape)}"
        )
    if grad.shape[fd] != dim:
        raise FusedStatsError(
            f"grad{where} has {grad.shape[fd]} features on dim {feature_dim} (shape "
            f"{tuple(grad.shape)}, dtype {grad.dtype}); expected dim={dim}"
        )
    g = grad if fd == grad.dim() - 1 else grad.movedim(fd, -1)
    positions = tuple(g.shape[1:-1])
    B = g.shape[0]
    g = g.reshape(B, math.prod(positions), dim)  # not -1: B or a position may be 0
    if mask is None:
        return g, None
    if not isinstance(mask, torch.Tensor):
        raise FusedStatsError(f"mask{where} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.device != grad.device:
        raise FusedStatsError(f"mask{where} is on {mask.device}, grad on {grad.device}")
    if tuple(mask.shape) == (B,):
        m = mask.reshape(B, 1).expand(B, g.shape[1])
    elif tuple(mask.shape) == (B, *positions):
        m = mask.reshape(B, g.shape[1])
    else:
        raise FusedStatsError(
            f"mask{where} has shape {tuple(mask.shape)}; expected "
            f"{f'{(B, *positions)} or ' if positions else ''}{(B,)} "
            f"for grad of shape {tuple(grad.shape)} with feature_dim={feature_dim}"
        )
    if m.dtype != torch.bool:
        if m.is_floating_point() and not torch.isfinite(m).all():
            raise FusedStatsError(f"mask{where} contains NaN/Inf")
        m = m != 0
    return g, m
