"""The CPU second moment through BLAS ``dsyrk`` (fused_stats.ops.cpu_blas): against fp64 references
on the same inputs, exact symmetry, run-to-run determinism, torch's thread setting, the fallback."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

import fused_stats as fs
from fused_stats.ops import cpu_blas, torch_twin

pytest.importorskip("scipy")
pytest.importorskip("threadpoolctl")

F64 = torch.float64


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The BLAS path is taken at one torch thread (fused_stats.ops.cpu_blas.MAX_TORCH_THREADS)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _symmetric(d, gen):
    a = torch.randn(d, d, generator=gen, dtype=F64)
    return a + a.T


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("R,d", [(700, 192), (130, 1024), (600, 257)])
def test_dsyrk_update_equals_fp64_reference(R, d):
    gen = torch.Generator().manual_seed(R + d)
    rows = torch.randn(R, d, generator=gen) + 0.3  # fp32, as a model's gradients
    S0 = _symmetric(d, gen)
    assert cpu_blas.takes_second_moment(S0, rows), "this size must take the BLAS path"
    S = S0.clone()
    ptr = S.data_ptr()
    torch_twin.second_moment_update(S, rows)
    assert S.data_ptr() == ptr, "S is updated in place"
    y = rows.double()  # the reference: fp64 upcast of the same fp32 rows, torch's GEMM
    assert _rel(S - S0, y.T @ y) < 1e-12
    assert torch.equal(S, S.T), "S stays exactly symmetric"
    # and the torch fallback (addmm) on the same inputs agrees to rounding
    fallback = S0.clone()
    fallback.addmm_(y.T, y)
    assert _rel(S, fallback) < 1e-13


def test_dsyrk_update_against_brute_force_outer_products():
    # exact reference: one outer product per row, accumulated in fp64 from a zero matrix, on rows
    # of small integers (every product and partial sum is exact in fp64, so equality is exact)
    gen = torch.Generator().manual_seed(3)
    d = cpu_blas.MIN_DIM
    R = cpu_blas.MIN_ROWS_TIMES_DIM // d + 5
    rows = torch.randint(-8, 9, (R, d), generator=gen).to(torch.float32)
    S = torch.zeros(d, d, dtype=F64)
    assert cpu_blas.takes_second_moment(S, rows)
    torch_twin.second_moment_update(S, rows)
    want = torch.zeros(d, d, dtype=F64)
    for k in range(R):
        want += torch.outer(rows[k].double(), rows[k].double())
    assert torch.equal(S, want)


def test_dsyrk_update_is_deterministic_across_runs_and_buffers():
    gen = torch.Generator().manual_seed(11)
    d, R = 320, 900
    rows = torch.randn(R, d, generator=gen, dtype=F64)
    S0 = _symmetric(d, gen)
    results = []
    for offset in range(3):  # rows and S at different memory offsets (alignment)
        store = torch.empty(R * d + offset, dtype=F64)
        shifted = store[offset:].view(R, d)
        shifted.copy_(rows)
        sstore = torch.empty(d * d + offset, dtype=F64)
        S = sstore[offset:].view(d, d)
        S.copy_(S0)
        torch_twin.second_moment_update(S, shifted)
        torch_twin.second_moment_update(S, shifted)
        results.append(S.clone())
    for a, b in itertools.combinations(results, 2):
        assert torch.equal(a, b)


def test_small_blocks_and_other_tensors_take_torch():
    gen = torch.Generator().manual_seed(1)
    d = 256
    S = torch.zeros(d, d, dtype=F64)
    assert not cpu_blas.takes_second_moment(S, torch.randn(8, d, generator=gen))  # small block
    assert not cpu_blas.takes_second_moment(
        torch.zeros(64, 64, dtype=F64), torch.randn(5000, 64, generator=gen)
    )  # small d
    assert not cpu_blas.takes_second_moment(
        torch.zeros(d, 2 * d, dtype=F64)[:, ::2], torch.randn(1000, d, generator=gen)
    )  # strided S
    assert not cpu_blas.takes_second_moment(S.float(), torch.randn(1000, d, generator=gen))
    assert cpu_blas.takes_second_moment(S, torch.randn(1000, d, generator=gen))


def test_blas_call_runs_at_torchs_thread_count(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    d, R = 256, 1024
    rows = torch.randn(R, d, generator=gen)
    seen = []
    blas = cpu_blas._blas()[0]
    real = blas.dsyrk

    def spy(*args, **kwargs):
        seen.append(cpu_blas.blas_thread_counts())
        return real(*args, **kwargs)

    monkeypatch.setattr(blas, "dsyrk", spy)
    before_torch = torch.get_num_threads()
    controllers = cpu_blas._blas()[1]
    before_blas = cpu_blas.blas_thread_counts()
    try:
        for c in controllers:  # as with OPENBLAS_NUM_THREADS=2: the call must still use one
            c.set_num_threads(2)
        torch.set_num_threads(1)
        S = torch.zeros(d, d, dtype=F64)
        torch_twin.second_moment_update(S, rows)
        assert seen == [[1] * len(controllers)], seen
        assert cpu_blas.blas_thread_counts() == [2] * len(controllers), "restored after the call"
        torch.set_num_threads(2)  # more torch threads: torch's addmm, no BLAS call
        S2 = torch.zeros(d, d, dtype=F64)
        torch_twin.second_moment_update(S2, rows)
        assert len(seen) == 1
        y = rows.double()
        assert _rel(S2, y.T @ y) < 1e-12 and _rel(S, S2) < 1e-13
    finally:
        torch.set_num_threads(before_torch)
        for c, n in zip(controllers, before_blas):
            c.set_num_threads(n)


def test_grad_stats_estimate_with_and_without_blas_agree(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    d = 200
    batches = [torch.randn(700, d, generator=gen) + 0.05 for _ in range(3)]

    def run():
        acc = fs.GradStats(d, second_moment="dense", backend="torch")
        for b in batches:
            acc.update(b)
        return acc

    fast = run()
    monkeypatch.setattr(cpu_blas, "available", lambda: False)
    slow = run()
    assert _rel(fast.S, slow.S) < 1e-13
    e_fast, e_slow = fast.estimate(), slow.estimate()
    for key in ("mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2"):
        a, b = getattr(e_fast, key), getattr(e_slow, key)
        assert abs(a - b) <= 1e-9 * abs(b), key


def test_grad_stats_mirrors_the_second_moment_once_per_read(monkeypatch):
    # streaming adds each batch to S's upper triangle only; any read of S (the attribute, a
    # state_dict, an estimate) sees the full, exactly symmetric matrix, mirrored once per read
    gen = torch.Generator().manual_seed(12)
    d = 256
    batches = [torch.randn(600, d, generator=gen) + 0.1 for _ in range(3)]
    mirrors = []
    real_mirror = torch_twin.mirror_upper

    def counting_mirror(S):
        mirrors.append(S.shape)
        real_mirror(S)

    monkeypatch.setattr(torch_twin, "mirror_upper", counting_mirror)
    acc = fs.GradStats(d, second_moment="dense", backend="torch")
    for b in batches:
        acc.update(b)
    assert mirrors == [], "no mirror while streaming"
    y = torch.cat(batches).double() - acc.centre
    S = acc.S
    assert torch.equal(S, S.T), "S read after streaming is exactly symmetric"
    assert _rel(S, y.T @ y) < 1e-12
    assert len(mirrors) == 1
    assert torch.equal(acc.state_dict()["S"], S) and len(mirrors) == 1  # already complete
    acc.update(batches[0])
    assert len(mirrors) == 1
    state = acc.state_dict()["S"]
    assert len(mirrors) == 2 and torch.equal(state, state.T)
    y = torch.cat(batches + batches[:1]).double() - acc.centre
    assert _rel(state, y.T @ y) < 1e-12


def test_without_scipy_the_second_moment_falls_back_to_torch():
    code = (
        "import sys; sys.modules['scipy'] = None; sys.modules['scipy.linalg'] = None\n"
        "import torch\n"
        "from fused_stats.ops import cpu_blas, torch_twin\n"
        "assert not cpu_blas.available()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "rows = torch.randn(1000, 256, generator=g)\n"
        "S = torch.zeros(256, 256, dtype=torch.float64)\n"
        "torch_twin.second_moment_update(S, rows)\n"
        "y = rows.double(); assert float((S - y.T @ y).abs().max()) < 1e-10\n"
        "print('fallback ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "fallback ok" in out.stdout
