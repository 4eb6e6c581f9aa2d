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
that fails on its arguments, raises :class:`FusedStatsError` naming the signature. Hugging Face
forwards take ``**kwargs`` and would ignore a misspelled key (an ``attention_masks`` would silently
count the padding), so for a ``transformers.PreTrainedModel`` every batch key must be a named
parameter of ``forward`` or of the ``TypedDict`` its ``**kwargs`` are annotated with
(``Unpack[TransformersKwargs]``); a key that is neither raises, naming the closest parameter.

:func:`causal_targets` is the one rule for which shifted targets count; :func:`causal_lm_loss`
averages over them and ``Probe.step(..., mask="labels")`` counts the positions that predict them.
"""

from __future__ import annotations

import difflib
import inspect
import sys
import typing
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ...errors import FusedStatsError

IGNORE_INDEX = -100  # the label of a position without a target (torch's and HF's convention)


def causal_targets(labels: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``valid[..., t]`` (shape ``labels.shape[:-1] + (T - 1,)``): whether position ``t``'s
    prediction of token ``t + 1`` counts — ``labels[..., t+1] ≠ IGNORE_INDEX`` and, with a mask,
    both ``t`` and ``t + 1`` are real tokens (module docstring)."""
    valid = labels[..., 1:] != IGNORE_INDEX
    if attention_mask is not None:
        real = attention_mask != 0
        valid = valid & real[..., 1:] & real[..., :-1]
    return valid


def _check_integer(name: str, value: torch.Tensor) -> None:
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise FusedStatsError(f"{name} must hold integer ids (any integer dtype), got dtype {value.dtype}")


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


def _typed_kwargs(model) -> set[str]:
    """The keys of the ``TypedDict`` that ``model.forward``'s ``**kwargs`` are annotated with
    (HF: ``**kwargs: Unpack[TransformersKwargs]``); empty when there is none."""
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return set()
    keys: set[str] = set()
    for p in params:
        if p.kind is not inspect.Parameter.VAR_KEYWORD:
            continue
        hint = p.annotation
        for candidate in (hint, *typing.get_args(hint)):
            keys |= set(getattr(candidate, "__required_keys__", ())) | set(
                getattr(candidate, "__optional_keys__", ())
            )
    return keys


def _is_hf_model(model) -> bool:
    transformers = sys.modules.get("transformers")  # an HF model implies transformers is loaded
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def check_batch_keys(model, keys, names: list[str]) -> None:
    """Raise for a key an HF model's forward would swallow into ``**kwargs`` unused (module
    docstring); other models are left to their own signature."""
    if not _is_hf_model(model):
        return
    accepted = set(names) | _typed_kwargs(model)
    accepted.discard("kwargs")
    for key in keys:
        if key in accepted or key == "labels":
            continue
        close = difflib.get_close_matches(str(key), sorted(accepted), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise FusedStatsError(
            f"batch key {key!r} is not a parameter of {type(model).__name__}.forward ({hint}"
            f"its parameters: {', '.join(n for n in names if n != 'kwargs')}); HF forwards take "
            "**kwargs and would ignore it silently"
        )


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
        check_batch_keys(model, inputs, names or [])
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
    _check_integer("input_ids", ids)
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
    if labels is not None:
        _check_integer("labels", labels)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if ids.dtype != torch.int64:  # embeddings take int32/int64 only; uint8 or int16 ids are common
        ids = inputs["input_ids"] = ids.long()
    logits = _logits(call_lm(model, inputs))
    if logits.dim() != 3 or tuple(logits.shape[:2]) != (B, T):
        raise FusedStatsError(f"logits have shape {tuple(logits.shape)}; expected ({B}, {T}, vocab)")
    if labels is None:
        labels = ids
    valid = causal_targets(labels, mask)
    counts = valid.sum(dim=1)
    empty = (counts == 0).nonzero().flatten().tolist()
    if empty:
        raise FusedStatsError(
            f"sequences {empty[:10]} of the batch (input_ids {tuple(ids.shape)}) have no valid "
            "target token (all labels -100 or masked); drop them from the batch"
        )
    pred = logits
    if pred.dtype in (torch.float16, torch.bfloat16):
        pred = pred.float()  # a softmax over a large vocabulary in half precision loses digits
    # Every position's logits go in, the last one with a dummy target that is dropped below: the
    # slice logits[:, :-1] is not contiguous, so flattening it would copy all (B, T - 1, vocab)
    # logits, and its backward would write them once more into a zero-filled (B, T, vocab) buffer.
    # The per-token losses and the gradients are the same, row by row.
    target = torch.zeros((B, T), dtype=torch.long, device=labels.device)  # int64: cross_entropy's only
    target[:, :-1] = labels[:, 1:].masked_fill(~valid, 0)
    token_loss = F.cross_entropy(pred.reshape(B * T, -1), target.view(-1), reduction="none").view(B, T)
    token_loss = token_loss[:, :-1]
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
    _check_integer("classification_loss: targets", y)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, y.long(), reduction="none")
