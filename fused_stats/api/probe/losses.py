"""Per-sample loss helpers for :meth:`fused_stats.Probe.step` (``loss_fn(model, batch) -> (B,)``).

Role: the probe differentiates the *sum* of per-sample losses (docs/design.md, section 5), so a loss
function must return one loss per sample, never a batch mean. Two common ones:

* :func:`causal_lm_loss` — per-sequence language-modelling loss: the shifted cross-entropy
  ``ℓ_b = (1/|V_b|) Σ_{t ∈ V_b} −log softmax(logits[b, t])[labels[b, t+1]]`` averaged over the
  sequence's valid targets ``V_b = {t : labels[b, t+1] ≠ −100, mask[b, t+1] ≠ 0, mask[b, t] ≠ 0}``
  (the HF convention: ``labels`` aligned with ``input_ids``, the model shifts; ``labels`` default to
  ``input_ids``). Requiring ``mask[b, t]`` too drops the prediction of the first real token of a
  left-padded sequence from a padding position.
* :func:`classification_loss` — per-sample cross-entropy ``ℓ_b = −log softmax(logits_b)[y_b]``.

Calling style. HF models take keywords (``model(input_ids=..., attention_mask=...)``); models whose
``forward`` has no ``input_ids`` parameter and no ``**kwargs`` (TransformerLens'
``HookedTransformer.forward(input, ...)``, plain ``nn.Module`` LMs) get the tokens positionally,
``model(input_ids, **the other keys it accepts)``. A key such a model does not accept, or a call
that fails on its arguments, raises :class:`FusedStatsError` naming the signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ...errors import FusedStatsError

IGNORE_INDEX = -100


def _logits(output) -> torch.Tensor:
    """The logits of an HF ``ModelOutput``, a tuple whose first element is the logits, or a tensor."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise FusedStatsError(
        f"cannot find logits in the model output of type {type(output).__name__}; expected a "
        "tensor, an object with .logits or a tuple starting with the logits"
    )


def _forward_parameters(model):
    """``(names, takes_var_keywords)`` of ``model.forward`` (None when it cannot be inspected)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None, True
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return list(params), var_kw


def call_lm(model, inputs: Mapping):
    """Call a language model on ``inputs`` (``input_ids`` and extras) in its own style (module
    docstring): keywords for HF-style models, the tokens positionally otherwise."""
    names, var_kw = _forward_parameters(model)
    positional = names is not None and "input_ids" not in names and not var_kw
    ids = inputs["input_ids"]
    if positional:
        extra = {k: v for k, v in inputs.items() if k != "input_ids"}
        unknown = [k for k in extra if k not in names]
        if unknown:
            raise FusedStatsError(
                f"{type(model).__name__}.forward({', '.join(names)}) takes the tokens positionally "
                f"and does not accept {unknown} from the batch; drop those keys"
            )
        args, kwargs = (ids,), extra
    else:
        args, kwargs = (), dict(inputs)
    try:
        return model(*args, **kwargs)
    except TypeError as exc:
        text = str(exc)
        if "argument" not in text:
            raise
        style = "positionally" if positional else "as keywords"
        raise FusedStatsError(
            f"calling {type(model).__name__} with the batch {style} ({sorted(inputs)}) failed: "
            f"{text}; its forward takes ({', '.join(names or ['?'])})"
        ) from exc


def causal_lm_loss(model, batch) -> torch.Tensor:
    """Per-sequence causal-LM loss, shape (B,): mean shifted cross-entropy over valid targets.

    ``batch``: a mapping with ``input_ids`` (B, T) and optionally ``attention_mask`` (B, T) and
    ``labels`` (B, T, ``-100`` = ignored); other keys (e.g. ``position_ids``) are passed to the model.
    A bare (B, T) tensor is taken as ``input_ids``. ``labels`` are never passed to the model, so it
    does not compute its own batch-mean loss. A sequence without any valid target raises
    :class:`FusedStatsError` (its loss would be undefined, and a zero would add a fake sample).
    """
    if isinstance(batch, torch.Tensor):
        batch = {"input_ids": batch}
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise FusedStatsError(
            f"causal_lm_loss needs a mapping with 'input_ids' (B, T) or a token tensor, got "
            f"{type(batch).__name__}"
            + (f" with keys {list(batch.keys())}" if isinstance(batch, Mapping) else "")
        )
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise FusedStatsError(
            f"input_ids must be a (B, T) tensor, got {getattr(ids, 'shape', type(ids).__name__)}"
        )
    B, T = ids.shape
    if T < 2:
        raise FusedStatsError(
            f"causal_lm_loss needs sequences of length >= 2, got input_ids {tuple(ids.shape)}"
        )
    mask = batch.get("attention_mask")
    labels = batch.get("labels")
    for name, value in (("attention_mask", mask), ("labels", labels)):
        if value is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != (B, T)):
            raise FusedStatsError(
                f"{name} must be a tensor of shape {(B, T)} like input_ids, got "
                f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}"
            )
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = _logits(call_lm(model, inputs))
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (B, T):
        raise FusedStatsError(f"logits have shape {tuple(logits.shape)}; expected ({B}, {T}, vocab)")
    if labels is None:
        labels = ids
    valid = labels[:, 1:] != IGNORE_INDEX
    if mask is not None:
        valid = valid & (mask[:, 1:] != 0) & (mask[:, :-1] != 0)
    counts = valid.sum(dim=1)
    empty = (counts == 0).nonzero().flatten().tolist()
    if empty:
        raise FusedStatsError(
            f"sequences {empty[:10]} of the batch (input_ids {tuple(ids.shape)}) have no valid "
            "target token (all labels -100 or masked); drop them from the batch"
        )
    pred = logits[:, :-1]
    if pred.dtype in (torch.float16, torch.bfloat16):
        pred = pred.float()  # a softmax over a large vocabulary in half precision loses digits
    target = labels[:, 1:].masked_fill(~valid, 0)
    token_loss = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="none").view(
        B, T - 1
    )
    # where(), not multiply: an inf at an ignored position must not turn the sum into nan
    token_loss = torch.where(
        valid, token_loss, torch.zeros((), dtype=token_loss.dtype, device=token_loss.device)
    )
    return token_loss.sum(dim=1) / counts.to(token_loss.dtype)


def classification_loss(model, batch) -> torch.Tensor:
    """Per-sample cross-entropy, shape (B,), for ``batch = (inputs, targets)``.

    ``batch`` may also be a mapping with ``inputs`` (or ``pixel_values``) and ``targets`` (or
    ``labels``). ``model(inputs)`` must return logits (B, classes) (or an object with ``.logits``).
    """
    if isinstance(batch, Mapping):
        x = batch.get("inputs", batch.get("pixel_values"))
        y = batch.get("targets", batch.get("labels"))
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch
    else:
        raise FusedStatsError(
            f"classification_loss needs (inputs, targets) or a mapping with inputs/targets, got "
            f"{type(batch).__name__}"
        )
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise FusedStatsError("classification_loss: inputs and targets must be tensors")
    logits = _logits(model(x))
    if logits.dim() != 2 or tuple(y.shape) != (logits.shape[0],):
        raise FusedStatsError(
            f"classification_loss: logits {tuple(logits.shape)} and targets {tuple(y.shape)}; "
            "expected (B, classes) and (B,)"
        )
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, y, reduction="none")
