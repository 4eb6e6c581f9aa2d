"""Triton kernels and their launchers (docs/design.md, section 6); each mirrors a torch twin.

=========================  =================================================  ==========================
launcher                   torch twin (oracle and CPU path)                   module
=========================  =================================================  ==========================
``capture_reduce``         :func:`fused_stats.ops.torch_twin.capture_reduce`   :mod:`.capture`
``second_moment_update``   :func:`...torch_twin.second_moment_update`          :mod:`.second_moment`
``gram_rows``              :func:`...torch_twin.gram_rows`                     :mod:`.gram`
``cross_reduce``           :func:`fused_stats.ops.cross_twin.cross_reduce`     :mod:`.cross`
=========================  =================================================  ==========================

Launchers take CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (Triton's interpreter; see
:mod:`._triton_compat` for why this works whatever the import order, and for the few Triton
internals used, all in that one module). They validate their arguments with the same checks as the
twins (:mod:`fused_stats.contracts`). Importing this package imports Triton, so the ops layer
imports it lazily. :mod:`.aot` compiles every kernel ahead of time for Hopper (sm_90a) and reads
registers, spills and SASS without a GPU; it imports the kernel modules, never the reverse.
"""

from .capture import capture_reduce
from .cross import cross_reduce
from .gram import gram_rows
from .second_moment import second_moment_update

__all__ = ["capture_reduce", "cross_reduce", "gram_rows", "second_moment_update"]
