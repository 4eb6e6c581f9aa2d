"""Probe checkpoints and resumable runs.

Reference: the same Probe on the same model fed the same batches in one uninterrupted
``Probe.run``. A run interrupted mid-way (an exception raised by the batch iterator, or a
subprocess SIGKILLed while it writes a checkpoint) and resumed from its checkpoint directory must
end with bit-identical accumulator state (``torch.equal`` on every state tensor), identical step
counters and an identical report. The resuming side reads every state file through deliberately
misaligned tensors (``misaligned_loading``), so the bit identity does not hang on whether this
CPU's BLAS rounds by alignment; the resumed state tensors must be 64-byte aligned. Damaged checkpoints are rejected with FusedStatsError and leave
the probe unchanged; merged checkpoints of two shards equal one run over both (<= 1e-10).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from misaligned_loading import MisalignedLoading, assert_aligned

import fused_stats as fs
from fused_stats import Probe
from fused_stats.accumulators import state_differences
from fused_stats.api.state.checkpoint import (
    LATEST,
    has_checkpoint,
    latest_snapshot,
    load_probe_state,
    merge_checkpoints,
    run_with_checkpoints,
    save_probe_state,
)

from tiny_models import MaskedPoolNet, masked_seq_batches
from tiny_models import masked_pool_loss as loss_fn

POINTS = ["blocks.0", "blocks.1"]
EST_FIELDS = ("mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2", "ag_max", "ag_mean")


# ----------------------------------------------------------------------------- model and data
def make_batches(seed: int, count: int):
    return masked_seq_batches(seed, count, size=5, T=4)


def new_probe(second_moment="auto"):
    return Probe(MaskedPoolNet(6), points=POINTS, second_moment=second_moment)


def state_of(probe) -> dict:
    return {
        (stream, name): acc.state_dict()
        for (kind, stream, name), acc in probe.table.items()
        if kind == "grad"
    }


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert not state_differences(a[key], b[key]), (key, state_differences(a[key], b[key]))


def report_of(probe):
    """The probe's report with its creation time fixed (Report == treats NaN as equal)."""
    report = probe.report(misalignment_trials=200)
    report.data["created"] = "fixed"
    return report


class Interrupted(Exception):
    pass


def interrupt_after(batches, k):
    """The batch iterable of a run that dies while fetching batch k + 1."""
    for i, batch in enumerate(batches):
        if i == k:
            raise Interrupted(f"simulated crash after {k} batches")
        yield batch


TRAIN, TEST = make_batches(1, 11), make_batches(2, 7)


@pytest.fixture
def misaligned(monkeypatch):
    """Every state file this test reads comes back as views off a 64-byte boundary."""
    return MisalignedLoading(monkeypatch)


def assert_resumed_aligned(probe, loading) -> None:
    loading.check_used()
    for stream in (probe.stats, probe.test_stats):
        for name, acc in stream.items():
            assert_aligned(acc, name)


@pytest.fixture(scope="module")
def uninterrupted():
    probe = new_probe()
    probe.run(TRAIN, loss_fn, progress=False)
    probe.run(TEST, loss_fn, stream="test", progress=False)
    return probe


# ----------------------------------------------------------------------------- tests
def test_interrupted_run_resumes_to_identical_state(tmp_path, uninterrupted, misaligned):
    ckpt = tmp_path / "ckpt"
    first = new_probe()
    with pytest.raises(Interrupted):
        run_with_checkpoints(first, interrupt_after(TRAIN, 7), loss_fn, ckpt, every=3)
    manifest = json.loads((latest_snapshot(ckpt) / "manifest.json").read_text())
    assert manifest["consumed"] == {"train": 6}  # the checkpoint at 6; batch 7 was lost

    second = new_probe()  # a new process: fresh model and probe
    assert run_with_checkpoints(second, TRAIN, loss_fn, ckpt, every=3) == len(TRAIN)
    # the test stream dies too, then resumes; the train progress is kept alongside
    with pytest.raises(Interrupted):
        run_with_checkpoints(second, interrupt_after(TEST, 5), loss_fn, ckpt, every=2, stream="test")
    third = new_probe()
    assert run_with_checkpoints(third, TEST, loss_fn, ckpt, every=2, stream="test") == len(TEST)

    assert_resumed_aligned(third, misaligned)
    assert_same_state(state_of(third), state_of(uninterrupted))
    assert third.steps == uninterrupted.steps == {"train": len(TRAIN), "test": len(TEST)}
    assert report_of(third) == report_of(uninterrupted)
    # finished: running again consumes nothing and changes nothing
    before = state_of(third)
    assert run_with_checkpoints(third, TEST, loss_fn, ckpt, every=2, stream="test") == len(TEST)
    assert_same_state(state_of(third), before)


KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import fused_stats as fs
    import test_checkpoint_resume as T
    from fused_stats.api.state.checkpoint import run_with_checkpoints

    calls = [0]
    real_save = fs.GradStats.save
    def dying_save(self, path):
        calls[0] += 1
        if calls[0] == {kill_at}:  # mid-way through writing a snapshot
            os.kill(os.getpid(), signal.SIGKILL)
        real_save(self, path)
    fs.GradStats.save = dying_save
    run_with_checkpoints(T.new_probe(), T.TRAIN, T.loss_fn, {ckpt!r}, every=2)
""")


def test_sigkill_while_writing_a_checkpoint(tmp_path, uninterrupted, misaligned):
    ckpt = tmp_path / "ckpt"
    # 2 points, train only: 2 files a snapshot; call 6 is the 2nd file of snapshot 3 (batch 6)
    script = KILLED_RUN.format(tests=str(Path(__file__).parent), kill_at=6, ckpt=str(ckpt))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (ckpt / LATEST).read_text() == "ckpt-00000002"
    assert any(p.name.startswith(".tmp-") for p in ckpt.iterdir())  # the half-written snapshot
    manifest = json.loads((latest_snapshot(ckpt) / "manifest.json").read_text())
    assert manifest["consumed"] == {"train": 4}

    resumed = new_probe()
    run_with_checkpoints(resumed, TRAIN, loss_fn, ckpt, every=2)
    run_with_checkpoints(resumed, TEST, loss_fn, ckpt, every=2, stream="test")
    assert_resumed_aligned(resumed, misaligned)
    assert_same_state(state_of(resumed), state_of(uninterrupted))
    assert report_of(resumed) == report_of(uninterrupted)
    assert not any(p.name.startswith(".tmp-") for p in ckpt.iterdir())  # cleaned up
    assert sorted(p.name for p in ckpt.iterdir()) == [LATEST, (ckpt / LATEST).read_text()]


def test_save_load_round_trip_into_fresh_probe(tmp_path, uninterrupted, misaligned):
    save_probe_state(uninterrupted, tmp_path)
    fresh = new_probe()
    manifest = load_probe_state(fresh, tmp_path)
    assert_resumed_aligned(fresh, misaligned)
    assert manifest["point_names"] == POINTS
    assert_same_state(state_of(fresh), state_of(uninterrupted))
    assert fresh.dims == uninterrupted.dims and fresh.steps == uninterrupted.steps
    assert fresh.test_stats["blocks.0"].name == "blocks.0 [test]"
    # the restored probe keeps streaming: one more batch equals one more batch on the original
    extra = make_batches(9, 1)[0]
    fresh.step(extra, loss_fn)
    original = new_probe()
    load_probe_state(original, tmp_path)
    original.step(extra, loss_fn)
    assert_same_state(state_of(fresh), state_of(original))


def _damage_file(path: Path):
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,words",
    [
        ("flip_state_byte", ["SHA-256", "train-0000"]),
        ("truncate_state", ["SHA-256"]),
        ("remove_state", ["missing", "train-0001"]),
        ("manifest_version", ["version 99", "reads version 1"]),
        ("manifest_garbage", ["manifest", "unreadable"]),
        ("manifest_n", ["n=", "manifest says"]),
        ("no_latest", ["no checkpoint"]),
        ("latest_dangling", ["no manifest.json"]),
    ],
)
def test_damaged_checkpoint_is_rejected_and_probe_unchanged(tmp_path, uninterrupted, damage, words):
    snap = save_probe_state(uninterrupted, tmp_path)
    manifest_path = snap / "manifest.json"
    if damage == "flip_state_byte":
        _damage_file(snap / "train-0000.safetensors")
    elif damage == "truncate_state":
        path = snap / "train-0000.safetensors"
        path.write_bytes(path.read_bytes()[:-40])
    elif damage == "remove_state":
        (snap / "train-0001.safetensors").unlink()
    elif damage == "manifest_version":
        manifest = json.loads(manifest_path.read_text())
        manifest["version"] = 99
        manifest_path.write_text(json.dumps(manifest))
    elif damage == "manifest_garbage":
        manifest_path.write_text(manifest_path.read_text()[:50])
    elif damage == "manifest_n":
        manifest = json.loads(manifest_path.read_text())
        manifest["points"][0]["n"] += 1
        manifest_path.write_text(json.dumps(manifest))
    elif damage == "no_latest":
        (tmp_path / LATEST).unlink()
    elif damage == "latest_dangling":
        (tmp_path / LATEST).write_text("ckpt-00000042")
    # a probe that already holds data must keep it, bit for bit
    victim = new_probe()
    victim.run(make_batches(5, 2), loss_fn, progress=False)
    before, steps = state_of(victim), dict(victim.steps)
    with pytest.raises(fs.FusedStatsError) as info:
        load_probe_state(victim, tmp_path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert_same_state(state_of(victim), before)
    assert victim.steps == steps


def test_manifest_entries_without_kind_are_gradstats(tmp_path, uninterrupted):
    # a manifest entry without "kind" is a GradStats entry (the format's default)
    snap = save_probe_state(uninterrupted, tmp_path)
    path = snap / "manifest.json"
    manifest = json.loads(path.read_text())
    assert {entry.pop("kind") for entry in manifest["points"]} == {"grad"}
    path.write_text(json.dumps(manifest))
    fresh = new_probe()
    load_probe_state(fresh, tmp_path)
    assert_same_state(state_of(fresh), state_of(uninterrupted))
    assert report_of(fresh) == report_of(uninterrupted)


def test_checkpoint_of_other_points_is_rejected(tmp_path, uninterrupted):
    save_probe_state(uninterrupted, tmp_path)
    other = Probe(MaskedPoolNet(6), points=["blocks.1"])
    with pytest.raises(fs.FusedStatsError, match=r"'blocks.0'.*not a point of this probe"):
        load_probe_state(other, tmp_path)
    assert other.stats == {} and other.test_stats == {}


def test_resume_with_shorter_data_is_an_error(tmp_path):
    run_with_checkpoints(new_probe(), TRAIN[:6], loss_fn, tmp_path, every=3)
    with pytest.raises(
        fs.FusedStatsError, match="holds 6 train batches but the batch iterable ended after 4"
    ):
        run_with_checkpoints(new_probe(), TRAIN[:4], loss_fn, tmp_path, every=3)
    with pytest.raises(fs.FusedStatsError, match="every must be a positive int"):
        run_with_checkpoints(new_probe(), TRAIN, loss_fn, tmp_path, every=0)
    assert has_checkpoint(tmp_path)


def test_merged_shard_checkpoints_equal_one_run(tmp_path, misaligned):
    one = new_probe("pool")
    shards = []
    for i, (train, test) in enumerate([(TRAIN[:5], TEST[:3]), (TRAIN[5:], TEST[3:])]):
        probe = new_probe("pool")
        probe.run(train, loss_fn, progress=False)
        probe.run(test, loss_fn, stream="test", progress=False)
        save_probe_state(probe, tmp_path / f"shard{i}")
        shards.append(tmp_path / f"shard{i}")
    one.run(TRAIN, loss_fn, progress=False)
    one.run(TEST, loss_fn, stream="test", progress=False)
    merge_checkpoints(tmp_path / "merged", shards)
    merged = new_probe("pool")
    load_probe_state(merged, tmp_path / "merged")
    assert_resumed_aligned(merged, misaligned)
    assert merged.steps == one.steps
    for stream in ("train", "test"):
        for name in POINTS:
            a = (merged.stats if stream == "train" else merged.test_stats)[name]
            b = (one.stats if stream == "train" else one.test_stats)[name]
            assert (a.n, a.mode) == (b.n, b.mode)
            ea, eb = a.estimate(), b.estimate()
            for field in EST_FIELDS:
                assert math.isclose(getattr(ea, field), getattr(eb, field), rel_tol=1e-10), field
            assert torch.allclose(a.pool_rows(), b.pool_rows(), rtol=1e-12, atol=1e-12)
    for name in POINTS:
        assert math.isclose(merged.realized_alignment(name), one.realized_alignment(name), rel_tol=1e-10)


def test_crash_between_snapshot_rename_and_pointer_update(tmp_path, uninterrupted, monkeypatch, misaligned):
    # the writer dies after its snapshot folder is in place but before LATEST names it: the
    # resumed run must use the previous snapshot and still be able to write new ones
    import fused_stats.api.state.checkpoint as ckpt_mod

    real = ckpt_mod.write_atomic
    calls = {"latest": 0}

    def dying(path, payload):
        if path.name == LATEST:
            calls["latest"] += 1
            if calls["latest"] == 3:
                raise Interrupted("killed before publishing snapshot 3")
        real(path, payload)

    monkeypatch.setattr(ckpt_mod, "write_atomic", dying)
    with pytest.raises(Interrupted):
        run_with_checkpoints(new_probe(), TRAIN, loss_fn, tmp_path, every=2)
    monkeypatch.setattr(ckpt_mod, "write_atomic", real)
    assert (tmp_path / LATEST).read_text() == "ckpt-00000002"
    assert (tmp_path / "ckpt-00000003" / "manifest.json").is_file()  # complete, unpublished
    resumed = new_probe()
    run_with_checkpoints(resumed, TRAIN, loss_fn, tmp_path, every=2)
    run_with_checkpoints(resumed, TEST, loss_fn, tmp_path, every=2, stream="test")
    assert_resumed_aligned(resumed, misaligned)
    assert_same_state(state_of(resumed), state_of(uninterrupted))
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, (tmp_path / LATEST).read_text()]
