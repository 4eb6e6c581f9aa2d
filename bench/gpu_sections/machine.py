"""The machine and its ceilings: versions and device (``env``), then the copy bandwidth (``clone``
and ``copy_`` of a bf16 tensor of the capture input's size, bytes read + written) and the dense
matmul rates ``2 n³ / t`` in bf16, TF32 and fp64 (``ceilings``), the references of later sections.
"""

from __future__ import annotations

import subprocess

from .harness import bench


def section_env(run, ctx):
    torch = ctx.torch
    import triton

    out = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": str(ctx.device),
        "tokens": ctx.tokens,
        "d": ctx.d,
    }
    if ctx.cuda:
        prop = torch.cuda.get_device_properties(ctx.device)
        out.update(
            gpu=prop.name,
            sms=prop.multi_processor_count,
            memory_gib=round(prop.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            capability=list(torch.cuda.get_device_capability(ctx.device)),
        )
    else:
        out["note"] = "no CUDA device: kernels through the interpreter at tiny sizes; timings mean nothing"
    out["driver"] = driver_version() if ctx.cuda else None
    return out


def driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:  # no nvidia-smi: the versions torch reports still stand
        return None


def section_ceilings(run, ctx):
    torch = ctx.torch
    n = ctx.tokens * ctx.d  # elements of one bf16 gradient (B x T x d)
    x = torch.empty(n, dtype=torch.bfloat16, device=ctx.device).normal_()
    ms = bench(lambda: x.clone(), run)
    copy = 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9
    y = torch.empty_like(x)
    ms_copy = bench(lambda: y.copy_(x), run)
    copy_ = 2 * x.numel() * x.element_size() / (ms_copy * 1e-3) / 1e9
    ctx.peers["copy_GBps"] = copy
    run.row("ceilings", "clone GB/s (read+write)", copy, "GB/s", note=f"{n * 2 / 1e9:.2f} GB tensor")
    run.row("ceilings", "copy_ GB/s (read+write)", copy_, "GB/s")
    m = ctx.matmul_n
    out = {"clone_GBps": copy, "copy_GBps": copy_}
    for name, dtype, tf32, size in (
        ("bf16", torch.bfloat16, False, m),
        ("tf32", torch.float32, True, m),
        ("fp64", torch.float64, False, m // 2),
    ):
        a = torch.randn(size, size, device=ctx.device, dtype=torch.float32).to(dtype)
        b = torch.randn(size, size, device=ctx.device, dtype=torch.float32).to(dtype)
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            ms = bench(lambda a=a, b=b: a @ b, run)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        rate = 2 * size**3 / (ms * 1e-3) / 1e12
        ctx.peers[f"{name}_TFLOPs"] = rate
        out[f"matmul_{name}_TFLOPs"] = rate
        run.row("ceilings", f"{name} matmul {size}^3", rate, "TFLOP/s")
    if ctx.cuda:
        torch.cuda.empty_cache()
    return out
