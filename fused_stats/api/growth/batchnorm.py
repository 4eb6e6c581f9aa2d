"""Calibrated BatchNorm statistics of a new ResNet block: the ones the probe measures with and
:func:`fused_stats.grow` inserts.

Role: a fresh ``BatchNorm2d`` holds running statistics mean 0, variance 1. The probe runs the model
in eval mode (each sample's tangent depends on that sample only), so at those statistics it would
measure a block that normalises its conv outputs by (0, 1), while the first training step, in
train mode, normalises them by the batch (the two ``|∂L/∂γ|²`` of the zero BatchNorm differed by
factors 0.03 to 2.6 across candidates). Eval mode is kept, and each new BatchNorm's running
statistics are set, in
module order (the earlier ones already set, the block in eval mode), to the per-channel statistics
of its input ``x`` over a calibration batch:

    running_mean = mean_{b,h,w} x,    running_var = mean_{b,h,w} (x − running_mean)²,

the biased variance, which is what train mode normalises a batch by (``F.batch_norm`` with
``training=True``). On the calibration batch the block in eval mode then computes exactly what it
computes in train mode, its zero BatchNorm's ``∂L/∂γ = Σ_t q_t ⊙ x̂_t`` included (``γ = β = 0``
keeps the block the identity either way, so ``q`` is the same); on later batches of the same
distribution it is the normalisation a training batch would see, up to the batch's noise.

The probe calibrates at a candidate on the first batch it sees there
(:meth:`.tangent.GrowthTangent.map_features`); ``fs.grow(..., batchnorm_stats=probe)`` inserts the
block with those statistics (:func:`resolve`). Without ``batchnorm_stats`` a grown block keeps the
fresh statistics.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import FusedStatsError

F64 = torch.float64


class _Reached(Exception):
    pass


def batchnorms(block: nn.Module) -> list[tuple[str, nn.BatchNorm2d]]:
    return [(name, m) for name, m in block.named_modules() if isinstance(m, nn.BatchNorm2d)]


def calibrate(block: nn.Module, act: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Set the running statistics of every BatchNorm of ``block`` (eval mode) from the block run on
    ``act`` (module docstring); returns name -> (mean, var) copies, fp64 on the CPU."""
    stats = {}
    for name, bn in batchnorms(block):
        seen: list[torch.Tensor] = []

        def keep(mod, args, seen=seen):
            seen.append(args[0])
            raise _Reached

        handle = bn.register_forward_pre_hook(keep)
        try:
            with torch.no_grad():
                block(act.to(bn.running_mean.dtype))
        except _Reached:
            pass
        finally:
            handle.remove()
        if not seen:
            raise FusedStatsError(
                f"the new block did not run its BatchNorm {name!r} on the calibration batch"
            )
        x = seen[0].detach().to(F64).transpose(0, 1).reshape(bn.num_features, -1)
        mean = x.mean(dim=1)
        var = (x - mean[:, None]).pow(2).mean(dim=1)
        if not bool(torch.isfinite(mean).all() and torch.isfinite(var).all()):
            raise FusedStatsError(f"the calibration batch gives non-finite statistics at BatchNorm {name!r}")
        with torch.no_grad():
            bn.running_mean.copy_(mean)
            bn.running_var.copy_(var)
        stats[name] = (mean.cpu(), var.cpu())
    return stats


def apply(block: nn.Module, stats: dict, point: str) -> None:
    """Put ``stats`` (name -> (mean, var)) into the BatchNorms of ``block``; checked first."""
    own = dict(batchnorms(block))
    if not isinstance(stats, dict) or set(stats) != set(own):
        names = sorted(stats) if isinstance(stats, dict) else type(stats).__name__
        raise FusedStatsError(
            f"batchnorm_stats for {point!r} name {names}, the new block's BatchNorms are {sorted(own)}"
        )
    for name, pair in stats.items():
        shape = (own[name].num_features,)
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2) or any(
            not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not bool(torch.isfinite(t).all())
            for t in pair
        ):
            raise FusedStatsError(
                f"batchnorm_stats for {point!r}, {name!r}: expected (mean, var), two finite tensors of shape {shape}"
            )
    with torch.no_grad():
        for name, (mean, var) in stats.items():
            own[name].running_mean.copy_(mean)
            own[name].running_var.copy_(var)


def resolve(source, protocol, points, arch, init: str) -> dict[str, dict]:
    """``fs.grow``'s ``batchnorm_stats``: None, a Probe measuring ``protocol`` (or its
    GrowthTangent), or a dict point -> name -> (mean, var); point -> stats for ``points``."""
    if source is None:
        return {}
    if arch.transformer:
        raise FusedStatsError(f"batchnorm_stats: the new blocks of {arch.kind!r} have no BatchNorm")
    if protocol.family != "layer" or init == "copy":
        raise FusedStatsError(
            "batchnorm_stats are for new ResNet blocks (family 'layer', init 'zero' or 'random'); "
            f"got family {protocol.family!r}, init {init!r} (a copy keeps its source block's statistics)"
        )
    tangent = getattr(source, "cross", source)
    if hasattr(tangent, "batchnorm_stats") and hasattr(tangent, "protocol"):
        if tangent.protocol.digest != protocol.digest:
            raise FusedStatsError(
                f"batchnorm_stats come from a probe of protocol {tangent.protocol.digest[:12]}…, growth "
                f"uses {protocol.digest[:12]}…: its blocks are not the ones measured"
            )
        source = tangent.batchnorm_stats
    if not isinstance(source, dict):
        raise FusedStatsError(
            "batchnorm_stats must be None, a Probe of the growth protocol, its feature source or a dict "
            f"point -> BatchNorm name -> (mean, var), got {type(source).__name__}"
        )
    missing = [p for p in points if p not in source]
    if missing:
        raise FusedStatsError(
            f"batchnorm_stats hold no calibrated statistics for {missing} (the probe has not measured them)"
        )
    return {p: source[p] for p in points}


__all__ = ["apply", "calibrate", "resolve"]
