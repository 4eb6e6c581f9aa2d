"""The second-moment and Gram kernels' speed: TFLOP/s of ``S += YᵀY`` counting the triangle's FLOPs
``d (d + 1) R``, bf16 rows against the bf16 matmul rate (target >= 60 %), fp32 rows (tf32x3)
against a third of the TF32 rate (``second_moment``); the Gram rows of 64 new rows against a pool
of about the auto pool's size, ``2 · 64 · N d`` FLOPs (``gram``); with ``--sweeps``, the kernel's
(BM, BK, warps, stages) alternatives (``syrk_sweep``).
"""

from __future__ import annotations

from .harness import bench


def gradient_rows(ctx, dtype):
    return ctx.randn(ctx.tokens, ctx.d, dtype=dtype, shift=0.01)


def section_second_moment(run, ctx):
    """TFLOP/s of the second-moment kernel (the triangle's FLOPs ``d (d + 1) R``): bf16 rows against
    the measured bf16 matmul rate; fp32 rows (tf32x3: three TF32 MMAs a product) against a third of
    the TF32 rate, with no target."""
    torch = ctx.torch
    from fused_stats.kernels import second_moment_update
    from fused_stats.ops import torch_twin

    out = {}
    d, R = ctx.d, ctx.tokens
    flops = d * (d + 1) * R
    for label, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):

        def one(label=label, dtype=dtype):
            rows = gradient_rows(ctx, dtype)
            S = torch.zeros(d, d, dtype=torch.float64, device=ctx.device)
            scratch = S.clone()
            ms = bench(lambda: second_moment_update(S, rows), run)
            ms_twin = bench(lambda: torch_twin.second_moment_update(scratch, rows), run)
            rate = flops / (ms * 1e-3) / 1e12
            entry = {"ms": ms, "twin_eager_ms": ms_twin, "TFLOPs_triangle": rate}
            if label == "bf16":
                full = bench(lambda: torch.mm(rows.T, rows), run)  # full d x d, bf16 out
                entry["torch_bf16_full_gemm_ms"] = full
                run.row(
                    "second moment speed",
                    "bf16 rows TFLOP/s (triangle)",
                    rate,
                    "TFLOP/s",
                    reference=ctx.peers.get("bf16_TFLOPs"),
                    target=0.60,
                    note=f"{ms:.3f} ms; torch bf16 full GEMM {full:.3f} ms; twin fp64 {ms_twin:.1f} ms",
                )
            else:
                tf32 = ctx.peers.get("tf32_TFLOPs")
                entry["tf32x3_ceiling_TFLOPs"] = tf32 / 3 if tf32 else None
                run.row(
                    "second moment speed",
                    "fp32 rows (tf32x3) TFLOP/s (triangle)",
                    rate,
                    "TFLOP/s",
                    reference=entry["tf32x3_ceiling_TFLOPs"],
                    note=f"reference = TF32 matmul / 3; {ms:.3f} ms",
                )
            if ctx.cuda:
                torch.cuda.empty_cache()
            return entry

        run.case(out, label, one)
    return out


def section_gram(run, ctx):
    """Milliseconds of the Gram rows of 64 new rows against a pool of about the auto pool's size."""
    torch = ctx.torch
    from fused_stats.kernels import gram_rows
    from fused_stats.ops import torch_twin

    out = {}
    d = ctx.d
    n_pool = max(2, int(d * 0.61))
    f32, f64 = torch.float32, torch.float64
    for label, new_dtype, pool_dtype in (
        ("fp64", f64, f64),
        ("bf16", torch.bfloat16, torch.bfloat16),
        ("fp32", f32, f32),
        ("fp32_x_fp64_pool", f32, f64),  # a pool's extension: fp32 new rows against the fp64 pool
    ):

        def one(label=label, new_dtype=new_dtype, pool_dtype=pool_dtype):
            new = ctx.randn(64, d, dtype=new_dtype)
            pool = ctx.randn(n_pool, d, dtype=pool_dtype)
            ms = bench(lambda: gram_rows(new, pool), run)
            ms_twin = bench(lambda: torch_twin.gram_rows(new, pool), run)
            rate = 2 * 64 * n_pool * d / (ms * 1e-3) / 1e12
            run.row("gram speed", f"{label} ms", ms, "ms", note=f"twin eager {ms_twin:.3f} ms")
            return {"ms": ms, "twin_eager_ms": ms_twin, "TFLOPs": rate, "shape": [64, n_pool, d]}

        run.case(out, label, one)
    return out


def section_syrk_sweep(run, ctx):
    """Alternative (BM, BK, warps, stages) of the second-moment kernel, bf16 rows, on a scratch S."""
    torch = ctx.torch
    if not ctx.cuda:
        return {"_status": "skipped", "reason": "no CUDA"}
    from fused_stats.kernels import second_moment
    from fused_stats.kernels._common import override_config

    rows = gradient_rows(ctx, torch.bfloat16)
    S = torch.zeros(ctx.d, ctx.d, dtype=torch.float64, device=ctx.device)
    flops = ctx.d * (ctx.d + 1) * ctx.tokens
    out = {}
    for cfg in ((128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 4), (128, 64, 4, 3), (64, 64, 4, 4)):
        key = "bm{}_bk{}_w{}_s{}".format(*cfg)
        try:
            with override_config(syrk_config=cfg, syrk_splits=1):
                ms = bench(lambda: second_moment.second_moment_update(S, rows), run)
            out[key] = flops / (ms * 1e-3) / 1e12
        except Exception as exc:  # e.g. out of shared memory
            out[key] = f"{type(exc).__name__}: {exc}"[:200]
    best = max((v, k) for k, v in out.items() if isinstance(v, float))
    run.row(
        "second moment sweep",
        f"best {best[1]} (bf16 rows)",
        best[0],
        "TFLOP/s",
        reference=ctx.peers.get("bf16_TFLOPs"),
        target=0.60,
    )
    return {"TFLOPs": out, "best": best[1]}
