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
