"""Growing a model that DistributedDataParallel wraps: the wrapper rebuilt in place.

Role: DDP's reducer is built on the parameter list of its module (buckets and one autograd hook
per parameter), so parameters added by :func:`~fused_stats.grow` would get no gradient
all-reduce and the ranks would drift apart from the first step after growth. After a growth
event on every rank, :func:`rebuild_ddp` runs DDP's constructor again on the same wrapper object
with the settings it was built with: whoever holds the wrapper (HF Trainer's training loop and
``model_wrapped``, accelerate's ``_models``, Lightning's ``strategy.model``) trains the grown
model at the next step. The constructor checks that every rank holds the same parameter shapes
and broadcasts rank 0's parameters and buffers, as at the first wrap; the old reducer is dropped
first, which removes its autograd hooks.

:func:`check_rebuildable` refuses, before anything changes, what this cannot rebuild: no DDP
wrapper around the model under several processes, a sharded model (FSDP, FSDP2, DeepSpeed),
``torch.nn.DataParallel``, and DDP features whose state is tied to the old parameter list
(communication hooks, DDP's native mixed precision, delayed all-reduce, a device mesh).
"""

from __future__ import annotations

import inspect
import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ...errors import FusedStatsError

SUPPORTED_SETUPS = (
    "one process, or plain torch DistributedDataParallel: the HF Trainer under torchrun (accelerate "
    "MULTI_CPU / MULTI_GPU, no FSDP or DeepSpeed config) and Lightning's strategy 'ddp' (DDPStrategy)"
)


def world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def active_ddp_wrapper():
    """The DDP whose forward is running now (None outside one); read by a forward pre-hook of
    the wrapped module, which is how a Trainer callback, that is never handed the wrapper, finds it."""
    return getattr(DistributedDataParallel, "_active_ddp_module", None)


def _sharded_kind(module: nn.Module) -> str | None:
    for sub in module.modules():
        names = {cls.__name__ for cls in type(sub).__mro__}
        if "FullyShardedDataParallel" in names:
            return "FSDP (FullyShardedDataParallel)"
        if "FSDPModule" in names:
            return "FSDP2 (fully_shard)"
        if "DeepSpeedEngine" in names:
            return "DeepSpeed"
        if isinstance(sub, nn.DataParallel):
            return "torch.nn.DataParallel"
    return None


def refuse_unsupported_model(model: nn.Module, where: str) -> None:
    """Refuse a model that is, or holds, a sharded or replicated wrapper growth cannot rebuild."""
    kind = _sharded_kind(model)
    if kind is not None:
        raise FusedStatsError(
            f"{where}: the model is wrapped by {kind}, whose wrapper cannot be rebuilt around a grown "
            f"model; growth during training supports {SUPPORTED_SETUPS}"
        )


def check_rebuildable(wrapper, module: nn.Module, where: str) -> None:
    """Refuse, before anything changes, a setup :func:`rebuild_ddp` cannot follow a growth of
    ``module`` in. ``wrapper``: the DDP seen around ``module`` (None: none seen)."""
    refuse_unsupported_model(module, where)
    if wrapper is None:
        if world_size() > 1:
            raise FusedStatsError(
                f"{where}: {world_size()} processes, but no DistributedDataParallel wrapper ran the model's "
                f"training forward; growth during training supports {SUPPORTED_SETUPS}"
            )
        return
    if not isinstance(wrapper, DistributedDataParallel):
        raise FusedStatsError(
            f"{where}: the model is wrapped by {type(wrapper).__name__}; growth during training supports "
            f"{SUPPORTED_SETUPS}"
        )
    if not any(m is module for m in wrapper.module.modules()):
        raise FusedStatsError(
            f"{where}: the DistributedDataParallel seen does not wrap the model being grown"
        )
    refuse_unsupported_model(wrapper.module, where)
    tied = [
        label
        for label, present in (
            ("a communication hook (register_comm_hook)", bool(getattr(wrapper, "_comm_hooks", None))),
            ("DDP's native mixed precision", getattr(wrapper, "mixed_precision", None) is not None),
            ("delayed all-reduce parameters", bool(getattr(wrapper, "_delay_all_reduce_params", None))),
            ("a device mesh", getattr(wrapper, "device_mesh", None) is not None),
        )
        if present
    ]
    if tied:
        raise FusedStatsError(
            f"{where}: the DistributedDataParallel wrapper uses {', '.join(tied)}, whose state is built on "
            f"the old parameter list and is not rebuilt after growth; growth during training supports "
            f"{SUPPORTED_SETUPS} without those options"
        )


def _settings(ddp: DistributedDataParallel) -> dict:
    """The constructor arguments that rebuild ``ddp`` as it was built (those this torch has)."""
    accepted = inspect.signature(DistributedDataParallel.__init__).parameters
    settings = {
        "device_ids": ddp.device_ids,
        "output_device": ddp.output_device,
        "dim": ddp.dim,
        "process_group": ddp.process_group,
        "bucket_cap_mb": ddp.bucket_bytes_cap / (1024 * 1024),
        "find_unused_parameters": ddp.find_unused_parameters,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "static_graph": ddp.static_graph,
    }
    for name in ("skip_all_reduce_unused_params", "batched_grad_copy"):
        if name in accepted and hasattr(ddp, name):
            settings[name] = getattr(ddp, name)
    if not ddp.broadcast_buffers:
        # broadcast_buffers=False also skips the buffer sync at construction, as the first wrap did
        settings["broadcast_buffers"] = False
    return {k: v for k, v in settings.items() if k in accepted}


def rebuild_ddp(ddp: DistributedDataParallel) -> None:
    """Rebuild ``ddp`` in place around its (grown) module; a collective (every rank calls it)."""
    settings = _settings(ddp)
    training = ddp.training
    # hooks registered on the wrapper itself survive (the handles point at these dicts)
    hooks = {k: v for k, v in vars(ddp).items() if k.startswith("_") and "hooks" in k}
    for handle in getattr(ddp, "_accum_grad_hooks", ()):
        handle.remove()
    # drop the old reducer before the new one registers its hooks on the same parameters
    for name in ("logger", "reducer"):
        if name in vars(ddp):
            delattr(ddp, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers' deprecation
        DistributedDataParallel.__init__(ddp, ddp.module, **settings)
    for key, value in hooks.items():
        if key != "_accum_grad_hooks":
            setattr(ddp, key, value)
    ddp.training = training


__all__ = ["SUPPORTED_SETUPS", "check_rebuildable", "rebuild_ddp", "refuse_unsupported_model"]
