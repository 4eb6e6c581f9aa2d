"""Lightning integration: the probe's statistics collected during ``lightning.Trainer.fit``.

Role: :class:`FusedStatsLightningCallback` opens one
:class:`~fused_stats.api.training.observe.Observation` per micro-batch (``on_train_batch_start`` to
``on_after_backward``), so every micro-batch of an ``accumulate_grad_batches`` window is folded
with the declared loss reduction checked as ``probe.observe`` checks it. Lightning divides the
``training_step`` loss by ``accumulate_grad_batches`` before ``backward`` (automatic
optimisation); that factor is passed as ``loss_scale`` and divided out, so
``q_b = ∂ℓ_b/∂z_b`` as in :meth:`fused_stats.Probe.step`. After each optimizer step (every
``every`` steps) one :class:`~fused_stats.MonitorLog` line is written and the metrics
(``fused_stats/<point>/d_align``, ``ag_max``, ``n``, and with ``cross=`` ``cross_frob`` and
``saturated``) go to the LightningModule's loggers through ``pl_module.log_dict``. The steps
after the last logged one get a final record (and MonitorLog line) in ``on_train_end``; when
training raises, ``on_exception`` closes the open observation (its micro-batch is not folded).

DDP: each rank folds its own micro-batches and the logged statistics are merged over the ranks
(copies; the probe's own accumulators stay local). The hooks only read gradients, so training is
bit-identical with and without the callback.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback
from torch.nn.parallel import DistributedDataParallel

from ..api.growth.distributed import (
    SUPPORTED_SETUPS,
    check_rebuildable,
    rebuild_ddp,
    refuse_unsupported_model,
)
from ..api.growth.record import GREW, RECORD_KEY, growth_history
from ..api.training.step_logging import check_callback_args, merged_probe, metrics_of, step_record
from ..errors import FusedStatsError


class FusedStatsLightningCallback(Callback):
    """Collect ``probe``'s statistics during ``Trainer.fit`` (module docstring).

    ``probe``: built on the LightningModule or a submodule of it; ``loss_reduction``: how the
    ``training_step`` loss combines per-sample losses; ``log``: an optional MonitorLog;
    ``every``: log after every ``every``-th optimizer step. :attr:`records` holds every logged
    record, :attr:`micro_batches` the micro-batches folded.
    """

    def __init__(self, probe, loss_reduction: str = "mean", log=None, every: int = 1, stream: str = "train"):
        check_callback_args(loss_reduction, every, log)
        probe.check_stream(stream)
        self.probe = probe
        self.loss_reduction = loss_reduction
        self.monitor_log = log
        self.every = every
        self.stream = stream
        self.records: list[dict] = []
        self.micro_batches = 0
        self._observation = None
        self._logged_step = 0

    def _drop(self):
        obs, self._observation = self._observation, None
        if obs is not None:
            obs.close(fold=False)

    def on_train_start(self, trainer, pl_module):
        # a resumed run: its earlier steps were logged by the run before
        self._logged_step = int(trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._drop()
        if not pl_module.automatic_optimization:
            raise FusedStatsError(
                "FusedStatsLightningCallback needs automatic optimisation (Lightning's own "
                "backward); with manual optimisation use probe.observe around your backward"
            )
        self._observation = self.probe.observe(
            loss_reduction=self.loss_reduction,
            stream=self.stream,
            loss_scale=1.0 / trainer.accumulate_grad_batches,
        )
        self._observation.open()

    def on_after_backward(self, trainer, pl_module):
        obs, self._observation = self._observation, None
        if obs is not None:
            obs.close()
            self.micro_batches += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._drop()  # a step that skipped backward (training_step returned None)
        step = int(trainer.global_step)
        if step == self._logged_step or step % self.every:
            return
        record = self._record(trainer, step)
        metrics = metrics_of(record["points"])
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)

    def _record(self, trainer, step: int) -> dict:
        self._logged_step = step
        source = self.probe
        if trainer.world_size > 1:
            source = merged_probe(self.probe)
        record = step_record(self.probe, source, self.monitor_log, self.stream, step)
        self.records.append(record)
        return record

    def on_train_end(self, trainer, pl_module):
        self._drop()
        step = int(trainer.global_step)
        if step > self._logged_step:
            # the steps after the last every-th one: recorded (and in the MonitorLog), not sent
            # to the loggers, which Lightning closes before this hook
            self._record(trainer, step)

    def on_exception(self, trainer, pl_module, exception):
        # training raised between on_train_batch_start and on_after_backward: the hooks must not
        # stay on the model, nor the captured outputs in memory
        self._drop()


class GrowthScheduleLightningCallback(Callback):
    """Grow the LightningModule's model by a :class:`fused_stats.GrowthSchedule` during ``fit``.

    ``model_of(pl_module)``: the module the schedule's protocol names points in (default: the
    LightningModule itself). After the micro-batch that completes a scheduled optimizer step
    (``on_train_batch_end`` with a new ``global_step``: ``accumulate_grad_batches`` windows are
    whole), the schedule decides and grows in place, extending ``trainer.optimizers[0]``; the lr
    schedulers of ``configure_optimizers`` write the lr of that optimizer's groups, which the new
    parameters joined. Events go into the growth record, :attr:`events`, and the loggers
    (``pl_module.log_dict``: ``fused_stats/growth/...``).

    Strategy ``"ddp"`` (DDPStrategy, several processes): every rank folds its own probe batches,
    the probe is all-reduced and rank 0's decision broadcast, every rank grows alike, and the
    strategy's DistributedDataParallel (``trainer.strategy.model``) is rebuilt in place around
    the grown module (:func:`fused_stats.api.growth.distributed.rebuild_ddp`).

    Refused with nothing changed: a scheduled step beyond ``max_steps`` (at ``on_train_start``),
    another strategy under several processes (FSDP, DeepSpeed, model parallel: named with the
    supported ones, at ``on_train_start``), a probe batch that is one of the step's training
    micro-batches, manual optimisation and more than one optimizer.
    :meth:`state_dict` / :meth:`load_state_dict` carry the schedule's state in
    Lightning checkpoints, and the model's growth record travels in the checkpoint too (resume
    by building the grown architecture, e.g. from the record's count of new layers).
    """

    def __init__(self, schedule, model_of=None):
        from ..api.growth.schedule import GrowthSchedule

        if not isinstance(schedule, GrowthSchedule):
            raise FusedStatsError(
                f"GrowthScheduleLightningCallback needs a fused_stats.GrowthSchedule, got {type(schedule).__name__}"
            )
        self.schedule = schedule
        self.model_of = model_of or (lambda pl_module: pl_module)
        self._step_batches: list = []
        self._batches_step = -1

    @property
    def events(self) -> list[dict]:
        return self.schedule.events

    def state_dict(self) -> dict:
        return {"schedule_state": self.schedule.state_dict()}

    def load_state_dict(self, state_dict) -> None:
        self.schedule.load_state_dict(state_dict["schedule_state"])

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        # a Lightning checkpoint holds no HF config: the growth record travels beside the weights
        checkpoint[RECORD_KEY] = growth_history(self.model_of(pl_module))

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        if RECORD_KEY in checkpoint:
            model = self.model_of(pl_module)
            setattr(getattr(model, "config", None) or model, RECORD_KEY, list(checkpoint[RECORD_KEY]))

    def on_train_start(self, trainer, pl_module):
        self._check_strategy(trainer, pl_module)
        if not pl_module.automatic_optimization:
            raise FusedStatsError("GrowthScheduleLightningCallback needs automatic optimisation")
        if len(trainer.optimizers) != 1:
            raise FusedStatsError(
                f"GrowthScheduleLightningCallback needs exactly one optimizer, got {len(trainer.optimizers)}"
            )
        max_steps = int(trainer.max_steps)
        if max_steps < 0:
            max_steps = int(trainer.estimated_stepping_batches)
        self.schedule.check_training_length(max_steps)

    def _check_strategy(self, trainer, pl_module) -> None:
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        strategy = trainer.strategy
        where = f"GrowthScheduleLightningCallback (strategy {type(strategy).__name__})"
        if isinstance(strategy, DDPStrategy):  # DeepSpeedStrategy too: its engine is refused here
            check_rebuildable(strategy.model, self.model_of(pl_module), where)
        elif isinstance(strategy, SingleDeviceStrategy) and trainer.world_size == 1:
            refuse_unsupported_model(pl_module, where)
        else:
            raise FusedStatsError(
                f"{where}: its model wrapper cannot be rebuilt around a grown model; growth during training "
                f"supports {SUPPORTED_SETUPS}"
            )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self._batches_step:
            # a new optimizer step's first micro-batch
            self._batches_step, self._step_batches = int(trainer.global_step), []
        self._step_batches.append(batch)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = int(trainer.global_step)
        if not self.schedule.is_scheduled(step):
            return  # also inside an accumulation window: its step was decided at the window's end
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        model = self.model_of(pl_module)
        wrapper = trainer.strategy.model
        wrapper = wrapper if isinstance(wrapper, DistributedDataParallel) else None
        check_rebuildable(wrapper, model, f"GrowthScheduleLightningCallback at step {step}")
        event = self.schedule.maybe_grow(model, step, optimizer, training_batches=self._step_batches)
        if event["event"] == GREW and wrapper is not None:
            rebuild_ddp(wrapper)
        pl_module.log_dict(self.schedule.metrics(event), on_step=True, on_epoch=False, sync_dist=False)
