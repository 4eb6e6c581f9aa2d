"""Offline merge of saved shards: ``fused-stats merge``.

Separate "jobs" (accumulators fed disjoint shards with different means, hence different centres)
save their states; ``fused-stats merge OUT IN1 IN2 IN3`` must give the state of ONE accumulator fed
every shard (<= 1e-10 relative on every estimate; pools row for row), for dense, pool and auto
(including auto switching to dense only in the merge). Bad merges (different dims, a damaged
shard, a dense shard into a pool) exit with status 2, name the culprit and write nothing.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
import torch

import fused_stats as fs
from fused_stats.accumulators import auto_pool_limit
from fused_stats.api.state.checkpoint import load_probe_state, save_probe_state
from fused_stats.cli import main

F64 = torch.float64
FIELDS = ("mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2", "trace_sigma", "ag_max", "ag_mean")


def shard(seed: int, sizes, dim: int, mean: float, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    mu = mean * torch.randn(dim, generator=gen, dtype=F64)
    return [(mu + torch.randn(b, dim, generator=gen, dtype=F64)).to(dtype) for b in sizes]


def feed(acc, batches):
    for x in batches:
        acc.update(x)
    return acc


def assert_same(merged, ref, rel=1e-10):
    assert (merged.n, merged.mode, merged.dim) == (ref.n, ref.mode, ref.dim)
    em, er = merged.estimate(), ref.estimate()
    for key in FIELDS:
        assert math.isclose(getattr(em, key), getattr(er, key), rel_tol=rel), (
            key,
            getattr(em, key),
            getattr(er, key),
        )
    if ref.mode == "pool":
        assert torch.allclose(merged.pool_rows(), ref.pool_rows(), rtol=1e-12, atol=1e-12)
        a = fs.misalignment_probability(merged, 3, 3, trials=300, seed=1)
        b = fs.misalignment_probability(ref, 3, 3, trials=300, seed=1)
        assert a.probability == b.probability


D_AUTO = 20
LIMIT = auto_pool_limit(D_AUTO)  # 11

CASES = {
    "dense": (
        dict(dim=7, second_moment="dense"),
        [shard(1, [6, 4], 7, 50.0), shard(2, [9], 7, -3.0), shard(3, [2, 2, 3], 7, 0.0)],
    ),
    "pool": (
        dict(dim=5, second_moment="pool"),
        [shard(4, [5], 5, 2.0), shard(5, [3, 3], 5, 2.5), shard(6, [4], 5, -1.0)],
    ),
    "auto_stays_pool": (
        dict(dim=D_AUTO, second_moment="auto"),
        [shard(7, [3], D_AUTO, 1.0), shard(8, [4], D_AUTO, 1.0), shard(9, [2], D_AUTO, 1.0)],
    ),
    "auto_switches_in_merge": (
        dict(dim=D_AUTO, second_moment="auto"),
        [
            shard(10, [LIMIT - 1], D_AUTO, 3.0),
            shard(11, [LIMIT - 2], D_AUTO, 1.0),
            shard(12, [5], D_AUTO, 1.0),
        ],
    ),
    "fp32_large_mean": (
        dict(dim=6, second_moment="dense"),
        [shard(13, [8], 6, 100.0, torch.float32), shard(14, [8], 6, 100.0, torch.float32)],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cli_merge_equals_one_stream(tmp_path, case, capsys):
    kwargs, shards = CASES[case]
    paths = []
    for i, batches in enumerate(shards):
        path = tmp_path / f"job{i}.safetensors"
        feed(fs.GradStats(**kwargs), batches).save(path)
        paths.append(str(path))
    out = tmp_path / "merged.safetensors"
    assert main(["merge", str(out), *paths]) == 0
    ref = feed(fs.GradStats(**kwargs), [x for batches in shards for x in batches])
    merged = fs.GradStats.load(out)
    assert_same(merged, ref)
    assert f"n={ref.n}" in capsys.readouterr().out


def test_merge_with_empty_shard_and_in_place_output(tmp_path):
    kwargs, shards = CASES["dense"]
    a = tmp_path / "a.safetensors"
    empty = tmp_path / "empty.safetensors"
    feed(fs.GradStats(**kwargs), shards[0]).save(a)
    fs.GradStats(**kwargs).save(empty)
    # the output may be one of the inputs (read first, then replaced atomically)
    assert main(["merge", str(a), str(empty), str(a)]) == 0
    ref = feed(fs.GradStats(**kwargs), shards[0])
    assert_same(fs.GradStats.load(a), ref)


def _saved(tmp_path, name, acc):
    path = tmp_path / name
    acc.save(path)
    return str(path)


def test_bad_merges_exit_2_and_write_nothing(tmp_path, capsys):
    good = _saved(
        tmp_path, "good.safetensors", feed(fs.GradStats(4, second_moment="dense"), shard(20, [5], 4, 1.0))
    )
    other_dim = _saved(tmp_path, "dim5.safetensors", feed(fs.GradStats(5), shard(21, [5], 5, 1.0)))
    pool = _saved(
        tmp_path, "pool.safetensors", feed(fs.GradStats(4, second_moment="pool"), shard(22, [5], 4, 1.0))
    )
    damaged = tmp_path / "damaged.safetensors"
    data = bytearray((tmp_path / "good.safetensors").read_bytes())
    data[-5] ^= 0xFF
    damaged.write_bytes(bytes(data))
    out = tmp_path / "out.safetensors"
    for inputs, words in [
        ([good, other_dim], ["dim5.safetensors", "dim=5", "dim=4"]),
        ([pool, good], ["good.safetensors", "dense", "pool"]),
        ([good, str(damaged)], ["damaged.safetensors", "checksum"]),
        ([good, str(tmp_path / "nope.safetensors")], ["not found", "nope.safetensors"]),
        ([good, str(tmp_path)], ["mix of files and directories"]),
    ]:
        assert main(["merge", str(out), *inputs]) == 2
        err = capsys.readouterr().err
        for word in words:
            assert word in err, (word, err)
        assert not out.exists()
    # an existing output that is not an input needs --force
    out.write_bytes(b"precious")
    assert main(["merge", str(out), good]) == 2
    assert "--force" in capsys.readouterr().err and out.read_bytes() == b"precious"
    assert main(["merge", "--force", str(out), good]) == 0
    assert fs.GradStats.load(out).n == 5


def _probe(dims: dict) -> fs.Probe:
    """A real probe over a chain of linear layers ``h.0 -> h.1`` whose outputs have ``dims``
    (its accumulators are filled directly below, as if its steps had produced these shards)."""
    sizes = [3, *dims.values()]
    model = torch.nn.Module()
    model.h = torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in itertools.pairwise(sizes)))
    return fs.Probe(model, points=list(dims), second_moment="pool")


def test_cli_merge_of_probe_checkpoint_directories(tmp_path, capsys):
    dims = {"h.0": 5, "h.1": 8}
    ref = _probe(dims)
    dirs = []
    for job in range(3):
        probe = _probe(dims)
        for i, (name, d) in enumerate(dims.items()):
            for stream, table, ref_table in (
                ("train", probe.stats, ref.stats),
                ("test", probe.test_stats, ref.test_stats),
            ):
                data = shard(100 + 10 * job + 2 * i + (stream == "test"), [4, 3], d, 1.0 + job)
                table[name] = feed(probe.new_accumulator("grad", stream, name, d), data)
                if name not in ref_table:
                    ref_table[name] = ref.new_accumulator("grad", stream, name, d)
                feed(ref_table[name], data)
        save_probe_state(probe, tmp_path / f"job{job}")
        dirs.append(str(tmp_path / f"job{job}"))
    assert main(["merge", str(tmp_path / "all"), *dirs]) == 0
    assert "h.1" in capsys.readouterr().out
    merged = _probe(dims)
    load_probe_state(merged, tmp_path / "all")
    for name in dims:
        assert_same(merged.stats[name], ref.stats[name])
        assert_same(merged.test_stats[name], ref.test_stats[name])


def test_console_script_is_installed(tmp_path):
    # the entry point itself, once: a real process as a user runs it
    a = _saved(tmp_path, "a.safetensors", feed(fs.GradStats(3), shard(30, [4], 3, 1.0)))
    b = _saved(tmp_path, "b.safetensors", feed(fs.GradStats(3), shard(31, [4], 3, 1.0)))
    out = tmp_path / "ab.safetensors"
    proc = subprocess.run(
        [sys.executable, "-m", "fused_stats.cli", "merge", str(out), a, b],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert fs.GradStats.load(out).n == 8


def test_cli_merge_of_norm_histogram_files_equals_numpy(tmp_path, capsys):
    # a kind the command has no code of its own for: it merges through the protocol
    import numpy as np

    from fused_stats.accumulators import NormHistogram

    low, high, bins = 0.5, 20.0, 7
    shards = [shard(40 + i, [6, 5], 4, 1.0 + i) for i in range(3)]
    paths = []
    for i, data in enumerate(shards):
        paths.append(str(tmp_path / f"h{i}.safetensors"))
        feed(NormHistogram(4, low=low, high=high, bins=bins), data).save(paths[-1])
    out = tmp_path / "h.safetensors"
    assert main(["merge", str(out), *paths]) == 0
    printed = capsys.readouterr().out
    assert "n=33" in printed and "norm_hist: bins=7, unit=sample" in printed
    merged = NormHistogram.load(out)
    norms = torch.cat([x for data in shards for x in data]).norm(dim=1).numpy()
    edges = np.logspace(np.log10(low), np.log10(high), bins + 1)
    counts = merged.to_dict()
    assert counts["counts"] == np.histogram(norms, bins=edges)[0].tolist()
    assert (counts["underflow"], counts["overflow"]) == (int((norms < low).sum()), int((norms >= high).sum()))
    other = tmp_path / "other.safetensors"
    NormHistogram(4, low=low, high=high, bins=bins + 1).save(other)
    assert main(["merge", str(tmp_path / "bad.safetensors"), paths[0], str(other)]) == 2
    assert "bins 7 vs 8" in capsys.readouterr().err
    assert not (tmp_path / "bad.safetensors").exists()
