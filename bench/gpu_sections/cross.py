"""The cross-gradient kernel's speed, both units: its time, the TFLOP/s of its two GEMMs over the
counted positions (``Φ = Z W_inᵀ``, then ``QᵀΦ``: ``4 · positions · d r`` FLOPs) and the extra
memory one call allocates, against the torch twin (``cross``).
"""

from __future__ import annotations

from .harness import bench


def section_cross(run, ctx):
    """The cross-gradient kernel's time, its two GEMMs' TFLOP/s and its extra memory, both units."""
    torch = ctx.torch
    from fused_stats.kernels import cross
    from fused_stats.ops import cross_twin

    if not getattr(cross, "IS_FUSED_KERNEL", False):
        return {
            "_status": "skipped",
            "reason": "no fused cross-gradient kernel in this build; "
            "fused_stats.kernels.cross_reduce runs the torch twin",
        }
    d = ctx.d
    r = 8 if run.args.dry_run else 64
    tokens = max(24, ctx.tokens // 4)
    T = min(512, max(1, tokens // 8))
    B = max(1, tokens // T)
    grad = ctx.randn(B, T, d, dtype=torch.bfloat16, shift=0.2)
    act = ctx.randn(B, T, d, dtype=torch.bfloat16)
    w_in = ctx.randn(r, d, scale=d**-0.5)
    mask = torch.rand(B, T, generator=ctx.gen, device=ctx.device) > 0.1
    out = {"shape": [B, T, d, r]}
    for unit in ("sample", "position"):

        def one(unit=unit):
            args = (grad, act, mask, w_in, "gelu", unit)
            ms = bench(lambda: cross.cross_reduce(*args), run)
            ms_twin = bench(lambda: cross_twin.cross_reduce(*args), run)
            # the two GEMMs over counted positions (phi = Z W_in^T, then Q^T Phi), tf32x3 products
            tflops = 4 * int(mask.sum()) * d * r / (ms * 1e-3) / 1e12
            entry = {"ms": ms, "twin_eager_ms": ms_twin, "gemm_TFLOPs": tflops}
            note = f"twin eager {ms_twin:.3f} ms; {tflops:.1f} TFLOP/s in the 2 GEMMs"
            if ctx.cuda:  # extra memory of one call: phi(W_in z) must exist only per chunk in the kernel
                peak = {}
                for who, fn in (("kernel", cross.cross_reduce), ("twin", cross_twin.cross_reduce)):
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(ctx.device)
                    base = torch.cuda.memory_allocated(ctx.device)
                    fn(*args)
                    torch.cuda.synchronize()
                    peak[who] = (torch.cuda.max_memory_allocated(ctx.device) - base) / 2**20
                entry["peak_extra_MiB"] = peak
                note += f"; extra memory {peak['kernel']:.0f} MiB (twin {peak['twin']:.0f} MiB)"
            run.row("cross speed", f"{unit} ms", ms, "ms", note=note)
            return entry

        run.case(out, unit, one)
    return out
