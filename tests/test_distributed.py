"""GradStats.all_reduce and all_reduce_probe over two gloo processes on CPU.

One ``torch.multiprocessing.spawn`` of two ranks runs every case (a spawn costs seconds). Each rank
is fed its half of a seeded data set; after the all-reduce, both ranks must hold the estimates of
ONE accumulator fed with all the data in one process (the reference, built in the parent), to
<= 1e-10 relative. The halves have different means, so the ranks' centres differ. Cases: dense,
pool, auto (staying a pool / switching to dense only through the reduce / one rank already dense),
one rank with no data, no data anywhere, position unit with masks, an explicit process group,
a whole ``fs.Probe`` (one rank without any test batch, so its test accumulators do not exist until
the reduce creates them), and configuration mismatches,
which must raise FusedStatsError on both ranks and leave the state bit-identical.
"""

from __future__ import annotations

import json
import math
import os
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import fused_stats as fs
from fused_stats.accumulators import auto_pool_limit

from gloo_harness import init_gloo, run_two_ranks
from tiny_models import TanhBlock

FIELDS = ("mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2", "trace_sigma", "ag_max", "ag_mean")
F64 = torch.float64


# ----------------------------------------------------------------------------- data
def batches(seed: int, sizes, dim: int, mean: float, dtype=F64, positions: int = 0):
    """Seeded batches with a per-seed mean direction (so shards have different centres)."""
    gen = torch.Generator().manual_seed(seed)
    mu = mean * torch.randn(dim, generator=gen, dtype=F64)
    out = []
    for size in sizes:
        shape = (size, positions, dim) if positions else (size, dim)
        x = mu + torch.randn(*shape, generator=gen, dtype=F64)
        mask = None
        if positions:
            mask = torch.rand(size, positions, generator=gen) < 0.7
            mask[0, :] = False  # a sample with no counted position is no sample
        out.append((x.to(dtype), mask))
    return out


# case name -> (constructor kwargs, rank 0 batches, rank 1 batches, update kwargs)
def cases():
    d_auto = 16
    limit = auto_pool_limit(d_auto)  # 9
    return {
        "dense": (
            dict(dim=6, second_moment="dense"),
            batches(1, [7, 5], 6, 3.0),
            batches(2, [4, 9, 3], 6, -2.0),
            {},
        ),
        "pool": (dict(dim=5, second_moment="pool"), batches(3, [6, 3], 5, 10.0), batches(4, [5], 5, 1.0), {}),
        "pool_capacity": (
            dict(dim=5, second_moment="pool", pool_capacity=30),
            batches(5, [6], 5, 0.5),
            batches(6, [7], 5, 0.5),
            {},
        ),
        # 4 + 4 <= limit: stays a pool on both ranks
        "auto_pool": (
            dict(dim=d_auto, second_moment="auto"),
            batches(7, [4], d_auto, 2.0),
            batches(8, [2, 2], d_auto, 2.0),
            {},
        ),
        # each rank below the limit, the total above it: must become dense through the reduce
        "auto_switch": (
            dict(dim=d_auto, second_moment="auto"),
            batches(9, [limit - 2], d_auto, 1.0),
            batches(10, [limit - 3], d_auto, 4.0),
            {},
        ),
        # rank 1 already switched to dense, rank 0 still a pool
        "auto_mixed": (
            dict(dim=d_auto, second_moment="auto"),
            batches(11, [3], d_auto, 1.0),
            batches(12, [limit, 4], d_auto, 1.0),
            {},
        ),
        "dense_empty_rank1": (dict(dim=6, second_moment="dense"), batches(13, [8], 6, 5.0), [], {}),
        "pool_empty_rank0": (dict(dim=6, second_moment="pool"), [], batches(14, [3, 4], 6, 5.0), {}),
        "auto_empty_rank0": (dict(dim=d_auto, second_moment="auto"), [], batches(15, [5], d_auto, 1.0), {}),
        "position_masked": (
            dict(dim=4, second_moment="dense"),
            batches(16, [3, 2], 4, 1.0, positions=5),
            batches(17, [4], 4, -1.0, positions=5),
            dict(unit="position"),
        ),
        "sample_masked_fp32": (
            dict(dim=4, second_moment="auto"),
            batches(18, [5], 4, 30.0, torch.float32, positions=3),
            batches(19, [6], 4, 30.0, torch.float32, positions=3),
            {},
        ),
    }


def feed(acc, items, kwargs):
    for x, mask in items:
        acc.update(x, mask=mask, **kwargs)
    return acc


def summary(acc) -> dict:
    out = {"n": acc.n, "mode": acc.mode, "unit": acc.unit, "skipped": acc.skipped_batches}
    if acc.n >= 4:
        est = acc.estimate()
        out.update({key: getattr(est, key) for key in FIELDS})
    if acc.mode == "pool" and acc.n:
        out["pool_rows"] = acc.pool_rows().tolist()
        if acc.n >= 4:
            out["misalignment"] = fs.misalignment_probability(acc, 2, 2, trials=200, seed=3).probability
    return out


def state_tensors(acc) -> dict:
    return acc.state_dict()


def same_state(acc, saved: dict) -> bool:
    return acc.same_state(saved)


class TinyNet(torch.nn.Module):
    """Two residual blocks (the probed points) between an input and a 3-class output layer."""

    def __init__(self, d=5):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, d)
        self.blocks = torch.nn.ModuleList([TanhBlock(d), TanhBlock(d)])
        self.out = torch.nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


PROBE_POINTS = ["blocks.0", "blocks.1"]


def probe_loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, reduction="none")


def probe_batches(seed: int, count: int):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(5, 4, generator=gen) + 0.3, torch.randint(0, 3, (5,), generator=gen))
        for _ in range(count)
    ]


def probe_data(rank: int):
    """(train, test) batches of a rank; rank 1 has no test batch (its test accumulators never exist)."""
    return probe_batches(300 + rank, 3), (probe_batches(400, 2) if rank == 0 else [])


def run_probe(probe, train, test):
    for batch in train:
        probe.step(batch, probe_loss)
    for batch in test:
        probe.step(batch, probe_loss, stream="test")
    return probe


def dense_kind(name="grad_dense"):
    """A kind added through the registry: a second GradStats, dense, beside the probe's pool."""
    from fused_stats.api.probe.fold import Kind

    return Kind(
        name,
        lambda probe: getattr(probe, "keep_dense", False),
        lambda probe, name, dim, dtype, device: fs.GradStats(int(dim), "dense", device=device, name=name),
    )


def dense_probe():
    probe = fs.Probe(TinyNet(), points=PROBE_POINTS, second_moment="pool")
    probe.keep_dense = True
    return probe


# ----------------------------------------------------------------------------- worker
def _worker(rank: int, world: int, outdir: str) -> None:
    import torch.distributed as dist

    from fused_stats.api.state.distributed import all_reduce_probe

    init_gloo(rank, world, outdir)
    try:
        results = {}
        for name, (kwargs, items0, items1, upd) in cases().items():
            acc = feed(fs.GradStats(**kwargs), items0 if rank == 0 else items1, upd)
            acc.all_reduce()
            results[name] = summary(acc)

        # an explicit group (both ranks, listed in reverse order)
        group = dist.new_group([1, 0])
        kwargs, items0, items1, upd = cases()["dense"]
        acc = feed(fs.GradStats(**kwargs), items0 if rank == 0 else items1, upd)
        acc.all_reduce(group)
        results["dense_group"] = summary(acc)

        # nobody has data: stays empty, skipped batches are summed
        acc = fs.GradStats(3, nonfinite="skip")
        acc.update(torch.full((2, 3), math.nan))
        acc.all_reduce()
        results["all_empty"] = summary(acc)

        # mismatches must raise on BOTH ranks and leave the state untouched
        errors = {}
        for case, kwargs in {
            "dim": dict(dim=4 + rank, second_moment="dense"),
            "second_moment": dict(dim=4, second_moment=("dense", "pool")[rank]),
            "capacity": dict(dim=4, second_moment="pool", pool_capacity=9),
        }.items():
            acc = feed(fs.GradStats(**kwargs), batches(200 + rank, [5], kwargs["dim"], 1.0), {})
            before = state_tensors(acc)
            try:
                acc.all_reduce()
                errors[case] = None
            except fs.FusedStatsError as exc:
                errors[case] = {"message": str(exc), "unchanged": same_state(acc, before), "n": acc.n}
        acc = fs.GradStats(4, second_moment="dense")
        acc.update(torch.randn(5, 3, 4), unit=("sample", "position")[rank])
        before = state_tensors(acc)
        try:
            acc.all_reduce()
            errors["unit"] = None
        except fs.FusedStatsError as exc:
            errors["unit"] = {"message": str(exc), "unchanged": same_state(acc, before), "n": acc.n}
        results["errors"] = errors

        # a whole probe, each rank on its own batches
        probe = run_probe(fs.Probe(TinyNet(), points=PROBE_POINTS, second_moment="pool"), *probe_data(rank))
        all_reduce_probe(probe)
        results["probe"] = {
            f"{stream}/{name}": summary(accs[name])
            for stream, accs in (("train", probe.stats), ("test", probe.test_stats))
            for name in PROBE_POINTS
        }
        results["probe_steps"] = probe.steps
        # a third kind of accumulator goes through the same table and reduce
        hist = run_probe(fs.Probe(TinyNet(), points=PROBE_POINTS, norm_histogram=HIST), *probe_data(rank))
        all_reduce_probe(hist)
        results["histograms"] = {
            f"{kind}/{stream}/{name}": acc.counts.tolist()
            for (kind, stream, name), acc in hist.table.items()
            if kind == "norm_hist"
        }
        # a kind added with register_kind is reduced too (rank 1's test one created by the reduce);
        # ranks that registered different kinds: an error on both, not a hang
        from fused_stats.api.probe.fold import Kind, register_kind, unregister_kind

        register_kind(dense_kind())
        try:
            custom = run_probe(dense_probe(), *probe_data(rank))
            all_reduce_probe(custom)
            results["custom_kind"] = {
                f"{stream}/{name}": summary(custom.accumulators("grad_dense", stream)[name])
                for stream in ("train", "test")
                for name in PROBE_POINTS
            }
            # a kind registered on one rank only, which no probe keeps, changes nothing
            if rank == 1:
                register_kind(Kind("grad_unused", lambda probe: False, dense_kind().make))
            unused = run_probe(dense_probe(), *probe_data(rank))
            all_reduce_probe(unused)
            results["unused_kind"] = summary(unused.accumulators("grad_dense", "train")[PROBE_POINTS[0]])
            if rank == 1:
                register_kind(dense_kind("grad_extra"))
            other = run_probe(dense_probe(), *probe_data(rank))
            try:
                all_reduce_probe(other)
                results["kinds_mismatch"] = None
            except fs.FusedStatsError as exc:
                results["kinds_mismatch"] = str(exc)
        finally:
            unregister_kind("grad_dense")
            unregister_kind("grad_extra")
            unregister_kind("grad_unused")
        # ranks probing different points (also different numbers of them): an error on both
        # ranks, not a hang
        mismatch = []
        for points in (PROBE_POINTS[rank : rank + 1], PROBE_POINTS[rank:]):
            other = run_probe(fs.Probe(TinyNet(), points=points), *probe_data(0))
            try:
                all_reduce_probe(other)
                mismatch.append(None)
            except fs.FusedStatsError as exc:
                mismatch.append(str(exc))
        results["probe_mismatch"] = mismatch
        from fused_stats.accumulators.distributed import all_reduce_many

        named = {("h.0" if rank == 0 else "h.9"): fs.GradStats(3)}
        try:
            all_reduce_many(named)
            results["many_mismatch"] = None
        except fs.FusedStatsError as exc:
            results["many_mismatch"] = str(exc)
        # same name, different kinds of accumulator: different collectives would follow (a hang),
        # so it must be an error on both ranks
        from fused_stats.accumulators.cross_stats import CrossStats

        named = {"h.0": fs.GradStats(3) if rank == 0 else CrossStats(3, torch.ones(2, 3), "gelu")}
        try:
            all_reduce_many(named)
            results["kind_mismatch"] = None
        except fs.FusedStatsError as exc:
            results["kind_mismatch"] = str(exc)
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as handle:
            json.dump(results, handle)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_two_ranks(_worker, tmp_path_factory.mktemp("gloo"))


# ----------------------------------------------------------------------------- checks
def assert_same(got: dict, ref: dict, rel: float = 1e-10) -> None:
    assert got["n"] == ref["n"]
    assert got["mode"] == ref["mode"]
    assert got["unit"] == ref["unit"]
    for key in FIELDS:
        if key in ref:
            # the scale of the four targets: differences of terms of size ~|q|^2 / |q|^4
            assert math.isclose(got[key], ref[key], rel_tol=rel, abs_tol=1e-300), (key, got[key], ref[key])
    if "pool_rows" in ref:
        assert torch.allclose(
            torch.tensor(got["pool_rows"], dtype=F64),
            torch.tensor(ref["pool_rows"], dtype=F64),
            rtol=1e-12,
            atol=1e-12,
        )
    if "misalignment" in ref:
        assert got["misalignment"] == ref["misalignment"]


@pytest.mark.parametrize("case", list(cases()))
def test_all_reduce_equals_one_stream(ranks, case):
    kwargs, items0, items1, upd = cases()[case]
    ref = summary(feed(fs.GradStats(**kwargs), items0 + items1, upd))
    assert ref["n"] >= 4
    for rank in range(2):
        assert_same(ranks[rank][case], ref)


def test_auto_modes_follow_one_stream(ranks):
    # the representation after the reduce is the one a single stream would have reached
    assert ranks[0]["auto_pool"]["mode"] == "pool"
    assert ranks[0]["auto_switch"]["mode"] == "dense"
    assert ranks[0]["auto_mixed"]["mode"] == "dense"
    assert ranks[0]["pool_empty_rank0"]["mode"] == "pool"


def test_explicit_group(ranks):
    kwargs, items0, items1, upd = cases()["dense"]
    ref = summary(feed(fs.GradStats(**kwargs), items0 + items1, upd))
    for rank in range(2):
        assert_same(ranks[rank]["dense_group"], ref)


def test_no_data_anywhere(ranks):
    for rank in range(2):
        assert ranks[rank]["all_empty"]["n"] == 0
        assert ranks[rank]["all_empty"]["skipped"] == 2  # one skipped batch per rank


@pytest.mark.parametrize(
    "case,words",
    [
        ("dim", ["dim", "[4, 5]"]),
        ("second_moment", ["second_moment", "dense", "pool"]),
        ("capacity", ["pool_capacity=9", "10"]),
        ("unit", ["unit", "sample", "position"]),
    ],
)
def test_mismatch_raises_on_every_rank(ranks, case, words):
    for rank in range(2):
        err = ranks[rank]["errors"][case]
        assert err is not None, f"rank {rank} accepted a {case} mismatch"
        for word in words:
            assert word in err["message"], (word, err["message"])
        assert err["unchanged"]


HIST = {"low": 1e-3, "high": 1e1, "bins": 8}


def test_probe_all_reduce_of_norm_histograms(ranks):
    (train0, test0), (train1, test1) = probe_data(0), probe_data(1)
    ref = run_probe(
        fs.Probe(TinyNet(), points=PROBE_POINTS, norm_histogram=HIST), train0 + train1, test0 + test1
    )
    # the one-stream reference: numpy's histogram of the per-sample norms the GradStats pools hold
    pooled = run_probe(
        fs.Probe(TinyNet(), points=PROBE_POINTS, second_moment="pool"), train0 + train1, test0 + test1
    )
    edges = np.logspace(-3, 1, 9)
    for rank in range(2):
        got = ranks[rank]["histograms"]
        assert len(got) == 2 * len(PROBE_POINTS)
        for stream, accs in (("train", pooled.stats), ("test", pooled.test_stats)):
            for name in PROBE_POINTS:
                norms = accs[name].pool_rows().norm(dim=1).numpy()
                inside = np.histogram(norms[(norms >= 1e-3) & (norms < 1e1)], bins=edges)[0]
                want = [int((norms < 1e-3).sum()), *inside.tolist(), int((norms >= 1e1).sum())]
                assert [int(v) for v in got[f"norm_hist/{stream}/{name}"]] == want
                assert (
                    got[f"norm_hist/{stream}/{name}"]
                    == ref.table[("norm_hist", stream, name)].counts.tolist()
                )


def test_probe_all_reduce(ranks):
    (train0, test0), (train1, test1) = probe_data(0), probe_data(1)
    ref = run_probe(
        fs.Probe(TinyNet(), points=PROBE_POINTS, second_moment="pool"), train0 + train1, test0 + test1
    )
    for rank in range(2):
        assert ranks[rank]["probe_steps"] == ref.steps == {"train": 6, "test": 2}
        for stream, accs in (("train", ref.stats), ("test", ref.test_stats)):
            for name in PROBE_POINTS:
                assert_same(ranks[rank]["probe"][f"{stream}/{name}"], summary(accs[name]))
    for rank in range(2):
        for message in ranks[rank]["probe_mismatch"]:
            assert message is not None and "different points" in message, message
        assert "different sets of accumulators" in ranks[rank]["many_mismatch"]
        assert "different sets of accumulators" in ranks[rank]["kind_mismatch"]


def test_probe_all_reduce_of_a_registered_kind(ranks):
    from fused_stats.api.probe.fold import register_kind, unregister_kind

    (train0, test0), (train1, test1) = probe_data(0), probe_data(1)
    register_kind(dense_kind())
    try:
        ref = run_probe(dense_probe(), train0 + train1, test0 + test1)
        want = {
            f"{stream}/{name}": summary(ref.accumulators("grad_dense", stream)[name])
            for stream in ("train", "test")
            for name in PROBE_POINTS
        }
    finally:
        unregister_kind("grad_dense")
    for rank in range(2):
        for key, value in want.items():
            assert value["mode"] == "dense" and value["n"] > 0
            assert_same(ranks[rank]["custom_kind"][key], value)
        assert ranks[rank]["unused_kind"] == ranks[rank]["custom_kind"][f"train/{PROBE_POINTS[0]}"]
        assert "keep different accumulator kinds" in ranks[rank]["kinds_mismatch"]


# ----------------------------------------------------------------------------- NCCL (GPU only)
NCCL_CASES = ("dense", "pool", "auto_switch", "auto_mixed", "dense_empty_rank1", "position_masked")


def _nccl_worker(rank: int, world: int, port: int, outdir: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for name in NCCL_CASES:
            kwargs, items0, items1, upd = cases()[name]
            mine = items0 if rank == 0 else items1
            for where in ("cuda", "cpu"):  # state on the GPU, and CPU state over an NCCL group
                device = torch.device("cuda", rank) if where == "cuda" else torch.device("cpu")
                # the torch twin on CUDA too: this checks the communication, not the kernels
                acc = fs.GradStats(**kwargs, device=device, backend="torch")
                feed(acc, [(x.to(device), None if m is None else m.to(device)) for x, m in mine], upd)
                acc.all_reduce()
                assert acc.device == device and acc.centre.device == device
                results[f"{name}/{where}"] = summary(acc)
        with open(os.path.join(outdir, f"nccl{rank}.json"), "w") as handle:
            json.dump(results, handle)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices: NCCL over one rank is an identity all-reduce and would check nothing",
)
def test_nccl_all_reduce_equals_one_stream(tmp_path):
    world = 2
    mp.spawn(_nccl_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        got = json.loads((tmp_path / f"nccl{rank}.json").read_text())
        for name in NCCL_CASES:
            kwargs, items0, items1, upd = cases()[name]
            ref = summary(feed(fs.GradStats(**kwargs), items0 + items1, upd))
            for where in ("cuda", "cpu"):
                assert_same(got[f"{name}/{where}"], ref)
