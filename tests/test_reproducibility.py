"""A loaded state continues exactly like the live one it was saved from, bit for bit.

Reference: the live accumulator (or probe) that was never saved, fed the same next batches. Every
state file is read through :class:`misaligned_loading.MisalignedLoading`, which makes each tensor
safetensors returns a view 8 bytes past a 64-byte boundary, so the tests do not depend on whether
this CPU's BLAS happens to round by alignment. For GradStats (dense, pool, auto across its switch
to dense, position unit), CrossStats (including the carried single sample), a probe checkpoint and
merged shards (``fused-stats merge`` of state files, and of probe checkpoints):

(a) every loaded state tensor starts on a 64-byte boundary (its own allocation), and
(b) after the same next batches, every state tensor equals the live one (``torch.equal``), and so
    do the estimates.
"""

from __future__ import annotations

import pytest
import torch
from misaligned_loading import MisalignedLoading, assert_aligned, assert_bit_identical, state_tensors

import fused_stats as fs
from fused_stats.accumulators.cross_stats import CrossStats
from fused_stats.api.state.checkpoint import load_probe_state, merge_checkpoints, save_probe_state
from fused_stats.cli import main as cli_main

from tiny_models import MaskedPoolNet, masked_seq_batches
from tiny_models import masked_pool_loss as loss_fn

DIM = 32  # 'auto' keeps a pool while N*32 + N^2 <= 32^2, i.e. up to 19 samples


@pytest.fixture
def misaligned(monkeypatch):
    return MisalignedLoading(monkeypatch)


def grad_batches(seed: int, count: int, size: int = 5, positions: int | None = None):
    """Gradient batches with a strong mean (3x the noise: where rounding matters most)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (size, DIM) if positions is None else (size, positions, DIM)
    out = []
    for _ in range(count):
        grad = 3.0 + torch.randn(shape, generator=gen)
        mask = None
        if positions is not None:
            mask = torch.rand(size, positions, generator=gen) < 0.7
            mask[:, 0] = True
        out.append((grad, mask))
    return out


def estimates_of(acc) -> dict:
    if isinstance(acc, CrossStats):
        return acc.saturation(alpha=0.05).to_dict()
    est = acc.estimate().to_dict()
    if acc.mode == "pool":
        est["misalignment"] = fs.misalignment_probability(acc, 4, 4, trials=300, seed=1).to_dict()
    return est


# ----------------------------------------------------------------------------- GradStats
GRAD_CASES = {
    "dense": dict(second_moment="dense", unit="sample", positions=None),
    "pool": dict(second_moment="pool", unit="sample", positions=None),
    "auto": dict(second_moment="auto", unit="sample", positions=None),  # pool when saved, dense after
    "position": dict(second_moment="pool", unit="position", positions=3),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_grad_stats_resume_is_bit_identical(tmp_path, misaligned, case):
    spec = GRAD_CASES[case]
    batches = grad_batches(
        10 + len(case), 5, size=3 if case == "position" else 5, positions=spec["positions"]
    )
    live = fs.GradStats(
        DIM,
        second_moment=spec["second_moment"],
        pool_capacity=64 if spec["second_moment"] == "pool" else None,
    )
    for grad, mask in batches[:3]:
        live.update(grad, mask=mask, unit=spec["unit"])
    saved_mode = live.mode
    live.save(tmp_path / "state.safetensors")
    loaded = fs.GradStats.load(tmp_path / "state.safetensors")
    misaligned.check_used()
    assert_aligned(loaded, f"{case}: loaded")  # (a)
    assert_bit_identical(loaded, live, f"{case}: as loaded")
    for grad, mask in batches[3:]:
        live.update(grad, mask=mask, unit=spec["unit"])
        loaded.update(grad, mask=mask, unit=spec["unit"])
    assert_bit_identical(loaded, live, f"{case}: continued")  # (b)
    assert estimates_of(loaded) == estimates_of(live)
    if case == "auto":  # the continuation crossed the pool -> dense switch
        assert (saved_mode, live.mode) == ("pool", "dense")


def test_merged_grad_stats_files_are_bit_identical(tmp_path, misaligned):
    """``fused-stats merge`` of saved shards, continued, equals the in-memory merge of the live
    shards, continued (the merge re-centres one shard: BLAS work on loaded operands)."""
    shards = []
    for seed in (21, 22, 23):
        acc = fs.GradStats(DIM, second_moment="dense")
        for grad, _ in grad_batches(seed, 2):
            acc.update(grad + 0.5 * seed)  # different means: the re-centring is not trivial
        shards.append(acc)
    paths = [tmp_path / f"shard{i}.safetensors" for i in range(len(shards))]
    for acc, path in zip(shards, paths):
        acc.save(path)
    out = tmp_path / "merged.safetensors"
    assert cli_main(["merge", str(out), *map(str, paths)]) == 0
    live = shards[0].copy()
    for acc in shards[1:]:
        live.merge(acc)
    loaded = fs.GradStats.load(out)
    misaligned.check_used()
    assert_aligned(loaded, "merged")
    assert_bit_identical(loaded, live, "merged, as loaded")
    for grad, _ in grad_batches(24, 2):
        live.update(grad)
        loaded.update(grad)
    assert_bit_identical(loaded, live, "merged, continued")
    assert estimates_of(loaded) == estimates_of(live)


# ----------------------------------------------------------------------------- CrossStats
def cross_batches(seed: int, sizes, T: int = 4, d_in: int = 6):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for size in sizes:
        grad = 1.0 + torch.randn(size, T, DIM, generator=gen)
        act = torch.randn(size, T, d_in, generator=gen)
        mask = torch.rand(size, T, generator=gen) < 0.8
        mask[:, 0] = True
        out.append((grad, act, mask))
    return out


def test_cross_stats_resume_is_bit_identical(tmp_path, misaligned):
    w_in = torch.randn(5, 6, generator=torch.Generator().manual_seed(3))
    # the saved part ends with a one-sample batch: its c is carried (saved) for the next pair
    batches = cross_batches(31, [4, 3, 1, 1, 5])
    live = CrossStats(DIM, w_in, activation="gelu")
    for grad, act, mask in batches[:3]:
        live.update(grad, act, mask)
    assert live.carry is not None
    live.save(tmp_path / "cross.safetensors")
    loaded = CrossStats.load(tmp_path / "cross.safetensors")
    misaligned.check_used()
    assert_aligned(loaded, "cross: loaded")
    assert_bit_identical(loaded, live, "cross: as loaded")
    for grad, act, mask in batches[3:]:
        live.update(grad, act, mask)
        loaded.update(grad, act, mask)
    assert_bit_identical(loaded, live, "cross: continued")
    assert loaded.cross_frob2() == live.cross_frob2()
    assert estimates_of(loaded) == estimates_of(live)


def test_merged_cross_stats_files_are_bit_identical(tmp_path, misaligned):
    w_in = torch.randn(5, 6, generator=torch.Generator().manual_seed(4))
    shards = []
    for seed in (41, 42):
        acc = CrossStats(DIM, w_in, activation="tanh")
        for grad, act, mask in cross_batches(seed, [3, 4]):
            acc.update(grad, act, mask)
        shards.append(acc)
    paths = [tmp_path / f"cross{i}.safetensors" for i in range(2)]
    for acc, path in zip(shards, paths):
        acc.save(path)
    out = tmp_path / "merged.safetensors"
    assert cli_main(["merge", str(out), *map(str, paths)]) == 0
    live = shards[0].copy().merge(shards[1])
    loaded = CrossStats.load(out)
    misaligned.check_used()
    assert_aligned(loaded, "merged cross")
    for grad, act, mask in cross_batches(43, [4, 2]):
        live.update(grad, act, mask)
        loaded.update(grad, act, mask)
    assert_bit_identical(loaded, live, "merged cross, continued")
    assert estimates_of(loaded) == estimates_of(live)


# ----------------------------------------------------------------------------- probe checkpoints
def probe_batches(seed: int, count: int):
    return masked_seq_batches(seed, count, size=4, T=3)


def new_probe():
    return fs.Probe(
        MaskedPoolNet(DIM),
        points=["blocks.0", "blocks.1"],
        second_moment="auto",
        cross=fs.CrossSpec(rank=4, activation="gelu", seed=5),
    )


def feed(probe, train, test):
    for batch in train:
        probe.step(batch, loss_fn)
    for batch in test:
        probe.step(batch, loss_fn, stream="test")


def accumulators(probe) -> dict:
    """Every accumulator of a probe, by (kind, stream, point)."""
    from fused_stats.api.state import checkpoint

    accs = checkpoint.probe_state(probe)
    assert {key[0] for key in accs} == {"grad", "cross"} and len(accs) == 8, sorted(accs)
    return accs


def assert_probes_bit_identical(got, want, what):
    a, b = accumulators(got), accumulators(want)
    assert a.keys() == b.keys()
    for key in a:
        assert_bit_identical(a[key], b[key], f"{what} {key}")
    for name in ("blocks.0", "blocks.1"):
        assert got.stats[name].estimate().to_dict() == want.stats[name].estimate().to_dict()
        assert got.saturation(name).to_dict() == want.saturation(name).to_dict()
        assert got.realized_alignment(name) == want.realized_alignment(name)


def test_probe_checkpoint_resume_is_bit_identical(tmp_path, misaligned):
    live = new_probe()
    feed(live, probe_batches(51, 3), probe_batches(52, 2))
    save_probe_state(live, tmp_path / "ckpt")
    resumed = new_probe()
    load_probe_state(resumed, tmp_path / "ckpt")
    misaligned.check_used()
    for key, acc in accumulators(resumed).items():
        assert_aligned(acc, f"loaded {key}")
    more_train, more_test = probe_batches(53, 3), probe_batches(54, 2)
    feed(live, more_train, more_test)
    feed(resumed, more_train, more_test)
    assert_probes_bit_identical(resumed, live, "resumed")
    assert resumed.steps == live.steps


def test_merged_probe_checkpoints_are_bit_identical(tmp_path, misaligned):
    """Merged shard checkpoints (``fused-stats merge`` of checkpoint folders), loaded and
    continued, equal the in-memory merge of the live shard probes, continued."""
    shards = []
    for i, seed in enumerate((61, 63)):
        probe = new_probe()
        feed(probe, probe_batches(seed, 2), probe_batches(seed + 1, 2))
        save_probe_state(probe, tmp_path / f"shard{i}")
        shards.append(probe)
    out = tmp_path / "merged"
    assert cli_main(["merge", str(out), str(tmp_path / "shard0"), str(tmp_path / "shard1")]) == 0
    live = shards[0]
    others = accumulators(shards[1])
    for key, acc in accumulators(live).items():
        acc.merge(others[key])
    merged = new_probe()
    load_probe_state(merged, out)
    misaligned.check_used()
    for key, acc in accumulators(merged).items():
        assert_aligned(acc, f"merged {key}")
    more_train, more_test = probe_batches(65, 2), probe_batches(66, 2)
    feed(live, more_train, more_test)
    feed(merged, more_train, more_test)
    assert_probes_bit_identical(merged, live, "merged")


def test_merge_checkpoints_api_reads_aligned_state(tmp_path, misaligned):
    """The Python merge (what the command calls) on its own: the merged snapshot, read back,
    holds exactly the in-memory merge of the live shards."""
    shards = []
    for i, seed in enumerate((71, 73)):
        probe = new_probe()
        feed(probe, probe_batches(seed, 2), probe_batches(seed + 1, 1))
        save_probe_state(probe, tmp_path / f"s{i}")
        shards.append(accumulators(probe))
    merge_checkpoints(tmp_path / "m", [tmp_path / "s0", tmp_path / "s1"])
    merged = new_probe()
    load_probe_state(merged, tmp_path / "m")
    misaligned.check_used()
    for key, acc in accumulators(merged).items():
        assert_aligned(acc, f"merged {key}")
        want = shards[0][key].copy().merge(shards[1][key])
        assert_bit_identical(acc, want, f"merged {key}")
        assert state_tensors(acc)  # something was compared
