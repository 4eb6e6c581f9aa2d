"""HF Trainer set-ups for growth during training: which are refused, and the resume replay.

Role: :func:`check_trainer_setup` refuses at ``on_train_begin`` (before any step, nothing grown)
the Trainer set-ups whose wrapper cannot be rebuilt around a grown model: FSDP, DeepSpeed, XLA,
Megatron-LM (accelerate's ``distributed_type`` or the ``TrainingArguments``) and
``nn.DataParallel`` (several GPUs in one process). :func:`replay_checkpoint_growth` rebuilds the
grown architecture of a checkpoint on the model the Trainer was given: the entries of the
checkpoint's growth record (``config.json``, ``fused_stats_growth``) that the model lacks are
grown again, one :func:`fused_stats.grow` call per event (same protocol, points, init and
step), so the Trainer's weight loading that follows finds every parameter of the checkpoint.
"""

from __future__ import annotations

import json
import os

from ..api.growth.distributed import SUPPORTED_SETUPS, refuse_unsupported_model
from ..api.growth.grow import grow
from ..api.growth.record import (
    EVIDENCE_KEYS,
    FIRST_STEP_KEYS,
    GREW,
    RECORD_KEY,
    SATURATED,
    growth_history,
    record_saturation,
)
from ..errors import FusedStatsError

# accelerate's DistributedType values whose model wrapper is not a plain DDP
_UNSUPPORTED_TYPES = {"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP", "XLA": "XLA", "MEGATRON_LM": "Megatron-LM"}
# the names a later depth growth renumbers in the entries before it (record module docstring): a
# model holding a checkpoint's first events holds them under the names they had before the later ones
_RENUMBERED_KEYS = ("position", "new_parameters", "widened")


def _accelerate_type() -> str | None:
    try:
        from accelerate.state import AcceleratorState
    except ImportError:
        return None
    if not AcceleratorState._shared_state:  # no Accelerator built in this process
        return None
    return str(getattr(AcceleratorState().distributed_type, "value", AcceleratorState().distributed_type))


def check_trainer_setup(args, model) -> None:
    """Refuse a Trainer set-up growth cannot follow (module docstring); raises before training."""
    where = "GrowthScheduleCallback"
    found = []
    if getattr(args, "deepspeed", None):
        found.append("DeepSpeed (TrainingArguments.deepspeed)")
    if getattr(args, "fsdp", None):
        found.append(f"FSDP (TrainingArguments.fsdp={args.fsdp})")
    kind = _accelerate_type()
    if kind in _UNSUPPORTED_TYPES:
        found.append(f"{_UNSUPPORTED_TYPES[kind]} (accelerate distributed_type {kind})")
    # the Trainer's own rule (Trainer._wrap_model): more than one GPU in this process, DataParallel
    if int(getattr(args, "n_gpu", 1) or 1) > 1:
        found.append(f"torch.nn.DataParallel over {args.n_gpu} GPUs in one process")
    if found:
        raise FusedStatsError(
            f"{where}: the Trainer runs under {'; '.join(found)}, whose model wrapper cannot be rebuilt "
            f"around a grown model; growth during training supports {SUPPORTED_SETUPS}"
        )
    if model is not None:
        refuse_unsupported_model(model, where)


def checkpoint_record(checkpoint: str) -> list[dict] | None:
    """The growth record in ``checkpoint``'s ``config.json`` (None: no config file there)."""
    path = os.path.join(checkpoint, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as handle:
        record = json.load(handle).get(RECORD_KEY) or []
    if not isinstance(record, list) or not all(isinstance(e, dict) for e in record):
        raise FusedStatsError(f"{path}: {RECORD_KEY} is not a list of growth entries")
    return record


def _unrenumbered(entries: list[dict]) -> list[dict]:
    return [{k: v for k, v in e.items() if k not in _RENUMBERED_KEYS} for e in entries]


def _events(entries: list[dict]) -> list[list[dict]]:
    """The entries grouped by the fs.grow call that wrote them (consecutive, same step and event)."""
    events: list[list[dict]] = []
    for entry in entries:
        last = events[-1][0] if events else None
        if (
            last is not None
            and entry.get("event") == GREW == last.get("event")
            and entry.get("step") == last.get("step")
            and entry.get("protocol_digest") == last.get("protocol_digest")
        ):
            events[-1].append(entry)
        else:
            events.append([entry])
    return events


def replay_checkpoint_growth(model, checkpoint: str, protocol, optimizer=None) -> int:
    """Grow ``model`` as the checkpoint's record says, where the model's record stops short of it.

    Returns the number of events replayed (0 when the model already holds the checkpoint's
    architecture, e.g. built by ``from_pretrained(checkpoint)``). Refused with nothing changed: a
    model whose record is not a prefix of the checkpoint's (compared without the block names a later
    growth renumbered in the checkpoint's entries), an entry of another protocol, and an
    optimizer built before the replay (the grown parameters would be missing from it).
    """
    record = checkpoint_record(checkpoint)
    if record is None:
        return 0
    have = growth_history(model)
    if _unrenumbered(record[: len(have)]) != _unrenumbered(have):
        raise FusedStatsError(
            f"resume from {checkpoint}: the model's growth record ({len(have)} entries) is not the start "
            f"of the checkpoint's ({len(record)} entries); build the model the checkpoint continues"
        )
    missing = record[len(have) :]
    if not missing:
        return 0
    foreign = sorted({e.get("protocol_digest") for e in missing} - {protocol.digest}, key=str)
    if foreign:
        raise FusedStatsError(
            f"resume from {checkpoint}: its growth record holds events of protocol {foreign[0]!s:.12}…, "
            f"the GrowthScheduleCallback's protocol is {protocol.digest[:12]}…"
        )
    if optimizer is not None:
        raise FusedStatsError(
            f"resume from {checkpoint}: the Trainer's optimizer was built before the grown architecture; "
            "let the Trainer create it (no optimizers=(...)), or build the model with from_pretrained(checkpoint)"
        )
    events = _events(missing)
    for entries in events:
        first = entries[0]
        if first.get("event") == SATURATED:
            record_saturation(model, protocol, first.get("step"), first.get("verdict", ""))
            continue
        points = [e["point"] for e in entries]
        # the schedule's first-step prediction is replayed where the entry holds it
        evidence = {
            e["point"]: {k: e.get(k) for k in EVIDENCE_KEYS} | {k: e[k] for k in FIRST_STEP_KEYS if k in e}
            for e in entries
        }
        grow(model, protocol, at=points, init=first.get("init"), step=first.get("step"), evidence=evidence)
    if growth_history(model) != record:
        raise FusedStatsError(
            f"resume from {checkpoint}: replaying its growth record gave another record; the checkpoint "
            "was not written by this model and protocol"
        )
    return len(events)


__all__ = ["check_trainer_setup", "checkpoint_record", "replay_checkpoint_growth"]
