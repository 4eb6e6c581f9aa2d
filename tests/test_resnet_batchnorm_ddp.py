"""A ResNet GrowthSchedule under torch.distributed (2-process gloo, fp64, CPU): every rank measures
and grows with rank 0's BatchNorm calibration (its first probe batch), so the all-reduced
statistics are of one block per candidate. References: one process probing rank 0's batch first
(the calibration) and then rank 1's, and the grown block of both ranks (bit-equal); a rank other
than 0 refuses to calibrate on its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fused_stats as fs
from fused_stats.networks.resnet import cifar_resnet20

from gloo_harness import init_gloo, run_two_ranks

POINTS = ["layer1.1", "layer2.1"]


def model_and_batches(rank):
    model = cifar_resnet20(width=4, seed=3, random_batchnorm=True).double()
    g = torch.Generator().manual_seed(200 + rank)
    batches = [
        (torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 10, (4,), generator=g))
        for _ in range(2)
    ]
    return model, batches


def _worker(rank, world, outdir):
    init_gloo(rank, world, outdir)
    model, batches = model_and_batches(rank)
    protocol = fs.GrowthProtocol(POINTS, seed=5)
    schedule = fs.GrowthSchedule(
        protocol, at_steps=[1], probe_batches=batches, loss_fn=fs.classification_loss, alpha=0.99
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    event = schedule.maybe_grow(model, 1, optimizer)
    torch.save(model.state_dict(), Path(outdir) / f"grown_rank{rank}.pt")
    out = {"event": event}
    alone = fs.Probe(model, points=["layer1.1"], cross=fs.GrowthProtocol(["layer1.1"], seed=6))
    try:
        alone.step(batches[0], fs.classification_loss)
        out["alone"] = "measured"
    except fs.FusedStatsError as exc:
        out["alone"] = str(exc)
    (Path(outdir) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_every_rank_measures_and_grows_with_rank_0s_calibration(tmp_path):
    ranks = run_two_ranks(_worker, tmp_path)
    assert ranks[0]["event"] == ranks[1]["event"] and ranks[0]["event"]["event"] == "grew"
    assert ranks[0]["alone"] == "measured"
    assert "rank 1 of 2" in ranks[1]["alone"] and "broadcast_batchnorm_stats" in ranks[1]["alone"]
    grown = [torch.load(tmp_path / f"grown_rank{r}.pt") for r in range(2)]
    assert list(grown[0]) == list(grown[1])
    for name, value in grown[0].items():
        assert torch.equal(value, grown[1][name]), name
    # one process: rank 0's first batch calibrates, then every batch of both ranks is measured
    model, batches0 = model_and_batches(0)
    _, batches1 = model_and_batches(1)
    protocol = fs.GrowthProtocol(POINTS, seed=5)
    probe = fs.Probe(model, points=POINTS, cross=protocol)
    for b in batches0 + batches1:
        probe.step(b, fs.classification_loss)
    advice = fs.advise(probe, protocol, alpha=0.99)
    event = ranks[0]["event"]
    assert event["point"] == advice.top.point
    assert event["cross_frob2"] == pytest.approx(advice.top.cross_frob2, rel=1e-10)
    reference = model
    fs.grow(reference, protocol, at=[event["point"]], batchnorm_stats=probe)
    for name, value in reference.state_dict().items():
        if "running" in name:
            assert torch.equal(value, grown[0][name]), name
