"""HF ``Trainer`` integration: the probe's statistics collected during ``Trainer.train()``.

Role: :class:`FusedStatsCallback` opens one :class:`~fused_stats.api.training.observe.Observation` per
micro-batch (the Trainer's ``on_step_begin`` / ``on_substep_end`` / ``on_pre_optimizer_step``
events bracket each micro-batch's forward and backward), so every micro-batch of a
gradient-accumulation step is folded with the declared loss reduction checked exactly as
``probe.observe`` checks it. After each optimizer step (every ``every`` steps) it writes one
:class:`~fused_stats.MonitorLog` line and one set of metrics into the Trainer's logs
(``fused_stats/<point>/d_align``, ``.../ag_max``, ``.../n`` and, with ``cross=``, ``.../cross_frob``
(``|C|_F``) and ``.../saturated``), so the console, TensorBoard and W&B show them.

**Per-sample scaling.** The loss the Trainer differentiates per micro-batch is
``ℒ = c · (1/N) Σ_b Σ_t ℓ_bt`` (HF causal-LM token mean; ``N``: the Trainer's
``num_items_in_batch``, the valid targets of the whole accumulation step, over all ranks when
``average_tokens_across_devices``), with ``c`` the Trainer's own factor: the number of processes
when it averages tokens across devices (it multiplies the loss so that DDP's gradient mean is a
token mean), and ``1/k`` (``k`` micro-batches in this step) when the model is not given
``num_items_in_batch``. The callback passes ``c`` as ``loss_scale`` and the observation divides it
out, so ``q_b = ∂ℓ_b/∂z_b`` as in :meth:`fused_stats.Probe.step`.

**DDP** (accelerate's multi-process launch): each rank folds its own micro-batches; the
statistics logged are merged over the ranks (copies; the probe's own accumulators stay local, as
:class:`~fused_stats.MonitorLog` with ``all_reduce=True`` does), and only rank 0 writes the line.

**Why a Trainer mixin as well.** A callback runs after the Trainer's reporting callbacks
(TensorBoard, W&B) in ``on_log``, so the metrics it adds there reach only the console and the
callbacks after it; it also patches the newest ``state.log_history`` entry. Mix
:class:`FusedStatsTrainerMixin` into the Trainer class (``class MyTrainer(FusedStatsTrainerMixin,
Trainer)``) to put them into the logs before any callback sees them; the mixin also closes the
callback's open observation when training raises (with a plain ``Trainer``, call
:meth:`FusedStatsCallback.close` in a ``finally``). The steps after the last logged one get a
final record (and MonitorLog line) in ``on_train_end``.

The hooks only read gradients: training is bit-identical with and without the callback.
"""

from __future__ import annotations

import math
import numbers

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from ..api.growth.distributed import active_ddp_wrapper, check_rebuildable, rebuild_ddp
from ..api.growth.record import GREW
from ..api.training.step_logging import check_callback_args, merged_probe, metrics_of, step_record
from ..errors import FusedStatsError
from ._trainer_growth import check_trainer_setup, replay_checkpoint_growth


class PendingMetrics:
    """The metrics a callback computed at a step, handed to the Trainer's next log once: into
    ``logs`` and the step's ``log_history`` entry (used by :class:`FusedStatsTrainerMixin` too)."""

    _pending: dict[str, float]

    def pop_metrics(self) -> dict[str, float]:
        """The metrics of the last logged step, once."""
        out, self._pending = self._pending, {}
        return out

    def on_log(self, args, state, control, logs=None, **kwargs):
        metrics = self.pop_metrics()
        if not metrics or logs is None:
            return control
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)
        return control


class FusedStatsCallback(PendingMetrics, TrainerCallback):
    """Collect ``probe``'s statistics during ``Trainer.train()`` (module docstring).

    Parameters
    ----------
    probe : fused_stats.Probe
        Built on the model given to the Trainer (the unwrapped module).
    loss_reduction : {"token_mean", "mean", "sum"}
        How the model's loss combines per-sample losses (HF causal-LM models: ``"token_mean"``).
    log : fused_stats.MonitorLog, optional
        Gets one line per logged optimizer step (its own ``every`` is not used; pass
        ``all_reduce=True`` under DDP, or leave it to the callback, which merges either way).
    every : int
        Log (MonitorLog line and Trainer metrics) after every ``every``-th optimizer step.
    stream : {"train", "test"}
    loss_scale : float, optional
        Overrides the Trainer's own loss factor ``c`` (module docstring), e.g. for a custom
        ``compute_loss``.

    Attributes
    ----------
    records : list of dict
        The MonitorLog-style records of every logged step (this rank's view of the merged
        statistics).
    micro_batches : int
        Micro-batches folded.
    """

    def __init__(
        self,
        probe,
        loss_reduction: str = "token_mean",
        log=None,
        every: int = 1,
        stream: str = "train",
        loss_scale=None,
    ):
        check_callback_args(loss_reduction, every, log)
        if loss_scale is not None and (
            not isinstance(loss_scale, numbers.Real) or not math.isfinite(loss_scale) or loss_scale <= 0
        ):
            raise FusedStatsError(f"loss_scale must be a positive number or None, got {loss_scale!r}")
        probe.check_stream(stream)
        self.probe = probe
        self.loss_reduction = loss_reduction
        self.log = log
        self.every = every
        self.stream = stream
        self.loss_scale = loss_scale
        self.records: list[dict] = []
        self.micro_batches = 0
        self._observation = None
        self._pending: dict[str, float] = {}
        self._hook = None
        self._kwargs_seen: dict | None = None
        self._world = 1
        self._average_tokens = False
        self._k_in_step = 0
        self._steps_in_epoch = None
        self._batch_in_epoch = 0
        self._accumulation = 1
        self._logged_step = 0

    # ------------------------------------------------------------------ set-up
    def on_train_begin(self, args, state, control, **kwargs):
        self._logged_step = int(state.global_step)
        self._world = max(int(getattr(args, "world_size", 1) or 1), 1)
        self._average_tokens = bool(getattr(args, "average_tokens_across_devices", False))
        self._accumulation = int(args.gradient_accumulation_steps)
        loader = kwargs.get("train_dataloader")
        try:
            self._steps_in_epoch = len(loader) if loader is not None else None
        except TypeError:
            self._steps_in_epoch = None
        model = self.probe.model
        if self._hook is None:
            self._hook = model.register_forward_pre_hook(self._see_call, with_kwargs=True)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._batch_in_epoch = 0

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        step = int(state.global_step)
        if step > self._logged_step:
            # the steps after the last every-th one (the partial window): the run's end is recorded
            self._log_step(step)
            self._pending = {}  # the Trainer logs nothing after on_train_end

    def close(self) -> None:
        """Drop an open observation (folding nothing) and the forward hook; idempotent. Called at
        the end of training, by :class:`FusedStatsTrainerMixin` when training raises, and by
        hand around a plain ``Trainer.train()``: ``try: trainer.train() finally: cb.close()``."""
        self._close(fold=False)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _see_call(self, module, args, kwargs):
        if self._kwargs_seen is None:
            self._kwargs_seen = dict(kwargs)

    # ------------------------------------------------------------------ micro-batches
    def _micro_batches_this_step(self) -> int:
        """``k``: the micro-batches of the current optimizer step (fewer at an epoch's end)."""
        ga, total = self._accumulation, self._steps_in_epoch
        if total is None:
            return ga
        first = self._batch_in_epoch - self._k_in_step  # index of the step's first micro-batch
        return max(min(ga, total - first), 1)

    def _trainer_factor(self) -> float:
        """``c``: the factor the Trainer multiplied the micro-batch's token-mean loss by."""
        if self.loss_scale is not None:
            return float(self.loss_scale)
        kwargs = self._kwargs_seen or {}
        if kwargs.get("num_items_in_batch") is not None:
            return float(self._world) if self._average_tokens and self._world > 1 else 1.0
        return 1.0 / self._micro_batches_this_step()

    class _Scale:
        """``loss_scale`` read when the observation exits (after the forward showed its kwargs)."""

        def __init__(self, callback):
            self.callback = callback

        def get_scale(self):
            return self.callback._trainer_factor()

    def _open(self):
        self._kwargs_seen = None
        self._observation = self.probe.observe(
            loss_reduction=self.loss_reduction, stream=self.stream, loss_scale=self._Scale(self)
        )
        self._observation.open()

    def _close(self, fold: bool = True):
        obs, self._observation = self._observation, None
        if obs is None:
            return
        if not fold:
            # training ended or failed between events: drop the capture, fold nothing
            obs.close(fold=False)
            return
        self._k_in_step += 1
        self._batch_in_epoch += 1
        obs.close()
        self.micro_batches += 1

    def on_step_begin(self, args, state, control, **kwargs):
        self._close(fold=False)
        self._k_in_step = 0
        self._open()

    def on_substep_end(self, args, state, control, **kwargs):
        self._close()
        self._open()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._close()

    # ------------------------------------------------------------------ logging
    def on_step_end(self, args, state, control, **kwargs):
        step = int(state.global_step)
        if step % self.every:
            return control
        self._log_step(step)
        control.should_log = True
        return control

    def _log_step(self, step: int) -> None:
        self._logged_step = step
        source = self.probe
        if self._world > 1:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                source = merged_probe(self.probe)
        record = step_record(self.probe, source, self.log, self.stream, step)
        self.records.append(record)
        self._pending = metrics_of(record["points"])


class FusedStatsTrainerMixin:
    """Put a :class:`FusedStatsCallback`'s metrics into ``Trainer.log`` before any callback
    (TensorBoard, W&B, ``state.log_history``) sees the logs: ``class MyTrainer(
    FusedStatsTrainerMixin, Trainer)``. With a :class:`GrowthScheduleCallback`,
    ``train(resume_from_checkpoint=...)`` first grows the Trainer's model as the checkpoint's
    growth record says (where the model's record stops short of it), then loads the weights."""

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        growth = [c for c in self._fused_stats_callbacks() if isinstance(c, GrowthScheduleCallback)]
        if growth and (model is None or model is self.model):
            check_trainer_setup(self.args, self.model)
            replay_checkpoint_growth(
                self.model, resume_from_checkpoint, growth[0].schedule.protocol, optimizer=self.optimizer
            )
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

    def log(self, logs, *args, **kwargs):
        for callback in self._fused_stats_callbacks():
            logs.update(callback.pop_metrics())
        return super().log(logs, *args, **kwargs)

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            # HF has no exception event: without this, a step that raised would leave the
            # observation's hooks on the model and its outputs referenced
            for callback in self._fused_stats_callbacks():
                callback.close()

    def _fused_stats_callbacks(self):
        kinds = (FusedStatsCallback, GrowthScheduleCallback)
        return [c for c in self.callback_handler.callbacks if isinstance(c, kinds)]


class GrowthScheduleCallback(PendingMetrics, TrainerCallback, ExportableState):
    """Grow the Trainer's model by a :class:`fused_stats.GrowthSchedule` (its module docstring).

    After each optimizer step (``on_step_end``: gradient accumulation's micro-batches are done and
    the gradients zeroed) the schedule decides at its scheduled steps and grows the model in place,
    extending the Trainer's optimizer; the Trainer's ``LambdaLR`` writes the lr of the optimizer's
    groups, which the new parameters joined, so it drives them from the next step on. Each event
    goes into the model's growth record (step, ``cross_frob2``, ``p_value``), :attr:`events`, and
    the Trainer's logs (``fused_stats/growth/...``; mix :class:`FusedStatsTrainerMixin` into the
    Trainer to have them before TensorBoard / W&B see the logs, as for :class:`FusedStatsCallback`).

    Several processes (``torchrun``, accelerate's DDP): every rank folds its own probe batches,
    the probe is all-reduced and rank 0's decision broadcast (:meth:`GrowthSchedule.maybe_grow`),
    every rank grows alike (same protocol, same seed), and the DDP wrapper that ran the training
    forward (seen by the forward pre-hook; the Trainer's ``model_wrapped``, the one accelerate
    holds) is rebuilt in place around the grown model
    (:func:`fused_stats.api.growth.distributed.rebuild_ddp`), so the Trainer's loop trains it at
    the next step.

    Refused with nothing changed: a scheduled step beyond ``max_steps`` (at ``on_train_begin``),
    FSDP, DeepSpeed, XLA, Megatron and ``nn.DataParallel`` set-ups (at ``on_train_begin``; the
    message names the supported ones), a probe batch equal to one of the step's training
    micro-batches (their ``input_ids``, seen by a forward pre-hook, or the same tensor), a
    scheduled step without an optimizer, and a multi-process step whose forward ran in no plain
    DDP wrapper. The schedule's state travels in ``trainer_state.json`` (``state()``), so a run
    resumed from a checkpoint written after a growth event keeps its events and stop flag; the
    grown architecture comes from the checkpoint (``from_pretrained(checkpoint)``, or the
    original model with :class:`FusedStatsTrainerMixin`, which replays the checkpoint's growth
    record before the Trainer loads the weights).
    """

    def __init__(self, schedule=None):
        from ..api.growth.schedule import GrowthSchedule

        if schedule is None:
            # the Trainer's restore_callback_states_from_checkpoint rebuilds callbacks without
            # arguments; this one restores its schedule's state itself from trainer_state.json
            raise FusedStatsError(
                "GrowthScheduleCallback needs its GrowthSchedule (GrowthScheduleCallback(schedule)); with "
                "TrainingArguments(restore_callback_states_from_checkpoint=True) the Trainer rebuilds "
                "callbacks without arguments: leave that flag off, the callback restores the schedule's "
                "state from trainer_state.json itself"
            )
        if not isinstance(schedule, GrowthSchedule):
            raise FusedStatsError(
                f"GrowthScheduleCallback needs a fused_stats.GrowthSchedule, got {type(schedule).__name__}"
            )
        self.schedule = schedule
        self._hook = None
        self._wrapper = None
        self._step_batches: list[dict] = []
        self._pending: dict[str, float] = {}

    @property
    def events(self) -> list[dict]:
        return self.schedule.events

    def state(self) -> dict:
        return {"args": {}, "attributes": {"schedule_state": self.schedule.state_dict()}}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        check_trainer_setup(args, model)
        self.schedule.check_training_length(int(state.max_steps))
        saved_states = (getattr(state, "stateful_callbacks", None) or {}).get(type(self).__name__) or []
        for saved in saved_states if isinstance(saved_states, list) else [saved_states]:
            # a resumed run: trainer_state.json of the checkpoint holds the schedule's events
            if isinstance(saved, dict) and "schedule_state" in saved.get("attributes", {}):
                self.schedule.load_state_dict(saved["attributes"]["schedule_state"])
        if self._hook is None and model is not None:
            self._hook = model.register_forward_pre_hook(self._see_batch, with_kwargs=True)

    def _see_batch(self, module, args, kwargs):
        if torch.is_grad_enabled() and module.training:
            self._step_batches.append({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
            self._wrapper = active_ddp_wrapper()

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_batches = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        step = int(state.global_step)
        if not self.schedule.is_scheduled(step):
            return control
        if model is None:
            raise FusedStatsError(f"GrowthScheduleCallback at step {step}: the Trainer passed no model")
        check_rebuildable(self._wrapper, model, f"GrowthScheduleCallback at step {step}")
        # accelerate's AcceleratedOptimizer delegates param_groups and state to the torch optimizer
        event = self.schedule.maybe_grow(model, step, optimizer, training_batches=self._step_batches)
        if event["event"] == GREW and self._wrapper is not None:
            rebuild_ddp(self._wrapper)
        self._pending = self.schedule.metrics(event)
        control.should_log = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
