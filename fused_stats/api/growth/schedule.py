"""Growing during training: :class:`GrowthSchedule`, the decision taken at scheduled optimizer steps.

Role: at each scheduled step (``at_steps``, or every ``every``-th optimizer step) a fresh
``fs.Probe(model, points=protocol.candidates, cross=protocol)`` folds the user's held-out
``probe_batches`` into its train stream, :func:`~fused_stats.api.growth.advise.advise` ranks the
candidates (Holm-adjusted test of ``H0: C = 0`` at ``alpha``), and

* a significant candidate exists: :func:`~fused_stats.api.growth.grow.grow` grows at
  ``advice.top`` (the significant candidate of largest ``|C|_F²``), extending the optimizer (new
  parameters join their counterparts' param group with no state), with the step and the advice
  written into the model's growth record (a ResNet block with the BatchNorm statistics the probe
  calibrated on its first batch and measured with, :mod:`.batchnorm`; under ``torch.distributed``
  rank 0's, which every rank measures with);
* none: the event "saturated everywhere" is recorded and the schedule stops (the stopping rule
  of the depth paper: to first order no new block of the protocol lowers the loss).

The candidate names are names in the current model: after a layer is inserted the blocks are
renumbered, so ``model.layers.1`` names the block at index 1 of the grown stack. The probe runs
in eval mode with parameters frozen (``Probe.step``), so the training gradients, modules'
training flags and the random state of dropout-free models are untouched; the learning-rate
scheduler needs nothing: ``LambdaLR`` and its kin write ``group["lr"]`` of the optimizer's
groups, and the new parameters sit inside those groups.

The integrations (``fused_stats.integrations.transformers.GrowthScheduleCallback`` and
``fused_stats.integrations.lightning.GrowthScheduleLightningCallback``) call :meth:`maybe_grow`
after each optimizer step. :meth:`state_dict` / :meth:`load_state_dict` carry the schedule's own
state (events, stopped) across a checkpoint.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping

import torch
from torch import nn

from ...errors import FusedStatsError
from ..probe.driver import Probe
from ..probe.losses import causal_lm_loss
from .advise import advise
from .first_step import is_supported, split_predicted_change
from .grow import grow
from .plan import GrowthPlan
from .protocol import GrowthProtocol
from .record import EVIDENCE_KEYS, FIRST_STEP_KEYS, GREW, SATURATED, record_saturation


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _positive_int(name: str, value) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise FusedStatsError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _tensors(batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [v for v in batch.values() if isinstance(v, torch.Tensor)]
    if isinstance(batch, (list, tuple)):
        return [t for item in batch for t in _tensors(item)]
    return []


def _on_device(batch, device):
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _on_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [_on_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def _same_batch(a, b) -> bool:
    """Whether two batches are the same data: a shared tensor object, or equal token tensors."""
    ta, tb = _tensors(a), _tensors(b)
    if any(x is y for x in ta for y in tb):
        return True
    ids_a = a.get("input_ids") if isinstance(a, Mapping) else (ta[0] if ta else None)
    ids_b = b.get("input_ids") if isinstance(b, Mapping) else (tb[0] if tb else None)
    if not isinstance(ids_a, torch.Tensor) or not isinstance(ids_b, torch.Tensor):
        return False
    return ids_a.shape == ids_b.shape and torch.equal(ids_a.detach().cpu(), ids_b.detach().cpu())


def first_step_prediction(probe, point: str, optimizer) -> tuple[float | None, str]:
    """``(change, note)``: the predicted change of the mean held-out loss from the first step of
    ``optimizer`` on the growth at ``point`` (:func:`.first_step.split_predicted_change`: the
    probe batches split by parity, one half stepping and the other scoring), or None and why not.
    A prediction that cannot be made never stops the training."""
    inner = optimizer
    while not is_supported(inner) and isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer  # accelerate's AcceleratedOptimizer steps the torch optimizer it wraps
    try:
        change = split_predicted_change(probe, point, inner)
    except FusedStatsError as exc:
        return None, f"no first-step prediction: {exc}"
    note = (
        f"{type(inner).__name__} at the groups' lr: the probe batches split by parity, each half's "
        "step scored on the other"
    )
    return change, note


class GrowthSchedule:
    """When and how to grow during training (module docstring).

    Parameters
    ----------
    protocol : fused_stats.GrowthProtocol
        The candidates, family and initialisation; its ``candidates`` are probed at every event.
    at_steps : sequence of int, optional
        The optimizer steps (``global_step`` after the step, 1-based) at which to decide.
    every : int, optional
        Decide after every ``every``-th optimizer step instead (exactly one of ``at_steps``, ``every``).
    probe_batches : sequence of batches
        Held-out batches (never the training batches) folded into the probe at every event; at
        least 2 samples in all.
    loss_fn : callable
        Per-sample losses ``loss_fn(model, batch) -> (B,)`` (default :func:`fused_stats.causal_lm_loss`).
    alpha : float
        Family-wise level of the Holm-adjusted saturation test.
    max_growths : int, optional
        Stop after this many growth events (None: until saturated).
    """

    def __init__(
        self,
        protocol: GrowthProtocol,
        at_steps=None,
        every: int | None = None,
        probe_batches=None,
        loss_fn=causal_lm_loss,
        alpha: float = 0.05,
        max_growths: int | None = None,
    ):
        if not isinstance(protocol, GrowthProtocol):
            raise FusedStatsError(
                f"protocol must be a fused_stats.GrowthProtocol, got {type(protocol).__name__}"
            )
        if protocol.family == "mlp_width":
            # a schedule grows at one candidate, and width growth must widen every block alike
            raise FusedStatsError(
                "GrowthSchedule grows at the one top candidate; family 'mlp_width' widens every block's MLP "
                "at once (the config holds one intermediate size), so it cannot be scheduled: use family "
                "'layer' or 'cross_block', or call fs.grow with every boundary"
            )
        if protocol.score == "adam_first_step":
            raise FusedStatsError(
                "GrowthSchedule probes its held-out batches as one stream, and score 'adam_first_step' needs "
                "a train and a test stream (<s_M, C_K>): rank by 'cross_frob2' or 'signal_fraction'"
            )
        if (at_steps is None) == (every is None):
            raise FusedStatsError("give exactly one of at_steps=[...] and every=N")
        if at_steps is not None:
            if isinstance(at_steps, (str, bytes)) or not hasattr(at_steps, "__iter__"):
                raise FusedStatsError(f"at_steps must be a list of positive ints, got {at_steps!r}")
            steps = [_positive_int("each of at_steps", s) for s in at_steps]
            if not steps or len(set(steps)) != len(steps):
                raise FusedStatsError(
                    f"at_steps must be a non-empty list of distinct steps, got {list(at_steps)}"
                )
            at_steps = tuple(sorted(steps))
        else:
            every = _positive_int("every", every)
        if probe_batches is None or isinstance(probe_batches, (Mapping, torch.Tensor)):
            raise FusedStatsError(
                "probe_batches must be a list of held-out batches (not one batch, not None), got "
                f"{type(probe_batches).__name__}"
            )
        probe_batches = list(probe_batches)
        if not probe_batches:
            raise FusedStatsError("probe_batches is empty: the saturation test needs held-out batches")
        if protocol.score == "split_adam" and len(probe_batches) < 2:
            # the split halves are the probe's even and odd steps: one batch leaves half B empty
            raise FusedStatsError(
                f"GrowthSchedule score 'split_adam' splits probe_batches into two halves (even and odd "
                f"batches), so it needs at least 2 probe batches; got {len(probe_batches)}"
            )
        if not callable(loss_fn):
            raise FusedStatsError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not isinstance(alpha, numbers.Real) or isinstance(alpha, bool) or not 0 < alpha < 1:
            raise FusedStatsError(f"alpha must be in (0, 1), got {alpha!r}")
        if max_growths is not None:
            max_growths = _positive_int("max_growths", max_growths)
        self.protocol = protocol
        self.at_steps = at_steps
        self.every = every
        self.probe_batches = probe_batches
        self.loss_fn = loss_fn
        self.alpha = float(alpha)
        self.max_growths = max_growths
        self.events: list[dict] = []
        self.stopped = False

    # ------------------------------------------------------------------ checks
    @property
    def growths(self) -> int:
        return sum(e["event"] == GREW for e in self.events)

    def is_scheduled(self, step: int) -> bool:
        if step < 1 or self.stopped or any(e["step"] == step for e in self.events):
            return False
        if self.at_steps is not None:
            return step in self.at_steps
        return step % self.every == 0

    def check_training_length(self, max_steps: int) -> None:
        """Refuse a schedule step the training never reaches (before training starts)."""
        if self.at_steps is not None and max_steps > 0 and self.at_steps[-1] > max_steps:
            late = [s for s in self.at_steps if s > max_steps]
            raise FusedStatsError(
                f"GrowthSchedule: at_steps {late} lie beyond the training length ({max_steps} optimizer steps)"
            )

    def check_not_training_batches(self, training_batches) -> None:
        """Refuse probe batches that are training batches (shared tensors or equal ``input_ids``)."""
        for i, probe_batch in enumerate(self.probe_batches):
            for seen in training_batches:
                if _same_batch(probe_batch, seen):
                    raise FusedStatsError(
                        f"GrowthSchedule: probe batch {i} is a training batch (the same tensor or the same "
                        "input_ids): the test needs held-out data, never the batches the model trains on"
                    )

    # ------------------------------------------------------------------ the decision
    def decide(self, model: nn.Module):
        """The advice on ``model`` from the probe batches (nothing changes). Under
        ``torch.distributed`` each rank folds its own ``probe_batches`` and the probe is
        all-reduced, so the advice is that of all ranks' batches together."""
        return self._decide(model)[2]

    def _decide(self, model: nn.Module):
        """``(plan, probe, advice)``: the plan the probe measured, which the growth then follows,
        and the probe (a ResNet block grows with the BatchNorm statistics it calibrated)."""
        plan = GrowthPlan.build(model, self.protocol)
        probe = Probe(model, points=list(self.protocol.candidates), cross=plan)
        device = next((p.device for p in model.parameters()), None)
        batches = iter(self.probe_batches)
        if _world() > 1 and probe.cross.channelwise:
            # rank 0 calibrates the new BatchNorms on its first batch and every rank measures with
            # those statistics: the all-reduced sums are then of one block per candidate
            if torch.distributed.get_rank() == 0:
                probe.step(_on_device(next(batches), device), self.loss_fn, stream="train")
            probe.cross.broadcast_batchnorm_stats(src=0)
            missing = [p for p in self.protocol.candidates if p not in probe.cross.batchnorm_stats]
            if missing:  # the same broadcast object on every rank: refused on all of them
                raise FusedStatsError(
                    f"GrowthSchedule: rank 0's first probe batch did not reach {missing}, so their "
                    "BatchNorm statistics could not be calibrated for every rank"
                )
        for batch in batches:
            # the Trainer moves its own batches to the model's device; the held-out ones follow
            probe.step(_on_device(batch, device), self.loss_fn, stream="train")
        if _world() > 1:
            probe.all_reduce()
        return plan, probe, advise(probe, self.protocol, alpha=self.alpha)

    def maybe_grow(self, model: nn.Module, step: int, optimizer=None, training_batches=()) -> dict | None:
        """At a scheduled ``step``: probe, advise, grow at the top significant candidate or record
        saturation and stop. Returns the event (None when ``step`` is not scheduled). Every refusal
        is raised before the model or the optimizer changes."""
        if not self.is_scheduled(step):
            return None
        if optimizer is None:
            raise FusedStatsError(
                f"GrowthSchedule at step {step}: the optimizer is not created yet, so the new parameters "
                "could not join it; create it before the first scheduled step"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise FusedStatsError(
                f"GrowthSchedule: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise FusedStatsError(
                "GrowthSchedule: pass the module inside DistributedDataParallel (ddp.module) and wrap "
                "the grown model in a new DistributedDataParallel after a growth event"
            )
        self.check_not_training_batches(training_batches)
        plan, probe, advice = self._decide(model)
        top = advice.top
        if top is None:
            event = {"step": step, "event": SATURATED, "point": None, "cross_frob2": None, "p_value": None}
            event.update(p_adjusted=None, verdict=advice.verdict)
        else:
            event = {
                "step": step,
                "event": GREW,
                "point": top.point,
                "cross_frob2": top.cross_frob2,
                "p_value": top.p_value,
                "p_adjusted": top.p_adjusted,
                "verdict": advice.verdict,
            }
            # before the growth: the prediction reads the groups the new parameters will join
            event.update(zip(FIRST_STEP_KEYS, first_step_prediction(probe, top.point, optimizer)))
        if _world() > 1:
            # every rank holds the same reduced statistics; rank 0's event is taken everywhere, so
            # a last-bit difference between ranks cannot split the decision
            shared = [event]
            torch.distributed.broadcast_object_list(shared, src=0)
            event = shared[0]
        if event["event"] == SATURATED:
            record_saturation(model, self.protocol, step, event["verdict"])
            self.stopped = True
        else:
            evidence = {event["point"]: {k: event[k] for k in EVIDENCE_KEYS + FIRST_STEP_KEYS}}
            grow(
                model,
                plan,
                at=[event["point"]],
                optimizer=optimizer,
                step=step,
                evidence=evidence,
                batchnorm_stats=probe if probe.cross.channelwise else None,
            )
            if self.max_growths is not None and self.growths + 1 >= self.max_growths:
                self.stopped = True
        self.events.append(event)
        return event

    def metrics(self, event: dict) -> dict[str, float]:
        """The event as training-log scalars (``fused_stats/growth/...``)."""
        grew = event["event"] == GREW
        out = {
            "fused_stats/growth/grew": 1.0 if grew else 0.0,
            "fused_stats/growth/saturated": 0.0 if grew else 1.0,
        }
        if grew:
            out["fused_stats/growth/cross_frob2"] = float(event["cross_frob2"])
            out["fused_stats/growth/p_value"] = float(event["p_value"])
            out["fused_stats/growth/p_adjusted"] = float(event["p_adjusted"])
            out["fused_stats/growth/point_index"] = float(self.protocol.index(event["point"]))
            if event.get("first_step_change") is not None:  # events of older states have none
                out["fused_stats/growth/first_step_change"] = float(event["first_step_change"])
        return out

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        return {
            "protocol_digest": self.protocol.digest,
            "events": [dict(e) for e in self.events],
            "stopped": self.stopped,
        }

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, Mapping) or set(state) != {"protocol_digest", "events", "stopped"}:
            raise FusedStatsError(f"not a GrowthSchedule state: {state!r}")
        if state["protocol_digest"] != self.protocol.digest:
            raise FusedStatsError(
                f"GrowthSchedule state was written under protocol {state['protocol_digest'][:12]}…, "
                f"this schedule's is {self.protocol.digest[:12]}…"
            )
        self.events = [dict(e) for e in state["events"]]
        self.stopped = bool(state["stopped"])


__all__ = ["GREW", "SATURATED", "GrowthSchedule"]
