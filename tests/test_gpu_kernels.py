"""The fused kernels compiled for a CUDA device, against their fp64 torch twins at realistic sizes
(``pytest -m gpu`` on any GPU machine; ``bench/gpu_check.py`` runs these first, then its timings).

Marked ``gpu``: skipped without CUDA (tests/conftest.py). On CPU the same kernels are checked through
Triton's interpreter by tests/test_kernels_interpreter.py; what only compiled code shows is here:

* one tiny launch of every kernel variant (fp64 MMAs, the pool's fp32 x fp64 Gram, the two-pass
  capture, ``T < 16`` samples, stage 1, split-K, both cross units) and the Triton internals the
  package's compatibility shim needs;
* every op against its twin at ``tokens = 65536``, ``d = 4096`` (the capture op, masked, per sample,
  sequence-first strides; the second moment from bf16 and fp32 rows; the Gram rows; the cross
  gradient); the two-pass capture forced at d = 4096 and natural at d = 12288; an odd d and a
  feature-strided input;
* the bf16 second moment's mean *signed* diagonal error (a rounding bias of long fp32 chains shows
  there, below the tolerance on the maximum);
* bitwise repeats (each op twice, ``torch.equal``);
* inputs past 2^31 elements, checked by additivity (the full call against the sum over its two
  halves, each small enough for offsets that cannot wrap), as no twin fits at that size;
* ``GradStats(backend="triton")`` against ``backend="torch"`` end to end, and the weight-streamed
  probe against the in-memory one.

Tolerances: 16/32-bit inputs are accumulated in fp32 by the kernels, so relative errors are fp32
rounding of long sums: 2e-5 of each quantity's scale (1e-4 for the cross gradient's fp32 products and
for sums over other partitions of the rows); fp64 inputs are computed in fp64: 1e-9 (tiny) / 1e-12.

``FUSED_STATS_GPU_TESTS_ON_CPU=1`` (with ``TRITON_INTERPRET=1``) runs them on CPU at tiny sizes: a
check of the tests' own code, not a second copy of the interpreter tests.
"""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.gpu

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
# realistic sizes on a GPU (a LLaMA-7B point, 64K tokens a batch); tiny ones for the CPU check
TOKENS, D = (65536, 4096) if ON_CUDA else (96, 40)
F64 = torch.float64


@pytest.fixture(autouse=True)
def interpreter_off_gpu(monkeypatch):
    """On CPU the launchers take CPU tensors only under the interpreter flag."""
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
    if ON_CUDA:
        torch.cuda.empty_cache()


@pytest.fixture
def rand(request):
    """``rand(*shape, dtype=, scale=, shift=)``: fresh normal values on the device, seeded from the
    test's id."""
    gen = torch.Generator(device=DEVICE).manual_seed(zlib.crc32(request.node.nodeid.encode()))

    def make(*shape, dtype=torch.float32, scale=1.0, shift=0.0):
        # fp64 values drawn in fp64: fp32-valued ones would hide an fp64 path that rounds to fp32
        x = torch.randn(*shape, generator=gen, device=DEVICE, dtype=F64 if dtype == F64 else torch.float32)
        return (x * scale + shift).to(dtype)

    make.gen = gen
    return make


def rel_err(got, want) -> float:
    """max |got - want| / max |want|, in fp64."""
    got, want = got.to(F64), want.to(F64)
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((got - want).abs().max()) if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


def random_mask(rand, B, T):
    return torch.rand(B, T, generator=rand.gen, device=DEVICE) > 0.1


def centre_of(g):
    """The mean of some samples (never all: ``s`` would then vanish and its relative error be that of
    cancellation), rounded to fp32 as the accumulator rounds its centre."""
    head = g[: max(1, min(8, g.shape[0] // 2))]
    return head.to(F64).mean((0, 1)).to(torch.float32).to(F64)


CAPTURE_FIELDS = ("rows", "s", "t", "a1", "a2", "norm_max", "norm_sum")


def assert_capture_matches_twin(g, mask, unit, tol=2e-5, **config):
    from fused_stats.kernels import capture_reduce
    from fused_stats.kernels._common import override_config
    from fused_stats.ops import torch_twin

    c = centre_of(g)
    with override_config(**config):
        got = capture_reduce(g, mask, c, unit)
    want = torch_twin.capture_reduce(g, mask, c, unit)
    assert got.n == want.n
    assert torch.equal(got.valid, want.valid)
    errs = {k: rel_err(getattr(got, k), getattr(want, k)) for k in CAPTURE_FIELDS}
    assert max(errs.values()) < tol, errs


# ---------------------------------------------------------------------------- preflight
def test_triton_internals_the_shim_needs_are_present():
    from fused_stats.kernels import _triton_compat

    assert _triton_compat.missing_internals(aot=False) == []


def _launch_capture(rand, dtype, B, T, d, unit, **config):
    from fused_stats.kernels import capture_reduce
    from fused_stats.kernels._common import override_config
    from fused_stats.ops import torch_twin

    g = rand(B, T, d, dtype=dtype, shift=0.3)
    c = torch.zeros(d, dtype=F64, device=DEVICE)
    with override_config(**config):
        got = capture_reduce(g, None, c, unit)
    want = torch_twin.capture_reduce(g, None, c, unit)
    return max(rel_err(getattr(got, k), getattr(want, k)) for k in ("rows", "s", "t", "a1", "norm_max"))


def _launch_syrk(rand, dtype, **config):
    from fused_stats.kernels import second_moment_update
    from fused_stats.kernels._common import override_config
    from fused_stats.ops import torch_twin

    rows = rand(100, 48, dtype=dtype)
    S = torch.zeros(48, 48, dtype=F64, device=DEVICE)
    with override_config(**config):
        second_moment_update(S, rows)
    want = torch.zeros_like(S)
    torch_twin.second_moment_update(want, rows)
    return rel_err(S, want)


def _launch_gram(rand, new_dtype, pool_dtype):
    from fused_stats.kernels import gram_rows
    from fused_stats.ops import torch_twin

    new, pool = rand(5, 40, dtype=new_dtype), rand(19, 40, dtype=pool_dtype)
    return rel_err(gram_rows(new, pool), torch_twin.gram_rows(new, pool))


def _launch_cross(rand, dtype, unit):
    from fused_stats.kernels import cross
    from fused_stats.ops import cross_twin

    grad, act = rand(3, 5, 24, dtype=dtype), rand(3, 5, 20, dtype=dtype)
    w = rand(4, 20, dtype=F64 if dtype == F64 else torch.float32, scale=0.2)
    got = cross.cross_reduce(grad, act, None, w, "gelu", unit)
    want = cross_twin.cross_reduce(grad, act, None, w, "gelu", unit)
    return rel_err(got.c_sum, want.c_sum)


BF16, F32 = torch.bfloat16, torch.float32
D_TWO_PASS = 2 * (2048 if ON_CUDA else 64)
# (variant, launch(rand) -> max rel err against the twin, dtype that sets the tolerance)
TINY_LAUNCHES = [
    ("capture_bf16_position", lambda r: _launch_capture(r, BF16, 2, 3, 40, "position"), BF16),
    ("capture_fp64_position", lambda r: _launch_capture(r, F64, 2, 3, 40, "position"), F64),
    (
        "capture_two_pass",
        lambda r: _launch_capture(
            r, BF16, 2, 3, D_TWO_PASS, "position", capture_single_chunk_max_d=D_TWO_PASS // 2
        ),
        BF16,
    ),
    ("capture_sample_t_lt_16", lambda r: _launch_capture(r, BF16, 3, 5, 40, "sample"), BF16),
    ("capture_sample_stage1", lambda r: _launch_capture(r, BF16, 2, 40, 40, "sample"), BF16),
    ("syrk_bf16", lambda r: _launch_syrk(r, BF16), BF16),
    ("syrk_fp32", lambda r: _launch_syrk(r, F32), F32),
    ("syrk_fp64", lambda r: _launch_syrk(r, F64), F64),
    ("syrk_bf16_split_k", lambda r: _launch_syrk(r, BF16, syrk_splits=3), BF16),
    ("gram_bf16", lambda r: _launch_gram(r, BF16, BF16), BF16),
    ("gram_fp32", lambda r: _launch_gram(r, F32, F32), F32),
    ("gram_fp64", lambda r: _launch_gram(r, F64, F64), F64),
    ("gram_fp32_x_fp64", lambda r: _launch_gram(r, F32, F64), F64),
    ("cross_sample_bf16", lambda r: _launch_cross(r, BF16, "sample"), BF16),
    ("cross_position_bf16", lambda r: _launch_cross(r, BF16, "position"), BF16),
    ("cross_sample_fp64", lambda r: _launch_cross(r, F64, "sample"), F64),
    ("cross_position_fp64", lambda r: _launch_cross(r, F64, "position"), F64),
]


@pytest.mark.parametrize("launch, dtype", [x[1:] for x in TINY_LAUNCHES], ids=[x[0] for x in TINY_LAUNCHES])
def test_tiny_launch_of_every_variant(rand, launch, dtype):
    """Each variant's first JIT compilation at a tiny size: one that does not compile on this stack
    is named before the long tests run."""
    err = launch(rand)
    assert err < (1e-9 if dtype == F64 else 1e-4), err


# ---------------------------------------------------------------------------- capture
def _capture_case(rand, name):
    tokens, d = TOKENS, D
    T = min(4096, max(1, tokens // 16))
    Ts = min(2048, max(1, tokens // 32))
    B, Bs = max(1, tokens // T), max(1, tokens // Ts)
    if name.startswith("position"):
        g = rand(B, T, d, dtype=BF16, shift=0.5)
        return g, (random_mask(rand, B, T) if name.endswith("mask") else None), "position"
    if name == "sample_bf16_mask":
        mask = random_mask(rand, Bs, Ts)
        mask[0] = False  # one sample fully masked
        return rand(Bs, Ts, d, dtype=BF16, shift=0.5), mask, "sample"
    # sequence-first storage, as HF models hand some gradients over
    return rand(Ts, Bs, d, dtype=BF16, shift=0.5).transpose(0, 1), None, "sample"


@pytest.mark.parametrize(
    "name", ["position_bf16", "position_bf16_mask", "sample_bf16_mask", "sample_bf16_transposed"]
)
def test_capture_matches_twin(rand, name):
    g, mask, unit = _capture_case(rand, name)
    assert_capture_matches_twin(g, mask, unit)


@pytest.mark.parametrize("unit", ["position", "sample"])
@pytest.mark.parametrize("forced", [True, False], ids=["forced", "natural"])
def test_capture_two_pass(rand, unit, forced):
    """The wide-row path: forced below its threshold, and at a d where the launcher takes it itself
    (the interpreter's single-chunk limit is 64)."""
    if ON_CUDA:
        d, config = (4096, {"capture_single_chunk_max_d": 2048}) if forced else (12288, {})
    else:
        d, config = (D, {"capture_single_chunk_max_d": 16}) if forced else (70, {})
    T = 8
    B = max(1, max(8, TOKENS // 4) // T)
    g = rand(B, T, d, dtype=BF16, shift=0.5)
    assert_capture_matches_twin(g, random_mask(rand, B, T), unit, **config)


@pytest.mark.parametrize("unit", ["position", "sample"])
@pytest.mark.parametrize("layout", ["odd_d", "feature_stride_2"])
def test_capture_layouts(rand, unit, layout):
    B, T = (max(1, TOKENS // 512), min(512, TOKENS)) if ON_CUDA else (3, 5)
    if layout == "odd_d":
        g = rand(B, T, D - 1, dtype=BF16, shift=0.5)
    else:  # every other feature of a wider buffer
        g = rand(B, T, 2 * D, dtype=BF16, shift=0.5)[:, :, ::2]
        assert g.stride(-1) == 2
    assert_capture_matches_twin(g, random_mask(rand, B, T), unit)


# ---------------------------------------------------------------------------- second moment, Gram
def _rows(rand, dtype):
    return rand(TOKENS, D, dtype=dtype, shift=0.01)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_second_moment_matches_twin(rand, dtype):
    from fused_stats.kernels import second_moment_update
    from fused_stats.ops import torch_twin

    rows = _rows(rand, dtype)
    start = rand(D, D, dtype=F64)
    start = start + start.T  # S accumulates: the kernel adds into what is there
    S = start.clone()
    second_moment_update(S, rows)
    want = start.clone()
    torch_twin.second_moment_update(want, rows)
    assert rel_err(S, want) < 2e-5
    assert torch.equal(S, S.T)


@pytest.mark.parametrize("config", [{}, {"syrk_splits": 8}], ids=["plain", "split_k"])
def test_bf16_second_moment_diagonal_has_no_rounding_bias(rand, config):
    """Mean signed relative error of diag S (sums of squares over all rows: the longest fp32 chains).
    Random rounding averages out; an accumulator that rounds one way gives a mean of the size of the
    maximum, which the 2e-5 tolerance on the maximum would not flag."""
    from fused_stats.kernels import second_moment_update
    from fused_stats.kernels._common import override_config
    from fused_stats.ops import torch_twin

    rows = _rows(rand, BF16)
    want = torch.zeros(D, D, dtype=F64, device=DEVICE)
    torch_twin.second_moment_update(want, rows)
    S = torch.zeros_like(want)
    with override_config(**config):
        second_moment_update(S, rows)
    ref = torch.diagonal(want)
    e = (torch.diagonal(S) - ref) / ref
    assert float(e.abs().max()) < 2e-5
    assert abs(float(e.mean())) < 2e-6


@pytest.mark.parametrize(
    "new_dtype, pool_dtype",
    [(F64, F64), (BF16, BF16), (F32, F32), (F32, F64)],
    ids=["fp64", "bf16", "fp32", "fp32_x_fp64_pool"],
)
def test_gram_rows_match_twin(rand, new_dtype, pool_dtype):
    from fused_stats.kernels import gram_rows
    from fused_stats.ops import torch_twin

    n_pool = max(2, int(D * 0.61))  # about the auto pool's size limit, no multiple of 16
    new, pool = rand(64, D, dtype=new_dtype), rand(n_pool, D, dtype=pool_dtype)
    err = rel_err(gram_rows(new, pool), torch_twin.gram_rows(new, pool))
    assert err < (1e-12 if F64 in (new_dtype, pool_dtype) else 2e-5), err


# ---------------------------------------------------------------------------- cross gradient
@pytest.mark.parametrize("unit", ["sample", "position"])
def test_cross_gradient_matches_twin(rand, unit):
    from fused_stats.kernels import cross
    from fused_stats.ops import cross_twin

    if not getattr(cross, "IS_FUSED_KERNEL", False):
        pytest.skip("no fused cross-gradient kernel in this build (the torch twin runs)")
    r = 64 if ON_CUDA else 8
    tokens = max(24, TOKENS // 4)
    T = min(512, max(1, tokens // 8))
    B = max(1, tokens // T)
    args = (
        rand(B, T, D, dtype=BF16, shift=0.2),
        rand(B, T, D, dtype=BF16),
        random_mask(rand, B, T),
        rand(r, D, scale=D**-0.5),
        "gelu",
        unit,
    )
    got, want = cross.cross_reduce(*args), cross_twin.cross_reduce(*args)
    for k in ("n", "p2", "p3", "p4"):
        assert getattr(got, k) == getattr(want, k), k
    errs = {k: rel_err(getattr(got, k), getattr(want, k)) for k in ("c_sum", "sq_norm_sum", "u2", "u3", "u4")}
    assert max(errs.values()) < 1e-4, errs


# ---------------------------------------------------------------------------- bitwise repeats
def _twice_capture(rand):
    from fused_stats.kernels import capture_reduce

    g, mask, unit = _capture_case(rand, "position_bf16_mask")
    c = centre_of(g)
    a, b = capture_reduce(g, mask, c, unit), capture_reduce(g, mask, c, unit)
    keys = ("valid",) + CAPTURE_FIELDS
    return [getattr(a, k) for k in keys], [getattr(b, k) for k in keys]


def _twice_syrk(rand, **config):
    from fused_stats.kernels import second_moment_update
    from fused_stats.kernels._common import override_config

    rows = _rows(rand, BF16)
    out = []
    for _ in range(2):
        S = torch.zeros(D, D, dtype=F64, device=DEVICE)
        with override_config(**config):
            second_moment_update(S, rows)
        out.append([S])
    return out


def _twice_gram(rand):
    from fused_stats.kernels import gram_rows

    new, pool = rand(64, D), rand(max(2, D // 2), D, dtype=F64)
    return [gram_rows(new, pool)], [gram_rows(new, pool)]


def _twice_cross(rand):
    from fused_stats.kernels import cross

    B, T = (8, 64) if ON_CUDA else (3, 4)
    grad, act = rand(B, T, D, dtype=BF16), rand(B, T, D, dtype=BF16)
    w = rand(8, D, scale=D**-0.5)
    keys = ("c_sum", "sq_norm_sum", "u2", "u3", "u4")
    first, second = [], []
    for unit in ("sample", "position"):
        a, b = (cross.cross_reduce(grad, act, None, w, "gelu", unit) for _ in range(2))
        first += [getattr(a, k) for k in keys]
        second += [getattr(b, k) for k in keys]
    return first, second


@pytest.mark.parametrize(
    "twice",
    [_twice_capture, _twice_syrk, lambda r: _twice_syrk(r, syrk_splits=8), _twice_gram, _twice_cross],
    ids=["capture", "second_moment_bf16", "second_moment_bf16_split_k", "gram_fp32_x_fp64", "cross"],
)
def test_bitwise_repeat(rand, twice):
    first, second = twice(rand)
    assert len(first) == len(second) > 0
    for x, y in zip(first, second):
        assert torch.equal(x, y)


# ---------------------------------------------------------------------------- past 2^31 elements
# a wrapped int32 offset reads unrelated elements (errors of order one); the tolerance leaves out
# only the fp32 rounding of partial sums over other partitions of the rows
BIG = 2**31 + 2**26 if ON_CUDA else 4 * 7 * D + 1  # elements


def assert_additive(full, halves, tol=1e-4):
    assert full.n == halves[0].n + halves[1].n
    for k in ("s", "t", "a1", "a2", "norm_sum"):
        assert rel_err(getattr(full, k), getattr(halves[0], k) + getattr(halves[1], k)) < tol, k
    assert rel_err(full.norm_max, torch.maximum(halves[0].norm_max, halves[1].norm_max)) < tol


def test_position_capture_and_second_moment_past_2_31_elements(rand):
    from fused_stats.kernels import capture_reduce, second_moment_update

    T = 2048 if ON_CUDA else 4
    B = -(-BIG // (T * D))
    g = rand(B, T, D, dtype=BF16, shift=0.3)
    assert g.numel() >= BIG
    c = torch.zeros(D, dtype=F64, device=DEVICE)
    full = capture_reduce(g, None, c, "position")
    del full.rows
    halves = []
    for part in (g[: B // 2], g[B // 2 :]):
        r = capture_reduce(part, None, c, "position")
        del r.rows
        halves.append(r)
    assert_additive(full, halves)
    rows = g.view(-1, D)
    S = torch.zeros(D, D, dtype=F64, device=DEVICE)
    second_moment_update(S, rows)
    S_halves = torch.zeros_like(S)
    half = rows.shape[0] // 2
    second_moment_update(S_halves, rows[:half])
    second_moment_update(S_halves, rows[half:])
    assert rel_err(S, S_halves) < 1e-4


def test_sample_capture_of_sequence_first_buffer_past_2_31_elements(rand):
    """(T, B, d) storage viewed as (B, T, d): the position stride is B d and (T - 1) B d passes 2^31;
    T < 16, so the row kernel sums the positions itself."""
    from fused_stats.kernels import capture_reduce

    T = 8
    B = -(-BIG // ((T - 1) * D))
    g = rand(T, B, D, dtype=BF16, shift=0.3).transpose(0, 1)
    assert (T - 1) * g.stride(1) >= BIG - D
    c = torch.zeros(D, dtype=F64, device=DEVICE)
    full = capture_reduce(g, None, c, "sample")
    halves = [capture_reduce(part.contiguous(), None, c, "sample") for part in (g[: B // 2], g[B // 2 :])]
    assert_additive(full, halves)


# ---------------------------------------------------------------------------- end to end
def test_grad_stats_triton_backend_matches_torch_backend(rand):
    import fused_stats as fs

    per_batch = max(8, TOKENS // 4)
    T = min(512, per_batch)
    B = max(1, per_batch // T)
    accs = {b: fs.GradStats(D, second_moment="dense", backend=b) for b in ("triton", "torch")}
    for _ in range(3):
        g = rand(B, T, D, dtype=BF16, shift=0.3)
        for acc in accs.values():
            acc.update(g, unit="position")
    got, want = accs["triton"].estimate(), accs["torch"].estimate()
    assert got.n == want.n == 3 * B * T
    for k in ("mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2", "ag_max", "ag_mean"):
        assert abs(getattr(got, k) / getattr(want, k) - 1) < 1e-5, k


def test_weight_streamed_probe_matches_in_memory_probe():
    """fs.stream_blocks from pinned host memory (and, from a sharded folder) against the same model
    held on the device."""
    import copy

    transformers = pytest.importorskip("transformers")
    import fused_stats as fs

    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=32,
        use_cache=False,
    )
    torch.manual_seed(0)
    host_model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    batch = {
        k: v.to(DEVICE)
        for k, v in dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).items()
    }
    reference = fs.Probe(copy.deepcopy(host_model).to(DEVICE))
    reference.step(batch, fs.causal_lm_loss)
    if ON_CUDA:
        for p in host_model.parameters():
            p.data = p.data.pin_memory()
    with fs.stream_blocks(host_model, device=DEVICE, prefetch=1) as streamed:
        probe = fs.Probe(streamed.model)
        probe.step(batch, fs.causal_lm_loss)
        assert streamed.block_bytes <= streamed.peak_resident_bytes <= 2 * streamed.block_bytes  # prefetch=1
    assert list(probe.points) == list(reference.points)
    for p in reference.points:
        got, want = probe.stats[p].estimate(), reference.stats[p].estimate()
        assert abs(got.trace_sigma2 / want.trace_sigma2 - 1) < 1e-4, p
