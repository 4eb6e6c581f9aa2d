"""Property-based bad-input suite (hypothesis).

Every drawn input yields either a correct update or a :class:`FusedStatsError` whose message names
what was wrong, and after an error the accumulated state is bit-identical (``torch.equal`` on every
state tensor, same ``n``/``unit``/``mode``/skip count).

"Correct" is judged by an independent fp64 reference written here: the per-sample vectors a batch
defines are collected by explicit Python loops over samples and positions (unit ``sample``: the
sum of a sample's counted positions, a sample with none is no sample; ``position``: every counted
position; ``flat``: the whole sample in C order), and the four targets are U-statistics over ordered
tuples of distinct indices of their Gram matrix ``g_ij = q_iᵀq_j``, in O(n²) closed forms
(checked against literal ``itertools.permutations`` sums in this file): with ``H`` = G with a zero
diagonal, ``r_j = Σ_i H_ij``, ``T = Σ H``, ``P2 = Σ H²``, ``P3 = Σ_j (r_j² − Σ_i H_ij²)``::

    U1 = T/(n)_2   U2 = P2/(n)_2   U3 = P3/(n)_3   U4 = (T² − 4 P3 − 2 P2)/(n)_4

(the last by inclusion–exclusion over pairs of ordered pairs sharing one or two indices), then
``|μ|² = U1``, ``|μ|⁴ = U4``, ``μᵀΣμ = U3 − U4``, ``tr Σ² = U2 − 2U3 + U4`` (docs/design.md, section 2).
The reference's own fp64 rounding is ~eps·(max|q|²)^k, so the comparison uses that scale.

Drawn: shapes (B, d), (B, T, d), NCHW with feature_dim=1, flat samples; B and T possibly 0; float16,
bfloat16, float32, float64; masks None / (B,) / (B, *positions), bool, int or float, all-false;
values over several scales with an offset mean; NaN/Inf at counted or uncounted positions; wrong
feature sizes; integer, bool and complex tensors; "meta" device tensors and masks; unit changes;
pool overflow; under the "skip" policy. State files: truncated, byte-flipped, wrong version,
random bytes. Probe: a step that fails (loss_fn raising, NaN input, wrong loss shape) leaves no
hook on any module and no accumulator changed.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fused_stats as fs
from fused_stats.accumulators import state_differences

from tiny_models import TanhBlock

F64 = torch.float64
TARGETS = ("mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2")
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- reference
def falling(n: int, k: int) -> int:
    return math.prod(range(n - k + 1, n + 1))


def u_statistics(q: torch.Tensor) -> dict:
    """The four targets from the Gram matrix of the rows of ``q`` (n >= 4), module docstring."""
    n = q.shape[0]
    G = q @ q.T
    H = G - torch.diag(torch.diagonal(G))
    r = H.sum(dim=1)
    T = float(H.sum())
    P2 = float((H * H).sum())
    P3 = float((r * r).sum() - (H * H).sum())
    U1, U2, U3 = T / falling(n, 2), P2 / falling(n, 2), P3 / falling(n, 3)
    U4 = (T * T - 4 * P3 - 2 * P2) / falling(n, 4)
    return {"mu_norm2": U1, "mu_norm4": U4, "mu_sigma_mu": U3 - U4, "trace_sigma2": U2 - 2 * U3 + U4}


def u_statistics_literal(q: torch.Tensor) -> dict:
    """The same, literally averaged over ordered tuples of distinct indices (small n only)."""
    n = q.shape[0]
    G = (q @ q.T).tolist()
    u1 = sum(G[i][j] for i, j in itertools.permutations(range(n), 2)) / falling(n, 2)
    u2 = sum(G[i][j] ** 2 for i, j in itertools.permutations(range(n), 2)) / falling(n, 2)
    u3 = sum(G[i][j] * G[j][k] for i, j, k in itertools.permutations(range(n), 3)) / falling(n, 3)
    u4 = sum(G[i][j] * G[k][m] for i, j, k, m in itertools.permutations(range(n), 4)) / falling(n, 4)
    return {"mu_norm2": u1, "mu_norm4": u4, "mu_sigma_mu": u3 - u4, "trace_sigma2": u2 - 2 * u3 + u4}


@pytest.mark.parametrize("n", [4, 5, 7])
def test_closed_form_reference_equals_literal_sums(n):
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, 3, generator=gen, dtype=F64) + 0.7
    fast, slow = u_statistics(q), u_statistics_literal(q)
    for key in TARGETS:
        assert math.isclose(fast[key], slow[key], rel_tol=1e-10, abs_tol=1e-12), key


def reference_vectors(grad, mask, unit: str, feature_dim: int) -> list[torch.Tensor]:
    """Per-sample vectors of one batch by explicit loops (module docstring)."""
    g = grad.to(F64)
    B = g.shape[0]
    out = []
    if unit == "flat":
        for b in range(B):
            out.append(g[b].reshape(-1).clone())
        return out
    fd = feature_dim % g.dim()
    pos_axes = [a for a in range(1, g.dim()) if a != fd]
    pos_shape = [g.shape[a] for a in pos_axes]
    for b in range(B):
        total, any_counted = None, False
        for idx in itertools.product(*[range(s) for s in pos_shape]):
            index = [b] + [0] * (g.dim() - 1)
            for axis, i in zip(pos_axes, idx):
                index[axis] = i
            index[fd] = slice(None)
            vec = g[tuple(index)]
            if mask is None:
                counted = True
            elif mask.dim() == 1:
                counted = bool(mask[b] != 0)
            else:
                counted = bool(mask[(b, *idx)] != 0)
            if not counted:
                continue
            if unit == "position":
                out.append(vec.clone())
            else:
                total = vec.clone() if total is None else total + vec
                any_counted = True
        if unit == "sample" and any_counted:
            out.append(total)
    return out


# ----------------------------------------------------------------------------- state helpers
def snapshot(acc) -> dict:
    state = acc.state_dict()
    return {"state": state, "skipped": state.pop("skipped_batches"), "device": acc.device}


def assert_unchanged(acc, before: dict) -> None:
    after = snapshot(acc)
    changed = state_differences(after["state"], before["state"])
    assert not changed, changed
    for key in ("skipped", "device"):
        assert after[key] == before[key], key


def check_against_reference(acc, vectors: list[torch.Tensor]) -> None:
    assert acc.n == len(vectors)
    if acc.n < 4:
        with pytest.raises(fs.FusedStatsError, match="at least 4 samples"):
            acc.estimate()
        return
    q = torch.stack(vectors)
    est = acc.estimate()
    ref = u_statistics(q)
    scale = float((q * q).sum(dim=1).max())  # max |q|^2
    for key, degree in (("mu_norm2", 1), ("mu_norm4", 2), ("mu_sigma_mu", 2), ("trace_sigma2", 2)):
        tol = 1e-10 * max(scale, 1e-300) ** degree * q.shape[0]
        assert abs(getattr(est, key) - ref[key]) <= tol + 1e-9 * abs(ref[key]), (
            key,
            getattr(est, key),
            ref[key],
        )
    norms = q.norm(dim=1)
    assert math.isclose(est.ag_max, float(norms.max()), rel_tol=1e-12)
    assert math.isclose(est.ag_mean, float(norms.mean()), rel_tol=1e-10)
    assert math.isclose(
        float(acc.mean().norm()), float(q.mean(0).norm()), rel_tol=1e-9, abs_tol=1e-12 * math.sqrt(scale)
    )
    if acc.mode == "pool":
        assert torch.allclose(acc.pool_rows(), q, rtol=1e-12, atol=1e-12 * math.sqrt(scale))


# ----------------------------------------------------------------------------- batch strategy
@st.composite
def batch_specs(draw, dim: int):
    """A dict describing one update call, plus what must happen (``expect``: list of words)."""
    kind = draw(
        st.sampled_from(
            ["ok"] * 4
            + ["nonfinite"] * 2
            + ["wrong_dim", "int", "meta", "bad_mask", "unit_change", "meta_mask"]
        )
    )
    unit = draw(st.sampled_from(["sample", "position", "flat"]))
    layout = draw(st.sampled_from(["2d", "3d", "nchw"]))
    B = draw(st.sampled_from([1, 2, 3, 4, 5, 0]))  # 0 (an empty batch) now and then
    T = draw(st.sampled_from([1, 2, 3, 0]))
    dtype = draw(st.sampled_from(FLOATS))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    offset = draw(st.sampled_from([0.0, 1.0, 5.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    mask_kind = draw(st.sampled_from(["none", "none", "per_sample", "positions", "all_false"]))
    mask_dtype = draw(st.sampled_from([torch.bool, torch.int64, torch.float32]))
    return dict(
        kind=kind,
        unit=unit,
        layout=layout,
        B=B,
        T=T,
        dtype=dtype,
        scale=scale,
        offset=offset,
        seed=seed,
        mask_kind=mask_kind,
        mask_dtype=mask_dtype,
        dim=dim,
        where_bad=draw(st.sampled_from(["counted", "uncounted"])),
        bad_value=draw(st.sampled_from([math.nan, math.inf, -math.inf])),
    )


def build(spec: dict, locked_unit):
    """(grad, mask, unit, feature_dim) of a spec, and the words an error must contain (or None)."""
    gen = torch.Generator().manual_seed(spec["seed"])
    d, B, T = spec["dim"], spec["B"], spec["T"]
    # one thing wrong at a time: keep the unit the accumulator was fed unless changing it is the point
    unit = locked_unit or spec["unit"]
    if spec["kind"] == "unit_change" and locked_unit is not None:
        unit = next(u for u in ("sample", "position", "flat") if u != locked_unit)
    layout = spec["layout"]
    if unit == "flat":
        # a sample of shape (a, b) with a * b = d (or (d,)): flat means "the whole sample"
        shape = (B, d) if layout == "2d" or d == 1 else (B, 1, d)
        feature_dim = -1
    elif layout == "2d":
        shape, feature_dim = (B, d), -1
    elif layout == "3d":
        shape, feature_dim = (B, T, d), -1
    else:
        shape, feature_dim = (B, d, T, 2), 1
    feat_axis = feature_dim % len(shape)
    if spec["kind"] == "wrong_dim":
        shape = (
            tuple(s + 1 if i == feat_axis else s for i, s in enumerate(shape))
            if unit != "flat"
            else (B, d + 1)
        )
    grad = spec["offset"] + spec["scale"] * torch.randn(*shape, generator=gen, dtype=F64)
    mask = None
    if (unit != "flat" and spec["mask_kind"] != "none" and shape[0] > 0) or (
        unit != "flat" and spec["kind"] == "bad_mask"
    ):
        positions = tuple(s for i, s in enumerate(shape) if i not in (0, feat_axis))
        if spec["mask_kind"] == "per_sample":
            mask = torch.rand(B, generator=gen) < 0.6
        elif spec["mask_kind"] == "all_false":
            mask = torch.zeros(B, *positions, dtype=torch.bool)
        else:
            mask = torch.rand(B, *positions, generator=gen) < 0.6
        if spec["kind"] == "bad_mask":
            mask = torch.ones(B + 1, *positions, dtype=torch.bool)
        mask = mask.to(spec["mask_dtype"])
    if spec["kind"] == "nonfinite" and grad.numel():
        # put the bad value at a counted or an uncounted position
        counted = reference_keep(grad, mask, unit, feature_dim)
        pick = counted if spec["where_bad"] == "counted" else ~counted
        idx = pick.nonzero()
        if len(idx):
            grad[tuple(idx[len(idx) // 2].tolist())] = spec["bad_value"]
    grad = grad.to(spec["dtype"])
    expect = None
    if spec["kind"] == "bad_mask" and unit == "flat":
        mask = torch.ones(shape[0], dtype=torch.bool)
        expect = ["flat", "takes no mask"]
    elif spec["kind"] == "int":
        grad = (grad.to(F64).nan_to_num() * 10).to(torch.int32)
        expect = ["floating-point", "torch.int32"]
    elif spec["kind"] == "meta":
        grad = grad.to("meta")
        expect = ["meta"]
    elif spec["kind"] == "meta_mask" and unit != "flat":
        if mask is None:
            mask = torch.ones(shape[0], dtype=torch.bool)
        mask = mask.to("meta")
        expect = ["mask", "meta"]
    elif spec["kind"] == "wrong_dim":
        expect = [str(tuple(grad.shape)), f"dim={d}"]
    elif spec["kind"] == "bad_mask" and mask is not None:
        expect = ["mask", str(tuple(mask.shape))]
    elif unit != locked_unit and locked_unit is not None:
        expect = ["unit", repr(locked_unit), repr(unit)]
    return grad, mask, unit, feature_dim, expect


def reference_keep(grad, mask, unit, feature_dim) -> torch.Tensor:
    """Bool tensor of grad's shape: True where an element is counted (by unit and mask)."""
    if unit == "flat" or mask is None:
        return torch.ones(grad.shape, dtype=torch.bool)
    fd = feature_dim % grad.dim()
    m = mask != 0
    if m.dim() == 1:
        m = m.reshape(-1, *[1] * (grad.dim() - 1))
    else:
        m = m.unsqueeze(fd)
    return m.expand(grad.shape).clone()


# ----------------------------------------------------------------------------- update properties
@settings(max_examples=400, **SETTINGS)
@given(
    data=st.data(),
    dim=st.sampled_from([1, 3, 8]),
    second_moment=st.sampled_from(["dense", "pool", "auto"]),
    capacity=st.sampled_from([None, 20]),
    policy=st.sampled_from(["raise", "skip"]),
)
def test_updates_are_correct_or_rejected_cleanly(data, dim, second_moment, capacity, policy):
    acc = fs.GradStats(
        dim,
        second_moment=second_moment,
        nonfinite=policy,
        pool_capacity=capacity if second_moment == "pool" else None,
        name="h.3",
    )
    vectors: list[torch.Tensor] = []
    locked_unit = None
    for spec in data.draw(st.lists(batch_specs(dim), min_size=1, max_size=4)):
        grad, mask, unit, feature_dim, expect = build(spec, locked_unit)
        new = None
        if expect is None:
            new = reference_vectors(grad, mask, unit, feature_dim)
            if new and not all(bool(torch.isfinite(v).all()) for v in new):
                expect = ["skip"] if policy == "skip" else ["non-finite", "h.3"]
            elif new and second_moment == "pool" and capacity and len(vectors) + len(new) > capacity:
                expect = ["pool_capacity=20", str(len(vectors))]
        before = snapshot(acc)
        if expect == ["skip"]:
            acc.update(grad, mask=mask, unit=unit, feature_dim=feature_dim)
            before["skipped"] += 1
            assert_unchanged(acc, before)
        elif expect is not None:
            with pytest.raises(fs.FusedStatsError) as info:
                acc.update(grad, mask=mask, unit=unit, feature_dim=feature_dim)
            for word in expect:
                assert word in str(info.value), (word, str(info.value))
            assert_unchanged(acc, before)
        else:
            acc.update(grad, mask=mask, unit=unit, feature_dim=feature_dim)
            vectors.extend(new)
            if new:
                locked_unit = unit
            else:  # an empty or fully masked batch is no batch
                assert_unchanged(acc, before)
        check_against_reference(acc, vectors)


# ----------------------------------------------------------------------------- merge properties
@settings(max_examples=120, **SETTINGS)
@given(
    seed=st.integers(0, 2**31 - 1),
    dim=st.integers(1, 4),
    kinds=st.tuples(st.sampled_from(["dense", "pool", "auto"]), st.sampled_from(["dense", "pool", "auto"])),
    sizes=st.tuples(st.integers(0, 9), st.integers(0, 9)),
    other_dim=st.booleans(),
    other_unit=st.booleans(),
    meta=st.booleans(),
)
def test_merge_is_correct_or_rejected_cleanly(seed, dim, kinds, sizes, other_dim, other_unit, meta):
    gen = torch.Generator().manual_seed(seed)
    a = fs.GradStats(dim, second_moment=kinds[0])
    b = fs.GradStats(dim + other_dim, second_moment=kinds[1])
    qa = torch.randn(sizes[0], dim, generator=gen, dtype=F64) + 2.0
    qb = torch.randn(sizes[1], dim + other_dim, generator=gen, dtype=F64) - 1.0
    if sizes[0]:
        a.update(qa)
    if sizes[1]:
        if other_unit:
            b.update(qb.unsqueeze(1), unit="position")
        else:
            b.update(qb)
    if meta:
        b = fs.GradStats(dim, device="meta")
    before = snapshot(a)
    expect = None
    if meta:
        expect = ["meta"] if sizes[0] else None
    elif other_dim:
        expect = ["dim"]
    elif other_unit and sizes[0] and sizes[1]:
        expect = ["unit"]
    elif kinds[0] == "pool" and b.n and b.mode == "dense":
        expect = ["dense", "pool"]
    if expect is not None:
        with pytest.raises(fs.FusedStatsError) as info:
            a.merge(b)
        for word in expect:
            assert word in str(info.value), (word, str(info.value))
        assert_unchanged(a, before)
        return
    a.merge(b)
    vectors = list(qa) + ([] if meta else list(qb))
    check_against_reference(a, vectors)


# ----------------------------------------------------------------------------- state files
def saved_state(tmp_path, gen, mode="pool"):
    acc = fs.GradStats(3, second_moment=mode, name="blocks.2")
    acc.update(torch.randn(6, 3, generator=gen, dtype=F64) + 1.0)
    path = tmp_path / "state.safetensors"
    acc.save(path)
    return acc, path


def same_loaded(acc, loaded) -> bool:
    return acc.same_state(loaded) and acc.config() == loaded.config()


@settings(max_examples=200, **SETTINGS)
@given(data=st.data(), mode=st.sampled_from(["pool", "dense"]))
def test_damaged_state_files_are_rejected(tmp_path_factory, data, mode):
    tmp_path = tmp_path_factory.mktemp("state")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    acc, path = saved_state(tmp_path, gen, mode)
    raw = path.read_bytes()
    how = data.draw(st.sampled_from(["truncate", "flip", "flip", "garbage", "empty"]))
    if how == "truncate":
        damaged = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif how == "flip":
        pos = data.draw(st.integers(0, len(raw) - 1))
        bit = data.draw(st.integers(1, 255))
        damaged = raw[:pos] + bytes([raw[pos] ^ bit]) + raw[pos + 1 :]
    elif how == "garbage":
        damaged = bytes(data.draw(st.binary(min_size=1, max_size=200)))
    else:
        damaged = b""
    path.write_bytes(damaged)
    try:
        loaded = fs.GradStats.load(path)
    except fs.FusedStatsError as exc:
        assert str(path) in str(exc)
        return
    # a change that reached nothing the state depends on must give back the very same state
    assert same_loaded(acc, loaded), f"{how} at a byte loaded a different state silently"


def test_wrong_version_and_format_are_named(tmp_path, gen):
    from safetensors import safe_open
    from safetensors.torch import save_file

    _, path = saved_state(tmp_path, gen)
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118  (a safetensors handle is not iterable)
    for key, value, words in (
        ("version", "2", ["version '2'", "reads version 1"]),
        ("format", "something.else", ["something.else"]),
    ):
        bad = dict(meta, **{key: value})
        other = tmp_path / f"{key}.safetensors"
        save_file(tensors, str(other), metadata=bad)
        with pytest.raises(fs.FusedStatsError) as info:
            fs.GradStats.load(other)
        for word in words:
            assert word in str(info.value), (word, str(info.value))
    # a state whose metadata is edited (n) but whose checksum is not: rejected, not trusted
    state = json.loads(meta["state"])
    state["n"] += 1
    edited = tmp_path / "edited.safetensors"
    save_file(tensors, str(edited), metadata=dict(meta, state=json.dumps(state)))
    with pytest.raises(fs.FusedStatsError, match="checksum"):
        fs.GradStats.load(edited)


# ----------------------------------------------------------------------------- probe: no hook left
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(3, 5)
        self.blocks = torch.nn.ModuleList([TanhBlock(5), TanhBlock(5)])
        self.out = torch.nn.Linear(5, 2)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def hook_count(model) -> int:
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(getattr(m, "_forward_hooks_with_kwargs", {}))
        for m in model.modules()
    )


@settings(max_examples=40, **SETTINGS)
@given(
    failure=st.sampled_from(["raise", "nan_input", "mean_loss", "int_loss", "wrong_batch", "ok"]),
    seed=st.integers(0, 1000),
    B=st.integers(1, 4),
)
def test_failed_probe_step_leaves_no_hook_and_no_change(failure, seed, B):
    from fused_stats.api.probe.driver import Probe

    model = Net()
    probe = Probe(model, points=["blocks.0", "blocks.1"], second_moment="dense")
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (8,), generator=gen)

    def good_loss(m, x):
        return torch.nn.functional.cross_entropy(m(x), y[: x.shape[0]], reduction="none")

    probe.step(torch.randn(6, 3, generator=gen), good_loss)  # some state to protect
    hooks = hook_count(model)
    params = [p.detach().clone() for p in model.parameters()]
    flags = [p.requires_grad for p in model.parameters()]
    before = {name: snapshot(acc) for name, acc in probe.stats.items()}
    x = torch.randn(B, 3, generator=gen)

    def raising(m, batch):
        m(batch)
        raise RuntimeError("user loss failed")

    loss = {
        "raise": raising,
        "nan_input": good_loss,
        "ok": good_loss,
        "wrong_batch": good_loss,
        "mean_loss": lambda m, b: good_loss(m, b).mean(),
        "int_loss": lambda m, b: good_loss(m, b).long(),
    }[failure]
    if failure == "nan_input":
        x[0, 0] = math.nan
    if failure == "wrong_batch":
        x = torch.randn(B, 4, generator=gen)  # the model's first Linear rejects it
    if failure == "ok":
        probe.step(x, loss)
        assert probe.stats["blocks.0"].n == 6 + B
    else:
        expected = {"raise": RuntimeError, "wrong_batch": RuntimeError}.get(failure, fs.FusedStatsError)
        with pytest.raises(expected):
            probe.step(x, loss)
        for name, acc in probe.stats.items():
            assert_unchanged(acc, before[name])
    assert hook_count(model) == hooks == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    assert [p.requires_grad for p in model.parameters()] == flags
