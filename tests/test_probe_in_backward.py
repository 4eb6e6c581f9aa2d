"""The in-backward fold of ``Probe.step`` equals the fold it replaced, bit for bit.

Reference: the probe driver, capture hooks and cross-gradient twin of commit 18b8335 (the last
commit before the gradients were reduced inside the backward), read with ``git show`` and loaded
as modules next to the current ones: that driver takes ONE ``torch.autograd.grad`` for all points
and folds the full (B, T, d) gradients and outputs afterwards. Both probes see the same batches;
every accumulator tensor, counter, estimate, certificate, saturation test and checkpoint must be
equal (``torch.equal``, ``==``). Also here: a non-finite gradient at any one point (atomic and per
point), the per-point mode against the atomic one, and a downstream in-place change.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.networks.resnet import cifar_resnet20
from fused_stats.ops import cross_twin

from tiny_models import padded_lm_batch
from tiny_models import tiny_lm_config as lm_config

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

OLD = "18b8335"
ROOT = Path(fs.__file__).resolve().parents[1]
VOCAB = 40


def _git_show(path: str) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{OLD}:{path}"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("git is not available: the reference is the code of commit " + OLD)
    if out.returncode != 0:
        pytest.skip(f"commit {OLD} is not in this checkout's history: {out.stderr[-200:]}")
    return out.stdout


def _load(name: str, source: str):
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = name.rpartition(".")[0]
    sys.modules[name] = module
    exec(compile(source, f"<{OLD}:{name}>", "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def old():
    """``(OldProbe, old_cross_reduce)``: the driver and the cross twin of commit 18b8335."""
    _load("fused_stats.api.probe._old_hooks", _git_show("fused_stats/api/probe/hooks.py"))
    driver = (
        _git_show("fused_stats/api/probe/driver.py")
        .replace("from .hooks import", "from ._old_hooks import")
        # table.KINDS is gone (the kinds are the registry's); that commit's value of it
        .replace(
            "from .table import KINDS, STREAMS,",
            "KINDS = ('grad', 'cross', 'norm_hist')\nfrom .table import STREAMS,",
        )
        # the stacked entry points are prepare_many / commit_many given a stack now
        .replace(".prepare_stacked(", ".prepare_many(")
        .replace(".commit_stacked(", ".commit_many(")
    )
    module = _load("fused_stats.api.probe._old_driver", driver)
    twin = _load("fused_stats.ops._old_cross_twin", _git_show("fused_stats/ops/cross_twin.py"))
    return module.Probe, twin.cross_reduce


@contextlib.contextmanager
def old_twin(old_cross_reduce):
    """The old probe runs with the old cross twin (the current one was split in two)."""
    current = cross_twin.cross_reduce
    cross_twin.cross_reduce = old_cross_reduce
    try:
        yield
    finally:
        cross_twin.cross_reduce = current


# ----------------------------------------------------------------------------- comparison
def same(a, b, where):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, (where, a, b)


def assert_same_probe(new, ref, tmp_path=None):
    assert new.table.keys() == ref.table.keys()
    for key in ref.table:
        same(new.table[key].state_dict(), ref.table[key].state_dict(), key)
    same(new.steps, ref.steps, "steps")
    same(new.skipped_steps, ref.skipped_steps, "skipped")
    same(new.dims, ref.dims, "dims")
    same(new.feature_dims, ref.feature_dims, "feature_dims")
    for point in ref.points:
        for stream in ("train", "test"):
            acc = ref.table.get(("grad", stream, point))
            if acc is not None and acc.n >= 4:
                same(new.estimate(point, stream).to_dict(), ref.estimate(point, stream).to_dict(), point)
        if ref.table.get(("grad", "test", point)) is not None and ref.table[("grad", "train", point)].n >= 4:
            same(new.certificate(point).to_dict(), ref.certificate(point).to_dict(), f"{point}/cert")
        if ref.cross is not None:
            same(new.saturation(point).to_dict(), ref.saturation(point).to_dict(), f"{point}/sat")
    if tmp_path is not None:  # the checkpoint restores the same state into a fresh probe
        new.save_state(tmp_path / "new")
        restored = fs.Probe(
            new.model, points=new.points, unit=new.unit, cross=new.cross, **KW.get(id(new), {})
        )
        restored.load_state(tmp_path / "new")
        for key in ref.table:
            same(restored.table[key].state_dict(), ref.table[key].state_dict(), f"restored {key}")


KW: dict = {}


def run_both(old, make_model, batches, loss_fn, tmp_path=None, step_kw=None, **options):
    """The same batches through the current probe and the old one; returns both."""
    OldProbe, old_cross_reduce = old
    model = make_model()
    new, ref = fs.Probe(model, **options), OldProbe(model, **options)
    KW[id(new)] = {k: v for k, v in options.items() if k not in ("points", "unit", "cross")}
    for i, batch in enumerate(batches):
        stream = "test" if i % 3 == 2 else "train"
        kw = dict(step_kw or {})
        new.step(batch, loss_fn, stream=stream, **kw)
        with old_twin(old_cross_reduce):
            ref.step(batch, loss_fn, stream=stream, **kw)
    assert_same_probe(new, ref, tmp_path)
    return new, ref


# ----------------------------------------------------------------------------- models


def tiny_lm(arch: str, dtype):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(lm_config(arch), dtype=dtype)
    with torch.no_grad():  # norm weights away from 1, biases away from 0
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def lm_batches(gen, count=5, T=None):
    """Right-padded batches of varying sizes and lengths (one length ``T`` for unit="flat")."""
    shapes = [([9, 6, 4], 9), ([8, 8, 3, 5], 8), ([7, 5, 6], 7), ([6, 6, 2, 5, 3], 6), ([5, 5], 5)]
    if T is not None:
        shapes = [([min(n, T) for n in lengths], T) for lengths, _ in shapes]
    return [padded_lm_batch(gen, *shapes[i % len(shapes)], VOCAB, prompts=None) for i in range(count)]


LM_CASES = [
    ("sample", None, True),  # default mask: the attention mask of the padded batches
    ("sample", "labels", True),
    ("sample", "none", False),
    ("position", "labels", True),
    ("position", None, False),
    ("flat", None, False),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("arch", ["llama", "neox", "gpt2"])
def test_lm_probe_equals_the_old_fold(arch, dtype, old, gen, tmp_path):
    batches, fixed = lm_batches(gen), lm_batches(gen, T=6)
    for i, (unit, mask, cross) in enumerate(LM_CASES):
        run_both(
            old,
            lambda: tiny_lm(arch, dtype),
            fixed if unit == "flat" else batches,
            fs.causal_lm_loss,
            tmp_path / str(i),
            step_kw={"mask": mask},
            unit=unit,
            cross=fs.CrossSpec(rank=5, seed=1) if cross else None,
            second_moment="pool" if i % 2 else "auto",
            norm_histogram=unit != "flat" and i == 0,
        )


def test_lm_probe_with_a_per_sample_mask_equals_the_old_fold(old, gen):
    batches = lm_batches(gen, 3)
    keep = [
        torch.tensor([True, False, True]),
        torch.tensor([True, True, False, True]),
        torch.tensor([False, True, True]),
    ]
    OldProbe, old_cross_reduce = old
    model = tiny_lm("llama", torch.float64)
    options = {"cross": fs.CrossSpec(rank=3), "second_moment": "dense"}
    new, ref = fs.Probe(model, **options), OldProbe(model, **options)
    for batch, m in zip(batches, keep):
        new.step(batch, fs.causal_lm_loss, mask=m)
        with old_twin(old_cross_reduce):
            ref.step(batch, fs.causal_lm_loss, mask=m)
    assert_same_probe(new, ref)


def resnet():
    return cifar_resnet20(width=4, seed=0).double().eval()


@pytest.mark.parametrize("unit", ["sample", "position", "flat"])
def test_resnet_probe_equals_the_old_fold(unit, old, gen, tmp_path):
    batches = [
        (
            torch.randn(6, 3, 8, 8, generator=gen, dtype=torch.float64),
            torch.randint(0, 10, (6,), generator=gen),
        )
        for _ in range(4)
    ]
    run_both(
        old,
        resnet,
        batches,
        fs.classification_loss,
        tmp_path,
        unit=unit,
        cross=fs.CrossSpec(rank=4) if unit != "flat" else None,
        second_moment="pool",
    )


class MLP(nn.Module):
    """(B, d) residual points: one row per sample, the staged (stacked) path."""

    def __init__(self, d=6, depth=3):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, d)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(depth)])
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("cross", [False, True])
def test_one_row_per_sample_probe_equals_the_old_fold(cross, dtype, old, gen):
    batches = [
        (torch.randn(7, 4, generator=gen, dtype=dtype), torch.randint(0, 3, (7,), generator=gen))
        for _ in range(5)
    ]
    points = [f"blocks.{i}" for i in range(3)]
    run_both(
        old,
        lambda: MLP().to(dtype),
        batches,
        fs.classification_loss,
        points=points,
        cross=fs.CrossSpec(rank=5) if cross else None,
        second_moment="dense",
    )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_streamed_probe_equals_the_old_fold(arch, old, gen):
    OldProbe, old_cross_reduce = old
    batches = lm_batches(gen, 4)
    options = {"cross": fs.CrossSpec(rank=4, seed=2), "second_moment": "pool"}
    probes = []
    for cls in (fs.Probe, OldProbe):
        model = tiny_lm(arch, torch.float64)
        with (
            fs.stream_blocks(model, device="cpu") as st,
            old_twin(old_cross_reduce) if cls is OldProbe else contextlib.nullcontext(),
        ):
            p = cls(st.model, **options)
            for i, batch in enumerate(batches):
                p.step(batch, fs.causal_lm_loss, stream="test" if i == 3 else "train")
        probes.append(p)
    assert_same_probe(*probes)


# ----------------------------------------------------------------------------- the twin split
@pytest.mark.parametrize("unit", ["sample", "position"])
@pytest.mark.parametrize("T", [1, 3, 40])
@pytest.mark.parametrize("masked", [False, True])
def test_cross_twin_from_features_equals_the_old_twin(unit, T, masked, old, gen):
    _, old_cross_reduce = old
    B, d, r = 5, 7, 4
    grad = torch.randn(B, T, d, generator=gen, dtype=torch.float64)
    act = torch.randn(B, T, d, generator=gen, dtype=torch.float32)
    w = torch.randn(r, d, generator=gen)
    mask = (torch.rand(B, T, generator=gen) < 0.6) if masked else None
    want = old_cross_reduce(grad, act, mask, w, "gelu", unit, 2)
    got = cross_twin.cross_reduce_features(grad, cross_twin.features(act, mask, w, "gelu"), mask, unit, 2)
    for field in ("n", "c_sum", "sq_norm_sum", "u2", "u3", "u4", "p2", "p3", "p4"):
        same(getattr(got, field), getattr(want, field), field)


# ----------------------------------------------------------------------------- non-finite
class Scale(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def overflow_at(model, point):
    """The gradient at ``point``'s output, and only there, is so large that its sums overflow
    (|q|^4 > 1e300): its consumer reads it through ×1e90 in the backward, and the point's output
    passes ×1e-90 before the probe captures it, so the points below get the usual gradient."""
    points = fs.residual_points(model)
    k = points.index(point)
    follower = points[k + 1] if k + 1 < len(points) else "model.norm"

    def up(module, args, kwargs):
        if args:
            return (Scale.apply(args[0], 1e90), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": Scale.apply(kwargs["hidden_states"], 1e90)}

    def down(module, args, out):
        if isinstance(out, torch.Tensor):
            return Scale.apply(out, 1e-90)
        return (Scale.apply(out[0], 1e-90), *out[1:])

    handles = [
        model.get_submodule(follower).register_forward_pre_hook(up, with_kwargs=True),
        model.get_submodule(point).register_forward_hook(down),
    ]
    return _Handles(handles)


class _Handles:
    def __init__(self, handles):
        self.handles = handles

    def remove(self):
        for h in self.handles:
            h.remove()


def snapshot(probe):
    return {key: acc.state_dict() for key, acc in probe.table.items()} | {
        "steps": dict(probe.steps),
        "skipped": dict(probe.skipped_steps),
    }


@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("unit", ["sample", "position"])
def test_nonfinite_gradient_at_one_point_changes_nothing(unit, k, policy, gen):
    model = tiny_lm("llama", torch.float64)
    points = fs.residual_points(model)
    probe = fs.Probe(model, unit=unit, cross=fs.CrossSpec(rank=3), nonfinite=policy, second_moment="pool")
    first, bad = lm_batches(gen, 2)
    probe.step(first, fs.causal_lm_loss)
    before = snapshot(probe)
    handle = overflow_at(model, points[k])
    try:
        if policy == "raise":
            with pytest.raises(fs.FusedStatsError, match="non-finite"):
                probe.step(bad, fs.causal_lm_loss)
        else:
            probe.step(bad, fs.causal_lm_loss)
    finally:
        handle.remove()
    after = snapshot(probe)
    if policy == "skip":
        assert after.pop("skipped")["train"] == before.pop("skipped")["train"] + 1
    same(after, before, "state")


@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_per_point_mode_keeps_the_points_above_the_failure(k, policy, gen):
    """``atomic=False``: the points whose gradients arrived before the refused one (those after
    it in the forward) hold the batch, exactly as a clean per-point step leaves them; the
    refused point and those below it are as before the step; the step is not counted."""
    points = fs.residual_points(tiny_lm("llama", torch.float64))
    first, bad = lm_batches(gen, 2)
    options = {"cross": fs.CrossSpec(rank=3), "nonfinite": policy, "second_moment": "pool"}
    clean_model, model = tiny_lm("llama", torch.float64), tiny_lm("llama", torch.float64)
    clean, probe = fs.Probe(clean_model, **options), fs.Probe(model, **options)
    for p in (clean, probe):
        p.step(first, fs.causal_lm_loss, atomic=False)
    before = snapshot(probe)
    clean.step(bad, fs.causal_lm_loss, atomic=False)
    handle = overflow_at(model, points[k])
    try:
        if policy == "raise":
            with pytest.raises(fs.FusedStatsError, match=f"{points[k]}.*atomic=False"):
                probe.step(bad, fs.causal_lm_loss, atomic=False)
        else:
            probe.step(bad, fs.causal_lm_loss, atomic=False)
    finally:
        handle.remove()
    for key, acc in probe.table.items():
        want = clean.table[key] if points.index(key[2]) > k else None
        same(acc.state_dict(), want.state_dict() if want is not None else before[key], key)
    assert probe.steps == before["steps"]
    assert probe.skipped_steps["train"] == before["skipped"]["train"] + (policy == "skip")


def test_per_point_mode_agrees_with_the_atomic_step(gen):
    model = tiny_lm("gpt2", torch.float64)
    a = fs.Probe(model, unit="position", cross=fs.CrossSpec(rank=3), second_moment="pool")
    b = fs.Probe(model, unit="position", cross=fs.CrossSpec(rank=3), second_moment="pool")
    for batch in lm_batches(gen, 4):
        a.step(batch, fs.causal_lm_loss, mask="labels")
        b.step(batch, fs.causal_lm_loss, mask="labels", atomic=False)
    assert a.steps == b.steps
    for point in a.points:
        ea, eb = a.estimate(point).to_dict(), b.estimate(point).to_dict()
        for key, value in ea.items():
            if isinstance(value, float):
                assert math.isclose(eb[key], value, rel_tol=1e-12, abs_tol=1e-14), (point, key)
        assert math.isclose(b.saturation(point).cross_frob2, a.saturation(point).cross_frob2, rel_tol=1e-12)


# ----------------------------------------------------------------------------- in place downstream
class Residual(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, h):
        return h + torch.tanh(self.lin(h))


class InPlaceAfter(nn.Module):
    """Three tanh residual blocks on (B, T, d); the output of ``blocks.1`` is doubled in place."""

    def __init__(self, d=5):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, d)
        self.blocks = nn.ModuleList([Residual(d) for _ in range(3)])
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 1:
                h.mul_(2.0)  # the point's own output, changed after the point produced it
        return self.out(h).sum(1)


def test_gradient_is_that_of_the_output_before_a_downstream_in_place_change(gen):
    """The tensor hook is registered before the in-place change, so the gradient it reduces is the
    one a zero bias added at the point's output receives: checked against that bias, one backward
    per sample. (One-row-per-sample points keep their output for the stacked fold, so there the
    change is refused instead: tests/test_probe_behaviour.py.)"""
    model = InPlaceAfter().double()
    x = torch.randn(6, 4, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (6,), generator=gen)
    probe = fs.Probe(model, points=["blocks.0", "blocks.1"], second_moment="pool")
    probe.step((x, y), fs.classification_loss)
    rows = []
    for b in range(6):
        bias = torch.zeros(5, dtype=torch.float64, requires_grad=True)
        handle = model.blocks[1].register_forward_hook(lambda m, a, out, bias=bias: out + bias)
        try:
            loss = fs.classification_loss(model, (x[b : b + 1], y[b : b + 1])).sum()
            (g,) = torch.autograd.grad(loss, [bias])
        finally:
            handle.remove()
        rows.append(g)
    got = probe.stats["blocks.1"].pool_rows()
    assert torch.allclose(got, torch.stack(rows), rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- the kind registry
def test_a_kind_added_through_the_registry_is_folded_at_every_point(gen):
    """A new statistic is one ``register_kind`` (no edit of the folds or of ``new_accumulator``):
    here a second GradStats kind, dense, beside the probe's pooled one. The step folds it at every
    point; its estimates equal those of a dense GradStats fed the pooled kind's per-sample rows."""
    from fused_stats.api.probe.fold import Kind, register_kind, unregister_kind

    register_kind(
        Kind(
            "grad_dense",
            lambda probe: getattr(probe, "keep_dense", False),
            lambda probe, name, dim, dtype, device: fs.GradStats(int(dim), "dense", device=device, name=name),
        )
    )
    try:
        model = tiny_lm("gpt2", torch.float64)
        probe = fs.Probe(model, second_moment="pool")
        probe.keep_dense = True
        assert probe.kinds == ("grad", "grad_dense")
        for batch in lm_batches(gen, 3):
            probe.step(batch, fs.causal_lm_loss)
        for point in probe.points:
            dense = probe.accumulators("grad_dense")[point]
            ref = fs.GradStats(dense.dim, "dense")
            ref.update(probe.stats[point].pool_rows())
            assert dense.n == ref.n == probe.stats[point].n
            got, want = dense.estimate().to_dict(), ref.estimate().to_dict()
            for key, value in want.items():
                if isinstance(value, float):
                    assert math.isclose(got[key], value, rel_tol=1e-9, abs_tol=1e-15), (point, key)
    finally:
        unregister_kind("grad_dense")
    assert "grad_dense" not in fs.Probe(tiny_lm("gpt2", torch.float64)).kinds


def test_a_registered_kind_checkpoints_and_resumes(gen, tmp_path):
    """A kind added with ``register_kind`` whose accumulator is an existing class (GradStats) is
    saved with that class named in the manifest, loads back into a fresh probe and resumes to the
    state of one uninterrupted run."""
    import json

    from fused_stats.api.probe.fold import Kind, register_kind, unregister_kind

    register_kind(
        Kind(
            "grad_dense",
            lambda probe: True,
            lambda probe, name, dim, dtype, device: fs.GradStats(int(dim), "dense", device=device, name=name),
        )
    )
    try:
        model = tiny_lm("gpt2", torch.float64)
        batches = lm_batches(gen, 3)
        whole, part = fs.Probe(model, second_moment="pool"), fs.Probe(model, second_moment="pool")
        for batch in batches:
            whole.step(batch, fs.causal_lm_loss)
        for batch in batches[:2]:
            part.step(batch, fs.causal_lm_loss)
        part.save_state(tmp_path / "ckpt")
        snap = (tmp_path / "ckpt" / (tmp_path / "ckpt" / "LATEST").read_text().strip()) / "manifest.json"
        entries = json.loads(snap.read_text())["points"]
        assert {e.get("class") for e in entries if e["kind"] == "grad_dense"} == {"grad"}
        assert all("class" not in e for e in entries if e["kind"] == "grad")
        resumed = fs.Probe(model, second_moment="pool")
        resumed.load_state(tmp_path / "ckpt")
        resumed.step(batches[2], fs.causal_lm_loss)
        for point in whole.points:
            a, b = resumed.accumulators("grad_dense")[point], whole.accumulators("grad_dense")[point]
            assert a.mode == "dense" and a.n == b.n > 0
            for key, value in b.estimate().to_dict().items():
                if isinstance(value, float):
                    assert math.isclose(a.estimate().to_dict()[key], value, rel_tol=1e-12, abs_tol=1e-15)
    finally:
        unregister_kind("grad_dense")


def test_few_position_cross_step_agrees_with_the_old_shared_product(old, gen, monkeypatch):
    """The one case that is not bit for bit: ``cross=`` on (B, T, d) points with so few positions
    that the old fold shared one batched product across points (``CrossStats._prepare_stacked``,
    unmasked, ``unit="sample"``); the hooks fire one point at a time. The sums then agree to fp64
    rounding; the GradStats, which never took that product for T > 1, stay bit for bit."""
    OldProbe, old_cross_reduce = old
    model = tiny_lm("llama", torch.float64)
    batches = [padded_lm_batch(gen, [2, 2, 2], 2, VOCAB) for _ in range(4)]
    options = {"cross": fs.CrossSpec(rank=5, seed=1), "second_moment": "pool"}
    new, ref = fs.Probe(model, **options), OldProbe(model, **options)
    shared = []
    original = fs.CrossStats._prepare_stacked.__func__
    monkeypatch.setattr(
        fs.CrossStats,
        "_prepare_stacked",
        classmethod(lambda cls, *a, **k: shared.append(1) or original(cls, *a, **k)),
    )
    differs = False
    for batch in batches:
        new.step(batch, fs.causal_lm_loss, mask="none")
        assert not shared  # the hooks never share the product
        with old_twin(old_cross_reduce):
            ref.step(batch, fs.causal_lm_loss, mask="none")
        assert shared  # the old fold did: the case this test is about
        shared.clear()
    for key, acc in ref.table.items():
        got = new.table[key].state_dict()
        for name, value in acc.state_dict().items():
            if key[0] == "grad" or not isinstance(value, torch.Tensor):
                same(got[name], value, (key, name))
            else:
                # the tuple sums cancel (u4 ~ 1e-21 next to u2 ~ 1e-4): held to the state's own scale
                scale = float(value.abs().max()) if value.numel() else 0.0
                assert torch.allclose(got[name], value, rtol=1e-12, atol=1e-12 * scale), (key, name)
                differs |= not torch.equal(got[name], value)
    assert differs  # not bit for bit (else this case would belong with the bit-identical ones)
    for point in ref.points:
        a, b = new.saturation(point).to_dict(), ref.saturation(point).to_dict()
        assert math.isclose(a["cross_frob2"], b["cross_frob2"], rel_tol=1e-11), point
