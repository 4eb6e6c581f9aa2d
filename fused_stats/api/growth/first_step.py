"""First-step predictions for the user's own optimizer: :func:`predicted_change`.

Role: one step of a torch optimizer on the new parameters of a growth changes the mean test
loss by ``ΔL = Σ_e Δθ_e C_K,e + O(η²)`` over the entries ``e`` of the origin parameters (every
other new parameter has a zero gradient at the origin, so a zero first update), ``C_K`` the mean
per-sample tangent of the test stream and ``Δθ_e`` the optimizer's first update of entry ``e``
on the train gradient ``g`` (``C_M``, the mean over the probe's train stream). Every supported
optimizer's first update is elementwise, of one of two forms (torch/optim/*.py, torch 2.13):

    linear    Δθ = −lr · k · g
    adaptive  Δθ = −lr · k · g / (√(c + a² g²) + ε)

with, for a new parameter (no state; its first step is step 1):

* SGD: linear, ``k = 1 + μ`` with ``nesterov`` (the first momentum buffer is ``g`` itself, no
  dampening; the step is ``g + μ·buf``), else ``k = 1``;
* Adam, AdamW (also amsgrad, foreach, fused), Adamax: adaptive, ``k = a = 1, c = 0`` (moments
  ``(1−β₁)g, (1−β₂)g²`` over the bias corrections ``1−β₁, 1−β₂``; Adamax ``max(0, |g|+ε)``);
* Adagrad: ``k = 1, a = 1, c`` = the optimizer's ``defaults["initial_accumulator_value"]``
  (torch gives a parameter added after construction the defaults' value, not its group's);
  ``lr_decay`` enters as ``1/(1 + (t−1)·lr_decay)``, 1 at step 1;
* RMSprop: adaptive, ``a = √(1−α)`` (``centered``: ``√(α(1−α))``), ``k = 1``, with or without
  momentum (the first buffer is ``g/avg``);
* NAdam: adaptive, ``a = 1``, ``k = (1−μ₁)/(1−μ₁) + μ₂(1−β₁)/(1−μ₁μ₂)``,
  ``μ_t = β₁(1 − ½·0.96^(t·ψ))``, ψ = ``momentum_decay``;
* RAdam: linear, ``k = 1``: at step 1 ``ρ₁ = 1 ≤ 5``, the un-adapted bias-corrected momentum.

A widened tensor (``mlp_width``) keeps its slot and state: its new slice has zero moments and
the tensor's step count ``s``, so its first step is step ``t = s + 1`` (Adam:
``k = (1−β₁)/(1−β₁ᵗ)``, ``a = √((1−β₂)/(1−β₂ᵗ))``; Adamax ``k`` alike, ``a = 1``; NAdam with
the carried ``mu_product``; RAdam rectified when ``ρ_t > 5``; Adagrad ``c = 0``, ``k =
1/(1 + (t−1)·lr_decay)``; SGD's buffer ``(1−dampening)g``; RMSprop as a new parameter).
``maximize`` flips the sign. Weight decay adds nothing: it is zero at a zero origin, and
``fs.grow`` puts a parameter of non-zero origin in a group with ``weight_decay = 0``.

Each new parameter's settings are those of the param group it joins under ``fs.grow``
(:func:`.grow.planned_groups`, the join rule itself, which also gives the index that group has
after growth, the key of the prediction's per-group parts); a parameter whose counterpart the
optimizer does not hold is not trained and adds nothing. With ``protocol.train_batch_size = B``
the adaptive rules read ``(1/n_B) Σ_b s_b`` over the train stream's B-sized sub-batches
(:mod:`.sub_batches`, kept at the protocol's ``adam_eps``): exact for a rule whose ``c = 0`` and
``ε/a`` is that ε, refused otherwise; the linear ones read ``C_M``. What is kept for this: the
mean train and test tangents (fp64, C's shape) per candidate, on each :class:`.advise.Candidate`
of advice made from a live probe (``first_step``); advice read from a report has none. A probe
with a train stream only (:class:`fused_stats.GrowthSchedule`'s) is split by step parity into
halves A and B (:func:`split_records`): A's step scored on B's mean tangent and the reverse,
averaged (:func:`split_predicted_change`), independent halves, so no noise-on-noise term.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...errors import FusedStatsError
from .grow import planned_groups
from .plan import GrowthPlan

F64 = torch.float64
SUPPORTED = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "NAdam", "RAdam", "Adamax")


@dataclass(frozen=True)
class Rule:
    """A first update ``−lr·k·g`` (``a`` None) or ``−lr·k·g/(√(c + a²g²) + ε)``."""

    k: float
    a: float | None = None
    c: float = 0.0
    eps: float = 0.0

    def update(self, g: torch.Tensor) -> torch.Tensor:
        """The update per unit lr, negated (``u`` in ``Δθ = −lr·u``)."""
        if self.a is None:
            return self.k * g
        return self.k * g / (torch.sqrt(self.c + (self.a * g) ** 2) + self.eps)


@dataclass
class FirstStepTangent:
    """What one candidate's prediction needs: the mean train / test tangents (fp64, C's shape),
    the parameters their columns belong to (``segments``: ``(rel, start, stop)``), the model and
    protocol they were measured on, and the sub-batch state (None: not kept)."""

    point: str
    model: object = field(repr=False)
    protocol: object = field(repr=False)
    c_train: torch.Tensor = field(repr=False)
    c_test: torch.Tensor = field(repr=False)
    segments: tuple = ()
    sub_batches: object = field(default=None, repr=False)
    plan: GrowthPlan | None = field(default=None, repr=False)  # the probe's plan (always given)

    def __deepcopy__(self, memo):  # kept by reference in copies of the advice
        return self


@dataclass(frozen=True)
class FirstStepPrediction:
    """:func:`predicted_change`'s result at one candidate: ``change``, the predicted change of the
    mean test loss of one step; ``by_group``, ``lr`` and ``rules``: per param group, its part,
    lr and rule, keyed by the group's index in ``optimizer.param_groups`` after ``fs.grow`` at
    this candidate alone (the one its new parameters land in: Gemma2/3's post-norm scales in the
    ``weight_decay = 0`` copy that growth appends, not their counterpart's group); the new
    parameters that are not trained (their counterpart is frozen)."""

    point: str
    optimizer: str
    change: float
    by_group: dict
    lr: dict
    rules: dict
    train_batch_size: int | None
    untrained: tuple = ()


def _segments(source, point: str) -> tuple:
    """``(rel, start, stop)``: the parameter each column range of ``point``'s tangent belongs to."""
    if source.family == "mlp_width":
        return ((f"{source.adapter.mlp_output}.weight", 0, int(source.protocol.width)),)
    source.block(point)
    segments, at = [], 0
    for name, width, bias in source.maps[point]:
        rel = "w_out" if source.family == "cross_block" else f"{name}.weight"
        segments.append((rel, at, at + width))
        at += width
        if bias:  # a linear map's bias: one column; a BatchNorm's shift: one entry per channel
            step = width if source.channelwise else 1
            segments.append((f"{name}.bias", at, at + step))
            at += step
    return tuple(segments)


def _growth_source(probe):
    """The probe's tangent feature source, or None (not a growth probe, or under a projection)."""
    source = getattr(probe, "cross", None)
    if getattr(source, "protocol", None) is None or getattr(source, "maps", None) is None:
        return None
    return None if source.projection is not None else source


def tangent_record(probe, point: str) -> FirstStepTangent | None:
    """The :class:`FirstStepTangent` of ``point`` from a live probe over a growth protocol (None:
    not a growth probe, a projection, or no train / test samples)."""
    source = _growth_source(probe)
    if source is None:
        return None
    train, test = probe.cross_stats.get(point), probe.test_cross_stats.get(point)
    if train is None or test is None or train.n == 0 or test.n == 0:
        return None
    return FirstStepTangent(
        point,
        probe.model,
        source.protocol,
        train.c_sum.detach().to(device="cpu", dtype=F64) / train.n,
        test.c_sum.detach().to(device="cpu", dtype=F64) / test.n,
        _segments(source, point),
        getattr(source, "sub_batches", {}).get(point),
        plan=source.plan,
    )


@dataclass(frozen=True)
class _HalfDirections:
    """The sub-batch directions of one half of a split stream, read as :class:`.sub_batches.SubBatches`."""

    s_mean: torch.Tensor | None

    def mean(self) -> torch.Tensor | None:
        return self.s_mean


def split_records(probe, point: str) -> tuple[FirstStepTangent, FirstStepTangent]:
    """The train stream of one probe split by step parity (A: train steps 0, 2, …, whose tangent
    sum the feature source keeps; B: the rest) as two records: A's mean tangent stepping and B's
    scoring, and the reverse. Each pair is independent, so the mean of the two predictions has no
    noise-on-noise term, where one stream taken for both would (the ``split_adam`` score's
    reasoning, :mod:`.scores`). Raises :class:`FusedStatsError` saying why there is no split."""
    source = _growth_source(probe)
    if source is None:
        raise FusedStatsError(
            "the probe is not a growth probe without a projection (fs.Probe(model, cross=protocol)): no tangents"
        )
    train = probe.cross_stats.get(point)
    half = source.split_half(point, probe)
    if train is None or half is None or not 0 < half[1] < train.n:
        raise FusedStatsError(
            f"no split of the train stream at {point!r}: it needs at least 2 train steps, all of them "
            "by Probe.step (samples folded in another way, such as all_reduce across processes, end the split)"
        )
    a_sum = half[0].detach().to(device="cpu", dtype=F64)
    n_a, n_b = int(half[1]), train.n - int(half[1])
    c_a, c_b = a_sum / n_a, (train.c_sum.detach().to(device="cpu", dtype=F64) - a_sum) / n_b
    sub = getattr(source, "sub_batches", {}).get(point)
    s_a = s_b = None
    if sub is not None:
        s_a, s_b = sub.halves() or (None, None)
    segments = _segments(source, point)

    def record(c_step, c_score, s_step):
        directions = None if sub is None else _HalfDirections(s_step)
        return FirstStepTangent(
            point, probe.model, source.protocol, c_step, c_score, segments, directions, plan=source.plan
        )

    return record(c_a, c_b, s_a), record(c_b, c_a, s_b)


def split_predicted_change(probe, point: str, optimizer, lr=None) -> float:
    """The mean of :func:`predict` over :func:`split_records` of ``point``: the first step's
    predicted change of the mean loss from a probe with a train stream only (the schedule's)."""
    a_on_b, b_on_a = (predict(r, optimizer, lr).change for r in split_records(probe, point))
    return (a_on_b + b_on_a) / 2


def _value(x) -> float:
    return float(x.item() if isinstance(x, torch.Tensor) else x)


def _step_count(state) -> int:
    """The step count a widened tensor's new slice starts from (0: no state yet)."""
    step = (state or {}).get("step")
    return 0 if step is None else int(_value(step))


def first_step_rule(optimizer, group: dict, state=None) -> Rule:
    """The first update of an entry with zero state in ``group`` (``state``: the widened tensor's,
    whose step count and scalars the entry shares; None: a new parameter). Module docstring."""
    name = type(optimizer).__name__
    s = _step_count(state)
    t = s + 1
    fresh = s == 0 and not state
    if name == "SGD":
        mu = _value(group["momentum"])
        b = 1.0 if fresh or state.get("momentum_buffer") is None else 1.0 - _value(group["dampening"])
        if mu == 0:
            return Rule(1.0)
        return Rule(1.0 + mu * b if group["nesterov"] else b)
    eps = _value(group.get("eps", 0.0))
    if name in ("Adam", "AdamW"):
        b1, b2 = (_value(b) for b in group["betas"])
        return Rule((1 - b1) / (1 - b1**t), math.sqrt((1 - b2) / (1 - b2**t)), 0.0, eps)
    if name == "Adamax":
        b1 = _value(group["betas"][0])
        return Rule((1 - b1) / (1 - b1**t), 1.0, 0.0, eps)
    if name == "Adagrad":
        c = _value(optimizer.defaults["initial_accumulator_value"]) if fresh else 0.0
        return Rule(1.0 / (1 + (t - 1) * _value(group["lr_decay"])), 1.0, c, eps)
    if name == "RMSprop":
        alpha = _value(group["alpha"])
        a = math.sqrt(alpha * (1 - alpha)) if group["centered"] else math.sqrt(1 - alpha)
        return Rule(1.0, a, 0.0, eps)
    if name == "NAdam":
        b1, b2 = (_value(b) for b in group["betas"])
        psi = _value(group["momentum_decay"])
        mu = b1 * (1.0 - 0.5 * 0.96 ** (t * psi))
        mu_next = b1 * (1.0 - 0.5 * 0.96 ** ((t + 1) * psi))
        product = (1.0 if fresh else _value(state.get("mu_product", 1.0))) * mu
        k = (1 - mu) / (1 - product) + mu_next * (1 - b1) / (1 - product * mu_next)
        return Rule(k, math.sqrt((1 - b2) / (1 - b2**t)), 0.0, eps)
    if name == "RAdam":
        b1, b2 = (_value(b) for b in group["betas"])
        k = (1 - b1) / (1 - b1**t)
        rho_inf = 2 / (1 - b2) - 1
        rho = rho_inf - 2 * t * b2**t / (1 - b2**t)
        if rho <= 5.0:
            return Rule(k)
        rect = math.sqrt((rho - 4) * (rho - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho))
        return Rule(k * rect * math.sqrt(1 - b2**t), math.sqrt(1 - b2), 0.0, eps)
    raise FusedStatsError(_unsupported(optimizer))


def _unsupported(optimizer) -> str:
    return (
        f"predicted_change has no first-step rule for {type(optimizer).__module__}."
        f"{type(optimizer).__name__}: it supports exactly torch.optim.{', torch.optim.'.join(SUPPORTED)} "
        "(not subclasses, whose step may differ); use the per-unit-step numbers of the advice "
        "(predicted_change_sgd, predicted_change_adam) with the update rule of your optimizer"
    )


def is_supported(optimizer) -> bool:
    """Whether ``optimizer`` is exactly one of the :data:`SUPPORTED` torch classes."""
    return type(optimizer) in tuple(getattr(torch.optim, n) for n in SUPPORTED)


def _check_optimizer(optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise FusedStatsError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not is_supported(optimizer):
        raise FusedStatsError(_unsupported(optimizer))


def _checked_lr(lr) -> float | None:
    """``lr`` as a float (None: each group's own). What torch takes as an lr, a number or a
    one-element tensor, is accepted; a bool, an lr that is not finite or not above zero (whose
    prediction would be ±inf, NaN or no step at all) is refused."""
    if lr is None:
        return None
    if (
        isinstance(lr, torch.Tensor)
        and lr.numel() == 1
        and not lr.dtype.is_complex
        and lr.dtype != torch.bool
    ):
        value = float(lr.item())
    elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
        value = float(lr)
    else:
        shown = (
            f"a tensor of shape {tuple(lr.shape)}, {lr.dtype}" if isinstance(lr, torch.Tensor) else repr(lr)
        )
        raise FusedStatsError(
            f"lr must be None (each group's own), a number or a one-element tensor, got {shown}"
        )
    if not math.isfinite(value) or value <= 0:
        raise FusedStatsError(f"lr must be finite and > 0, got {value!r}")
    return value


def _current_plan(record: FirstStepTangent) -> GrowthPlan:
    """The plan the tangents were measured under, while it still describes the model. After the
    model changed (a growth since), the candidate's name may mean another place and the tangents
    are of the model as it was: refused, naming the change."""
    changed = record.plan.changes(record.model)
    if changed:
        raise FusedStatsError(
            f"candidate {record.point!r}: its tangents were measured on the model as it was, and the "
            f"model changed since ({changed}); predict the first step before growing, or probe the "
            "grown model again"
        )
    return record.plan


def predict(record: FirstStepTangent, optimizer, lr=None) -> FirstStepPrediction:
    """:func:`predicted_change` at one candidate (module docstring)."""
    _check_optimizer(optimizer)
    lr = _checked_lr(lr)
    protocol = record.protocol
    rels = [rel for rel, _, _ in record.segments]
    joins = planned_groups(record.model, _current_plan(record), record.point, optimizer, rels)
    size = getattr(protocol, "train_batch_size", None)
    s_mean = None
    if size is not None:
        s_mean = None if record.sub_batches is None else record.sub_batches.mean()
        if s_mean is None:
            raise FusedStatsError(
                f"candidate {record.point!r}: the protocol's train_batch_size={size} needs complete "
                f"sub-batches of {size} train samples from whole probe steps, and the probe has none "
                "(probe with train batches of B samples, or of a divisor of B)"
            )
    c_m, c_k = record.c_train, record.c_test
    by_group: dict[int, float] = {}
    rules: dict[int, Rule] = {}
    lrs: dict[int, float] = {}
    untrained = []
    for rel, start, stop in record.segments:
        join = joins[rel]
        g, group = join.group, join.settings
        if g is None:
            untrained.append(rel)
            continue
        state = None if join.shared is None else optimizer.state.get(join.shared)
        rule = first_step_rule(optimizer, group, state)
        step = float(_value(group["lr"]) if lr is None else lr)
        sign = -1.0 if group.get("maximize", False) else 1.0
        grad, test = c_m[:, start:stop], c_k[:, start:stop]
        if s_mean is not None and rule.a is not None:
            # exact only where the rule is k/a · s at the ε the sub-batch sums were kept at
            eps = float(protocol.adam_eps)
            if rule.c != 0.0 or not math.isclose(rule.eps / rule.a, eps, rel_tol=1e-9):
                raise FusedStatsError(
                    f"candidate {record.point!r}, {rel} in param group {g} ({type(optimizer).__name__}): "
                    f"its first update is k·g/(√({rule.c:g} + {rule.a:.6g}²g²) + {rule.eps:g}), but the "
                    f"sub-batch sums (train_batch_size={size}) were kept for g/(|g| + {eps:g}); set "
                    f"GrowthProtocol(adam_eps={rule.eps / rule.a:.12g}) for this group"
                    + (" (and initial_accumulator_value=0)" if rule.c else "")
                    + ", or train_batch_size=None"
                )
            part = rule.k / rule.a * float((s_mean[:, start:stop] * test).sum())
        else:
            part = float((rule.update(grad) * test).sum())
        by_group[g] = by_group.get(g, 0.0) - sign * step * part
        rules[g], lrs[g] = rule, step
    return FirstStepPrediction(
        record.point,
        type(optimizer).__name__,
        sum(by_group.values()),
        by_group,
        lrs,
        rules,
        size,
        tuple(untrained),
    )


def predicted_change(advice_or_candidate, optimizer, lr=None):
    """The first-order change of the mean test loss of one step of ``optimizer`` on the new
    parameters of the growth at a candidate (module docstring).

    ``advice_or_candidate``: an :class:`~fused_stats.Advice` made by :func:`fused_stats.advise`
    from a live ``fs.Probe`` (returns a dict point -> :class:`FirstStepPrediction`), one of its
    candidates (returns one), or the probe itself (a dict). ``optimizer``: the optimizer over the
    model as the probe measured it (before growth), one of the classes in :data:`SUPPORTED`.
    ``lr``: None, each group's own lr, or one lr for every group (a number or a one-element
    tensor, as torch takes it; finite and > 0). Raises
    :class:`FusedStatsError` for another optimizer class, for advice without the tangents (read
    from a report), under a projection, and once the model has changed since the probe measured
    it (a growth since: the tangents are of the model as it was).
    """
    _check_optimizer(optimizer)
    # advise imports this module: Advice and Candidate are recognised by their fields
    if hasattr(advice_or_candidate, "ranked") and hasattr(advice_or_candidate, "digest"):
        return {c.point: predicted_change(c, optimizer, lr) for c in advice_or_candidate.ranked}
    if hasattr(advice_or_candidate, "first_step") and hasattr(advice_or_candidate, "point"):
        record = advice_or_candidate.first_step
        if record is None:
            raise FusedStatsError(
                f"candidate {advice_or_candidate.point!r} carries no tangents: predicted_change needs "
                "the mean train and test tangents per entry, which advice made from a live fs.Probe "
                "keeps (advice read from a report or under a projection does not); pass "
                "fs.advise(probe) or the probe"
            )
        return predict(record, optimizer, lr)
    if hasattr(advice_or_candidate, "cross_stats"):
        probe = advice_or_candidate
        protocol = getattr(getattr(probe, "cross", None), "protocol", None)
        if protocol is None:
            raise FusedStatsError("predicted_change: the probe was not built with cross=GrowthProtocol")
        out = {}
        for point in protocol.candidates:
            record = tangent_record(probe, point)
            if record is None:
                raise FusedStatsError(
                    f"predicted_change: no tangents at {point!r} (needs train and test samples, "
                    "no projection)"
                )
            out[point] = predict(record, optimizer, lr)
        return out
    raise FusedStatsError(
        "predicted_change takes an Advice, one of its candidates or a Probe, got "
        f"{type(advice_or_candidate).__name__}"
    )


__all__ = ["SUPPORTED", "FirstStepPrediction", "FirstStepTangent", "Rule", "predicted_change"]
