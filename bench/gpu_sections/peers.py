"""``torch.compile`` of the torch twins, the last peer column (``compile_peers``, with
``--compile-peers``: compilation takes a while).
"""

from __future__ import annotations

import time

from .capture_speed import capture_cases, centre_of
from .harness import bench
from .second_moment import gradient_rows


def section_compile_peers(run, ctx):
    """torch.compile of the twins, the last peer column (compilation takes a while)."""
    torch = ctx.torch
    if not ctx.cuda:
        return {"_status": "skipped", "reason": "no CUDA"}
    from fused_stats.ops import torch_twin

    out = {}
    name, g, mask, unit = capture_cases(ctx)[1]
    c = centre_of(ctx, g)
    cap = torch.compile(torch_twin.capture_reduce)
    t = time.time()
    cap(g, mask, c, unit)
    out["capture_compile_s"] = time.time() - t
    out["capture_compiled_ms"] = bench(lambda: cap(g, mask, c, unit), run)
    run.row("peers", f"capture {name}: torch.compile(twin) ms", out["capture_compiled_ms"], "ms")
    rows = gradient_rows(ctx, torch.bfloat16)
    S = torch.zeros(ctx.d, ctx.d, dtype=torch.float64, device=ctx.device)
    sm = torch.compile(torch_twin.second_moment_update)
    t = time.time()
    sm(S, rows)
    out["second_moment_compile_s"] = time.time() - t
    out["second_moment_compiled_ms"] = bench(lambda: sm(S, rows), run)
    run.row(
        "peers", "second moment bf16 rows: torch.compile(twin) ms", out["second_moment_compiled_ms"], "ms"
    )
    return out
