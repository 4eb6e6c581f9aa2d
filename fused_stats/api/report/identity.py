"""Which model a report was measured on: its fingerprint, and the protocol entries that apply to it.

Role: reports of several runs are combined (``fs.advise`` over candidates probed separately) only
when they measured one model; the report's ``model["fingerprint"]`` is what is compared:

* ``config_digest``: SHA-256 of the canonical JSON (sorted keys, no spaces) of the model's
  configuration: ``config.to_dict()`` of an HF model without the entries that say where from or
  how it was loaded (:data:`LOAD_ONLY_CONFIG_KEYS`); for a model without ``config`` its module
  tree (``repr``: the classes and the layer sizes).
* ``num_parameters``: the distinct parameters (a tied weight counted once).
* ``parameters_digest``: SHA-256 over the state dict (parameters and persistent buffers, e.g.
  BatchNorm running statistics, which the eval-mode tangent reads) in name order; per tensor its
  name, dtype, shape and raw bytes, copied to CPU. The bytes of a value do not depend on the
  device, so the same weights give the same digest on any machine; another seed or any trained
  step changes it. ``None`` (with ``parameters_digest_missing`` saying why) when a tensor's values
  are not held by this process (meta tensors of a streamed model, sharded DTensors).

The digest is taken when the report is made, so it names the weights the statistics end on.
"""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

from .schema import FINGERPRINT_KEYS

# the config entries that record where a model was loaded from and how (not what it computes)
LOAD_ONLY_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_attn_implementation_internal",
        "attn_implementation",
        "torch_dtype",
        "dtype",
    }
)


def _canonical_digest(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def config_digest(model: nn.Module) -> str:
    """SHA-256 of the model's configuration (module docstring)."""
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "to_dict", None)):
        record = {k: v for k, v in config.to_dict().items() if k not in LOAD_ONLY_CONFIG_KEYS}
        return _canonical_digest({"class": type(model).__name__, "config": record})
    return _canonical_digest({"class": type(model).__name__, "modules": repr(model)})


def _unheld_reason(name: str, tensor: torch.Tensor) -> str | None:
    if tensor.is_meta:
        return f"{name} is a meta tensor (its values are not loaded)"
    if type(tensor) not in (torch.Tensor, nn.Parameter):
        return f"{name} is a {type(tensor).__name__} (this process holds only a part of it)"
    return None


def parameters_digest(model: nn.Module) -> tuple[str | None, str | None]:
    """``(digest, None)`` of the state dict's bytes in name order, or ``(None, why)``."""
    state = model.state_dict()
    for name, tensor in state.items():
        reason = _unheld_reason(name, tensor)
        if reason is not None:
            return None, reason
    sha = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach()
        header = f"{name}|{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}\n"
        sha.update(header.encode("utf-8"))
        data = tensor.to("cpu").contiguous().reshape(-1)
        if data.numel():
            # raw bytes through a uint8 view: no conversion, and bf16 (which numpy lacks) works
            sha.update(data.view(torch.uint8).numpy().data)
    return sha.hexdigest(), None


def model_fingerprint(model: nn.Module) -> dict:
    """The report's ``model["fingerprint"]`` (module docstring)."""
    digest, missing = parameters_digest(model)
    record = {
        "config_digest": config_digest(model),
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
        "parameters_digest": digest,
    }
    if missing is not None:
        record["parameters_digest_missing"] = missing
    return record


def _base_name(item: str) -> str:
    """``"mlp.down_proj.weight[new columns]"`` -> ``"mlp.down_proj.weight"``."""
    return item.split("[", 1)[0].strip()


def zero_parameters_in(table: dict, model: nn.Module) -> dict[str, list[str]]:
    """The entries of a protocol's ``zero_parameters`` table (architecture -> parameter names
    inside a block) that name parameters this model has, each cut to those parameters: a LLaMA
    keeps ``self_attn.o_proj.weight`` and ``mlp.down_proj.weight`` and drops the biases it has not
    and the other architectures' maps. ``"any"`` entries (the probe's own block) are kept whole."""
    names = [name for name, _ in model.named_parameters()]

    def present(item: str) -> bool:
        base = _base_name(item)
        return any(n == base or n.endswith("." + base) for n in names)

    out = {}
    for kind, items in table.items():
        if kind == "any":
            out[kind] = list(items)
            continue
        kept = [item for item in items if present(item)]
        if kept:
            out[kind] = kept
    return out


def protocol_with_model_entries(record: dict | None, model: nn.Module) -> dict | None:
    """A report's ``growth_protocol`` record plus ``model_zero_parameters``: the protocol's zero
    parameters that apply to ``model`` (:func:`zero_parameters_in`), for the markdown; a record
    whose feature source named them from the model's architecture keeps its own."""
    if record is None:
        return None
    if "model_zero_parameters" in record:
        return dict(record)
    table = (record.get("protocol") or {}).get("zero_parameters") or {}
    return {**record, "model_zero_parameters": zero_parameters_in(table, model)}


__all__ = [
    "FINGERPRINT_KEYS",
    "LOAD_ONLY_CONFIG_KEYS",
    "config_digest",
    "model_fingerprint",
    "parameters_digest",
    "protocol_with_model_entries",
    "zero_parameters_in",
]
