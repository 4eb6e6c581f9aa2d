"""Per-candidate scores beside ``|C|_F²``: first-step predictions per optimizer, the signal
fraction, and the curvature-aware gain.

Role: the advisor's numbers as predictions a user can check (docs/design.md, section 2.13).
With ``C_M = c_sum/M`` (train stream) and ``C_K = c_sum/K`` (test stream) the mean per-sample
tangents of the zero parameters (the gradient of the mean loss there):

* SGD: one step ``θ = −η C_M`` changes the mean test loss by ``−η ⟨C_M, C_K⟩ + O(η²)``. SGD
  with momentum ``μ`` takes the same first step (its buffer starts at the gradient), except with
  ``nesterov=True``: the update ``g + μ·buf`` with ``buf = g`` is ``(1 + μ) g``, so its first
  step, and the predicted change, are ``1 + μ`` times SGD's (1.9× at ``μ = 0.9``).
* Zero-state Adam / AdamW: the bias-corrected moments of one gradient are ``g`` and ``g²``, so the
  first update is ``−η g / (|g| + ε)`` elementwise (weight decay of a zero parameter is zero;
  ``fs.grow`` puts a parameter with a non-zero origin in a group without decay) and the change
  is ``−η ⟨s_M, C_K⟩`` with ``s_M = C_M / (|C_M| + ε)``: the whole train stream taken as the
  step's batch. With ``protocol.train_batch_size = B`` it is ``−η ⟨(1/n_B) Σ_b s_b, C_K⟩`` over
  B-sized sub-batches of the train stream (:mod:`.sub_batches`), the step of a batch of ``B``.
  Other optimizers and per-group settings: :func:`fused_stats.predicted_change`. The sum runs over the
  entries of ``C``, whatever their arrangement into parameter tensors. Under a random projection
  ``C Pᵀ`` the sign of the projection is not the projection of the sign: not available.
* Signal fraction ``|C|_F² / E|c_i|_F²`` (unbiased ``|C|_F²`` over ``Σ|c_i|²/n``): the share of
  the per-sample tangent that the samples have in common, free of the features' scale.
* Split Adam score ``⟨s_A, C_B⟩`` (:func:`split_adam_score`): ``s`` from one half of the train
  batches, ``C`` from the other (batch parity), so its mean is ``E[s_A]·C``. The probe's version
  (:func:`candidate_scores` given ``half``): A the even train steps, whose tangent sum the
  feature source keeps (``GrowthTangent.before_step``), B ``= c_sum − A``.
* Curvature-aware gain ``|g|⁴ / (2 gᵀHg)``: the loss drop of the best step along ``g`` under the
  quadratic model ``L(−t g) ≈ L − t|g|² + t² gᵀHg / 2`` (minimum at ``t = |g|²/gᵀHg``); a
  rescaling of the new parameters ``θ → aθ`` scales ``|g|²`` by ``1/a²`` and ``gᵀHg`` by
  ``1/a⁴``, so the gain is unchanged. :func:`curvature_gain` estimates both terms without
  noise-on-noise terms. ``|g|²`` from split halves (batch parity, as the split Adam score):
  ``⟨g_A, g_B⟩`` is the mean of ``⟨c_i, c_j⟩`` over pairs of distinct samples (``i`` in A, ``j``
  in B), unbiased for ``|E c|²``, where the plug-in ``|ḡ|²`` has mean ``|E c|² + tr Σ / n``.
  ``gᵀHg`` from three groups of batches (index mod 3): ``⟨ḡ_a, H_c ḡ_b⟩``, one group's Hessian
  (a Hessian-vector product, double backward, Pearlmutter 1994, on the grown model's new
  parameters) between the mean gradients of the other two, so every term is
  ``g_iᵀ H_k g_j`` over three distinct samples and its mean is ``gᵀ E[H] g``. The plug-in
  ``ḡᵀH̄ḡ`` adds ``tr(HΣ)/n`` (×1.5 on 12 samples); two halves with the Hessian of all samples,
  ``⟨ḡ_A, H̄ ḡ_B⟩``, keep a sample's own Hessian beside its own gradient (a term
  ``(2/n) E[(g_i − g)ᵀ H_i] g``: ×0.39 to ×1.11 of the three-sample mean on 10 samples of a tiny
  LLaMA). A non-finite loss or gradient is refused, never reported as "no minimum".
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import FusedStatsError
from .batchnorm import calibrate
from .blocks import block_for
from .grow import grow
from .plan import GrowthPlan
from .protocol import DEFAULT_ADAM_EPS

F64 = torch.float64
GROUPS = 3  # curvature_gain's gᵀHg: one group's Hessian between two others' gradients
ADAM_EPS = DEFAULT_ADAM_EPS
NO_ADAM_UNDER_PROJECTION = (
    "not available under a random projection (the sign of C Pᵀ is not the projection of the sign of C)"
)


def adam_direction(c_mean: torch.Tensor, eps: float) -> torch.Tensor:
    """``s = g / (|g| + ε)`` elementwise: zero-state Adam's first update per unit step, negated."""
    return c_mean / (c_mean.abs() + eps)


def candidate_scores(
    train,
    test,
    eps: float = ADAM_EPS,
    projected: bool = False,
    half=None,
    train_batch_size: int | None = None,
    sub_batches=None,
) -> dict:
    """The raw first-step inner products and the signal fraction of one candidate from its train
    and test CrossStats (module docstring), in the probed (possibly projected) coordinates.
    ``half``: ``(A sum, n_A)``, the tangent sum of the even train steps (B: the rest of the
    stream), for ``split_a_on_b = ⟨s_A, C_B⟩`` and ``split_b_on_a``; None: not kept.
    ``train_batch_size`` set: the Adam terms average ``s_b`` over the B-sized sub-batches of
    ``sub_batches`` (:class:`.sub_batches.SubBatches`; ``s_A``: the even-step ones), None where
    there are none."""
    out = {"adam_eps": eps, "sgd_inner": None, "adam_inner": None, "mean_sq_norm": None}
    if train_batch_size is not None:
        out["adam_train_batch_size"] = train_batch_size
        out["adam_sub_batches"] = 0 if sub_batches is None else sub_batches.n_sub
    if train is None or train.n == 0:
        return out
    c_train = train.c_sum.detach().to(device="cpu", dtype=F64) / train.n
    out["mean_sq_norm"] = float(train.sq_norm_sum) / train.n
    if half is not None and not projected and 0 < half[1] < train.n:
        a_sum = half[0].detach().to(device="cpu", dtype=F64)
        n_a, n_b = int(half[1]), train.n - int(half[1])
        c_a, c_b = a_sum / n_a, (train.c_sum.detach().to(device="cpu", dtype=F64) - a_sum) / n_b
        if train_batch_size is None:
            s_a, s_b = adam_direction(c_a, eps), adam_direction(c_b, eps)
        else:  # s from the B-sized sub-batches of each half (each one probe step)
            s_a, s_b = (None, None) if sub_batches is None else (sub_batches.halves() or (None, None))
        if s_a is not None:
            out["split_a_on_b"] = float((s_a * c_b).sum())
            out["split_b_on_a"] = float((s_b * c_a).sum())
            out["split_n"] = [n_a, n_b]
    if test is None or test.n == 0:
        return out
    c_test = test.c_sum.detach().to(device="cpu", dtype=F64) / test.n
    out["sgd_inner"] = float((c_train * c_test).sum())
    if not projected:
        if train_batch_size is None:
            out["adam_inner"] = float((adam_direction(c_train, eps) * c_test).sum())
        elif sub_batches is not None and sub_batches.mean() is not None:
            out["adam_inner"] = float((sub_batches.mean() * c_test).sum())
    return out


@dataclass(frozen=True)
class CurvatureGain:
    """:func:`curvature_gain`'s result: ``|g|²`` (the split-halves estimate ``⟨g_A, g_B⟩``),
    ``gᵀHg`` (the three-group estimate), the gain ``|g|⁴/(2 gᵀHg)``, samples and new parameters.
    ``gain`` is None, with ``reason`` saying why, when ``⟨g_A, g_B⟩ ≤ 0`` (no gradient detected:
    the halves do not agree on a direction) or ``gᵀHg ≤ 0`` (the quadratic model has no minimum
    along ``g``, or the estimate is noise); ``reason`` is None when there is a gain."""

    point: str
    grad_sq: float
    ghg: float
    gain: float | None
    n: int
    parameters: tuple[str, ...]
    reason: str | None = None

    def to_dict(self) -> dict:
        return {
            "point": self.point,
            "grad_sq": self.grad_sq,
            "ghg": self.ghg,
            "gain": self.gain,
            "n": self.n,
            "parameters": list(self.parameters),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class SplitAdamScore:
    """:func:`split_adam_score`'s result: ``⟨s_A, C_B⟩``, ``⟨s_B, C_A⟩``, their mean and the
    halves' sample counts."""

    point: str
    a_on_b: float
    b_on_a: float
    score: float
    n_a: int
    n_b: int


def _calibrated(plan: GrowthPlan, point: str, batch, loss_fn) -> dict:
    """The new ResNet block's BatchNorm statistics from the candidate's output on ``batch`` with
    the model in eval mode: the probe's calibration on its first batch (:mod:`.batchnorm`)."""
    model = plan.model
    seen: list[torch.Tensor] = []
    handle = model.get_submodule(point).register_forward_hook(
        lambda mod, args, out: seen.append(out.detach())
    )
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            loss_fn(model, batch)
    finally:
        handle.remove()
        model.train(training)
    if not seen:
        raise FusedStatsError(
            f"loss_fn did not run {point!r} on the first batch: cannot calibrate its BatchNorms"
        )
    return calibrate(block_for(plan, point).eval(), seen[0], point)


def _grown_copy(model: nn.Module, protocol, point: str, first=None):
    """A grown copy and its new parameters; ``first = (batch, loss_fn)`` calibrates a new ResNet
    block's BatchNorms on that batch, as the probe does on its first one."""
    plan = GrowthPlan.build(model, protocol)
    plan.candidate(point)  # refused before the copy
    if plan.protocol.family == "mlp_width":
        # width growth widens existing tensors (new_parameters is empty): these scores
        # differentiate whole new parameters, not the new slices of widened ones
        raise FusedStatsError(
            f"family 'mlp_width' at {point!r}: the new units are slices of widened parameter tensors, "
            "not new parameters, and this score differentiates whole new parameters; use the "
            "probe's scores for width growth (fs.advise: cross_frob2, signal_fraction, split_adam)"
        )
    grown = copy.deepcopy(model)
    grown_plan = plan.rebound(grown)
    stats = None
    resnet = plan.family == "layer" and not plan.architecture.transformer
    if first is not None and resnet and plan.protocol.init != "copy":  # calibrated as the probe does
        stats = {point: _calibrated(grown_plan, point, *first)}
    result = grow(grown, grown_plan, at=[point], batchnorm_stats=stats)
    grown.eval()
    named = dict(grown.named_parameters())
    params = [named[name] for name in result.new_parameters]
    if not params:
        raise FusedStatsError(f"growth at {point!r} adds no new parameters: nothing to score")
    wanted = {id(p) for p in params}
    for p in grown.parameters():
        if id(p) not in wanted:
            p.requires_grad_(False)
    return grown, params, tuple(result.new_parameters)


def split_adam_score(model: nn.Module, protocol, point: str, batches, loss_fn, eps=None) -> SplitAdamScore:
    """``⟨s_A, C_B⟩`` on two disjoint halves of ``batches`` (A: batches 0, 2, 4, …; B: 1, 3, …),
    ``s_A = C_A/(|C_A| + ε)`` from the mean tangent of half A: with the batches independent,
    ``s_A`` and ``C_B`` are, so its mean is ``E[s_A]·C`` (no noise-on-noise term, unlike
    ``⟨s_M, C_M⟩`` on one stream). ``score`` averages it with ``⟨s_B, C_A⟩`` (also unbiased for
    the same quantity when the halves are equal in size). The tangents are the gradients of the
    halves' mean losses on a grown copy's new parameters (one forward-backward per batch); ``ε``:
    the protocol's ``adam_eps`` unless given."""
    if loss_fn is None or not callable(loss_fn):
        raise FusedStatsError("split_adam_score needs loss_fn(model, batch) -> per-sample losses (B,)")
    batches = list(batches)
    if len(batches) < 2:
        raise FusedStatsError(f"split_adam_score needs at least 2 batches (two halves), got {len(batches)}")
    declared = protocol.protocol if isinstance(protocol, GrowthPlan) else protocol
    eps = getattr(declared, "adam_eps", ADAM_EPS) if eps is None else float(eps)
    grown, params, _ = _grown_copy(model, protocol, point, (batches[0], loss_fn))
    sums = [[torch.zeros_like(p, dtype=F64) for p in params] for _ in range(2)]
    counts = [0, 0]
    for index, batch in enumerate(batches):
        losses = _per_sample(loss_fn(grown, batch), point, index)
        counts[index % 2] += losses.shape[0]
        grads = torch.autograd.grad(losses.sum(), params, allow_unused=True)
        _finite_grads(grads, point, index, "gradient")
        for acc, g in zip(sums[index % 2], grads):
            if g is not None:
                acc += g.to(F64)
    if min(counts) == 0:
        raise FusedStatsError(f"split_adam_score: a half holds no samples (counts {counts})")
    means = [torch.cat([t.reshape(-1) for t in half]) / n for half, n in zip(sums, counts)]
    a_on_b = float(adam_direction(means[0], eps) @ means[1])
    b_on_a = float(adam_direction(means[1], eps) @ means[0])
    return SplitAdamScore(point, a_on_b, b_on_a, (a_on_b + b_on_a) / 2, counts[0], counts[1])


def _per_sample(losses, point: str | None = None, index: int = 0, note: str = "") -> torch.Tensor:
    if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
        raise FusedStatsError(
            "loss_fn must return per-sample losses of shape (B,), got "
            f"{getattr(losses, 'shape', type(losses).__name__)}"
        )
    if point is not None and not bool(torch.isfinite(losses).all()):
        bad = torch.nonzero(~torch.isfinite(losses.detach())).flatten().tolist()
        raise FusedStatsError(
            f"at {point!r}: the grown copy's loss is non-finite for samples {bad} of batch {index}{note}; "
            "a score of non-finite losses is not defined"
        )
    return losses


def _finite_grads(grads, point: str, index: int, what: str, note: str = "") -> None:
    for g in grads:
        if g is not None and not bool(torch.isfinite(g).all()):
            raise FusedStatsError(
                f"at {point!r}: the {what} of batch {index} on the new parameters is non-finite{note}"
            )


def curvature_gain(model: nn.Module, protocol, point: str, batches, loss_fn) -> CurvatureGain:
    """``|g|⁴ / (2 gᵀHg)`` at ``point`` for the mean per-sample loss over ``batches``.

    A deep copy of ``model`` is grown at ``point`` by :func:`fused_stats.grow` (``model`` is left
    untouched), the gradients of each batch's loss on the copy's new parameters come from one
    pass and ``gᵀHg`` from a second: for batch ``b`` of group ``c = b mod 3``,
    ``⟨ḡ_{c+2}, H_b ḡ_{c+1}⟩`` with ``H_b ḡ_{c+1} = ∇(∇L_b · ḡ_{c+1})`` (a double backward),
    ``ḡ_c`` the mean gradient of group ``c``, summed and divided by the sample count. Cost: one
    forward-backward per batch plus one forward, a backward with ``create_graph`` and a second
    backward per batch (about 4 training steps' compute per batch), and a copy of the model in
    memory. Run in ``eval()`` mode, like the probe; an HF
    model's copy runs eager attention (the fused kernels have no double backward).

    ``|g|²`` is ``⟨g_A, g_B⟩``, ``g_A`` the mean gradient of batches 0, 2, 4, … and ``g_B`` of
    1, 3, …; ``gᵀHg`` pairs three groups (module docstring: both unbiased), so at least 3 batches
    are needed. A non-finite loss or gradient is refused naming the point and the batch
    (e.g. left-padded samples, whose fully masked rows eager attention turns into NaN).
    """
    if loss_fn is None or not callable(loss_fn):
        raise FusedStatsError("curvature_gain needs loss_fn(model, batch) -> per-sample losses (B,)")
    batches = list(batches)
    if len(batches) < GROUPS:
        raise FusedStatsError(
            f"curvature_gain needs at least {GROUPS} batches (|g|² from two halves, even and odd "
            f"batches; gᵀHg from {GROUPS} groups, batch index mod {GROUPS}: one group's Hessian "
            f"between the other two's gradients), got {len(batches)}"
        )
    grown, params, names = _grown_copy(model, protocol, point, (batches[0], loss_fn))
    attention = getattr(getattr(grown, "config", None), "_attn_implementation", None)
    note = ""
    if attention not in (None, "eager") and callable(getattr(grown, "set_attn_implementation", None)):
        # fused attention kernels have no double backward (CPU SDPA): eager is the same function
        # on rows that attend to something
        grown.set_attn_implementation("eager")
        note = (
            " (the copy runs eager attention, which the double backward needs: a fully masked row, "
            "as left padding gives, is NaN there; pad on the right)"
        )
    halves = [[torch.zeros_like(p, dtype=F64) for p in params] for _ in range(2)]
    groups = [[torch.zeros_like(p, dtype=F64) for p in params] for _ in range(GROUPS)]
    counts, group_counts = [0, 0], [0] * GROUPS
    for index, batch in enumerate(batches):
        losses = _per_sample(loss_fn(grown, batch), point, index, note)
        counts[index % 2] += losses.shape[0]
        group_counts[index % GROUPS] += losses.shape[0]
        grads = torch.autograd.grad(losses.sum(), params, allow_unused=True)
        _finite_grads(grads, point, index, "gradient", note)
        for half, group, g in zip(halves[index % 2], groups[index % GROUPS], grads):
            if g is not None:
                half += g.to(F64)
                group += g.to(F64)
    if min(group_counts) == 0:
        raise FusedStatsError(
            f"curvature_gain at {point!r}: a group of batches holds no samples (even/odd halves "
            f"{counts}, index mod {GROUPS} {group_counts})"
        )
    n = sum(counts)
    means = [[t / count for t in group] for group, count in zip(groups, group_counts)]
    ghg = 0.0
    for index, batch in enumerate(batches):
        c = index % GROUPS
        # this batch's Hessian between the mean gradients of the two other groups: three
        # distinct samples in every term (module docstring)
        right, left = means[(c + 1) % GROUPS], means[(c + 2) % GROUPS]
        losses = _per_sample(loss_fn(grown, batch), point, index, note)
        g = torch.autograd.grad(losses.sum(), params, create_graph=True, allow_unused=True)
        dot = sum((gi.to(F64) * v).sum() for gi, v in zip(g, right) if gi is not None)
        if not isinstance(dot, torch.Tensor) or not dot.requires_grad:
            continue  # the gradient does not depend on the new parameters: no curvature here
        hv = torch.autograd.grad(dot, params, allow_unused=True)
        _finite_grads(hv, point, index, "Hessian-vector product", note)
        ghg += sum(float((h.to(F64) * w).sum()) for h, w in zip(hv, left) if h is not None)
    ghg /= n
    grad_sq = float(sum((a * b).sum() for a, b in zip(*halves))) / (counts[0] * counts[1])
    gain, reason = _gain(grad_sq, ghg)
    return CurvatureGain(point, grad_sq, ghg, gain, n, names, reason)


def _gain(grad_sq: float, ghg: float) -> tuple[float | None, str | None]:
    """``|g|⁴/(2 gᵀHg)`` and None, or None and why it is not estimable."""
    if not grad_sq > 0:
        return None, (
            f"no gradient detected: the halves' mean gradients have <g_A, g_B> = {grad_sq:.3g} <= 0 "
            "(their common direction is not above the noise)"
        )
    if math.isinf(ghg):
        return None, "g^T H g overflows the float range"
    if not ghg > 0:
        return None, (
            f"g^T H g = {ghg:.3g} <= 0: the quadratic model has no minimum along g (or the estimate is noise)"
        )
    gain = grad_sq**2 / (2.0 * ghg)
    if not math.isfinite(gain):
        return None, f"|g|^4 / (2 g^T H g) overflows (|g|^2 = {grad_sq:.3g}, g^T H g = {ghg:.3g})"
    return gain, None


__all__ = [
    "ADAM_EPS",
    "CurvatureGain",
    "SplitAdamScore",
    "adam_direction",
    "candidate_scores",
    "curvature_gain",
    "split_adam_score",
]
