"""Probing a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``), 2 gloo ranks on CPU.

Each rank shards the same seeded model (every block, then the root), probes its own batches with
``Probe.step`` and, in a second probe, with ``probe.observe`` around its own training backward
(blocks frozen, the input and output layers trainable), then ``probe.all_reduce()``. The reference
is independent of the sharding and of the reduce: the unsharded model in one process fed every
rank's batches. Both must agree to 1e-10 relative.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import fused_stats as fs

from gloo_harness import init_gloo, run_two_ranks
from tiny_models import TanhBlock

F64 = torch.float64
POINTS = ["blocks.0", "blocks.1", "blocks.2"]
FIELDS = ("mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2", "ag_max", "ag_mean")


class Net(torch.nn.Module):
    def __init__(self, d=6):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, d)
        self.blocks = torch.nn.ModuleList([TanhBlock(d) for _ in range(3)])
        self.out = torch.nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def make_net():
    net = Net().double()
    for block in net.blocks:
        block.requires_grad_(False)
    return net


def rank_batches(rank: int, count: int = 3):
    gen = torch.Generator().manual_seed(50 + rank)
    return [
        (torch.randn(5, 4, generator=gen, dtype=F64) + 0.2 * rank, torch.randint(0, 3, (5,), generator=gen))
        for _ in range(count)
    ]


def loss_fn(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")


def run(model, train, test):
    """(probe.step probe, observe probe) over ``train`` / ``test`` batches."""
    stepped = fs.Probe(model, points=POINTS, second_moment="pool", cross=fs.CrossSpec(rank=3))
    for b in train:
        stepped.step(b, loss_fn)
    for b in test:
        stepped.step(b, loss_fn, stream="test")
    observed = fs.Probe(model, points=POINTS, second_moment="pool")
    for b in train:
        with observed.observe(loss_reduction="mean"):
            torch.nn.functional.cross_entropy(model(b[0]), b[1]).backward()
    return stepped, observed


def summary(p) -> dict:
    out = {"steps": p.steps}
    for stream, accs in (("train", p.stats), ("test", p.test_stats)):
        for name, acc in accs.items():
            est = acc.estimate()
            out[f"{stream}/{name}"] = {"n": acc.n, **{k: getattr(est, k) for k in FIELDS}}
    for name in p.cross_stats:
        out[f"saturation/{name}"] = p.saturation(name).cross_frob2
    return out


def _worker(rank: int, world: int, outdir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init_gloo(rank, world, outdir)
    try:
        mesh = init_device_mesh("cpu", (world,))
        model = make_net()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded = type(model.blocks[0].lin.weight).__name__
        stepped, observed = run(model, rank_batches(rank), rank_batches(10 + rank, 1))
        stepped.all_reduce()
        observed.all_reduce()
        result = {"stepped": summary(stepped), "observed": summary(observed), "param_type": sharded}
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as handle:
            json.dump(result, handle)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_two_ranks(_worker, tmp_path_factory.mktemp("fsdp2"))


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, dict) and "n" in value:
            assert got[key]["n"] == value["n"], key
            for field in FIELDS:
                assert math.isclose(got[key][field], value[field], rel_tol=1e-10, abs_tol=1e-300), (
                    key,
                    field,
                    got[key][field],
                    value[field],
                )
        elif isinstance(value, float):
            assert math.isclose(got[key], value, rel_tol=1e-10, abs_tol=1e-300), key
        else:
            assert got[key] == value, key


def test_fsdp2_step_and_observe_equal_one_process(ranks):
    train = rank_batches(0) + rank_batches(1)
    test = rank_batches(10, 1) + rank_batches(11, 1)
    stepped, observed = run(make_net(), train, test)
    want = {"stepped": summary(stepped), "observed": summary(observed)}
    for rank in range(2):
        assert ranks[rank]["param_type"] == "DTensor"  # the blocks really were sharded
        assert_same(ranks[rank]["stepped"], want["stepped"])
        assert_same(ranks[rank]["observed"], want["observed"])
