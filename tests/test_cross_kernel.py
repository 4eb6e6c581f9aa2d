"""The fused cross-gradient kernel: interpreter runs against the torch twin and an
explicit reference. (Its Hopper (sm_90a) compile gate -- no spills, tf32x3 wgmma / fp64 DMMA, the
launcher's configurations -- is the shared one in tests/test_kernels_sm90.py.)

References for ``fused_stats.kernels.cross_reduce``:

* the torch twin :func:`fused_stats.ops.cross_twin.cross_reduce` (fp64), the contract: same
  signature, same :class:`CrossBatch` (``n``, tuple counts exactly; sums within a per-dtype
  tolerance);
* an explicit fp64 reference written here from the inputs upcast to fp64: ``c_i`` as a loop over
  each sample's unmasked positions of ``outer(q_t, φ(W_in z_t))``; ``Σ|c_i|²``; and the tuple sums
  by loops over ordered distinct pairs, triples and pairs of disjoint pairs; the same loops over
  absolute values give the scale of each sum.

Inputs: random (seeded per test), odd shapes (d, d_in, r not multiples of the 16-wide blocks),
T = 1, B = 1, fully masked samples, an all-masked batch, non-contiguous grad / act / w_in, every
input dtype, mixed dtypes, and ``override_config`` forcing several chunks, splits and items at
tiny sizes. Tolerances: products are fp32 for non-fp64 inputs, so ``2e-6`` of each quantity's
scale; fp64 inputs run in fp64: ``1e-12``.

On a GPU the fp32 products are ``tf32x3`` (~fp32 error); the interpreter's ``tl.dot`` is an exact
fp32 numpy matmul whatever the precision, so here the tolerance is that of fp32 products. A test
records the launches and checks each stage asks for ``tf32x3`` (fp32 compute) or ``ieee`` (fp64),
the precisions docs/design.md allows.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from fused_stats import FusedStatsError
from fused_stats.kernels import cross as cross_kernel
from fused_stats.kernels import cross_reduce
from fused_stats.kernels._common import override_config
from fused_stats.ops import cross_twin

F64 = torch.float64
TOL = {torch.float32: 2e-6, torch.float16: 2e-6, torch.bfloat16: 2e-6, torch.float64: 1e-12}
PHI = {
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "relu": lambda x: x.clamp_min(0),
    "silu": lambda x: x * torch.sigmoid(x),
    "tanh": torch.tanh,
    "identity": lambda x: x,
    "constant": torch.ones_like,
}


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def reference(grad, act, mask, w_in, activation, unit, group_size):
    """Explicit fp64 reference (module docstring): dict of sums and their absolute scales."""
    B, T, d = grad.shape
    q, z, w = grad.to(F64), act.to(F64), w_in.to(F64)
    keep = torch.ones(B, T, dtype=torch.bool) if mask is None else mask.bool()
    cs = []
    for b in range(B):
        ts = [t for t in range(T) if keep[b, t]]
        outers = [torch.outer(q[b, t], PHI[activation](w @ z[b, t])) for t in ts]
        if unit == "sample" and outers:
            cs.append(sum(outers))
        elif unit == "position":
            cs.extend(outers)
    n = len(cs)
    r = w.shape[0]
    flat = torch.stack([c.reshape(-1) for c in cs]) if n else torch.zeros(0, d * r, dtype=F64)
    out = {
        "n": n,
        "c_sum": flat.sum(0).reshape(d, r),
        "sq_norm_sum": (flat * flat).sum(),
        "u2": 0.0,
        "u3": 0.0,
        "u4": 0.0,
        "s2": 0.0,
        "s3": 0.0,
        "s4": 0.0,
        "a1": 0.0,
        "p": [0, 0, 0],
    }
    for g0 in range(0, n, group_size):
        k = (flat[g0 : g0 + group_size] @ flat[g0 : g0 + group_size].T).tolist()
        m = len(k)
        pairs = [(i, j) for i in range(m) for j in range(m) if i != j]
        out["u2"] += sum(k[i][j] ** 2 for i, j in pairs)
        out["s2"] += sum(k[i][j] ** 2 for i, j in pairs)
        out["a1"] += sum(abs(k[i][j]) for i, j in pairs)
        triples = [(i, j, h) for i, j in pairs for h in range(m) if h not in (i, j)]
        out["u3"] += sum(k[i][j] * k[j][h] for i, j, h in triples)
        out["s3"] += sum(abs(k[i][j] * k[j][h]) for i, j, h in triples)
        quads = [(a, b) for a in pairs for b in pairs if len({*a, *b}) == 4]
        out["u4"] += sum(k[a[0]][a[1]] * k[b[0]][b[1]] for a, b in quads)
        out["s4"] += sum(abs(k[a[0]][a[1]] * k[b[0]][b[1]]) for a, b in quads)
        out["p"] = [out["p"][0] + len(pairs), out["p"][1] + len(triples), out["p"][2] + len(quads)]
    return out


def check(got, ref, twin, tol, what):
    assert got.n == ref["n"] == twin.n, what
    assert [got.p2, got.p3, got.p4] == ref["p"] == [twin.p2, twin.p3, twin.p4], what
    cscale = max(float(ref["c_sum"].abs().max()) if ref["c_sum"].numel() else 0.0, 1e-300)
    for which in (twin.c_sum, ref["c_sum"]):
        torch.testing.assert_close(
            got.c_sum, which.to(F64), rtol=0, atol=tol * cscale, msg=lambda m: f"{what} c_sum: {m}"
        )
    sq_scale = max(float(ref["sq_norm_sum"]), 1e-300)
    # the twin forms u3, u4 by cancellation from sums over all pairs (|Σ_pairs k|² and the like),
    # so (Σ_pairs |k|)² bounds their rounding even where no triple or 4-tuple exists
    floor = max(ref["a1"] ** 2, 1e-300)
    for key, scale in (
        ("sq_norm_sum", sq_scale),
        ("u2", max(ref["s2"], 1e-300)),
        ("u3", max(ref["s3"], floor)),
        ("u4", max(ref["s4"], floor)),
    ):
        g = float(getattr(got, key))
        for want in (float(getattr(twin, key)), float(ref[key])):
            assert abs(g - want) <= 2 * tol * scale, f"{what} {key}: {g!r} vs {want!r} (scale {scale:.3g})"


def inputs(gen, B, T, d, din, r, dtype, mask="random", w_dtype=None):
    grad = torch.randn(B, T, d, generator=gen).to(dtype)
    act = (0.5 + torch.randn(B, T, din, generator=gen)).to(dtype)
    w = (torch.randn(r, din, generator=gen, dtype=F64) / math.sqrt(din)).to(
        w_dtype or (F64 if dtype == F64 else torch.float32)
    )
    m = None
    if mask == "random":
        m = torch.rand(B, T, generator=gen) > 0.3
        m[0, 0] = True
        if B > 2:
            m[1] = False  # a sample with no counted position is not a sample
    return grad, act, m, w


def run_case(grad, act, m, w, activation, unit, group_size, what, tol=None, **overrides):
    with override_config(**overrides):
        got = cross_reduce(grad, act, m, w, activation, unit, group_size)
    twin = cross_twin.cross_reduce(grad, act, m, w, activation, unit, group_size)
    ref = reference(grad, act, m, w, activation, unit, group_size)
    dtypes = {grad.dtype, act.dtype, w.dtype}
    check(got, ref, twin, tol or (1e-12 if F64 in dtypes else 2e-6), what)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("unit", ["sample", "position"])
def test_dtypes_units_masks(dtype, unit, gen):
    grad, act, m, w = inputs(gen, 5, 7, 19, 13, 17, dtype)
    # one group per chunk and 3 positions per item: several chunks, items and splits at tiny sizes
    run_case(
        grad,
        act,
        m,
        w,
        "gelu",
        unit,
        4,
        f"{unit} {dtype}",
        cross_chunk_groups=1,
        cross_item_rows=3,
        cross_splits=2,
    )


@pytest.mark.parametrize("activation", ["relu", "silu", "tanh", "identity", "constant"])
def test_activations(activation, gen):
    grad, act, m, w = inputs(gen, 4, 5, 18, 17, 3, torch.float32)
    unit = "position" if activation in ("tanh", "constant") else "sample"
    run_case(grad, act, m, w, activation, unit, 5, activation)


@pytest.mark.parametrize("case", ["T1", "B1_sample", "B1_position", "one_group", "r1_big_group"])
def test_edge_shapes(case, gen):
    if case == "T1":
        args, unit, gs = (6, 1, 9, 9, 5), "sample", 4
    elif case == "B1_sample":
        args, unit, gs = (1, 9, 10, 6, 4), "sample", 4
    elif case == "B1_position":
        args, unit, gs = (1, 9, 10, 6, 4), "position", 4
    elif case == "one_group":
        args, unit, gs = (6, 3, 7, 7, 5), "sample", 256
    else:
        args, unit, gs = (7, 2, 5, 3, 1), "position", 256
    grad, act, m, w = inputs(gen, *args, torch.float32, mask="random" if case != "T1" else None)
    run_case(grad, act, m, w, "gelu", unit, gs, case)


def test_non_contiguous_inputs(gen):
    g_big = torch.randn(9, 6, 2 * 11, generator=gen)
    grad = g_big.transpose(0, 1)[:, :, ::2]  # (6, 9, 11), strides (22, 132, 2)
    act = torch.randn(6, 9, 3 * 8, generator=gen)[:, :, 1::3]  # (6, 9, 8)
    w = torch.randn(8, 5, generator=gen).T  # (5, 8) transposed view
    m = (torch.rand(9, 6, generator=gen) > 0.4).T  # (6, 9) non-contiguous mask
    assert not (grad.is_contiguous() or act.is_contiguous() or w.is_contiguous() or m.is_contiguous())
    for unit in ("sample", "position"):
        run_case(grad, act, m, w, "silu", unit, 4, f"non-contiguous {unit}")


def test_mixed_dtypes_run_in_fp64(gen):
    grad = torch.randn(4, 5, 9, generator=gen).to(torch.bfloat16)
    act = torch.randn(4, 5, 6, generator=gen)
    w = torch.randn(3, 6, generator=gen, dtype=F64)
    run_case(grad, act, None, w, "gelu", "sample", 4, "bf16/fp32/fp64", tol=1e-12)


def test_nan_at_masked_positions_never_read(gen):
    grad, act, m, w = inputs(gen, 4, 6, 7, 7, 3, torch.float32)
    m[:, -1] = False
    grad[:, -1] = float("nan")
    act[:, -1] = float("inf")
    got = run_case(grad, act, m, w, "gelu", "sample", 4, "NaN at padding")
    assert torch.isfinite(got.c_sum).all()


def test_empty_batches(gen):
    grad, act, _, w = inputs(gen, 3, 4, 5, 5, 2, torch.float32, mask=None)
    for unit in ("sample", "position"):
        got = cross_reduce(grad, act, torch.zeros(3, 4, dtype=torch.bool), w, "gelu", unit)
        assert got.n == 0 and float(got.c_sum.abs().sum()) == 0 and float(got.sq_norm_sum) == 0
        got = cross_reduce(grad[:0], act[:0], None, w, "gelu", unit)
        assert got.n == 0 and got.c_sum.shape == (5, 2)


def test_bad_input(gen, monkeypatch):
    grad, act, m, w = inputs(gen, 3, 4, 5, 6, 2, torch.float32)
    with pytest.raises(FusedStatsError, match="act has shape"):
        cross_reduce(grad, act[:, :3], m, w, "gelu", "sample")
    with pytest.raises(FusedStatsError, match="mask has shape"):
        cross_reduce(grad, act, m[:, :2], w, "gelu", "sample")
    with pytest.raises(FusedStatsError, match="activation"):
        cross_reduce(grad, act, m, w, "softplus", "sample")
    with pytest.raises(FusedStatsError, match="unit"):
        cross_reduce(grad, act, m, w, "gelu", "flat")
    with pytest.raises(FusedStatsError, match="3 dimensions"):
        cross_reduce(grad[0], act, m, w, "gelu", "sample")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(FusedStatsError, match="TRITON_INTERPRET"):
        cross_reduce(grad, act, m, w, "gelu", "sample")


def test_cross_stats_on_triton_backend_equals_torch(gen):
    """The accumulator through ops dispatch: backend='triton' (interpreter) vs 'torch'."""
    from fused_stats.accumulators.cross_stats import CrossStats

    w = torch.randn(4, 6, generator=gen) / 3
    accs = {b: CrossStats(6, w, "gelu", backend=b, group_size=5) for b in ("torch", "triton")}
    for _ in range(3):
        grad, act, m, _ = inputs(gen, 7, 3, 6, 6, 4, torch.float32)
        for acc in accs.values():
            acc.update(grad, act, m)
    a, b = accs["torch"], accs["triton"]
    assert a.n == b.n and a.p == b.p
    assert b.cross_frob2() == pytest.approx(
        a.cross_frob2(), rel=1e-5, abs=1e-6 * float(a.sq_norm_sum) / a.n**2
    )
    sa, sb = a.saturation(), b.saturation()
    assert sb.cross_frob2_se_null == pytest.approx(sa.cross_frob2_se_null, rel=1e-5)


def test_gpu_check_cross_section_dry_run(tmp_path):
    """bench/gpu_check.py's cross section (the kernel's time beside the twin's, both units) runs
    with this kernel on CPU at its dry-run sizes (the script's own dry-run test skips this section;
    the kernel's correctness on a GPU is tests/test_gpu_kernels.py's)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_for_cross", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(["--dry-run", "--out", str(tmp_path)])
    out = module.section_cross(module.Run(args, tmp_path / "gpu_check.json"), module.Ctx(args))
    B, T, _, r = out["shape"]
    assert r == 8 and B * T >= 24, out
    for unit in ("sample", "position"):
        entry = out[unit]
        assert entry["ms"] > 0 and entry["twin_eager_ms"] > 0 and entry["gemm_TFLOPs"] > 0, out


@pytest.mark.parametrize(
    "dtypes", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.float32, F64)]
)
def test_launches_ask_for_tf32x3_or_fp64(dtypes, gen, monkeypatch):
    """Both stages, both units: fp32 compute (bf16 or fp32 grad/act, fp32 W_in) launches with
    ``PRECISION="tf32x3"``, any fp64 input with fp64 ``ieee`` products; never plain ``tf32``. The
    fp32-grad / fp64-``W_in`` case also checks (against the fp64 references at 1e-12) that the
    ``position`` unit's ``Σ |q_t|² |φ_t|²`` is fp64 then, not an fp32 Gram of ``q``."""
    io, w_dtype = dtypes
    seen = []
    real_launch = cross_kernel.launch

    def spy(kern, grid, device, *args, **meta):
        seen.append((kern, meta["DOT_DTYPE"], meta["PRECISION"]))
        return real_launch(kern, grid, device, *args, **meta)

    monkeypatch.setattr(cross_kernel, "launch", spy)
    grad, act, m, w = inputs(gen, 3, 4, 6, 5, 3, io, w_dtype=w_dtype)
    for unit in ("sample", "position"):
        run_case(grad, act, m, w, "gelu", unit, 4, f"{dtypes} {unit}")
    want = ("ieee", "fp64") if F64 in dtypes else ("tf32x3", "fp32")
    assert {id(k) for k, _, _ in seen} == {id(cross_kernel._phi_kernel), id(cross_kernel._cross_kernel)}
    assert {(p, str(d)) for _, d, p in seen} == {want}, seen
