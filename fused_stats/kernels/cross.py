"""Cross-gradient op (DESIGN section 6.3; issue 4) -- the slot for its fused Triton kernel.

There is no Triton kernel for it yet: :func:`cross_reduce` has the signature of
:func:`fused_stats.ops.cross_twin.cross_reduce` and runs that fp64 torch twin on the tensors' own
device (CUDA included), so ``backend="auto"`` on a GPU works and gives the twin's exact result.
The planned kernel (issue 4) computes ``C += sum_t q_t phi(W_in z_t)^T`` with per-sample ghost norms,
never materialising ``phi(W_in z)`` for all tokens; it will replace this function, keep the
signature, and be added to :mod:`.aot` (compile gate) and bench/gpu_check.py (section "cross").
"""

from __future__ import annotations

from ..ops import cross_twin

IS_FUSED_KERNEL = False  # bench/gpu_check.py and the tests read this


def cross_reduce(grad, act, mask, w_in, activation, unit, group_size=cross_twin.DEFAULT_GROUP_SIZE):
    """Placeholder: the torch twin (see module docstring)."""
    return cross_twin.cross_reduce(grad, act, mask, w_in, activation, unit, group_size)
