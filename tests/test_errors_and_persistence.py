"""Clear errors, untouched state on rejection, and exact persistence.

Every rejected input must raise ``fs.FusedStatsError`` whose message names what was seen (shape,
dtype, count, version...) and what was expected, and must leave the accumulator BIT-identical
(every state tensor compared with ``torch.equal``, plus n / mode / unit). Saved states must load
back bit-identically (also empty ones), and damaged, truncated, forged or foreign files must be
refused -- a pickle is never unpickled.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import fused_stats as fs
from fused_stats.accumulators import state_differences

from reference import (
    assert_state_identical,
    assert_targets_close,
    brute_force_targets,
    draw,
    per_sample_vectors,
    population,
    snapshot,
)

D = 6
F64 = torch.float64


def fed(mode: str, gen: torch.Generator, n: int = 20, **kwargs) -> fs.GradStats:
    return fed_with_rows(mode, gen, n, **kwargs)[0]


def fed_with_rows(
    mode: str, gen: torch.Generator, n: int = 20, **kwargs
) -> tuple[fs.GradStats, torch.Tensor]:
    """An accumulator fed ``n`` fresh rows in two batches, and those rows (fp64, for references)."""
    mu, L = population(D, "mean_like_noise", gen)
    acc = fs.GradStats(D, second_moment=mode, **kwargs)
    rows = draw((n,), mu, L, gen)
    acc.update(rows[: n // 2])
    acc.update(rows[n // 2 :])
    return acc, rows


def rejects(acc: fs.GradStats, call, *patterns: str) -> str:
    """``call()`` raises FusedStatsError whose message matches every pattern; state bit-identical."""
    before, counters = snapshot(acc)
    skipped = acc.skipped_batches
    with pytest.raises(fs.FusedStatsError) as info:
        call()
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"message {message!r} lacks {pattern!r}"
    assert_state_identical(before, acc, counters, f"after rejected call ({message})")
    assert acc.skipped_batches == skipped
    return message


MODES = ["dense", "pool", "auto"]


# ----------------------------------------------------------------------------- bad batches
@pytest.mark.parametrize("mode", MODES)
def test_wrong_shapes_and_dims(mode, gen):
    acc = fed(mode, gen)
    good = torch.randn(4, D, generator=gen, dtype=F64)
    rejects(
        acc, lambda: acc.update(torch.randn(4, D + 1, dtype=F64)), r"\(4, 7\)", "expected dim=6", "float64"
    )
    rejects(acc, lambda: acc.update(torch.randn(D, dtype=F64)), r"\(6,\)", r"\(B, d\)")
    rejects(
        acc,
        lambda: acc.update(torch.randn(3, 5, D, dtype=F64), feature_dim=1),
        r"\(3, 5, 6\)",
        "expected dim=6",
    )
    rejects(
        acc,
        lambda: acc.update(torch.randn(3, D, 2, dtype=F64), feature_dim=0),
        "feature_dim=0",
        r"\(3, 6, 2\)",
    )
    rejects(
        acc,
        lambda: acc.update(torch.randn(3, D, 2, dtype=F64), feature_dim=3),
        "feature_dim=3",
        r"\(3, 6, 2\)",
    )
    flat = fs.GradStats(D, second_moment=mode)
    rejects(
        flat,
        lambda: flat.update(torch.randn(3, 2, 4, dtype=F64), unit="flat"),
        r"\(2, 4\)",
        "8 elements",
        "dim=6",
    )
    rejects(acc, lambda: acc.update(torch.ones(4, D, dtype=torch.int64)), "floating-point", "torch.int64")
    rejects(acc, lambda: acc.update(torch.ones(4, D, dtype=torch.bool)), "floating-point", "torch.bool")
    rejects(acc, lambda: acc.update(good.numpy()), "torch.Tensor", "ndarray")
    rejects(acc, lambda: acc.update(good, unit="token"), "unit", "'token'")
    rejects(acc, lambda: acc.update(good, unit="position"), "unit='sample'", "unit='position'")
    rejects(acc, lambda: acc.update(good.to("meta")), "meta", "cpu")
    acc.update(good)  # still usable afterwards
    assert acc.n == 24


@pytest.mark.parametrize("mode", MODES)
def test_mask_errors(mode, gen):
    acc = fed(mode, gen)
    grad = torch.randn(3, 5, D, generator=gen, dtype=F64)
    rejects(
        acc,
        lambda: acc.update(grad, mask=torch.ones(3, 6, dtype=torch.bool)),
        r"mask.*\(3, 6\)",
        r"expected \(3, 5\)",
        r"\(3,\)",
    )
    rejects(acc, lambda: acc.update(grad, mask=torch.ones(5, dtype=torch.bool)), r"\(5,\)")
    bad = torch.ones(3, 5)
    bad[1, 2] = math.nan
    rejects(acc, lambda: acc.update(grad, mask=bad), "mask", "NaN")
    rejects(acc, lambda: acc.update(grad, mask=[[1] * 5] * 3), "mask", "torch.Tensor", "list")
    flat = fs.GradStats(D, second_moment=mode)
    flat.update(grad[:, 0], unit="flat")
    rejects(flat, lambda: flat.update(grad[:, 1], mask=torch.ones(3), unit="flat"), "flat", "no mask")


@pytest.mark.parametrize("mode", MODES)
def test_estimate_needs_four_samples(mode, gen):
    acc = fs.GradStats(D, second_moment=mode, name="layers.3")
    rejects(acc, acc.estimate, "at least 4", "n=0", "layers.3")
    acc.update(torch.randn(3, D, generator=gen, dtype=F64))
    rejects(acc, acc.estimate, "at least 4", "n=3", "layers.3")
    acc.update(torch.randn(1, D, generator=gen, dtype=F64))
    assert acc.estimate().n == 4


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_raise_by_default(mode, bad, gen):
    acc, rows = fed_with_rows(mode, gen, n=6)  # 6 + 5 accepted rows below: small enough for the brute force
    grad = torch.randn(5, 3, D, generator=gen, dtype=F64)
    grad[2, 1, 4] = bad
    rejects(acc, lambda: acc.update(grad), "non-finite", "nonfinite='skip'")
    rejects(acc, lambda: acc.update(grad.to(torch.float32), unit="sample"), "non-finite")
    empty = fs.GradStats(D, second_moment=mode, name="blocks.0")
    rejects(empty, lambda: empty.update(grad), "non-finite", "blocks.0")  # first batch too
    assert empty.n == 0 and empty.centre is None
    # a NaN in a masked (padding) position is not part of any sample: accepted
    mask = torch.ones(5, 3, dtype=torch.bool)
    mask[2, 1] = False
    acc.update(grad, mask=mask)
    # the accepted batch must count exactly its unmasked positions: the exact U-statistics of the
    # earlier rows plus the loop-built per-sample sums of the new batch (the NaN position left out)
    q = torch.cat([rows, per_sample_vectors(grad, mask, "sample")])
    assert acc.n == 11 and q.shape[0] == 11
    assert_targets_close(
        acc.estimate(), brute_force_targets(q), 1e-9, context=f"after a masked {bad}, mode={mode}"
    )


@pytest.mark.parametrize("mode", MODES)
def test_non_finite_skip_policy_counts(mode, gen):
    acc = fed(mode, gen, nonfinite="skip")
    before, counters = snapshot(acc)
    grad = torch.randn(4, D, generator=gen, dtype=F64)
    grad[0, 0] = math.nan
    acc.update(grad)
    grad[0, 0] = math.inf
    acc.update(grad, unit="sample")
    assert acc.skipped_batches == 2
    assert_state_identical(before, acc, counters, "after skipped batches")
    empty = fs.GradStats(D, second_moment=mode, nonfinite="skip")
    empty.update(grad)
    assert (empty.skipped_batches, empty.n, empty.centre) == (1, 0, None)
    grad[0, 0] = 1.0
    empty.update(grad)
    assert empty.n == 4
    # counts survive a merge
    acc.merge(empty)
    assert (acc.skipped_batches, acc.n) == (3, 24)


def test_pool_capacity_exceeded(gen):
    acc = fs.GradStats(D, second_moment="pool", pool_capacity=12)
    acc.update(torch.randn(10, D, generator=gen, dtype=F64))
    rejects(acc, lambda: acc.update(torch.randn(3, D, dtype=F64)), "10 samples", "3 more", "pool_capacity=12")
    other = fs.GradStats(D, second_moment="pool")
    other.update(torch.randn(5, D, generator=gen, dtype=F64))
    rejects(acc, lambda: acc.merge(other), "15", "capacity 12")
    acc.update(torch.randn(2, D, generator=gen, dtype=F64))
    assert acc.n == 12


def test_bad_constructor_arguments():
    for kwargs, pattern in (
        ({"dim": 0}, "dim"),
        ({"dim": 2.5}, "dim"),
        ({"dim": True}, "dim"),
        ({"dim": 3, "second_moment": "full"}, "'full'"),
        ({"dim": 3, "pool_capacity": 0}, "pool_capacity"),
        ({"dim": 3, "nonfinite": "ignore"}, "'ignore'"),
        ({"dim": 3, "backend": "cuda"}, "'cuda'"),
    ):
        with pytest.raises(fs.FusedStatsError, match=pattern):
            fs.GradStats(**kwargs)


# ----------------------------------------------------------------------------- merges
@pytest.mark.parametrize("mode", MODES)
def test_incompatible_merges(mode, gen):
    acc = fed(mode, gen)
    other_dim = fs.GradStats(D + 1)
    other_dim.update(torch.randn(5, D + 1, generator=gen, dtype=F64))
    rejects(acc, lambda: acc.merge(other_dim), "dim=7", "dim=6")
    positions = fs.GradStats(D)
    positions.update(torch.randn(2, 3, D, generator=gen, dtype=F64), unit="position")
    rejects(acc, lambda: acc.merge(positions), "unit='position'", "unit='sample'")
    rejects(acc, lambda: acc.merge("not an accumulator"), "GradStats", "str")
    meta = fs.GradStats(D, device="meta")
    meta.n = 1  # a state on another device (no second real device on CI)
    rejects(acc, lambda: acc.merge(meta), "meta", "cpu")


def test_dense_into_pool_is_refused(gen):
    pool = fed("pool", gen)
    dense = fed("dense", gen)
    rejects(pool, lambda: pool.merge(dense), "dense", "pool")
    empty_pool = fs.GradStats(D, second_moment="pool")
    rejects(empty_pool, lambda: empty_pool.merge(dense), "dense", "pool")
    auto_dense = fed("auto", gen, n=30)
    assert auto_dense.mode == "dense"
    rejects(pool, lambda: pool.merge(auto_dense), "dense", "pool")


# ----------------------------------------------------------------------------- persistence
def assert_same_accumulator(a: fs.GradStats, b: fs.GradStats) -> None:
    assert a.same_state(b), state_differences(a.state_dict(), b.state_dict())
    assert a.config() == b.config()


@pytest.mark.parametrize("case", ["dense", "pool", "auto_pool", "auto_dense", "empty", "skipped", "position"])
def test_save_load_round_trip_is_exact(case, tmp_path, gen):
    mu, L = population(D, "mean_100x_noise", gen)
    mode = {
        "auto_pool": "auto",
        "auto_dense": "auto",
        "skipped": "dense",
        "position": "pool",
        "empty": "auto",
    }.get(case, case)
    acc = fs.GradStats(
        D,
        second_moment=mode,
        pool_capacity=50 if case == "pool" else None,
        nonfinite="skip",
        name=f"point.{case}",
    )
    if case == "empty":
        pass
    elif case == "position":
        acc.update(draw((3, 4), mu, L, gen), unit="position")
    else:
        acc.update(draw((3 if case == "auto_pool" else 25,), mu, L, gen).to(torch.float32))
    if case == "skipped":
        acc.update(torch.full((2, D), math.nan))
    path = tmp_path / "sub" / "state.safetensors"
    acc.save(path)
    assert sorted(os.listdir(path.parent)) == ["state.safetensors"]  # no temp file left behind
    loaded = fs.GradStats.load(path)
    assert_same_accumulator(acc, loaded)
    if acc.n >= 4:
        assert acc.estimate() == loaded.estimate()
    # both continue identically
    unit = "position" if case == "position" else "sample"
    more = draw((6,) if unit == "sample" else (2, 3), mu, L, gen)
    acc.update(more, unit=unit)
    loaded.update(more, unit=unit)
    assert_same_accumulator(acc, loaded)
    # saving again over the same path replaces the file atomically
    acc.save(path)
    assert_same_accumulator(acc, fs.GradStats.load(path))


def saved(tmp_path, gen, mode="dense") -> tuple:
    acc = fed(mode, gen, n=40)
    path = tmp_path / "state.safetensors"
    acc.save(path)
    return acc, path


def test_corrupted_tensor_bytes(tmp_path, gen):
    _, path = saved(tmp_path, gen)
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 0x01  # a flipped bit inside the last tensor's data
    path.write_bytes(bytes(raw))
    with pytest.raises(fs.FusedStatsError, match="checksum"):
        fs.GradStats.load(path)


def test_edited_metadata_is_detected(tmp_path, gen):
    # a same-length edit of the JSON header (n = 40 -> 49) must not load silently wrong statistics
    _, path = saved(tmp_path, gen)
    raw = path.read_bytes()
    assert raw.count(b'\\"n\\": 40') == 1
    path.write_bytes(raw.replace(b'\\"n\\": 40', b'\\"n\\": 49'))
    with pytest.raises(fs.FusedStatsError, match=r"checksum|damaged|inconsistent"):
        fs.GradStats.load(path)


@pytest.mark.parametrize("keep", [0, 7, 100, -1])
def test_truncated_file(keep, tmp_path, gen):
    _, path = saved(tmp_path, gen)
    raw = path.read_bytes()
    path.write_bytes(raw[:keep] if keep >= 0 else raw[:-9])
    with pytest.raises(fs.FusedStatsError, match=r"damaged|checksum"):
        fs.GradStats.load(path)


def rewrite(path, **changes) -> None:
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        meta = dict(handle.metadata())
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118  (a safetensors handle is not iterable)
    meta.update(changes)
    save_file(tensors, str(path), metadata=meta)


def test_wrong_version_and_format(tmp_path, gen):
    acc, path = saved(tmp_path, gen)
    rewrite(path, version="2")
    with pytest.raises(fs.FusedStatsError, match=r"version '2'.*version 1"):
        fs.GradStats.load(path)
    rewrite(path, version="1", format="something.Else")
    with pytest.raises(fs.FusedStatsError, match=r"something.Else"):
        fs.GradStats.load(path)
    rewrite(path, format="fused_stats.GradStats")
    assert_same_accumulator(acc, fs.GradStats.load(path))  # restored metadata loads again


def test_forged_shapes_with_valid_checksum_are_refused(tmp_path, gen):
    # consistent bytes but a state that contradicts its own metadata: n says 40, the pool holds 39
    from fused_stats.accumulators.persistence import tensors_checksum

    _, path = saved(tmp_path, gen, mode="pool")
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        meta = dict(handle.metadata())
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118  (a safetensors handle is not iterable)
    tensors["pool"] = tensors["pool"][:39].contiguous()
    tensors["gram"] = tensors["gram"][:39, :39].contiguous()
    assert json.loads(meta["state"])["n"] == 40
    meta["sha256"] = tensors_checksum(tensors, meta)
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(fs.FusedStatsError, match=r"pool.*\(39, 6\).*\(40, 6\)"):
        fs.GradStats.load(path)


class _Marker:
    def __reduce__(self):
        return (os.mkdir, (os.environ["FUSED_STATS_TEST_MARKER"],))


def test_foreign_files_are_refused_and_never_unpickled(tmp_path, monkeypatch):
    marker = tmp_path / "was_executed"
    monkeypatch.setenv("FUSED_STATS_TEST_MARKER", str(marker))
    evil = tmp_path / "evil.safetensors"
    evil.write_bytes(pickle.dumps(_Marker()))
    with pytest.raises(fs.FusedStatsError, match=r"damaged|not a safetensors"):
        fs.GradStats.load(evil)
    assert not marker.exists()
    with pytest.raises(fs.FusedStatsError, match="no state file"):
        fs.GradStats.load(tmp_path / "missing.safetensors")
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(3)}, str(other))
    with pytest.raises(fs.FusedStatsError, match="format"):
        fs.GradStats.load(other)


def test_overflowing_fourth_power_is_rejected_and_state_unchanged():
    # finite inputs whose |y|^4 overflows fp64 would make every later estimate inf/nan
    gen = torch.Generator().manual_seed(11)
    acc = fs.GradStats(4, second_moment="dense")
    acc.update(torch.randn(6, 4, generator=gen, dtype=torch.float64))
    before = {k: getattr(acc, k).clone() for k in ("s", "t", "a1", "a2", "S")}
    huge = torch.randn(5, 4, generator=gen, dtype=torch.float64) * 1e90
    with pytest.raises(fs.FusedStatsError, match="overflow"):
        acc.update(huge)
    assert acc.n == 6
    for key, value in before.items():
        assert torch.equal(getattr(acc, key), value), key


@pytest.mark.parametrize(
    "mode,failing",
    [("dense", "second_moment_update"), ("pool", "gram_rows"), ("auto", "second_moment_update")],
)
def test_failure_inside_the_second_moment_leaves_the_state_consistent(mode, failing, monkeypatch):
    # an allocation or kernel failure (e.g. CUDA out of memory) while the second moment is built
    # must not leave n and the sums ahead of S / the pool: the second moment is built first
    import fused_stats.ops as ops_layer

    gen = torch.Generator().manual_seed(5)
    acc = fs.GradStats(6, second_moment=mode)
    first = torch.randn(3, 6, generator=gen, dtype=torch.float64) + 0.5
    acc.update(first)
    before = acc.copy()
    big = torch.randn(8, 6, generator=gen, dtype=torch.float64)  # auto: 3 + 8 > 3 -> turns dense

    def broken(*args, **kwargs):
        raise RuntimeError("simulated out of memory")

    monkeypatch.setattr(ops_layer, failing, broken)
    with pytest.raises(RuntimeError, match="simulated"):
        acc.update(big)
    monkeypatch.undo()
    assert acc.n == before.n and acc.mode == before.mode
    assert acc.same_state(before), state_differences(acc.state_dict(), before.state_dict())
    acc.update(big)  # and it still works afterwards: exactly the 11 rows, nothing of the failed try
    assert acc.n == 11
    assert_targets_close(
        acc.estimate(),
        brute_force_targets(torch.cat([first, big])),
        1e-9,
        context=f"recovered after a failing {failing}, mode={mode}",
    )


def test_saved_state_has_ordinary_file_permissions(tmp_path):
    # mkstemp creates owner-only files; a saved state should be readable like any file the user writes
    acc = fs.GradStats(3)
    acc.update(torch.randn(5, 3, dtype=torch.float64))
    old = os.umask(0o022)
    try:
        acc.save(tmp_path / "state.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "state.safetensors").stat().st_mode & 0o777 == 0o644
