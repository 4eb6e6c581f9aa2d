"""Per-sample scaling of the gradients an :class:`~fused_stats.api.training.observe.Observation`
captures, and the checks of the declared loss against the loss the backward went through.

:meth:`~fused_stats.Probe.step` differentiates ``Σ_b ℓ_b`` (``ℓ_b``: the
loss of sample ``b``), so its ``q_b`` is ``∂ℓ_b/∂z_b``. Sample ``b``'s activations reach only its
own loss terms, so for a training loss ``ℒ = Σ_b w_b ℓ_b`` the captured ``G_b = w_b ∂ℓ_b/∂z_b``
and ``q_b = s_b G_b`` with ``s_b = 1/w_b``:

* ``loss_reduction="sum"``: ``ℒ = Σ_b ℓ_b``, ``s_b = 1``;
* ``"mean"``: ``ℒ = (1/B) Σ_b ℓ_b``, ``s_b = B``;
* ``"token_mean"`` (the loss of HF causal-LM models): ``ℒ = (1/N) Σ_b Σ_{t∈V_b} ℓ_bt`` over all
  valid targets of the batch, with the per-sample loss ``ℓ_b = (1/n_b) Σ_{t∈V_b} ℓ_bt``, so
  ``ℒ = Σ_b (n_b/N) ℓ_b`` and ``s_b = N/n_b``. ``n_b = |V_b|`` counts the shifted targets
  ``labels[b, t+1] ≠ −100`` exactly as HF's ``ForCausalLMLoss`` does (without labels: the shifted
  ``attention_mask[b, 1:]``), and ``N = Σ_b n_b`` unless the model was called with
  ``num_items_in_batch`` (HF's gradient-accumulation normaliser), which is then ``N``. A sample
  with ``n_b = 0`` has no loss and is not a sample;
* ``scale=`` a (B,) tensor of ``s_b`` overrides the reduction (e.g. weighted losses);
* ``loss_scale``: the factor the declared loss was multiplied by before ``backward`` (e.g.
  ``1/accumulation_steps``, or a ``torch.amp.GradScaler``, whose current ``get_scale()`` is used),
  divided out: ``q_b = s_b G_b / loss_scale``.

Half-precision gradients (bf16 autocast) are cast to fp32 before they are scaled; the
accumulators keep fp64 totals as always.

:func:`check_declaration` compares the factors with those implied by the model's own loss (HF's
token mean, reached with weight ``w``: ``s_b = N/(w n_b)``), to a relative ``SCALE_RTOL``.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping

import torch

from ...errors import FusedStatsError
from ..probe.losses import IGNORE_INDEX

LOSS_REDUCTIONS = ("mean", "sum", "token_mean")
# "mean" with labels whose valid-target counts differ by this factor: a token mean was likely meant
UNEQUAL_COUNTS = 2.0
# relative disagreement between declared and implied scales that counts as a wrong declaration
SCALE_RTOL = 1e-4


def loss_of(output):
    """The scalar loss an HF-style output carries (``.loss`` or ``["loss"]``), else None."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad:
        return loss
    return None


def scale_value(loss_scale) -> float:
    if hasattr(loss_scale, "get_scale") and callable(loss_scale.get_scale):
        value = loss_scale.get_scale()
        if isinstance(value, torch.Tensor):
            value = value.item()
    else:
        value = loss_scale
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if (
        not isinstance(value, numbers.Real)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise FusedStatsError(
            f"loss_scale must be a positive finite number or an object with get_scale() "
            f"(e.g. torch.amp.GradScaler), got {value!r}"
        )
    return float(value)


def check_scale(scale) -> torch.Tensor:
    try:
        t = torch.as_tensor(scale).detach()
    except (TypeError, ValueError, RuntimeError):
        raise FusedStatsError(
            f"scale must be a (B,) tensor of per-sample factors, got {type(scale).__name__}"
        ) from None
    if t.dim() != 1 or t.numel() == 0:
        raise FusedStatsError(
            f"scale must be a 1-d tensor of shape (B,) (one factor per sample), got shape {tuple(t.shape)}"
        )
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise FusedStatsError(f"scale must be real numbers, got dtype {t.dtype}")
    t = t.to(device="cpu", dtype=torch.float64)
    bad = (~torch.isfinite(t) | (t <= 0)).nonzero().flatten().tolist()
    if bad:
        raise FusedStatsError(
            f"scale must be positive and finite for every sample (a zero would fold a fake zero "
            f"sample); entries {bad[:10]} are {t[bad[:5]].tolist()}"
        )
    return t


def scaled(grad: torch.Tensor, factor: torch.Tensor, B: int) -> torch.Tensor:
    """``factor[b] * grad[b]``; half precision is lifted to fp32 first (a bf16 product would lose
    the digits the fp64 totals keep)."""
    g = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
    f = factor.to(device=g.device, dtype=g.dtype).view((B,) + (1,) * (g.dim() - 1))
    return g * f


# ----------------------------------------------------------------------------- scale factors
def token_counts(batch, B: int):
    """``(n_b as fp64 (B,), N)`` for token_mean (module docstring): the valid targets per sample
    from ``labels`` (else ``attention_mask``), and their total (HF's ``num_items_in_batch`` when
    the batch carries it)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    attn = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor):
        if labels.dim() != 2 or labels.shape[0] != B:
            raise FusedStatsError(
                f"token_mean: labels of shape {tuple(labels.shape)}; expected ({B}, T) for the "
                f"batch of {B} samples the points saw"
            )
        counts = (labels[:, 1:] != IGNORE_INDEX).sum(dim=1)
    elif isinstance(attn, torch.Tensor):
        if attn.dim() != 2 or attn.shape[0] != B:
            raise FusedStatsError(
                f"token_mean: attention_mask of shape {tuple(attn.shape)}; expected ({B}, T)"
            )
        counts = (attn[:, 1:] != 0).sum(dim=1)
    else:
        keys = list(batch.keys()) if isinstance(batch, Mapping) else type(batch).__name__
        raise FusedStatsError(
            "loss_reduction='token_mean' needs the valid-token counts: call the probe's model "
            "with labels= (or attention_mask=) inside the block, or pass batch= to observe; "
            f"saw {keys}"
        )
    counts = counts.to(device="cpu", dtype=torch.float64)
    total = float(counts.sum())
    items = batch.get("num_items_in_batch") if isinstance(batch, Mapping) else None
    if items is not None:
        items = float(items.item() if isinstance(items, torch.Tensor) else items)
        if not math.isfinite(items) or items <= 0:
            raise FusedStatsError(f"num_items_in_batch={items} is not a positive count")
        total = items
    return counts, total


def per_sample_scales(batch, B: int, reduction, explicit_scale, first_point: str):
    """``(s as fp64 (B,), keep (B,) bool, counts, total)``: the factors that turn the gradient of
    the declared loss into per-sample-loss gradients (``"sum"``: 1, ``"mean"``: B,
    ``"token_mean"``: N/n_b, or ``explicit_scale``), the samples that exist, and the token counts
    when the batch gives them."""
    keep = torch.ones(B, dtype=torch.bool)
    counts = total = None
    if reduction == "token_mean" or (isinstance(batch, Mapping) and batch.get("labels") is not None):
        try:
            counts, total = token_counts(batch, B)
        except FusedStatsError:
            if reduction == "token_mean" and explicit_scale is None:
                raise
    if explicit_scale is not None:
        s = explicit_scale
        if tuple(s.shape) != (B,):
            raise FusedStatsError(
                f"scale has shape {tuple(s.shape)}; expected ({B},), one factor per sample of "
                f"the batch the points saw (point {first_point!r})"
            )
        s = s.clone()
    elif reduction == "sum":
        s = torch.ones(B, dtype=torch.float64)
    elif reduction == "mean":
        s = torch.full((B,), float(B), dtype=torch.float64)
    else:
        keep = counts > 0
        s = torch.where(keep, total / counts.clamp(min=1), torch.zeros((), dtype=torch.float64))
    return s, keep, counts, total


def check_declaration(s, keep, counts, total, loss_scale, loss_grads, reduction, explicit_scale):
    """Whether the declared scaling agrees with the loss the backward went through; returns the
    weight ``w`` with which the model's own loss was reached (None if not exactly once). Raises
    (or warns, for an explicit ``scale=``) when the factors disagree with that loss's ``N/(w n_b)``;
    warns for ``"mean"`` over very unequal token counts."""
    loss_weight = None
    weights = loss_grads
    if len(weights) == 1 and counts is not None:
        w = weights[0]
        loss_weight = w
        if not (math.isfinite(w) and w > 0):
            return loss_weight
        has = counts > 0  # a sample without targets has no term in that loss
        implied = total / (w * counts.clamp(min=1))
        used = s / loss_scale
        off = ((used[has] - implied[has]).abs() > SCALE_RTOL * implied[has]).nonzero().flatten()
        if off.numel():
            declared = "scale=" if explicit_scale is not None else f"loss_reduction={reduction!r}"
            message = (
                f"probe.observe: the backward went through the model's own loss (a mean over "
                f"all {total:g} valid target tokens, reached with weight {w:.6g}), which implies "
                f"per-sample factors N/(w n_b) = {implied[:6].tolist()}, but {declared} with "
                f"loss_scale={loss_scale:g} gives {used[:6].tolist()}. Declare "
                f"loss_reduction='token_mean'"
                + (f" and loss_scale={w:.6g}" if abs(w - 1) > 1e-12 else "")
                + "; nothing was accumulated"
            )
            if explicit_scale is not None:
                warnings.warn(message.replace("; nothing was accumulated", ""), stacklevel=5)
            else:
                raise FusedStatsError(message)
    elif (
        not weights
        and reduction == "mean"
        and explicit_scale is None
        and counts is not None
        and bool(keep.any())
    ):
        valid = counts[counts > 0]
        if valid.numel() and float(valid.max()) >= UNEQUAL_COUNTS * float(valid.min()):
            warnings.warn(
                f"probe.observe: loss_reduction='mean' but the labels give very unequal "
                f"valid-token counts per sample ({int(valid.min())} .. {int(valid.max())}); if "
                "the loss is a mean over all tokens of the batch (HF's), declare "
                "loss_reduction='token_mean' (a mean of per-sample means is right as 'mean')",
                stacklevel=5,
            )
    return loss_weight
