"""Which axis of a point's output holds the features (the stream's ``d``).

One rule for the probe, ``probe.observe`` and :func:`~fused_stats.insert_zero_block`. An explicit
``feature_dim`` is only checked (a non-batch axis of the output). Without one:

* ``(B, d)``: the last axis;
* a **convolutional module** — the point is, or contains, a channels-first layer (convolution,
  batch / instance / group norm) and no layer that works on the last axis (``Linear``,
  ``LayerNorm``, embeddings, attention) — gives ``(B, C, *spatial)`` maps: axis 1;
* any other 3-d output is a sequence ``(B, T, d)``: the last axis;
* any other output of 4 or more dimensions is ambiguous — ``(B, T, H, d_head)`` attention heads
  keep their features last, ``(B, C, H, W)`` maps keep them first, and the module does not say
  which — so it is refused with an error asking for ``feature_dim``.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import FusedStatsError

# Layers whose input and output are channels-first by definition in torch.
CHANNELS_FIRST = (
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm,
)
# Layers that act on the last axis: a module holding one is not a pure convolutional stack.
FEATURES_LAST = (
    nn.Linear,
    nn.Bilinear,
    nn.LayerNorm,
    nn.Embedding,
    nn.EmbeddingBag,
    nn.MultiheadAttention,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def is_conv_stack(module: nn.Module) -> bool:
    """Whether ``module`` proves a channels-first output: it is or holds a channels-first layer and
    holds no layer that acts on the last axis."""
    mods = list(module.modules())
    return any(isinstance(m, CHANNELS_FIRST) for m in mods) and not any(
        isinstance(m, FEATURES_LAST) for m in mods
    )


def resolve_feature_dim(
    module: nn.Module, activation: torch.Tensor, point: str, feature_dim: int | None = None, where: str = ""
) -> int:
    """The feature axis of ``module``'s output ``activation`` at ``point`` (module docstring);
    ``where`` completes the error's advice (e.g. ``" to fs.Probe"``)."""
    shape, nd = tuple(activation.shape), activation.dim()
    fd = feature_dim
    if fd is None:
        if nd <= 2:
            fd = -1
        elif is_conv_stack(module):
            fd = 1
        elif nd == 3:
            fd = -1
        else:
            raise FusedStatsError(
                f"point {point!r}: cannot tell which axis of its {nd}-d output of shape {shape} "
                f"holds the features: {type(module).__name__} is not a convolutional module, so "
                "the output need not be a channels-first (B, C, H, W) map (attention heads "
                f"(B, T, H, d_head) keep the features last). Pass feature_dim=-1 (features on the "
                f"last axis: dim {shape[-1]}) or feature_dim=1 (channels first: dim {shape[1]})"
                f"{where}"
            )
    if nd < 2 or not -nd <= fd < nd or fd % nd == 0:
        raise FusedStatsError(
            f"feature_dim={fd} is not a non-batch axis of point {point!r}'s output of shape {shape}"
        )
    return fd
