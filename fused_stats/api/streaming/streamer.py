"""The block scheduler behind :func:`fused_stats.stream_blocks`: which block's weights are live.

Role: :class:`BlockStreamer` owns the streamed model and its counters. A streamed block asks it for
its weights (``_acquire``) and gives them back (``_release``); the streamer loads them from its
weight source (the module's own host tensors, or a checkpoint's shards), with ``prefetch=1`` the
next block's in a background thread (on a GPU: into pinned memory, then over a side CUDA stream
that the compute stream waits on by an event) while the current block computes. The next block is
the following one in the forward and, in the backward, the deepest block still owed a backward,
so at most ``(1 + prefetch)`` blocks are materialised at once (:attr:`peak_resident_bytes`).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

import torch

from ...errors import FusedStatsError


class BlockStreamer:
    """What :func:`stream_blocks` returns: ``.model`` plus the memory counters; a context manager.

    ``block_bytes``: parameter + buffer bytes of the largest block (at the streamed dtype);
    ``resident_bytes``: those of the non-block parts kept on the device; ``peak_resident_bytes``:
    the most block bytes materialised at once since construction (at most
    ``(1 + prefetch) * block_bytes``).
    """

    def __init__(self, model, names, weights, device, dtype, prefetch, restore):
        self.model = model
        self.names = names
        self.prefetch = prefetch
        self.device = device
        self.dtype = dtype
        self._weights = weights
        self._restore = restore
        self._lock = threading.Lock()
        self._live = 0
        self.peak_resident_bytes = 0
        self._pending = None  # (index, future or dict, nbytes)
        self._needs_backward: set[int] = set()
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="fused_stats_prefetch")
            if prefetch and not weights.in_place
            else None
        )
        self._side = torch.cuda.Stream(device) if device is not None and device.type == "cuda" else None
        self.block_bytes = max((self._block_nbytes(i) for i in range(len(names))), default=0)
        self.resident_bytes = 0
        self.closed = False

    # -- accounting
    def _block_nbytes(self, i) -> int:
        raw = self._weights.nbytes(i)
        if self.dtype is None:
            return raw
        scale = torch.empty((), dtype=self.dtype).element_size()
        return (
            sum(
                math.prod(t.shape) * (scale if t.is_floating_point() else t.element_size())
                for t in [*self._weights.blocks[i].parameters(), *self._weights.blocks[i].buffers()]
            )
            if raw
            else 0
        )

    def _count(self, delta: int) -> None:
        with self._lock:
            self._live += delta
            self.peak_resident_bytes = max(self.peak_resident_bytes, self._live)

    # -- loading
    def _materialise(self, i) -> dict[str, torch.Tensor]:
        """Block ``i``'s tensors on the device (runs in the prefetch thread)."""
        host = self._weights.host(i)
        dev = self.device
        out = {}
        if self._side is None:
            for k, t in host.items():
                dtype = self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype
                out[k] = t.to(device=dev if dev is not None else t.device, dtype=dtype)
            return out
        with torch.cuda.device(dev), torch.cuda.stream(self._side):  # this thread's device too
            for k, t in host.items():
                dtype = self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype
                if t.is_pinned() and t.dtype == dtype:
                    pinned = t  # read from the checkpoint straight into pinned memory
                else:
                    pinned = torch.empty(t.shape, dtype=dtype, pin_memory=True)
                    pinned.copy_(t)
                out[k] = pinned.to(dev, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._side)
        out["\0event"] = event
        return out

    def _start(self, i):
        nbytes = self._block_nbytes(i)
        self._count(nbytes)
        if self._weights.in_place:
            return (i, self._weights.tensors(i), nbytes)
        if self._pool is None:
            try:
                return (i, self._materialise(i), nbytes)
            except BaseException:
                self._count(-nbytes)
                raise
        return (i, self._pool.submit(self._materialise, i), nbytes)

    def _finish(self, pending) -> dict[str, torch.Tensor]:
        _, value, nbytes = pending
        if not isinstance(value, dict):
            try:
                value = value.result()
            except BaseException:
                self._count(-nbytes)
                raise
        event = value.pop("\0event", None)
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            for t in value.values():
                t.record_stream(stream)
        return value

    def _drop_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        _, value, nbytes = pending
        if not isinstance(value, dict):
            with suppress(BaseException):  # dropped: its failure does not matter any more
                value.result()
        self._count(-nbytes)

    def _next(self, i, backward) -> int | None:
        if not backward and i + 1 < len(self.names):
            return i + 1
        later = [j for j in self._needs_backward if (j < i if backward else True)]
        return max(later) if later else None

    def _note_forward(self, i, needs_grad) -> None:
        if self.closed:
            raise FusedStatsError("this stream_blocks model was closed")
        if i == 0:
            self._needs_backward.clear()
        if needs_grad:
            self._needs_backward.add(i)
        else:
            self._needs_backward.discard(i)

    def _acquire(self, i, backward) -> dict[str, torch.Tensor]:
        pending = self._pending
        if pending is not None and pending[0] == i:
            self._pending = None
        else:
            self._drop_pending()
            pending = self._start(i)
        self._current = pending
        try:
            weights = self._finish(pending)
        except BaseException:
            self._current = None
            self._drop_pending()
            raise
        if backward:
            self._needs_backward.discard(i)
        if self.prefetch:
            nxt = self._next(i, backward)
            if nxt is not None and nxt != i:
                self._pending = self._start(nxt)
            self._keep = nxt == i
        else:
            self._keep = False
        self._current_weights = weights if self._keep else None
        return weights

    def _release(self, i, backward) -> None:
        current, self._current = self._current, None
        if current is None:
            return
        if self._keep and self._pending is None:
            # the next call needs this very block (last forward, then its backward): keep it
            self._pending = (i, self._current_weights, current[2])
            self._current_weights = None
            return
        self._current_weights = None
        self._count(-current[2])

    def _offload(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return x
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
        return host

    # -- life cycle
    def close(self) -> None:
        """Release every materialised block and the prefetch thread; a module source gets its
        blocks, tensors, device placement and flags back exactly."""
        if self.closed:
            return
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._restore()
        self.closed = True

    def __enter__(self) -> BlockStreamer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"BlockStreamer({type(self.model).__name__}, blocks={len(self.names)}, "
            f"block_bytes={self.block_bytes}, resident_bytes={self.resident_bytes}, "
            f"prefetch={self.prefetch})"
        )
