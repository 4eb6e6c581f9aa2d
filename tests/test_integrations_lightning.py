"""FusedStatsLightningCallback under lightning.Trainer (CPU, accumulate_grad_batches=2): logged
statistics equal Probe.step over the same micro-batches at the same parameters (recorded from the
run), one record per optimizer step, parameters bit-identical to a run without the callback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip(
    "lightning",
    reason="lightning is not installed: install the pinned peer libraries with `bash .ci/install-peers` "
    "(CI does)",
)

import lightning as L

import fused_stats as fs
from fused_stats.integrations.lightning import FusedStatsLightningCallback

from tiny_models import TanhBlock

F64 = torch.float64


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.blocks = nn.ModuleList(TanhBlock(6) for _ in range(2))
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = Net().double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)  # a batch mean

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)


def data():
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(30, 5, generator=g, dtype=F64), torch.randint(0, 3, (30,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=5)


def fit(callbacks=(), record=None):
    module = Module()
    if record is not None:
        module.net.register_forward_pre_hook(
            lambda m, args: record.append(
                ({k: v.clone() for k, v in m.state_dict().items()}, args[0].clone())
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(module, data())
    return module


def test_lightning_callback_accumulation():
    plain = fit()
    recorded = []
    module_probe = {}

    class Make(FusedStatsLightningCallback):
        def setup(self, trainer, pl_module, stage):
            self.probe = fs.Probe(pl_module.net, points=["blocks.0", "blocks.1"], second_moment="dense")
            module_probe["probe"] = self.probe

    cb = Make(probe=fs.Probe(Net(), points=["blocks.0"]), loss_reduction="mean")
    observed = fit([cb], record=recorded)
    for a, b in zip(plain.state_dict().values(), observed.state_dict().values()):
        assert torch.equal(a, b)
    assert cb.micro_batches == 6 and len(recorded) == 6
    assert [r["step"] for r in cb.records] == [1, 2, 3]
    # reference: Probe.step (per-sample losses summed, one activation backward) per micro-batch
    ref_net = Net().double()
    ref = fs.Probe(ref_net, points=["blocks.0", "blocks.1"], second_moment="dense")
    x_all = data().dataset.tensors
    for i, (state, x) in enumerate(recorded):
        ref_net.load_state_dict(state)
        y = x_all[1][5 * i : 5 * i + 5]
        assert torch.equal(x, x_all[0][5 * i : 5 * i + 5])
        ref.step((x, y), fs.classification_loss)
        if i % 2 == 1:
            record = cb.records[i // 2]
            for p in ref.points:
                est = ref.stats[p].estimate()
                for key in ("n", "d_align", "mu_norm2", "ag_max"):
                    assert record["points"][p][key] == pytest.approx(
                        getattr(est, key), rel=1e-9, abs=1e-12
                    ), (i, p, key)
