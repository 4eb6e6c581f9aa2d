"""Each torch twin refuses exactly what its Triton launcher refuses, with the same FusedStatsError;
``ops.cross_reduce`` dispatches by backend like the other ops.

For every op, a table of bad calls (wrong rank, integer dtype, non-tensor, mismatched shapes,
devices written as the meta device, unknown unit/activation, bad group size) is run through the
twin and through the launcher (CPU tensors under Triton's interpreter): both must raise
``FusedStatsError`` with the same message, and an in-place op (the second moment) must leave ``S``
unchanged. The dispatch test replaces each implementation by a recorder and checks which one
``fused_stats.ops`` calls for ``backend="torch"``, ``"triton"`` and ``"auto"`` (with
``FUSED_STATS_BACKEND``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from fused_stats import FusedStatsError, kernels, ops
from fused_stats.ops import cross_twin, torch_twin

F64 = torch.float64
META = torch.device("meta")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def capture_cases(gen):
    g = torch.randn(2, 3, 5, generator=gen)
    c = torch.randn(5, generator=gen, dtype=F64)
    return {
        "2-d grad": (g[0], None, c, "sample"),
        "integer grad": (g.to(torch.int32), None, c, "sample"),
        "grad not a tensor": (g.tolist(), None, c, "sample"),
        "unit flat": (g, None, c, "flat"),
        "centre of 4": (g, None, c[:4], "sample"),
        "centre a list": (g, None, c.tolist(), "sample"),
        "mask (3, 2)": (g, torch.ones(3, 2, dtype=torch.bool), c, "position"),
        "mask a list": (g, [[1, 1, 1], [1, 1, 1]], c, "sample"),
        "mask on meta": (g, torch.ones(2, 3, dtype=torch.bool, device=META), c, "sample"),
    }


def second_moment_cases(gen):
    rows = torch.randn(4, 5, generator=gen)
    S = torch.randn(5, 5, generator=gen, dtype=F64)
    return {
        "1-d rows": (S, rows[0]),
        "integer rows": (S, rows.to(torch.int64)),
        "S float32": (S.float(), rows),
        "S (6, 6)": (torch.randn(6, 6, generator=gen, dtype=F64), rows),
        "S 3-d": (S[None], rows),
        "S on meta": (S.to(META), rows),
    }


def gram_cases(gen):
    new = torch.randn(3, 5, generator=gen)
    pool = torch.randn(4, 5, generator=gen)
    return {
        "pool with 6 features": (new, torch.randn(4, 6, generator=gen)),
        "3-d new rows": (new[None], pool),
        "integer pool": (new, pool.to(torch.int32)),
        "pool on meta": (new, pool.to(META)),
        "pool not a tensor": (new, pool.tolist()),
    }


def cross_cases(gen):
    g = torch.randn(2, 3, 5, generator=gen)
    z = torch.randn(2, 3, 4, generator=gen)
    w = torch.randn(2, 4, generator=gen)
    m = torch.ones(2, 3, dtype=torch.bool)
    return {
        "act of 3 positions missing": (g, z[:, :2], m, w, "gelu", "sample", 8),
        "act width 3": (g, z[..., :3], m, w, "gelu", "sample", 8),
        "w_in 3-d": (g, z, m, w[None], "gelu", "sample", 8),
        "integer act": (g, z.to(torch.int32), m, w, "gelu", "sample", 8),
        "mask (2, 2)": (g, z, m[:, :2], w, "gelu", "sample", 8),
        "activation softplus": (g, z, m, w, "softplus", "sample", 8),
        "unit flat": (g, z, m, w, "gelu", "flat", 8),
        "group size 0": (g, z, m, w, "gelu", "position", 0),
        "group size True": (g, z, m, w, "gelu", "position", True),
        "act on meta": (g, z.to(META), m, w, "gelu", "sample", 8),
        "2-d grad": (g[0], z, m, w, "gelu", "sample", 8),
    }


OPS = {
    "capture_reduce": (capture_cases, torch_twin.capture_reduce, kernels.capture_reduce),
    "second_moment_update": (
        second_moment_cases,
        torch_twin.second_moment_update,
        kernels.second_moment_update,
    ),
    "gram_rows": (gram_cases, torch_twin.gram_rows, kernels.gram_rows),
    "cross_reduce": (cross_cases, cross_twin.cross_reduce, kernels.cross_reduce),
}


def message(fn, args) -> str:
    with pytest.raises(FusedStatsError) as info:
        fn(*args)
    return str(info.value)


@pytest.mark.parametrize("op", sorted(OPS))
def test_twin_and_launcher_refuse_the_same_input_the_same_way(op, gen):
    cases, twin, launcher = OPS[op]
    for name, args in cases(gen).items():
        before = [a.clone() if isinstance(a, torch.Tensor) and a.device != META else None for a in args]
        got_twin, got_kernel = message(twin, args), message(launcher, args)
        assert got_twin == got_kernel, f"{op}, {name}: twin says {got_twin!r}, launcher {got_kernel!r}"
        for a, b in zip(args, before):
            if b is not None:
                assert torch.equal(a, b), f"{op}, {name}: a rejected call changed an argument"


def test_valid_calls_still_agree(gen):
    """The checks refuse nothing valid: one call per op, twin vs launcher."""
    g = torch.randn(2, 3, 5, generator=gen)
    c = torch.randn(5, generator=gen, dtype=F64)
    m = torch.rand(2, 3, generator=gen) < 0.7
    a, b = torch_twin.capture_reduce(g, m, c, "position"), kernels.capture_reduce(g, m, c, "position")
    assert a.n == b.n and torch.allclose(a.s, b.s, rtol=1e-5, atol=1e-6)
    z, w = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 4, generator=gen)
    x = cross_twin.cross_reduce(g, z, m.float(), w, "tanh", "sample", 8)
    y = kernels.cross_reduce(g, z, m.float(), w, "tanh", "sample", 8)
    assert x.n == y.n and torch.allclose(x.c_sum, y.c_sum, rtol=1e-5, atol=1e-6)


def test_every_op_dispatches_by_backend(monkeypatch, gen):
    calls = []
    names = ("capture_reduce", "second_moment_update", "gram_rows", "cross_reduce")
    for name in names:
        for module, tag in (
            (torch_twin if name != "cross_reduce" else cross_twin, "torch"),
            (kernels, "triton"),
        ):
            monkeypatch.setattr(module, name, lambda *a, _t=tag, _n=name: calls.append((_n, _t)))
    g = torch.randn(2, 3, 5, generator=gen)
    rows = torch.randn(4, 5, generator=gen)

    def run_all(backend):
        ops.capture_reduce(g, None, torch.zeros(5, dtype=F64), "sample", backend)
        ops.second_moment_update(torch.zeros(5, 5, dtype=F64), rows, backend)
        ops.gram_rows(rows, rows, backend)
        ops.cross_reduce(g, g, None, torch.randn(2, 5, generator=gen), "gelu", "sample", 4, backend)

    for backend, want in (("torch", "torch"), ("triton", "triton"), ("auto", "torch")):
        calls.clear()
        run_all(backend)
        assert calls == [(n, want) for n in names], (backend, calls)
    monkeypatch.setenv("FUSED_STATS_BACKEND", "triton")
    calls.clear()
    run_all("auto")
    assert calls == [(n, "triton") for n in names], calls
