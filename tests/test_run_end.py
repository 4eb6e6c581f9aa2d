"""A run's end and a run's failure: nothing observed is missing from the log, nothing stays hooked.

* ``MonitorLog.close()`` / ``with MonitorLog(...)``: 120 observed steps with ``every=50`` give a
  third line at step 120 holding the last 20 steps, checked against reference probes fed the same
  batches by ``Probe.step`` (cumulative: all 120; window: steps 101..120 only).
* ``Observation.open()`` / ``close()`` fold exactly what the with-block folds; ``close(fold=False)``
  folds nothing and removes every hook.
* HF ``Trainer`` and Lightning: the steps after the last ``every``-th are recorded at the end
  (counted samples = every micro-batch's), and a training step that raises leaves no hook on the
  model and a probe whose next ``observe`` works.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.api.training.monitor_log import read_monitor_log

from tiny_models import TanhBlock, padded_lm_batch

F64 = torch.float64
KEYS = ("n", "mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2", "ag_max", "d_align")


class Net(nn.Module):
    def __init__(self, d=5):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, d)
        self.blocks = nn.ModuleList(TanhBlock(d) for _ in range(2))
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def batches(count, size=3, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(size, 3, generator=gen, dtype=F64), torch.randint(0, 4, (size,), generator=gen))
        for _ in range(count)
    ]


def loss_sum(model, batch):
    return nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")


def no_hooks(model, allowed=()):
    """No forward / backward hook on any module but the test's own ``allowed`` ones."""
    return not any(
        m._forward_pre_hooks or m._backward_hooks or any(h not in allowed for h in m._forward_hooks.values())
        for m in model.modules()
    )


def assert_record(got: dict, est, where):
    for key in KEYS:
        want = getattr(est, key)
        value = got[key]
        if isinstance(want, float) and math.isinf(want):
            assert value == want, (where, key)
        else:
            assert value == pytest.approx(want, rel=1e-9, abs=1e-15), (where, key, value, want)


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("how", ["close", "with"])
def test_monitor_log_writes_the_last_partial_window(tmp_path, window, how):
    model = Net().double()
    data = batches(120)
    path = tmp_path / "run.jsonl"
    probe = fs.Probe(model, second_moment="dense")

    def train(log):
        for batch in data:
            with probe.observe(loss_reduction="sum", log=log):
                loss_sum(model, batch).sum().backward()
            model.zero_grad()

    if how == "with":
        with fs.MonitorLog(path, every=50, window=window) as log:
            train(log)
    else:
        log = fs.MonitorLog(path, every=50, window=window)
        train(log)
        assert len(read_monitor_log(path)) == 2  # the partial window is still owed
        assert len(log.close()) == 1
        assert log.close() == []  # closing again writes nothing
    records = read_monitor_log(path)
    assert [r["step"] for r in records] == [50, 100, 120]
    # reference: Probe.step over the batches each line covers (no parameter update in between)
    first = 100 if window else 0
    ref = fs.Probe(model, second_moment="dense")
    for batch in data[first:]:
        ref.step(batch, loss_sum)
    for point in ref.points:
        est = ref.stats[point].estimate()
        assert records[-1]["points"][point]["n"] == 3 * (120 - first)
        assert_record(records[-1]["points"][point], est, point)
    with pytest.raises(fs.FusedStatsError, match="closed"):
        log.observed(probe)


def test_monitor_log_with_nothing_unwritten_adds_no_line(tmp_path):
    model = Net().double()
    probe = fs.Probe(model, second_moment="dense")
    with fs.MonitorLog(tmp_path / "run.jsonl", every=2) as log:
        for batch in batches(4):
            with probe.observe(loss_reduction="sum", log=log):
                loss_sum(model, batch).sum().backward()
    assert [r["step"] for r in read_monitor_log(tmp_path / "run.jsonl")] == [2, 4]


def test_observation_open_close_equals_the_with_block():
    model = Net().double()
    data = batches(3, size=5)
    ref = fs.Probe(model, second_moment="dense")
    got = fs.Probe(model, second_moment="dense")
    for batch in data:
        with ref.observe(loss_reduction="mean"):
            nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        ob = got.observe(loss_reduction="mean")
        assert ob.open() is ob
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        assert ob.close() is True and ob.folded
        assert ob.close() is True  # already closed: nothing happens
    # independent anchor: Probe.step on the per-sample losses
    step = fs.Probe(model, second_moment="dense")
    for batch in data:
        step.step(batch, loss_sum)
    for point in ref.points:
        assert_record(
            {k: getattr(got.stats[point].estimate(), k) for k in KEYS}, step.stats[point].estimate(), point
        )
    # an aborted step: hooks gone, nothing folded, the next observation works
    before = got.stats[ref.points[0]].n
    ob = got.observe(loss_reduction="mean")
    ob.open()
    nn.functional.cross_entropy(model(data[0][0]), data[0][1]).backward()
    assert ob.close(fold=False) is False and no_hooks(model)
    assert got.stats[ref.points[0]].n == before
    with got.observe(loss_reduction="mean") as ob:
        nn.functional.cross_entropy(model(data[0][0]), data[0][1]).backward()
    assert ob.folded and got.stats[ref.points[0]].n == before + 5


# ----------------------------------------------------------------------------- Lightning
def lightning_fit(callback, fail_at=None, max_steps=3):
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Net().double()
            self.calls = 0

        def training_step(self, batch, batch_idx):
            self.calls += 1
            if self.calls == fail_at:
                raise RuntimeError("training failed mid-step")
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    callback.probe = fs.Probe(module.net, second_moment="dense")
    x, y = batches(1, size=40)[0]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=5)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(module, loader)
    return module


def test_lightning_records_the_last_steps(tmp_path):
    pytest.importorskip("lightning")
    from fused_stats.integrations.lightning import FusedStatsLightningCallback

    log = fs.MonitorLog(tmp_path / "run.jsonl", every=1)
    cb = FusedStatsLightningCallback(fs.Probe(Net().double()), loss_reduction="mean", log=log, every=2)
    lightning_fit(cb, max_steps=3)
    assert [r["step"] for r in cb.records] == [2, 3]
    assert [r["step"] for r in read_monitor_log(log.path)] == [2, 3]
    # 3 optimizer steps x 2 micro-batches x 5 samples
    assert all(p["n"] == 30 for p in cb.records[-1]["points"].values())


def test_lightning_exception_closes_the_observation():
    pytest.importorskip("lightning")
    from fused_stats.integrations.lightning import FusedStatsLightningCallback

    cb = FusedStatsLightningCallback(fs.Probe(Net().double()), loss_reduction="mean")
    module = None
    with pytest.raises(RuntimeError, match="training failed mid-step"):
        module = lightning_fit(cb, fail_at=3)
    net = cb.probe.model
    assert no_hooks(net) and cb._observation is None
    assert all(cb.probe.stats[p].n == 10 for p in cb.probe.points)  # the two folded micro-batches
    x, y = batches(1, size=5, seed=9)[0]
    with cb.probe.observe(loss_reduction="mean") as ob:
        nn.functional.cross_entropy(net(x), y).backward()
    assert ob.folded and module is None


# ----------------------------------------------------------------------------- HF Trainer
def hf_train(tmp_path, callback_args, trainer_mixin, fail_at=None, max_steps=3):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_integrations_transformers import VOCAB, Rows, T, tiny_llama, training_args

    from fused_stats.integrations.transformers import FusedStatsCallback, FusedStatsTrainerMixin

    model = tiny_llama()
    calls = [0]

    def maybe_fail(module, args, output):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("training failed mid-step")

    model.model.layers[1].register_forward_hook(maybe_fail)
    probe = fs.Probe(model, second_moment="dense")
    cb = FusedStatsCallback(probe, **callback_args)
    base = transformers.Trainer
    cls = type("MixedTrainer", (FusedStatsTrainerMixin, base), {}) if trainer_mixin else base
    data = Rows(torch.Generator().manual_seed(3), 18)
    trainer = cls(model=model, args=training_args(tmp_path, max_steps), train_dataset=data, callbacks=[cb])
    return model, probe, cb, trainer, maybe_fail, (T, VOCAB)


def test_hf_trainer_records_the_last_steps(tmp_path):
    log = fs.MonitorLog(tmp_path / "run.jsonl", every=1)
    model, _probe, cb, trainer, maybe_fail, _ = hf_train(
        tmp_path / "out", {"log": log, "every": 2}, trainer_mixin=False
    )
    trainer.train()
    assert [r["step"] for r in cb.records] == [2, 3]
    assert [r["step"] for r in read_monitor_log(log.path)] == [2, 3]
    # 3 optimizer steps x 2 micro-batches x 3 sequences
    assert all(p["n"] == 18 for p in cb.records[-1]["points"].values())
    assert no_hooks(model, allowed=(maybe_fail,))


@pytest.mark.parametrize("mixin", [True, False])
def test_hf_trainer_exception_closes_the_observation(tmp_path, mixin):
    model, probe, cb, trainer, maybe_fail, (T, VOCAB) = hf_train(
        tmp_path / "out", {"every": 1}, trainer_mixin=mixin, fail_at=3
    )
    with pytest.raises(RuntimeError, match="training failed mid-step"):
        if mixin:
            trainer.train()
        else:
            try:
                trainer.train()
            finally:
                cb.close()
    assert cb._observation is None and no_hooks(model, allowed=(maybe_fail,))
    assert all(probe.stats[p].n == 6 for p in probe.points)  # the two folded micro-batches
    gen = torch.Generator().manual_seed(11)
    batch = padded_lm_batch(gen, [5, 7], T, VOCAB)
    with probe.observe(loss_reduction="token_mean") as ob:
        model(**batch).loss.backward()
    assert ob.folded
