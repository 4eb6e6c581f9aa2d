"""The capture-reduce kernels' speed: achieved GB/s (the bytes they must move: the gradient and
mask read, the fp32 rows written, bench/KERNELS.md) against the copy bandwidth, target >= 85 %,
with the op and the eager torch twin as peers (``capture_speed``); and, with ``--sweeps``, the
row kernel's block sizes (``capture_sweep``).
"""

from __future__ import annotations

from .harness import bench


def capture_cases(ctx):
    """(name, grad, mask, unit) at the realistic size: B x T = tokens."""
    torch = ctx.torch
    d, tokens = ctx.d, ctx.tokens
    T = min(4096, max(1, tokens // 16)) if tokens >= 64 else 4
    B = max(1, tokens // T)
    Ts = min(2048, max(1, tokens // 32))
    Bs = max(1, tokens // Ts)
    g = ctx.randn(B, T, d, dtype=torch.bfloat16, shift=0.5)
    mask = torch.rand(B, T, generator=ctx.gen, device=ctx.device) > 0.1
    gs = ctx.randn(Bs, Ts, d, dtype=torch.bfloat16, shift=0.5)
    ms = torch.rand(Bs, Ts, generator=ctx.gen, device=ctx.device) > 0.1
    ms[0] = False  # one sample fully masked
    gt = ctx.randn(Ts, Bs, d, dtype=torch.bfloat16, shift=0.5).transpose(0, 1)  # HF-like strides
    return [
        ("position_bf16", g, None, "position"),
        ("position_bf16_mask", g, mask, "position"),
        ("sample_bf16_mask", gs, ms, "sample"),
        ("sample_bf16_transposed", gt, None, "sample"),
    ]


def centre_of(ctx, g):
    torch = ctx.torch
    # the mean of some of the samples (never all: s = sum y would then vanish, and its relative
    # error be that of cancellation), rounded to fp32 as the accumulator rounds its centre
    head = g[: max(1, min(8, g.shape[0] // 2))]
    return head.to(torch.float64).mean((0, 1)).to(torch.float32).to(torch.float64)


def capture_bytes(g, mask, unit):
    """Bytes the capture op must move: read the gradient (and mask), write the rows (fp32)."""
    B, T, d = g.shape
    rows = B * T if unit == "position" else B
    return g.numel() * g.element_size() + (mask.numel() if mask is not None else 0) + rows * d * 4 + rows


def section_capture_speed(run, ctx):
    """Achieved GB/s of the capture kernels (bytes they must move) against the copy bandwidth."""
    torch = ctx.torch
    from fused_stats.kernels import capture
    from fused_stats.ops import torch_twin

    copy = ctx.peers.get("copy_GBps")
    out = {}
    for name, g, mask, unit in capture_cases(ctx):

        def one(g=g, mask=mask, unit=unit, name=name):
            c = centre_of(ctx, g)
            nbytes = capture_bytes(g, mask, unit)
            ms_k = bench(lambda: capture.capture_partials(g, mask, c, unit), run)
            ms_op = bench(lambda: capture.capture_reduce(g, mask, c, unit), run)
            ms_twin = bench(lambda: torch_twin.capture_reduce(g, mask, c, unit), run)
            gbps = nbytes / (ms_k * 1e-3) / 1e9
            run.row(
                "capture speed",
                f"{name} kernels GB/s",
                gbps,
                "GB/s",
                reference=copy,
                target=0.85,
                note=f"op {ms_op:.3f} ms, twin eager {ms_twin:.3f} ms",
            )
            if ctx.cuda:
                torch.cuda.empty_cache()
            return {
                "bytes": nbytes,
                "kernels_ms": ms_k,
                "op_ms": ms_op,
                "twin_eager_ms": ms_twin,
                "GBps": gbps,
                "fraction_of_copy": gbps / copy if copy else None,
            }

        run.case(out, name, one)
    return out


def section_capture_sweep(run, ctx):
    """Block-size alternatives of the row kernel (capture adds into nothing: safe to re-run)."""
    if not ctx.cuda:
        return {"_status": "skipped", "reason": "no CUDA"}
    from fused_stats.kernels import capture
    from fused_stats.kernels._common import override_config

    name, g, mask, unit = capture_cases(ctx)[1]
    c = centre_of(ctx, g)
    nbytes = capture_bytes(g, mask, unit)
    out = {}
    combos = [(r, w, 4) for r in (1, 2, 4) for w in (4, 8, 16)] + [(1, 8, 2), (1, 8, 8), (2, 16, 2)]
    for block_r, warps, per_sm in combos:
        key = f"r{block_r}_w{warps}_p{per_sm}"
        try:
            with override_config(
                capture_block_r=block_r,
                capture_num_warps=warps,
                capture_programs=per_sm * capture.sm_count(ctx.device),
            ):
                ms = bench(lambda: capture.capture_partials(g, mask, c, unit), run)
            out[key] = nbytes / (ms * 1e-3) / 1e9
        except Exception as exc:  # e.g. out of registers for a large block
            out[key] = f"{type(exc).__name__}: {exc}"[:200]
    best = max((v, k) for k, v in out.items() if isinstance(v, float))
    run.row(
        "capture sweep",
        f"best {best[1]} ({name})",
        best[0],
        "GB/s",
        reference=ctx.peers.get("copy_GBps"),
        target=0.85,
    )
    return {"GBps": out, "best": best[1]}
