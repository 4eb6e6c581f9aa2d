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

A calibration batch with one value per channel (batch × H × W < 2: one sample of a 1×1 output),
or one in which a channel is constant, gives a variance of 0; every later batch would then be
divided by ``√eps`` (a |C|_F² of −15.9 where a batch of 8 gives −0.0025). Train mode refuses the
first (torch: "Expected more than 1 value per channel when training"), and neither has a
normalisation to measure with: :func:`calibrate` refuses both, naming the candidate, the BatchNorm,
the input's shape and the channels.

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


def calibrate(
    block: nn.Module, act: torch.Tensor, point: str = "the candidate"
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Set the running statistics of every BatchNorm of ``block`` (eval mode) from the block run on
    ``act`` (module docstring); returns name -> (mean, var) copies, fp64 on the CPU. Refused where
    a BatchNorm sees fewer than 2 values per channel or a channel of variance 0 (``point`` names
    the candidate in the message)."""
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
        shape = tuple(seen[0].shape)
        x = seen[0].detach().to(F64).transpose(0, 1).reshape(bn.num_features, -1)
        where = f"BatchNorm {name!r} of the new block at {point!r}"
        if x.shape[1] < 2:
            raise FusedStatsError(
                f"{where}: its calibration input of shape {shape} holds {x.shape[1]} value per channel "
                "(batch × H × W); the variance needs at least 2 (train mode refuses it too): make the "
                "first batch at this candidate larger"
            )
        mean = x.mean(dim=1)
        var = (x - mean[:, None]).pow(2).mean(dim=1)
        if not bool(torch.isfinite(mean).all() and torch.isfinite(var).all()):
            raise FusedStatsError(f"{where}: the calibration batch gives non-finite statistics")
        dead = torch.nonzero(var == 0).flatten().tolist()
        if dead:
            raise FusedStatsError(
                f"{where}: channels {dead} are constant over the calibration input of shape {shape} "
                "(variance 0: later batches would be divided by sqrt(eps)); calibrate on a batch "
                "where every channel varies"
            )
        with torch.no_grad():
            bn.running_mean.copy_(mean)
            bn.running_var.copy_(var)
        stats[name] = (mean.cpu(), var.cpu())
    return stats


def check(block: nn.Module, stats, point: str) -> None:
    """Refuse ``stats`` (name -> (mean, var)) that do not fit the BatchNorms of ``block``."""
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
        if not bool((pair[1] >= 0).all()):
            raise FusedStatsError(f"batchnorm_stats for {point!r}, {name!r}: a variance is negative")


def apply(block: nn.Module, stats: dict, point: str) -> None:
    """Put ``stats`` (name -> (mean, var)) into the BatchNorms of ``block``; checked first."""
    check(block, stats, point)
    own = dict(batchnorms(block))
    with torch.no_grad():
        for name, (mean, var) in stats.items():
            own[name].running_mean.copy_(mean)
            own[name].running_var.copy_(var)


def copied(stats: dict) -> dict:
    """point -> name -> (mean, var) as fp64 CPU copies (nothing shared with the caller)."""
    return {
        point: {
            name: (m.detach().to("cpu", F64).clone(), v.detach().to("cpu", F64).clone())
            for name, (m, v) in by_name.items()
        }
        for point, by_name in stats.items()
    }


def same(a: dict, b: dict) -> bool:
    """Whether two calibrations hold the same points, BatchNorms and values, bit for bit."""
    if set(a) != set(b) or any(set(a[p]) != set(b[p]) for p in a):
        return False
    return all(torch.equal(x, y) for p in a for n in a[p] for x, y in zip(a[p][n], b[p][n]))


SEPARATOR = "|"  # module names never hold it


def flatten(stats: dict) -> dict[str, torch.Tensor]:
    """point -> name -> (mean, var) as flat tensors ``"point|name|mean"`` (a checkpoint file)."""
    out = {}
    for point, by_name in stats.items():
        for name, (mean, var) in by_name.items():
            out[SEPARATOR.join((point, name, "mean"))] = mean.detach().to("cpu", F64).contiguous()
            out[SEPARATOR.join((point, name, "var"))] = var.detach().to("cpu", F64).contiguous()
    return out


def unflatten(flat: dict[str, torch.Tensor], where: str) -> dict:
    """Inverse of :func:`flatten`; ``where`` (a file) names what is refused."""
    pairs: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in flat.items():
        parts = key.split(SEPARATOR)
        if len(parts) != 3 or parts[2] not in ("mean", "var") or not isinstance(tensor, torch.Tensor):
            raise FusedStatsError(f"{where}: {key!r} is not a BatchNorm statistic (point|name|mean or var)")
        pairs.setdefault(parts[0], {}).setdefault(parts[1], {})[parts[2]] = tensor
    out = {}
    for point, by_name in pairs.items():
        out[point] = {}
        for name, both in by_name.items():
            if set(both) != {"mean", "var"}:
                raise FusedStatsError(f"{where}: BatchNorm {name!r} at {point!r} lacks its mean or variance")
            out[point][name] = (both["mean"], both["var"])
    return out


def resolve(source, plan, points, init: str) -> dict[str, dict]:
    """``fs.grow``'s ``batchnorm_stats``: None, a Probe measuring ``plan``'s protocol on a model
    of the plan's structure (or its GrowthTangent), or a dict point -> name -> (mean, var);
    point -> stats for ``points``."""
    if source is None:
        return {}
    protocol, arch = plan.protocol, plan.architecture
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
        measured = getattr(tangent, "plan", None)
        if measured is not None and measured.structure != plan.structure:
            # the model grew (or changed) since: the calibrated blocks are not the ones grown now
            raise FusedStatsError(
                f"batchnorm_stats come from a probe of the model as it was (blocks per container and "
                f"growth events {measured.structure}), the model is now {plan.structure}; probe it again"
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


def _world_and_rank(group=None) -> tuple[int, int]:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank()


class BatchNormCalibration:
    """The ResNet tangent's calibration (a mixin of :class:`.tangent.GrowthTangent`, which
    provides ``channelwise``, ``plan``, ``block(point)`` and the ``batchnorm_stats`` dict).

    Under ``torch.distributed`` the statistics of every rank must be the same, or the all-reduced
    sums would mix blocks normalised differently: rank 0 calibrates on its own first batch and the
    other ranks take its statistics (:meth:`broadcast_batchnorm_stats`, which ``GrowthSchedule``
    calls after rank 0's first probe batch); a rank other than 0 refuses to calibrate itself.
    """

    def calibrate_point(self, point: str, block: nn.Module, act: torch.Tensor) -> None:
        """Calibrate ``point``'s block on ``act``, its first batch, unless already calibrated."""
        if point in self.batchnorm_stats:
            return
        world, rank = _world_and_rank()
        if world > 1 and rank != 0:
            raise FusedStatsError(
                f"the new block at {point!r} has no BatchNorm statistics on rank {rank} of {world}: each "
                "rank would calibrate on its own first batch and the all-reduced statistics would mix "
                "normalisations; step the probe on rank 0 first, then call "
                "probe.cross.broadcast_batchnorm_stats() on every rank before the others step "
                "(GrowthSchedule does this)"
            )
        self.batchnorm_stats[point] = calibrate(block, act.detach(), point)

    def _checked_stats(self, stats, where: str) -> dict:
        """``stats`` (point -> name -> (mean, var)) checked against the candidates' blocks:
        fp64 CPU copies, or :class:`FusedStatsError` before anything is set."""
        if not isinstance(stats, dict):
            raise FusedStatsError(f"{where}: expected a dict point -> BatchNorm name -> (mean, var)")
        if stats and not self.channelwise:
            raise FusedStatsError(f"{where}: the new blocks of this protocol have no BatchNorm")
        unknown = [p for p in stats if p not in self.plan.candidates]
        if unknown:
            raise FusedStatsError(
                f"{where}: {unknown} are not candidates of this protocol: {list(self.plan.candidates)}"
            )
        for point, by_name in stats.items():
            check(self.block(point), by_name, point)
        return copied(stats)

    def set_batchnorm_stats(self, stats: dict, replace: bool = False) -> None:
        """Take ``stats`` (point -> BatchNorm name -> (mean, var)) as the calibration of those
        candidates, all checked before any is set. A candidate already calibrated with other
        statistics is refused (what it measured used them); ``replace=True`` makes the
        calibration exactly ``stats`` (a candidate not in it calibrates on its next batch)."""
        stats = self._checked_stats(stats, "batchnorm_stats")
        if not replace:
            clash = [
                p
                for p in stats
                if p in self.batchnorm_stats and not same({p: stats[p]}, {p: self.batchnorm_stats[p]})
            ]
            if clash:
                raise FusedStatsError(
                    f"batchnorm_stats: {clash} were calibrated with other statistics already (their "
                    "measurements used them); set the statistics before the first batch"
                )
        self._commit_stats(stats, replace)

    def _commit_stats(self, stats: dict, replace: bool) -> None:
        if replace:
            self.batchnorm_stats.clear()
        for point, by_name in stats.items():
            apply(self.block(point), by_name, point)
            self.batchnorm_stats[point] = by_name

    def broadcast_batchnorm_stats(self, src: int = 0, group=None) -> None:
        """A collective: every rank takes rank ``src``'s calibration (class docstring)."""
        world, rank = _world_and_rank(group)
        if world == 1:
            return
        shared = [flatten(self.batchnorm_stats) if rank == src else None]
        torch.distributed.broadcast_object_list(shared, src=src, group=group)
        self.set_batchnorm_stats(unflatten(shared[0], f"rank {src}'s BatchNorm statistics"))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The calibration as flat tensors for the probe's checkpoint (:func:`flatten`)."""
        return flatten(self.batchnorm_stats)

    def restore_checkpoint_tensors(self, flat: dict, sampled: list[str]):
        """Check a checkpoint's :meth:`checkpoint_tensors` (``sampled``: the points where it holds
        samples) and return the commit that makes them the calibration; refused before anything
        changes where a sampled ResNet point has no statistics (measured with others)."""
        stats = self._checked_stats(unflatten(flat, "the checkpoint's feature-source state"), "checkpoint")
        lacking = [p for p in sampled if self.channelwise and p not in stats]
        if lacking:
            raise FusedStatsError(
                f"the checkpoint holds samples at {lacking} but not the BatchNorm statistics of the new "
                "blocks they were measured with (written before calibration was saved?); resumed, the "
                "probe would measure later batches with other statistics: probe again from the start"
            )
        return lambda: self._commit_stats(stats, replace=True)


__all__ = [
    "BatchNormCalibration",
    "apply",
    "calibrate",
    "check",
    "copied",
    "flatten",
    "resolve",
    "same",
    "unflatten",
]
