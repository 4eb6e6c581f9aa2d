"""What counts as a position: the probe's masks (docs/design.md, section 5).

:func:`counted_positions` turns the ``mask=`` argument of :meth:`fused_stats.Probe.step` into a
(B, ...) tensor or None (everything counts): None → the batch's ``attention_mask``; ``"labels"``
→ position ``t`` counts when ``labels[b, t+1] ≠ −100`` and ``attention_mask`` is nonzero at ``t``
and ``t+1`` (the targets of :func:`fused_stats.causal_lm_loss`); ``"none"`` → None; a tensor or a
callable ``batch -> tensor`` as given. :func:`point_mask` fits that mask to one point's output.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ...errors import FusedStatsError
from .losses import causal_targets

MASK_MODES = ("attention", "labels", "none")


def counted_positions(batch, mask) -> torch.Tensor | None:
    """The counted-position mask of ``batch`` (module docstring), or None = everything."""
    if callable(mask) and not isinstance(mask, torch.Tensor):
        mask = mask(batch)
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor):
            raise FusedStatsError(f"the mask callable returned {type(mask).__name__}; expected a tensor")
    if isinstance(mask, torch.Tensor):
        return mask
    if mask is None:
        mask = "attention"
    if mask not in MASK_MODES:
        raise FusedStatsError(f"mask must be None, one of {MASK_MODES}, a tensor or a callable, got {mask!r}")
    if mask == "none":
        return None
    attn = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if mask == "attention":
        return attn
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if labels is None:
        raise FusedStatsError("mask='labels' needs a mapping batch with 'labels' (B, T)")
    if attn is not None and tuple(attn.shape) != tuple(labels.shape):
        raise FusedStatsError(
            f"attention_mask {tuple(attn.shape)} and labels {tuple(labels.shape)} differ in shape"
        )
    # position t emits the prediction of token t+1 (the shift of causal_lm_loss, one rule for both)
    keep = torch.zeros(labels.shape, dtype=torch.bool, device=labels.device)
    keep[..., :-1] = causal_targets(labels, attn)
    return keep


def point_mask(name: str, shape, fd: int, device, positions_mask) -> torch.Tensor | None:
    """``positions_mask`` as a bool (B, *positions) or (B,) mask of the point ``name`` whose output
    has ``shape`` with features on axis ``fd``, on ``device``; None stays None."""
    if positions_mask is None:
        return None
    m = positions_mask
    if m.device != device:
        m = m.to(device)
    ndim = len(shape)
    positions = tuple(s for i, s in enumerate(shape) if i not in (0, fd % ndim))
    B = shape[0]
    if tuple(m.shape) not in ((B,), (B, *positions)):
        raise FusedStatsError(
            f"mask of shape {tuple(m.shape)} does not fit point {name!r} with output shape "
            f"{tuple(shape)} (feature_dim={fd}); expected {(B, *positions)} or {(B,)}. Pass "
            "mask='none' or a mask per point shape"
        )
    if m.dtype != torch.bool:
        if m.is_floating_point() and not bool(torch.isfinite(m).all()):
            raise FusedStatsError(f"mask for point {name!r} contains NaN/Inf")
        m = m != 0
    return m


def flat_masked(grad, m, fd):
    """unit='flat': drop samples a (B,) mask excludes and samples with no counted position
    (not a sample, as for the other units), zero the uncounted positions of the others."""
    if m.dim() == 1:
        return grad[m]
    keep = m.unsqueeze(fd % grad.dim())
    zeroed = torch.where(keep, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
    return zeroed[m.reshape(m.shape[0], -1).any(dim=1)]


def position_sums(grad: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """``Σ_{t counted} grad[b, t]`` (B, d) of a (B, *positions, d) ``grad`` and a
    :func:`point_mask` ``m`` (None or (B,): every position; a (B,) mask's samples are dropped
    later), in fp32 for half precision. ``torch.where``, not a product with the mask: a NaN at an
    uncounted position stays out of the sum."""
    B, d = grad.shape[0], grad.shape[-1]
    dtype = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    g3 = grad.reshape(B, -1, d)
    if m is None or m.dim() == 1:
        return g3.sum(dim=1, dtype=dtype)
    keep = m.reshape(B, -1, 1)
    return torch.where(keep, g3, torch.zeros((), dtype=grad.dtype, device=grad.device)).sum(
        dim=1, dtype=dtype
    )
