"""Every Triton kernel against its torch twin and against plain-loop references, on CPU through
Triton's interpreter.

References:

* the torch twin (:mod:`fused_stats.ops.torch_twin`, fp64) -- the contract: same signature, same
  result within a per-dtype tolerance;
* independent ones: ``reference.per_sample_vectors`` (explicit loops over samples and positions)
  for the capture sums, and fp64 ``sum_k y_k y_k^T`` / row-by-row dot products for the GEMMs.

Inputs are random (seeded per test), of odd shapes: ``d`` not a multiple of any block, ``T = 1``,
``B = 1``, fully masked samples, non-contiguous grads (transposed, strided slices, expanded masks),
fp32 / fp16 / bf16 / fp64. The interpreter runs with tiny block sizes (see ``_common``) and
``override_config`` forces the other code paths (two-pass over ``d``, stage-1 position splits,
split-K) at these sizes.

Tolerances: for fp32/fp16/bf16 inputs the kernels compute in fp32 (16-bit values are exact in fp32),
so errors are fp32 rounding of sums of a few dozen terms: ``rtol = 2e-6`` relative to each
quantity's scale (4e-6 for the fourth-power sum). fp64 inputs are computed in fp64: ``1e-12``.

The interpreter flag: these kernels are :class:`fused_stats.kernels._triton_compat.DualKernel` objects, so
they run under the interpreter whatever the order in which Triton and the package were imported;
``TRITON_INTERPRET=1`` is set per test (monkeypatch) only because the launchers, like the backend
resolver, require it before they take CPU tensors. One test repeats a check in a fresh child process
that sets the flag *before* importing Triton (Triton's standard library is then interpreted too).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from fused_stats import FusedStatsError
from fused_stats.kernels import (
    _common,
    capture_reduce,
    gram_rows,
    second_moment_update,
)
from fused_stats.kernels._common import override_config
from fused_stats.ops import torch_twin

from reference import per_sample_vectors

F64 = torch.float64
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
RTOL = {torch.float32: 2e-6, torch.float16: 2e-6, torch.bfloat16: 2e-6, torch.float64: 1e-12}
FIELDS = ("s", "t", "a1", "a2", "norm_max", "norm_sum")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _close(got, want, rtol, what):
    got = got.to(F64)
    want = want.to(F64)
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(
        got, want, rtol=rtol, atol=rtol * max(scale, 1e-30), msg=lambda m: f"{what}: {m}"
    )


def _reference_sums(q: torch.Tensor, centre: torch.Tensor) -> dict:
    """Batch sums from per-sample vectors ``q`` (fp64, valid samples only), by their definitions."""
    y = q - centre
    ysq = (y * y).sum(dim=1)
    qn = q.norm(dim=1)
    zero = torch.zeros((), dtype=F64)
    return dict(
        s=y.sum(0),
        t=(ysq[:, None] * y).sum(0),
        a1=ysq.sum(),
        a2=(ysq**2).sum(),
        norm_max=qn.max() if len(qn) else zero,
        norm_sum=qn.sum(),
    )


def _centre_for(g: torch.Tensor, gen) -> torch.Tensor:
    """A centre near the mean of the positions, fp32-representable (as the accumulator makes it)."""
    d = g.shape[-1]
    base = g.to(F64).reshape(-1, d).nan_to_num().mean(0)
    return (base + 0.1 * torch.randn(d, generator=gen, dtype=F64)).to(torch.float32).to(F64)


def _check_capture(g, mask, unit, gen, **config):
    dtype = g.dtype
    centre = _centre_for(g, gen)
    with override_config(**config):
        got = capture_reduce(g, mask, centre, unit)
    twin = torch_twin.capture_reduce(g, mask, centre, unit)
    rtol = RTOL[dtype]
    # the contract: the twin's result
    assert got.n == twin.n
    assert torch.equal(got.valid.cpu(), twin.valid.cpu())
    assert got.rows.shape == twin.rows.shape
    assert got.rows.dtype == (F64 if dtype == F64 else torch.float32)
    _close(got.rows, twin.rows, rtol, "rows")
    assert bool((got.rows[~got.valid] == 0).all()), "rows that are not samples must be exactly 0"
    for field in FIELDS:
        assert getattr(got, field).dtype == F64, field
        _close(getattr(got, field), getattr(twin, field), rtol * (2 if field == "a2" else 1), field)
    # independent: loops over samples and positions
    q = per_sample_vectors(g, mask, unit)
    assert got.n == q.shape[0]
    _close(got.rows[got.valid], q - centre, rtol, "rows vs loops")
    want = _reference_sums(q, centre)
    for field in FIELDS:
        _close(getattr(got, field), want[field], rtol * (2 if field == "a2" else 1), f"{field} vs loops")
    return got


def _mask(B, T, gen, empty_sample=True):
    m = torch.rand(B, T, generator=gen) > 0.35
    if empty_sample and B > 1:
        m[1] = False  # a sample with no unmasked position is not a sample
    return m


# ---------------------------------------------------------------------------- capture-reduce
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit", ["sample", "position"])
def test_capture_masked_odd_d(dtype, unit, gen):
    g = (torch.randn(3, 5, 37, generator=gen) + 2.0).to(dtype)
    _check_capture(g, _mask(3, 5, gen), unit, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_capture_single_sample_single_position(dtype, gen):
    g = torch.randn(1, 1, 19, generator=gen).to(dtype)
    for unit in ("sample", "position"):
        got = _check_capture(g, None, unit, gen)
        assert got.n == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit", ["sample", "position"])
def test_capture_non_contiguous(dtype, unit, gen):
    # stored (T, B, d') and viewed as (B, T, d) with a feature stride of 2 (a slice): no copy
    base = (torch.randn(4, 3, 2 * 29, generator=gen) - 1.0).to(dtype)
    g = base.transpose(0, 1)[:, :, ::2]
    assert not g.is_contiguous() and g.stride(2) == 2
    mask = _mask(3, 4, gen).T.contiguous().T  # column-major mask
    _check_capture(g, mask, unit, gen)
    # a per-sample mask broadcast over positions (stride 0), as GradStats passes (B,) masks
    _check_capture(g, torch.tensor([True, False, True]).reshape(3, 1).expand(3, 4), unit, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("unit", ["sample", "position"])
def test_capture_two_pass_over_d(dtype, unit, gen):
    """d larger than one block: rows are written, then re-read for t (the wide-row path)."""
    g = (torch.randn(3, 4, 70, generator=gen) + 0.5).to(dtype)
    _check_capture(g, _mask(3, 4, gen), unit, gen)  # interpreter: one block holds d <= 64
    _check_capture(g, None, unit, gen, capture_single_chunk_max_d=16, capture_chunk_d=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_capture_sample_unit_position_splits(dtype, gen):
    """unit="sample" with long sequences: stage 1 sums slices of positions, stage 2 the slices."""
    g = (torch.randn(2, 37, 23, generator=gen) + 1.0).to(dtype)
    mask = _mask(2, 37, gen, empty_sample=False)
    mask[0, 20:] = False  # whole slices of sample 0 are masked
    _check_capture(g, mask, "sample", gen)  # T >= 16: stage 1 chosen automatically
    _check_capture(g, mask, "sample", gen, capture_splits=5)
    _check_capture(g, None, "sample", gen, capture_splits=3, capture_single_chunk_max_d=8, capture_chunk_d=8)
    _check_capture(g[:1], mask[:1], "sample", gen, capture_splits=0)  # summed in the row kernel


def test_capture_persistent_programs(gen):
    """More row blocks than programs: each program loops over several blocks."""
    g = torch.randn(9, 3, 21, generator=gen)
    _check_capture(g, _mask(9, 3, gen), "position", gen, capture_programs=2, capture_block_r=2)


@pytest.mark.parametrize("unit", ["sample", "position"])
def test_capture_all_masked_and_empty(unit, gen):
    g = torch.randn(2, 3, 11, generator=gen)
    got = _check_capture(g, torch.zeros(2, 3, dtype=torch.bool), unit, gen)
    assert got.n == 0 and float(got.a1) == 0.0 and float(got.norm_max) == 0.0
    empty = capture_reduce(torch.randn(0, 3, 11, generator=gen), None, torch.zeros(11, dtype=F64), unit)
    assert empty.n == 0 and empty.rows.shape == (0, 11)


def test_capture_nan_at_masked_positions_does_not_leak(gen):
    g = torch.randn(3, 6, 13, generator=gen)
    mask = _mask(3, 6, gen)
    g[~mask] = float("nan")
    for unit in ("sample", "position"):
        got = _check_capture(g, mask, unit, gen)
        assert bool(torch.isfinite(got.rows).all()) and bool(torch.isfinite(got.a2))


def test_capture_nan_at_counted_position_shows_in_sums(gen):
    g = torch.randn(2, 3, 9, generator=gen)
    g[0, 1, 4] = float("nan")
    got = capture_reduce(g, None, torch.zeros(9, dtype=F64), "sample")
    assert not bool(torch.isfinite(got.a1)) and not bool(torch.isfinite(got.norm_sum))


def test_capture_float_mask_and_deterministic(gen):
    g = torch.randn(4, 5, 33, generator=gen)
    fmask = (torch.rand(4, 5, generator=gen) > 0.5).to(torch.float32)
    a = _check_capture(g, fmask, "sample", gen)
    c = torch.zeros(33, dtype=F64)
    first = capture_reduce(g, fmask, c, "position")
    second = capture_reduce(g, fmask, c, "position")
    for field in ("rows",) + FIELDS:
        assert torch.equal(getattr(first, field), getattr(second, field)), field
    assert a.n == int(fmask.bool().any(1).sum())


def test_capture_rejects_bad_input(gen):
    g = torch.randn(2, 3, 8, generator=gen)
    c = torch.zeros(8, dtype=F64)
    with pytest.raises(FusedStatsError, match="unit"):
        capture_reduce(g, None, c, "flat")
    with pytest.raises(FusedStatsError, match=r"mask has shape \(3, 2\)"):
        capture_reduce(g, torch.ones(3, 2, dtype=torch.bool), c, "sample")
    with pytest.raises(FusedStatsError, match="centre"):
        capture_reduce(g, None, torch.zeros(7, dtype=F64), "sample")
    with pytest.raises(FusedStatsError, match="3 dimensions"):
        capture_reduce(g[0], None, c, "sample")
    with pytest.raises(FusedStatsError, match="floating-point"):
        capture_reduce(g.to(torch.int32), None, c, "sample")


def test_cpu_tensors_need_the_interpreter_flag(monkeypatch, gen):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(FusedStatsError, match="TRITON_INTERPRET"):
        capture_reduce(torch.randn(2, 3, 8, generator=gen), None, torch.zeros(8, dtype=F64), "sample")


# ---------------------------------------------------------------------------- second moment
def _random_symmetric(d, gen):
    a = torch.randn(d, d, generator=gen, dtype=F64)
    return a + a.T


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [{}, {"syrk_splits": 3}], ids=["one-pass", "split-k"])
def test_second_moment_against_twin_and_outer_products(dtype, config, gen):
    rows = (torch.randn(45, 37, generator=gen) + 0.3).to(dtype)
    S0 = _random_symmetric(37, gen)
    S = S0.clone()
    ptr = S.data_ptr()
    with override_config(**config):
        second_moment_update(S, rows)
    assert S.data_ptr() == ptr, "S must be updated in place"
    twin = S0.clone()
    torch_twin.second_moment_update(twin, rows)
    y = rows.to(F64)
    loops = S0.clone()
    for k in range(y.shape[0]):  # independent: one outer product per row
        loops += torch.outer(y[k], y[k])
    delta = S - S0
    rtol = {torch.float64: 1e-12}.get(dtype, 2e-6)
    _close(delta, twin - S0, rtol, "S - S0 vs twin")
    _close(delta, loops - S0, rtol, "S - S0 vs outer products")
    assert torch.equal(S, S.T), "the update must keep S exactly symmetric"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_second_moment_odd_shapes_and_strides(dtype, gen):
    for R, d in ((1, 19), (3, 1), (17, 16)):
        rows = torch.randn(R, d, generator=gen).to(dtype)
        S = _random_symmetric(d, gen)
        want = S + rows.to(F64).T @ rows.to(F64)
        second_moment_update(S, rows)
        _close(S, want, 2e-6, f"R={R} d={d}")
    # rows as a transposed view (column-major), S non-contiguous too
    rows = torch.randn(23, 40, generator=gen).to(dtype).T.contiguous().T[:, 3:]
    big = _random_symmetric(74, gen)
    S = big[::2, ::2]
    want = S.clone() + rows.to(F64).T @ rows.to(F64)
    second_moment_update(S, rows)
    _close(big[::2, ::2], want, 2e-6, "strided S / rows")


def test_second_moment_empty_and_rejected(gen):
    S = _random_symmetric(5, gen)
    before = S.clone()
    second_moment_update(S, torch.zeros(0, 5))
    assert torch.equal(S, before)
    with pytest.raises(FusedStatsError, match="float64"):
        second_moment_update(S.to(torch.float32), torch.randn(3, 5, generator=gen))
    with pytest.raises(FusedStatsError, match=r"\(6, 6\)"):
        second_moment_update(S, torch.randn(3, 6, generator=gen))
    assert torch.equal(S, before), "a rejected update must leave S unchanged"


def test_second_moment_deterministic(gen):
    rows = torch.randn(50, 33, generator=gen)
    S1 = torch.zeros(33, 33, dtype=F64)
    S2 = torch.zeros(33, 33, dtype=F64)
    with override_config(syrk_splits=4):
        second_moment_update(S1, rows)
        second_moment_update(S2, rows)
    assert torch.equal(S1, S2)


# ---------------------------------------------------------------------------- Gram rows
@pytest.mark.parametrize("dtype", DTYPES)
def test_gram_rows_against_twin_and_dot_products(dtype, gen):
    new = torch.randn(5, 37, generator=gen).to(dtype)
    pool = torch.randn(23, 50, generator=gen).to(dtype)[:, 5:42]  # strided rows
    got = gram_rows(new, pool)
    assert got.dtype == F64 and got.shape == (5, 23)
    rtol = {torch.float64: 1e-12}.get(dtype, 2e-6)
    _close(got, torch_twin.gram_rows(new, pool), rtol, "gram vs twin")
    a, b = new.to(F64), pool.to(F64)
    loops = torch.tensor(
        [[float(a[i] @ b[j]) for j in range(b.shape[0])] for i in range(a.shape[0])], dtype=F64
    )
    _close(got, loops, rtol, "gram vs dot products")


def test_gram_rows_mixed_dtypes_and_edges(gen):
    new = torch.randn(4, 21, generator=gen, dtype=F64)
    pool = torch.randn(9, 21, generator=gen).to(torch.bfloat16)
    _close(gram_rows(new, pool), new @ pool.to(F64).T, 1e-12, "fp64 x bf16 is computed in fp64")
    half = torch.randn(3, 21, generator=gen).to(torch.float16)
    _close(gram_rows(half, pool), half.to(F64) @ pool.to(F64).T, 2e-6, "fp16 x bf16")
    one = gram_rows(new[:1].T.contiguous().T, pool[:1])
    _close(one, new[:1] @ pool[:1].to(F64).T, 1e-12, "B = N = 1")
    assert gram_rows(new, pool[:0]).shape == (4, 0)
    assert gram_rows(new[:0], pool).shape == (0, 9)
    with pytest.raises(FusedStatsError, match="features"):
        gram_rows(new, torch.randn(3, 20, generator=gen))


# ---------------------------------------------------------------------------- interpreter plumbing
def test_kernels_are_compilable_objects_run_by_the_interpreter_on_cpu():
    from triton.runtime.jit import JITFunction

    from fused_stats.kernels import capture, gram, second_moment

    for k in (
        capture._capture_rows_kernel,
        capture._sum_positions_kernel,
        second_moment._syrk_upper_kernel,
        gram._gram_kernel,
    ):
        assert isinstance(k, JITFunction)  # what the compiler and the AOT gate need
        assert k.on(torch.device("cpu")) is k.interpreted
        assert k.on(torch.device("cuda")) is k


def test_interpreter_when_flag_set_before_triton_import():
    """In a child process that sets TRITON_INTERPRET=1 before anything imports Triton."""
    code = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from fused_stats.kernels import capture_reduce, second_moment_update
        from fused_stats.ops import torch_twin
        g = torch.Generator().manual_seed(3)
        x = torch.randn(3, 4, 10, generator=g)
        c = torch.zeros(10, dtype=torch.float64)
        a = capture_reduce(x, None, c, "sample")
        b = torch_twin.capture_reduce(x, None, c, "sample")
        assert torch.allclose(a.t, b.t, rtol=1e-5, atol=1e-5), (a.t, b.t)
        S = torch.zeros(10, 10, dtype=torch.float64)
        second_moment_update(S, a.rows)
        assert torch.allclose(S, b.rows.T @ b.rows, rtol=1e-5, atol=1e-5)
        print("child-ok")
    """)
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "child-ok" in out.stdout, out.stderr[-3000:]


def test_config_override_is_restored():
    with override_config(capture_block_r=2):
        assert _common.config_value("capture_block_r", 7) == 2
    assert _common.config_value("capture_block_r", 7) == 7
