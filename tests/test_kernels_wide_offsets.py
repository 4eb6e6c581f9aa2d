"""Element offsets past 2^31 and the NaN rule of ``max |q|``, through Triton's interpreter on CPU.

Offsets. A stride below 2^31 times an index can pass 2^31 (a position stride of a ``(T, B, d)``
buffer viewed as ``(B, T, d)``, a transposed operand's feature stride); in int32 that product wraps.
The inputs here are tiny views (a few elements) whose strides are about 2^30 elements, so that the
second or third index reaches past 2^31: every stride product the kernels form (position, mask and
feature strides of capture-reduce, both stages; the feature strides of both Gram operands and of
the cross kernel's activation and ``W_in``) is exercised. The views start 2^31 elements into their
storage, so a wrapped (negative) offset would still point inside the allocation and show up as a
wrong value rather than a crash. The storage is allocated with ``torch.empty`` and never touched
beyond the view's elements, so it costs virtual address space only (the interpreter passes CPU
storages through without copying them). The reference is each kernel's torch twin on the same view.

NaN. ``max |q|`` is NaN when a counted row's ``|q|`` is NaN, as the twin's ``max`` is, whatever
``tl.maximum`` does with NaN on the stack at hand (compiled code and Triton 3.9's interpreter drop
it, as ``fmax`` does).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from fused_stats.kernels import capture_reduce, cross_reduce, gram_rows
from fused_stats.kernels._common import override_config
from fused_stats.ops import cross_twin, torch_twin

F64 = torch.float64
WRAP = 2**31
BIG = 2**30 + 16  # fits int32; twice it does not


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def far_view(shape, strides, gen, dtype=torch.float16):
    """A view of ``shape``/``strides`` filled with random values, starting 2^31 elements into an
    otherwise untouched storage (module docstring)."""
    extent = sum((n - 1) * s for n, s in zip(shape, strides)) + 1
    assert extent > WRAP, "the view must reach past 2^31 elements"
    storage = torch.empty(WRAP + extent, dtype=dtype)
    view = storage.as_strided(shape, strides, WRAP)
    if dtype == torch.bool:
        view.copy_(torch.rand(shape, generator=gen) > 0.3)
    else:
        view.copy_(torch.randn(shape, generator=gen).to(dtype))
    return view


def _same_as_twin(g, mask, unit, **config):
    c = torch.zeros(g.shape[-1], dtype=F64)
    with override_config(**config):
        got = capture_reduce(g, mask, c, unit)
    want = torch_twin.capture_reduce(g, mask, c, unit)
    assert got.n == want.n
    assert torch.equal(got.valid, want.valid)
    for field in ("rows", "s", "t", "a1", "a2", "norm_max", "norm_sum"):
        torch.testing.assert_close(getattr(got, field).to(F64), getattr(want, field), rtol=1e-5, atol=1e-6)


def test_capture_position_stride_past_2_31(gen):
    """unit="sample" summed in the row kernel (T < 16): position index times position stride."""
    g = far_view((2, 3, 4), (4, BIG, 1), gen)
    _same_as_twin(g, None, "sample")


def test_capture_mask_position_stride_past_2_31(gen):
    g = torch.randn(2, 3, 4, generator=gen).to(torch.float16)
    mask = far_view((2, 3), (1, BIG), gen, dtype=torch.bool)
    # sample 0 exists only through its last position, whose mask offset is past 2^31
    mask.copy_(torch.tensor([[False, False, True], [True, False, True]]))
    _same_as_twin(g, mask, "sample")


@pytest.mark.parametrize("unit", ["sample", "position"])
def test_capture_feature_stride_past_2_31(unit, gen):
    g = far_view((2, 2, 3), (3, 6, BIG), gen)
    _same_as_twin(g, None, unit)
    # the two-pass path over d (the same load, in d-chunks)
    _same_as_twin(g, None, unit, capture_single_chunk_max_d=2, capture_chunk_d=2)


def test_capture_stage_one_feature_stride_past_2_31(gen):
    """unit="sample" with T >= 16: stage 1 (the positions kernel) reads with the feature stride."""
    g = far_view((1, 16, 3), (48, 3, BIG), gen)
    _same_as_twin(g, None, "sample", capture_splits=2)


def test_gram_feature_strides_past_2_31(gen):
    new = far_view((2, 3), (1, BIG), gen)
    pool = far_view((3, 3), (1, BIG), gen)
    got = gram_rows(new, pool)
    torch.testing.assert_close(got, torch_twin.gram_rows(new, pool), rtol=1e-5, atol=1e-6)


def test_cross_activation_and_weight_feature_strides_past_2_31(gen):
    grad = torch.randn(2, 2, 3, generator=gen).to(torch.float16)
    act = far_view((2, 2, 3), (3, 6, BIG), gen)
    w_far = far_view((2, 3), (1, BIG), gen)
    for w in (w_far, w_far.contiguous()):  # the activation's stride alone, then with W_in's
        for unit in ("sample", "position"):
            got = cross_reduce(grad, act, None, w, "identity", unit, 2)
            want = cross_twin.cross_reduce(grad, act, None, w, "identity", unit, 2)
            assert got.n == want.n
            torch.testing.assert_close(got.c_sum, want.c_sum, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got.sq_norm_sum, want.sq_norm_sum, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("unit", ["sample", "position"])
@pytest.mark.parametrize("config", [{}, {"capture_single_chunk_max_d": 4, "capture_chunk_d": 4}])
def test_norm_max_is_nan_when_a_counted_norm_is(unit, config, gen):
    g = torch.randn(3, 4, 9, generator=gen)
    g[1, 2, 5] = float("nan")
    c = torch.zeros(9, dtype=F64)
    with override_config(capture_programs=2, **config):  # the NaN row in one program of two
        got = capture_reduce(g, None, c, unit)
    want = torch_twin.capture_reduce(g, None, c, unit)
    assert math.isnan(float(want.norm_max))  # the twin's rule
    assert math.isnan(float(got.norm_max)), float(got.norm_max)
    # without the NaN, the same maximum as the twin
    g[1, 2, 5] = 0.0
    with override_config(capture_programs=2, **config):
        got = capture_reduce(g, None, c, unit)
    want = torch_twin.capture_reduce(g, None, c, unit)
    assert float(got.norm_max) == pytest.approx(float(want.norm_max), rel=1e-6)
