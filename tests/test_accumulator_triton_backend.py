"""``GradStats(backend="triton")`` against ``GradStats(backend="torch")`` fed the same batches, and
against the exact brute-force U-statistics, on CPU through Triton's interpreter.

The Triton path computes each batch in fp32 (centred at an fp32-representable centre) and keeps fp64
totals; the torch path is fp64 throughout. Both see the same fp32 (or bf16) inputs, so the only
difference is fp32 arithmetic on centred values: the estimates agree to ``1e-5`` relative even at a
mean 100 x the noise (docs/design.md, section 2), and the states to a few fp32 ulps of their scale.
References: the torch backend (the contract) and ``reference.brute_force_targets`` (exact rational
U-statistics over ordered tuples of distinct samples of the loop-built per-sample vectors).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import fused_stats as fs
from fused_stats import FusedStatsError

from reference import (
    TARGETS,
    assert_state_identical,
    assert_targets_close,
    brute_force_targets,
    draw,
    per_sample_vectors,
    population,
    snapshot,
)

F64 = torch.float64
EST_RTOL = 1e-5


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _batches(gen, regime, shape, n_batches, dtype=torch.float32, masked=True):
    d = shape[-1]
    mu, L = population(d, regime, gen)
    out = []
    for _ in range(n_batches):
        g = draw(shape[:-1], mu, L, gen).to(dtype)
        m = None
        if masked and len(shape) == 3:
            m = torch.rand(shape[:2], generator=gen) > 0.3
            m[0, 0] = True  # at least one counted position
        out.append((g, m))
    return out


def _feed(batches, unit, **kwargs):
    accs = {
        b: fs.GradStats(
            batches[0][0].shape[-1] if unit != "flat" else batches[0][0][0].numel(), backend=b, **kwargs
        )
        for b in ("triton", "torch")
    }
    for g, m in batches:
        for acc in accs.values():
            acc.update(g, m, unit=unit)
    return accs["triton"], accs["torch"]


def _assert_states_close(tri, ref, rtol=2e-6):
    assert tri.n == ref.n and tri.mode == ref.mode
    # the first batch's mean, rounded to fp32: from fp32 (kernel) or fp64 (twin) sums it may land
    # on neighbouring fp32 values, so the two states can be centred a few fp32 ulps apart
    torch.testing.assert_close(tri.centre, ref.centre, rtol=0, atol=1e-6 * float(ref.centre.abs().max()))
    for key in (f.name for f in ref.FIELDS if f.name != "centre"):
        a, b = getattr(tri, key), getattr(ref, key)
        if b is None:
            assert a is None, key
            continue
        scale = float(b.abs().max()) if b.numel() else 1.0
        torch.testing.assert_close(
            a, b, rtol=rtol, atol=rtol * max(scale, 1e-30), msg=lambda m, key=key: f"{key}: {m}"
        )


def _assert_estimates_close(tri, ref, rtol=EST_RTOL):
    et, er = tri.estimate(), ref.estimate()
    assert et.n == er.n and et.dim == er.dim
    for key in TARGETS + ("ag_max", "ag_mean"):
        a, b = getattr(et, key), getattr(er, key)
        assert abs(a - b) <= rtol * abs(b), f"{key}: triton {a!r} vs torch {b!r}"


@pytest.mark.parametrize("second_moment", ["dense", "pool", "auto"])
@pytest.mark.parametrize("unit", ["sample", "position"])
def test_same_estimates_as_torch_backend(second_moment, unit, gen):
    batches = _batches(gen, "mean_like_noise", (5, 4, 13), 4)
    tri, ref = _feed(batches, unit, second_moment=second_moment)
    _assert_states_close(tri, ref)
    _assert_estimates_close(tri, ref)


def test_auto_switches_pool_to_dense_through_the_kernels(gen):
    # d = 6: auto keeps a pool of at most 3 samples, so the second batch folds it into dense
    # (second_moment_update on the fp64 pool rows, the fp64-MMA path)
    batches = _batches(gen, "mean_like_noise", (3, 2, 6), 3)
    tri, ref = _feed(batches, "position", second_moment="auto")
    assert tri.mode == "dense"
    _assert_states_close(tri, ref)
    _assert_estimates_close(tri, ref)


def test_mean_100x_noise_fp32_and_flat_unit(gen):
    """The regime where uncentred fp32 fails (docs/design.md, section 2); unit="flat" on an NCHW-like batch."""
    batches = _batches(gen, "mean_100x_noise", (6, 2, 3, 5), 3, masked=False)
    batches = [(g.reshape(6, 2, 3, 5), None) for g, _ in batches]
    tri, ref = _feed(batches, "flat", second_moment="dense")
    _assert_estimates_close(tri, ref)


def test_bf16_gradients(gen):
    batches = _batches(gen, "mean_like_noise", (4, 5, 11), 3, dtype=torch.bfloat16)
    tri, ref = _feed(batches, "sample", second_moment="pool")
    _assert_states_close(tri, ref)
    _assert_estimates_close(tri, ref)


def test_against_exact_brute_force(gen):
    """Independent of both backends: exact U-statistics of the loop-built per-sample vectors."""
    batches = _batches(gen, "mean_100x_noise", (4, 3, 7), 3)
    tri, _ = _feed(batches, "sample", second_moment="dense")
    q = torch.cat([per_sample_vectors(g, m, "sample") for g, m in batches])
    assert tri.n == q.shape[0] <= 12
    assert_targets_close(tri.estimate(), brute_force_targets(q), rel=EST_RTOL, context="triton backend")


def test_merge_equals_one_stream(gen):
    batches = _batches(gen, "mean_like_noise", (5, 3, 9), 4)
    one, _ = _feed(batches, "position", second_moment="dense")
    left, _ = _feed(batches[:2], "position", second_moment="dense")
    right, _ = _feed(batches[2:], "position", second_moment="dense")
    left.merge(right)
    _assert_estimates_close(left, one, rtol=1e-6)


def test_rejected_batch_leaves_state_unchanged(gen):
    batches = _batches(gen, "mean_like_noise", (3, 4, 8), 2)
    acc = fs.GradStats(8, second_moment="dense", backend="triton")
    acc.update(*batches[0])
    before, counters = snapshot(acc)
    bad = batches[1][0].clone()
    bad[1, 2, 3] = float("nan")
    mask = torch.ones(3, 4, dtype=torch.bool)
    with pytest.raises(FusedStatsError, match="non-finite"):
        acc.update(bad, mask)
    assert_state_identical(before, acc, counters, "NaN batch through the kernels")
    # a NaN only at a masked position is not a problem
    mask[1, 2] = False
    acc.update(bad, mask)
    assert acc.n == counters[0] + 3
