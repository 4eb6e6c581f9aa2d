"""Scale-out of the depth probe's cross statistics: save/load, merge, all-reduce,
probe checkpoints, and the all-or-nothing probe step.

References, none of them produced by the code under test:

* ONE stream: a single :class:`CrossStats` (or one ``fs.Probe``) fed every batch in one process.
  Saved-and-merged shards, gloo all-reduces over two ranks and resumed or merged checkpoints must
  give its state (integer counts exactly, fp64 sums to 1e-12, ``|C|_F²`` and its standard errors to
  1e-10 relative) or, where the same operations run in the same order (a resumed run), the
  bit-identical state and an equal ``Saturation``;
* the U-statistic written out: ``|C|_F² = avg_{i≠j} <c_i, c_j>_F`` over ordered pairs of distinct
  samples, with ``c_i = Σ_t q_t φ(W_in z_t)ᵀ`` built by an explicit loop over each sample's counted
  positions (φ = gelu from its erf formula), in fp64 — for the merged shards;
* for rejected input: ``torch.equal`` on every state tensor of every accumulator before and after.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.accumulators import state_differences
from fused_stats.accumulators.cross_stats import CrossStats
from fused_stats.accumulators.persistence import save_checked
from fused_stats.api.state.checkpoint import merge_checkpoints, run_with_checkpoints
from fused_stats.cli import main

from gloo_harness import init_gloo, run_two_ranks
from tiny_models import TanhBlock

F64 = torch.float64
SAT_FIELDS = ("cross_frob2", "cross_frob2_se", "cross_frob2_se_null", "z", "p_value")


# ----------------------------------------------------------------------------- synthetic data
def cross_batches(seed: int, sizes, T=3, d=4, din=4, offset=0.7):
    """(grad, act, mask) batches; ``offset`` gives q a mean so that C ≠ 0 (no cancellation blur)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for B in sizes:
        act = torch.randn(B, T, din, generator=gen, dtype=F64)
        grad = torch.randn(B, T, d, generator=gen, dtype=F64) + offset
        mask = torch.rand(B, T, generator=gen) < 0.75
        mask[:, 0] = True
        out.append((grad, act, mask))
    return out


def w_in_for(seed=0, rank=3, din=4, dtype=F64):
    gen = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(rank, din, generator=gen, dtype=F64) / 2).to(dtype)


def fed(batches, unit="sample", w_in=None, **kwargs):
    acc = CrossStats(
        batches[0][0].shape[-1] if batches else 4,
        w_in_for() if w_in is None else w_in,
        "gelu",
        backend="torch",
        **kwargs,
    )
    for g, z, m in batches:
        acc.update(g, z, m, unit=unit)
    return acc


def gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def explicit_frob2(batches, w_in, unit):
    """The U-statistic written out (module docstring)."""
    cs = []
    for grad, act, mask in batches:
        for b in range(grad.shape[0]):
            outers = [
                torch.outer(grad[b, t], gelu(w_in.to(F64) @ act[b, t]))
                for t in range(grad.shape[1])
                if mask[b, t]
            ]
            if unit == "sample":
                cs.append(sum(outers))
            else:
                cs.extend(outers)
    n = len(cs)
    total = sum(float((cs[i] * cs[j]).sum()) for i in range(n) for j in range(n) if i != j)
    return total / (n * (n - 1))


def cross_state(acc) -> dict:
    """The declared state (counters and tensors, ``w_in`` included) and the block's settings."""
    return {**acc.state_dict(), "config": acc.config()}


def assert_bit_identical(a: dict, b: dict) -> None:
    assert not state_differences(a, b), state_differences(a, b)


def assert_same_sums(got: CrossStats, ref: CrossStats, rel=1e-10) -> None:
    """Counts exact, fp64 sums and every derived number of the saturation test to ``rel``."""
    assert (got.n, got.batches, list(got.p), got.unit) == (ref.n, ref.batches, list(ref.p), ref.unit)
    torch.testing.assert_close(got.c_sum, ref.c_sum, rtol=1e-12, atol=0)
    torch.testing.assert_close(got.sq_norm_sum, ref.sq_norm_sum, rtol=1e-12, atol=0)
    torch.testing.assert_close(got.u, ref.u, rtol=1e-12, atol=0)
    assert_same_saturation(got.saturation(), ref.saturation(), rel)


def same_number(a: float, b: float, rel: float) -> bool:
    """Equal to ``rel``, or both None (a value not estimable at this n, on both sides)."""
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=rel, abs_tol=0)


def assert_same_saturation(a, b, rel=1e-10) -> None:
    assert (a.n, a.rank, a.saturated) == (b.n, b.rank, b.saturated)
    for key in SAT_FIELDS:
        assert same_number(getattr(a, key), getattr(b, key), rel), (key, getattr(a, key), getattr(b, key))


# ----------------------------------------------------------------------------- 1. save / load / merge
@pytest.mark.parametrize("unit", ["sample", "position"])
def test_save_load_round_trip_and_continue(tmp_path, unit):
    data = cross_batches(1, [4, 3, 5])
    acc = fed(data[:2], unit, name="layers.1")
    acc.save(tmp_path / "a.safetensors")
    back = CrossStats.load(tmp_path / "a.safetensors")
    assert_bit_identical(cross_state(back), cross_state(acc))
    assert back.name == "layers.1" and back.rank == 3 and back.in_dim == 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left
    # a loaded state keeps streaming exactly like the original one
    g, z, m = data[2]
    back.update(g, z, m, unit=unit)
    acc.update(g, z, m, unit=unit)
    assert_bit_identical(cross_state(back), cross_state(acc))
    assert back.saturation() == acc.saturation()
    # fp32 w_in keeps its dtype, an empty state round-trips
    empty = CrossStats(4, w_in_for(dtype=torch.float32), "tanh")
    empty.save(tmp_path / "e.safetensors")
    again = CrossStats.load(tmp_path / "e.safetensors")
    assert (again.n, again.unit, again.activation, again.w_in.dtype) == (0, None, "tanh", torch.float32)


def test_cli_merge_of_cross_files_equals_one_stream_and_u_statistic(tmp_path, capsys):
    shards = [cross_batches(10, [4, 2]), cross_batches(11, [5], offset=-0.2), cross_batches(12, [3, 3])]
    paths = []
    for i, data in enumerate(shards):
        paths.append(str(tmp_path / f"job{i}.safetensors"))
        fed(data).save(paths[-1])
    out = tmp_path / "all.safetensors"
    assert main(["merge", str(out), *paths]) == 0
    assert "n=17" in capsys.readouterr().out
    merged = CrossStats.load(out)
    everything = [b for data in shards for b in data]
    assert_same_sums(merged, fed(everything))
    assert merged.cross_frob2() == pytest.approx(explicit_frob2(everything, w_in_for(), "sample"), rel=1e-10)


def _differs(**change):
    kwargs = dict(dim=4, w_in=w_in_for(), activation="gelu")
    kwargs.update(change)
    return CrossStats(kwargs["dim"], kwargs["w_in"], kwargs["activation"], backend="torch")


@pytest.mark.parametrize(
    "other,words",
    [
        (lambda: _differs(dim=5), ["dim 4 vs 5"]),
        (lambda: _differs(w_in=w_in_for(rank=2)), ["rank 3 vs 2"]),
        (lambda: _differs(w_in=w_in_for(din=6)), ["in_dim 4 vs 6"]),
        (lambda: _differs(activation="relu"), ["activation 'gelu' vs 'relu'"]),
        (lambda: _differs(w_in=w_in_for(seed=5)), ["w_in values"]),
        (lambda: _differs(w_in=w_in_for(dtype=torch.float32)), ["w_in dtype torch.float64 vs torch.float32"]),
        (lambda: fed(cross_batches(3, [3]), unit="position"), ["unit 'sample' vs 'position'"]),
        (lambda: "not a state", ["str"]),
    ],
)
def test_merge_mismatch_names_the_difference_and_changes_nothing(other, words):
    acc = fed(cross_batches(2, [4]), name="layers.0")
    before = cross_state(acc)
    theirs = other()
    with pytest.raises(fs.FusedStatsError) as info:
        acc.merge(theirs)
    for word in words + (["layers.0"] if isinstance(theirs, CrossStats) else []):
        assert word in str(info.value), (word, str(info.value))
    assert_bit_identical(cross_state(acc), before)


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x21
    path.write_bytes(bytes(data))


def _rewrite_meta(path, edit):
    """Rewrite a state with edited metadata but a VALID checksum (a consistent-looking lie)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = dict(handle.metadata())
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118  (a safetensors handle is not iterable)
    edit(meta, tensors)
    meta.pop("sha256")
    save_checked(path, tensors, meta)


def _edit_state(key, value):
    def edit(meta, tensors):
        state = json.loads(meta["state"])
        state[key] = value
        meta["state"] = json.dumps(state)

    return edit


@pytest.mark.parametrize(
    "damage,words",
    [
        ("flip_data", ["checksum"]),
        ("truncate", ["damaged"]),
        ("edit_n_in_header", ["checksum"]),
        ("version", ["version '7'", "reads version 1"]),
        ("gradstats_file", ["not a fused_stats.CrossStats state", "fused_stats.GradStats"]),
        ("c_sum_shape", ["c_sum has shape (3, 3)", "expected (4, 3)"]),
        ("n_negative", ["n=-2"]),
        ("p_too_large", ["p=[9999, "]),
        ("unit_unknown", ["unit='token'"]),
        ("missing_tensor", ["holds tensors", "'u'"]),
    ],
)
def test_damaged_cross_file_is_rejected(tmp_path, damage, words):
    path = tmp_path / "s.safetensors"
    acc = fed(cross_batches(4, [4, 3]))
    acc.save(path)
    if damage == "flip_data":
        _flip(path, -3)
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:-30])
    elif damage == "edit_n_in_header":
        raw = path.read_bytes()
        assert raw.count(b'\\"n\\": 7') == 1
        path.write_bytes(raw.replace(b'\\"n\\": 7', b'\\"n\\": 8'))
    elif damage == "version":
        _rewrite_meta(path, lambda meta, t: meta.update(version="7"))
    elif damage == "gradstats_file":
        g = fs.GradStats(4)
        g.update(torch.randn(5, 4, dtype=F64))
        g.save(path)
    elif damage == "c_sum_shape":
        _rewrite_meta(path, lambda meta, t: t.update(c_sum=t["c_sum"][:3].contiguous()))
    elif damage == "n_negative":
        _rewrite_meta(path, _edit_state("n", -2))
    elif damage == "p_too_large":
        _rewrite_meta(path, _edit_state("p", [9999, 0, 0]))
    elif damage == "unit_unknown":
        _rewrite_meta(path, _edit_state("unit", "token"))
    elif damage == "missing_tensor":
        _rewrite_meta(path, lambda meta, t: t.pop("u"))
    with pytest.raises(fs.FusedStatsError) as info:
        CrossStats.load(path)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    first = fed(cross_batches(5, [4]))
    first.save(path)
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        fed(cross_batches(6, [5])).save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


def test_cli_rejects_mixed_and_mismatched_cross_files(tmp_path, capsys):
    a = tmp_path / "a.safetensors"
    fed(cross_batches(7, [4])).save(a)
    relu = tmp_path / "relu.safetensors"
    CrossStats(4, w_in_for(), "relu").save(relu)
    grad = tmp_path / "grad.safetensors"
    g = fs.GradStats(4)
    g.update(torch.randn(4, 4, dtype=F64))
    g.save(grad)
    out = tmp_path / "out.safetensors"
    for inputs, words in [
        ([a, relu], ["relu.safetensors", "activation 'gelu' vs 'relu'"]),
        ([a, grad], ["different kinds", "fused_stats.GradStats", "fused_stats.CrossStats"]),
    ]:
        assert main(["merge", str(out), *map(str, inputs)]) == 2
        err = capsys.readouterr().err
        for word in words:
            assert word in err, (word, err)
        assert not out.exists()


# ----------------------------------------------------------------------------- model for probe tests
class Stamp(nn.Module):
    """Writes +inf into the stream at padded positions. Those positions never reach the loss, so
    their gradient is exactly 0 (finite) while the activation is not: only the cross statistics,
    which read the activation, can see the problem."""

    def forward(self, h, keep):
        return torch.where(keep.unsqueeze(-1), h, torch.full_like(h, math.inf))


class SeqNet(nn.Module):
    """(B, T, 3) -> masked mean pool -> 3 classes; two residual blocks and a Stamp (the points)."""

    def __init__(self, d=5, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(3, d)
        self.blocks = nn.ModuleList([TanhBlock(d) for _ in range(2)])
        self.stamp = Stamp()
        self.out = nn.Linear(d, 3)

    def forward(self, x, keep):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        h = self.stamp(h, keep)
        pooled = torch.where(keep.unsqueeze(-1), h, torch.zeros_like(h)).sum(1)
        return self.out(pooled / keep.sum(1, keepdim=True).clamp_min(1))


POINTS = ["blocks.0", "blocks.1", "stamp"]
SPEC = fs.CrossSpec(rank=3, activation="gelu", seed=4)


def loss_fn(model, batch):
    logits = model(batch["x"], batch["attention_mask"].bool())
    return nn.functional.cross_entropy(logits, batch["y"], reduction="none")


def seq_batches(seed: int, count: int, size: int = 4, T: int = 4, pad: bool = True):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        mask = torch.rand(size, T, generator=gen) < 0.75 if pad else torch.ones(size, T, dtype=torch.bool)
        mask[:, 0] = True
        out.append(
            {
                "x": torch.randn(size, T, 3, generator=gen) + 0.4,
                "attention_mask": mask,
                "y": torch.randint(0, 3, (size,), generator=gen),
            }
        )
    return out


def new_probe(spec=SPEC, **kwargs):
    return fs.Probe(SeqNet(), points=POINTS, cross=spec, **kwargs)


def probe_state(probe) -> dict:
    """Every state tensor of every accumulator of every point and stream, plus the counters."""
    out = {"steps": dict(probe.steps), "skipped": dict(probe.skipped_steps), "dims": dict(probe.dims)}
    for (kind, stream, name), acc in probe.table.items():
        out[f"{kind}/{stream}/{name}"] = cross_state(acc)
    return out


def assert_same_probe_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if "/" in key:
            assert_bit_identical(a[key], b[key])
        else:
            assert a[key] == b[key], key


TRAIN, TEST = seq_batches(1, 7), seq_batches(2, 4)


def run_all(probe, train=TRAIN, test=TEST):
    probe.run(train, loss_fn, progress=False)
    probe.run(test, loss_fn, stream="test", progress=False)
    return probe


@pytest.fixture(scope="module")
def uninterrupted():
    return run_all(new_probe())


# ----------------------------------------------------------------------------- 3. probe checkpoints
class Interrupted(Exception):
    pass


def dies_after(batches, k):
    for i, batch in enumerate(batches):
        if i == k:
            raise Interrupted
        yield batch


def test_resumed_run_has_the_uninterrupted_saturation(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    with pytest.raises(Interrupted):
        run_with_checkpoints(new_probe(), dies_after(TRAIN, 5), loss_fn, ckpt, every=2)
    manifest = json.loads((ckpt / (ckpt / "LATEST").read_text() / "manifest.json").read_text())
    kinds = sorted({(e["kind"], e["stream"]) for e in manifest["points"]})
    assert kinds == [("cross", "train"), ("grad", "train")] and manifest["consumed"] == {"train": 4}
    second = new_probe()  # a fresh process would build a fresh probe
    run_with_checkpoints(second, TRAIN, loss_fn, ckpt, every=2)
    third = new_probe()
    run_with_checkpoints(third, TEST, loss_fn, ckpt, every=3, stream="test")
    assert_same_probe_state(probe_state(third), probe_state(uninterrupted))
    for name in POINTS:
        for stream in ("train", "test"):
            assert third.saturation(name, stream=stream) == uninterrupted.saturation(name, stream=stream)


def test_probe_save_state_load_state_round_trip(tmp_path, uninterrupted):
    snap = uninterrupted.save_state(tmp_path)
    assert sorted(p.name for p in snap.iterdir() if p.name.startswith("cross-")) == [
        f"cross-{s}-000{i}.safetensors" for s in ("test", "train") for i in range(3)
    ]
    fresh = new_probe()
    manifest = fresh.load_state(tmp_path)
    assert manifest["point_names"] == sorted(POINTS)
    assert_same_probe_state(probe_state(fresh), probe_state(uninterrupted))
    assert fresh.test_cross_stats["blocks.0"].name == "blocks.0 [test]"
    # the restored probe keeps streaming exactly as the original does
    extra = seq_batches(9, 1)[0]
    original = new_probe()
    original.load_state(tmp_path)
    fresh.step(extra, loss_fn)
    original.step(extra, loss_fn)
    assert_same_probe_state(probe_state(fresh), probe_state(original))


def test_merged_checkpoints_and_cli_merge_equal_one_run(tmp_path, uninterrupted, capsys):
    shards = []
    for i, (train, test) in enumerate([(TRAIN[:3], TEST[:1]), (TRAIN[3:], TEST[1:])]):
        probe = run_all(new_probe(), train, test)
        probe.save_state(tmp_path / f"job{i}")
        shards.append(tmp_path / f"job{i}")
    merge_checkpoints(tmp_path / "api", shards)
    assert main(["merge", str(tmp_path / "cli"), *map(str, shards)]) == 0
    assert "cross: rank=3, activation=gelu, unit=sample" in capsys.readouterr().out
    for out in ("api", "cli"):
        merged = new_probe()
        merged.load_state(tmp_path / out)
        assert merged.steps == uninterrupted.steps
        for stream in ("train", "test"):
            table = merged.cross_stats if stream == "train" else merged.test_cross_stats
            ref = uninterrupted.cross_stats if stream == "train" else uninterrupted.test_cross_stats
            for name in POINTS:
                assert_same_sums(table[name], ref[name])
                assert_same_saturation(
                    merged.saturation(name, stream=stream), uninterrupted.saturation(name, stream=stream)
                )


def test_merge_of_checkpoints_with_other_blocks_is_refused(tmp_path, capsys):
    batch = TRAIN[:1]
    run_all(new_probe(), batch, []).save_state(tmp_path / "a")
    run_all(new_probe(fs.CrossSpec(rank=3, activation="gelu", seed=9)), batch, []).save_state(
        tmp_path / "seed"
    )
    run_all(fs.Probe(SeqNet(), points=POINTS), batch, []).save_state(tmp_path / "plain")
    for other, words in (
        ("seed", ["merging point 'blocks.0' (train, cross)", "seed", "w_in values"]),
        ("plain", ["does not hold the same points", "missing", "'blocks.0' (train, cross)"]),
    ):
        out = tmp_path / f"out-{other}"
        with pytest.raises(fs.FusedStatsError) as info:
            merge_checkpoints(out, [tmp_path / "a", tmp_path / other])
        for word in words:
            assert word in str(info.value), (word, str(info.value))
        assert main(["merge", str(out), str(tmp_path / "a"), str(tmp_path / other)]) == 2
        assert words[0] in capsys.readouterr().err
        assert not out.exists()


def test_checkpoint_and_probe_must_share_the_block(tmp_path, uninterrupted):
    uninterrupted.save_state(tmp_path / "cross")
    plain = run_all(fs.Probe(SeqNet(), points=POINTS), TRAIN[:2], [])
    plain.save_state(tmp_path / "plain")
    # warm: the victim already holds data (compared with its own CrossStats); cold: an empty
    # probe (compared with the block its CrossSpec would build)
    cases = [
        (tmp_path / "cross", lambda: fs.Probe(SeqNet(), points=POINTS), True, ["built without cross="]),
        (
            tmp_path / "cross",
            lambda: new_probe(fs.CrossSpec(rank=3, activation="gelu", seed=5)),
            False,
            ["w_in values", "'blocks.0'"],
        ),
        (
            tmp_path / "cross",
            lambda: new_probe(fs.CrossSpec(rank=3, activation="gelu", seed=5)),
            True,
            ["w_in values", "'blocks.0'"],
        ),
        (
            tmp_path / "cross",
            lambda: new_probe(fs.CrossSpec(rank=2, activation="gelu", seed=4)),
            True,
            ["(checkpoint vs probe) rank 3 vs 2"],
        ),
        (
            tmp_path / "cross",
            lambda: new_probe(fs.CrossSpec(rank=2, activation="gelu", seed=4)),
            False,
            ["(checkpoint vs probe) rank 3 vs 2"],
        ),
        (
            tmp_path / "cross",
            lambda: new_probe(fs.CrossSpec(rank=3, activation="tanh", seed=4)),
            False,
            ["activation 'gelu' vs 'tanh'"],
        ),
        (tmp_path / "plain", new_probe, False, ["no cross-gradient statistics", "blocks.0 (train)"]),
    ]
    for directory, make, warm, words in cases:
        victim = make()
        if warm:
            victim.run(seq_batches(5, 1), loss_fn, progress=False)
        before = probe_state(victim)
        with pytest.raises(fs.FusedStatsError) as info:
            victim.load_state(directory)
        for word in words:
            assert word in str(info.value), (word, str(info.value))
        assert_same_probe_state(probe_state(victim), before)


# ----------------------------------------------------------------------------- 5. all-or-nothing step
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_rejected_step_with_cross_changes_no_accumulator(policy):
    probe = new_probe(nonfinite=policy)
    probe.run(seq_batches(3, 2), loss_fn, progress=False)  # padded positions are not counted here
    probe.step(seq_batches(3, 1)[0], loss_fn, stream="test")
    before = probe_state(probe)
    bad = seq_batches(4, 1)[0]
    assert not bool(bad["attention_mask"].all())
    # mask="none" counts the padded positions: gradients there are 0, the stamp's activation inf
    if policy == "raise":
        with pytest.raises(fs.FusedStatsError, match=r"non-finite cross-gradient sums at point 'stamp'"):
            probe.step(bad, loss_fn, mask="none")
    else:
        probe.step(bad, loss_fn, mask="none")
    after = probe_state(probe)
    if policy == "skip":
        assert after["skipped"] == {"train": 1, "test": 0}
        after["skipped"] = before["skipped"]
    assert_same_probe_state(after, before)
    # the first step of a fresh probe creates no accumulator either, and good steps still work
    fresh = new_probe(nonfinite=policy)
    if policy == "raise":
        with pytest.raises(fs.FusedStatsError):
            fresh.step(bad, loss_fn, mask="none")
    else:
        fresh.step(bad, loss_fn, mask="none")
    assert (fresh.stats, fresh.cross_stats, fresh.dims, fresh.steps["train"]) == ({}, {}, {}, 0)
    fresh.step(bad, loss_fn)  # the attention mask leaves the inf positions out: accepted
    assert fresh.cross_stats["stamp"].n == 4 and fresh.steps["train"] == 1


# ----------------------------------------------------------------------------- 2 + 3. gloo, two ranks
def rank_cases():
    """name -> (rank 0 batches, rank 1 batches, unit)."""
    return {
        "sample": (cross_batches(20, [4, 3]), cross_batches(21, [5], offset=-0.3), "sample"),
        "position": (cross_batches(22, [3]), cross_batches(23, [2, 4]), "position"),
        "rank1_empty": (cross_batches(24, [6]), [], "sample"),
        "rank0_empty": ([], cross_batches(25, [3, 3]), "position"),
    }


def mismatch_cases(rank: int):
    """name -> this rank's accumulator; every case differs between the two ranks."""
    data = cross_batches(30 + rank, [4])
    return {
        "dim": lambda: CrossStats(4 + rank, w_in_for(), "gelu", backend="torch"),
        "rank": lambda: CrossStats(4, w_in_for(rank=3 - rank), "gelu", backend="torch"),
        "activation": lambda: (
            fed(data, w_in=w_in_for()) if rank == 0 else CrossStats(4, w_in_for(), "relu", backend="torch")
        ),
        "w_in": lambda: fed(data, w_in=w_in_for(seed=rank)),
        "unit": lambda: fed(data, unit=("sample", "position")[rank]),
    }


def probe_shares(rank: int):
    """(train, test) batches of a rank; rank 1 has no test batch (its test accumulators are made
    by the reduce)."""
    return (TRAIN[:4], TEST) if rank == 0 else (TRAIN[4:], [])


def _worker(rank: int, world: int, outdir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_gloo(rank, world, outdir)
    try:
        results = {"cases": {}, "mismatch": {}}
        for name, (data0, data1, unit) in rank_cases().items():
            acc = fed(data0 if rank == 0 else data1, unit)
            acc.all_reduce()
            results["cases"][name] = {
                "n": acc.n,
                "batches": acc.batches,
                "p": acc.p,
                "unit": acc.unit,
                "c_sum": acc.c_sum.tolist(),
                "sq": float(acc.sq_norm_sum),
                "u": acc.u.tolist(),
            }
        for name, make in mismatch_cases(rank).items():
            acc = make()
            before = cross_state(acc)
            try:
                acc.all_reduce()
                results["mismatch"][name] = None
            except fs.FusedStatsError as exc:
                same = not state_differences(cross_state(acc), before)
                results["mismatch"][name] = {"message": str(exc), "unchanged": same}

        probe = new_probe()
        run_all(probe, *probe_shares(rank))
        probe.all_reduce()
        results["probe"] = {
            f"{stream}/{name}": probe.saturation(name, stream=stream).to_dict()
            for stream in ("train", "test")
            for name in POINTS
        }
        results["probe_c_sum"] = {name: probe.cross_stats[name].c_sum.tolist() for name in POINTS}
        results["probe_steps"] = probe.steps
        results["probe_n"] = {name: probe.stats[name].n for name in POINTS}

        # a rank with another block (seed), or without cross=: an error on both ranks before any
        # accumulator is reduced
        results["probe_mismatch"] = {}
        for case, spec in (
            ("seed", fs.CrossSpec(rank=3, seed=4 + rank)),
            ("no_cross", SPEC if rank == 0 else None),
        ):
            other = run_all(fs.Probe(SeqNet(), points=POINTS, cross=spec), TRAIN[:1], [])
            before = probe_state(other)
            try:
                other.all_reduce()
                results["probe_mismatch"][case] = None
            except fs.FusedStatsError as exc:
                try:
                    assert_same_probe_state(probe_state(other), before)
                    same = True
                except AssertionError:
                    same = False
                results["probe_mismatch"][case] = {"message": str(exc), "unchanged": same}
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as handle:
            json.dump(results, handle)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_two_ranks(_worker, tmp_path_factory.mktemp("gloo_cross"))


@pytest.mark.parametrize("case", list(rank_cases()))
def test_all_reduce_equals_one_stream(ranks, case):
    data0, data1, unit = rank_cases()[case]
    ref = fed(data0 + data1, unit)
    for rank in range(2):
        got = ranks[rank]["cases"][case]
        assert (got["n"], got["batches"], got["p"], got["unit"]) == (ref.n, ref.batches, ref.p, ref.unit)
        torch.testing.assert_close(torch.tensor(got["c_sum"], dtype=F64), ref.c_sum, rtol=1e-12, atol=0)
        torch.testing.assert_close(torch.tensor(got["u"], dtype=F64), ref.u, rtol=1e-12, atol=0)
        assert math.isclose(got["sq"], float(ref.sq_norm_sum), rel_tol=1e-12)


@pytest.mark.parametrize(
    "case,words",
    [
        ("dim", ["dim [4, 5]"]),
        ("rank", ["rank [3, 2]"]),
        ("activation", ["activation ['gelu', 'relu']"]),
        ("w_in", ["w_in"]),
        ("unit", ["unit ['sample', 'position']"]),
    ],
)
def test_all_reduce_mismatch_raises_on_every_rank(ranks, case, words):
    for rank in range(2):
        err = ranks[rank]["mismatch"][case]
        assert err is not None, f"rank {rank} accepted a {case} mismatch"
        for word in words + ["ranks disagree"]:
            assert word in err["message"], (word, err["message"])
        assert err["unchanged"]


def test_probe_all_reduce_carries_cross_statistics(ranks, uninterrupted):
    ref = uninterrupted  # one process fed every rank's batches
    for rank in range(2):
        got = ranks[rank]
        assert got["probe_steps"] == ref.steps
        assert got["probe_n"] == {name: ref.stats[name].n for name in POINTS}
        for name in POINTS:
            torch.testing.assert_close(
                torch.tensor(got["probe_c_sum"][name], dtype=F64),
                ref.cross_stats[name].c_sum,
                rtol=1e-12,
                atol=1e-300,
            )
        for stream in ("train", "test"):
            for name in POINTS:
                want = ref.saturation(name, stream=stream)
                have = got["probe"][f"{stream}/{name}"]
                assert have["n"] == want.n and have["saturated"] == want.saturated
                for key in SAT_FIELDS + ("ag_max", "ag_mean"):
                    assert same_number(have[key], getattr(want, key), 1e-10), (key, have[key])
        for case, words in (
            ("seed", ["cross statistics at point", "block (activation, W_in) groups [0, 1]"]),
            ("no_cross", ["probe built with cross= [True, False]"]),
        ):
            err = got["probe_mismatch"][case]
            assert err is not None, f"rank {rank} accepted a probe {case} mismatch"
            for word in words:
                assert word in err["message"], (word, err["message"])
            assert err["unchanged"]
