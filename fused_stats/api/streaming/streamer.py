"""Weight-streamed blocks: exact probing of models whose block stack does not fit on the device.

Role: :func:`stream_blocks` turns a model (an ``nn.Module`` in host memory, or a local Hugging Face
checkpoint folder) into one whose repeated blocks (LLaMA ``model.layers``, GPT-NeoX
``gpt_neox.layers``, GPT-2 ``transformer.h``, ResNet stage blocks: the blocks
:func:`fused_stats.residual_points` finds) hold their weights only while they run. Embeddings,
final norm and head stay resident on ``device``.

Each block is replaced by a :class:`StreamedBlock` proxy at the same module name, so the probe's
points are unchanged. Its forward materialises the block's weights, runs the real block without
grad, keeps only the block's input ``x`` (on the host when the device is a GPU), drops the weights
and returns the output ``y`` through a custom autograd Function. That Function's backward
materialises the weights again, recomputes ``y = f(x)`` with grad from the saved input and returns
``∂L/∂x = (∂y/∂x)ᵀ ∂L/∂y`` (gradient checkpointing, Chen et al. 2016, at block granularity), so
autograd never holds a block's weights. The recomputation runs the same operations on the same
values, so the gradient every point hook sees is the in-memory one: all statistics are exact.
Cost: one extra forward per block. With ``prefetch=1`` the next block's weights load in a
background thread (on a GPU: into pinned memory, then a side CUDA stream) while the current block
computes. Block memory: at most ``(1 + prefetch)`` blocks materialised at once
(:attr:`BlockStreamer.peak_resident_bytes`).

For a folder, the model is built from ``config.json`` with every parameter on the meta device
(buffers real: rotary tables and masks are computed by the constructors), the resident tensors
are read once, and each block's tensors are read by name from the safetensors shards whenever
the block runs (the header is checked first: a missing, truncated or mismatching tensor is a
:class:`~fused_stats.FusedStatsError` naming the file and tensor, raised before the step folds
anything). Streamed blocks run without a KV cache (``config.use_cache`` is set to False).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call

from ...errors import FusedStatsError
from ..probe.points import residual_points

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype codes (the format's header spelling)
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


# ----------------------------------------------------------------------------- devices
def _resolve_device(device) -> torch.device | None:
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise FusedStatsError(f"stream_blocks: device {device!r} is not a torch device: {exc}") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = dev.index if dev.index is not None else (torch.cuda.current_device() if count else 0)
        if index >= count:
            raise FusedStatsError(
                f"stream_blocks: device {device!r} does not exist (this machine has {count} CUDA device(s))"
            )
        return torch.device("cuda", index)
    raise FusedStatsError(f"stream_blocks: device {device!r} is not supported; use 'cpu' or 'cuda[:i]'")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------- safetensors headers
def _read_header(path: Path) -> dict:
    """The safetensors header of ``path`` (``name -> {dtype, shape, data_offsets}``), checked
    against the file's size (a truncated shard is detected here, never by reading past its end)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise FusedStatsError(f"checkpoint shard {path} is truncated ({size} bytes, no header)")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise FusedStatsError(
                    f"checkpoint shard {path} is truncated: header of {length} bytes in a file of {size}"
                )
            header = json.loads(handle.read(length))
    except FileNotFoundError:
        raise FusedStatsError(f"checkpoint shard {path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FusedStatsError(f"checkpoint shard {path} has an unreadable header: {exc}") from None
    header.pop("__metadata__", None)
    header["\0base"] = 8 + length
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "\0base"), default=0)
    if 8 + length + end > size:
        raise FusedStatsError(
            f"checkpoint shard {path} is truncated: its tensors need "
            f"{8 + length + end} bytes, the file has {size}"
        )
    return header


class _Checkpoint:
    """Tensor name -> shard file of a checkpoint folder, with every shard's header."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
                raise FusedStatsError(f"checkpoint index {index} is unreadable: {exc}") from None
            self.files = {name: folder / file for name, file in weight_map.items()}
        elif (folder / SINGLE_FILE).is_file():
            self.files = None
        else:
            raise FusedStatsError(f"checkpoint folder {folder} has neither {INDEX_FILE} nor {SINGLE_FILE}")
        shards = sorted(set(self.files.values())) if self.files else [folder / SINGLE_FILE]
        self.headers = {path: _read_header(path) for path in shards}
        self.aliases: dict[str, str] = {}
        if self.files is None:
            self.files = {
                name: folder / SINGLE_FILE for name in self.headers[folder / SINGLE_FILE] if name != "\0base"
            }
        for name, path in self.files.items():
            if name not in self.headers[path]:
                raise FusedStatsError(
                    f"checkpoint index {index} puts tensor {name!r} in {path.name}, "
                    "whose header does not hold it"
                )

    def entry(self, name: str, shape, dtype, expected_dtype) -> tuple[Path, str]:
        """``(shard, name)`` of tensor ``name``, its header checked against ``shape`` and the
        config's dtype."""
        path = self.files.get(name)
        if path is None:
            raise FusedStatsError(
                f"tensor {name!r} is missing from the checkpoint in {self.folder} "
                f"(the model built from its config needs it, shape {tuple(shape)})"
            )
        info = self.headers[path][name]
        got_dtype = _ST_DTYPES.get(info["dtype"])
        if tuple(info["shape"]) != tuple(shape):
            raise FusedStatsError(
                f"tensor {name!r} in {path} has shape {tuple(info['shape'])}; the config gives {tuple(shape)}"
            )
        want = expected_dtype if dtype.is_floating_point else dtype
        if want is not None and got_dtype != want:
            raise FusedStatsError(
                f"tensor {name!r} in {path} has dtype {info['dtype']}; the config gives {want}"
            )
        return path, name

    def load(self, entries: dict[str, tuple[Path, str]], pin: bool = False) -> dict[str, torch.Tensor]:
        """Read ``local name -> (shard, tensor name)`` from the shards as CPU tensors, all views
        of ONE fresh buffer (pinned when ``pin``): the bytes go from the file straight into it
        (safetensors layout: little-endian data at the header's offsets; no pickle, nothing else
        read), and one allocation per block is returned to the system when the block is dropped.
        Each shard's header is re-checked first (the file may have changed since it was opened)."""
        by_file: dict[Path, list] = {}
        for local, (path, name) in entries.items():
            by_file.setdefault(path, []).append((local, name))
        layout, total = [], 0
        for path, names in by_file.items():
            fresh = _read_header(path)
            for local, name in names:
                was, now = self.headers[path][name], fresh.get(name)
                if now is None:
                    raise FusedStatsError(f"tensor {name!r} is missing from checkpoint shard {path}")
                if (now["dtype"], list(now["shape"])) != (was["dtype"], list(was["shape"])):
                    raise FusedStatsError(
                        f"tensor {name!r} in {path} has shape {tuple(now['shape'])} and dtype "
                        f"{now['dtype']}; the config gives shape {tuple(was['shape'])}, dtype "
                        f"{was['dtype']}"
                    )
                begin, stop = (int(x) for x in now["data_offsets"])
                layout.append(
                    (
                        local,
                        name,
                        path,
                        fresh["\0base"] + begin,
                        stop - begin,
                        total,
                        _ST_DTYPES[now["dtype"]],
                        tuple(now["shape"]),
                    )
                )
                total += (stop - begin + 63) // 64 * 64  # 64-byte aligned views
        if pin:
            buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        else:
            # its own anonymous mapping, unmapped when the last view is dropped: a malloc'd block
            # would raise glibc's dynamic mmap threshold and leave later activations on the heap
            buffer = torch.frombuffer(mmap.mmap(-1, max(total, 1)), dtype=torch.uint8)[:total]
        raw = buffer.numpy()
        out = {}
        handles = {}
        try:
            for local, name, path, offset, size, at, dtype, shape in layout:
                handle = handles.get(path) or handles.setdefault(path, open(path, "rb"))  # noqa: SIM115  (closed in the finally below)
                handle.seek(offset)
                got = handle.readinto(memoryview(raw[at : at + size]))
                if got != size:
                    raise FusedStatsError(
                        f"checkpoint shard {path} is truncated: tensor {name!r} "
                        f"needs {size} bytes at offset {offset}, read {got}"
                    )
                out[local] = buffer[at : at + size].view(dtype).view(shape)
        except OSError as exc:
            raise FusedStatsError(f"cannot read checkpoint shard {path}: {exc}") from None
        finally:
            for handle in handles.values():
                handle.close()
        return out


@contextmanager
def _parameters_on_meta():
    """Build modules with every parameter on the meta device and real buffers (constructors
    compute rotary tables and masks; parameters come from the checkpoint)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


# ----------------------------------------------------------------------------- the proxy
def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output, lambda t: t
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        rest = list(output[1:])
        if isinstance(output, tuple) and hasattr(output, "_fields"):
            return output[0], lambda t: type(output)(t, *rest)
        kind = type(output) if type(output) in (tuple, list) else tuple
        return output[0], lambda t: kind([t, *rest])
    raise FusedStatsError(
        f"a streamed block returned {type(output).__name__}; expected a tensor or "
        "a tuple whose first element is a tensor"
    )


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)


class _BlockFunction(torch.autograd.Function):
    """Identity for autograd on the block's output; the backward recomputes the block."""

    @staticmethod
    def forward(ctx, x, run):
        ctx.run = run
        # the run keeps its input only: a reference to the output would keep every block's output
        # on the device until the backward (the probe's hooks need none of them)
        output, run.output = run.output, None
        return output

    @staticmethod
    def backward(ctx, grad):
        run, ctx.run = ctx.run, None
        return run.backward(grad), None


class _Run:
    """One forward of one streamed block, kept for its backward (the input only, on the host
    for a GPU, plus references to the block's other arguments)."""

    def __init__(self, proxy, x, args, kwargs):
        self.proxy, self.args, self.kwargs = proxy, args, kwargs
        self.device = x.device
        self.saved = proxy.streamer._offload(x.detach())
        self.output = None
        self.rng = None

    def backward(self, grad):
        proxy = self.proxy
        streamer = proxy.streamer
        weights = streamer._acquire(proxy.index, backward=True)
        try:
            x = self.saved.to(self.device, non_blocking=True).requires_grad_()
            self.saved = None
            with torch.enable_grad(), torch.random.fork_rng(devices=[], enabled=self.rng is not None):
                if self.rng is not None:
                    torch.set_rng_state(self.rng)
                out = functional_call(proxy.block, weights, (x, *self.args), self.kwargs)
                y, _ = _first_tensor(out)
                (gx,) = torch.autograd.grad(y, x, grad)
            del out, y, x
        finally:
            del weights
            streamer._release(proxy.index, backward=True)
        return gx


class StreamedBlock(nn.Module):
    """Stands in for block ``index`` of a :class:`BlockStreamer` (module docstring); the real block
    is its ``block`` child, whose weights the streamer materialises per call."""

    def __init__(self, streamer: BlockStreamer, index: int, block: nn.Module):
        super().__init__()
        self.streamer = streamer  # a plain attribute: not a module, not in state_dict
        self.index = index
        self.block = block
        self.training = block.training

    @property
    def streamed_block(self) -> nn.Module:
        return self.block

    def forward(self, x, *args, **kwargs):
        streamer = self.streamer
        if not isinstance(x, torch.Tensor):
            raise FusedStatsError(
                f"streamed block {streamer.names[self.index]!r} needs a tensor as its "
                f"first argument, got {type(x).__name__}"
            )
        for value in (*args, *kwargs.values()):
            if type(value).__name__.endswith("Cache") or (
                isinstance(value, (tuple, list)) and any(type(v).__name__.endswith("Cache") for v in value)
            ):
                raise FusedStatsError(
                    f"streamed block {streamer.names[self.index]!r} got a KV cache "
                    f"({type(value).__name__}); streamed blocks run without one: pass use_cache=False"
                )
        grad_in = [t for t in _tensors_in((args, kwargs)) if t.requires_grad]
        if grad_in and torch.is_grad_enabled():
            raise FusedStatsError(
                f"streamed block {streamer.names[self.index]!r}: an argument other than the hidden "
                f"state requires grad (shape {tuple(grad_in[0].shape)}); only the first argument is "
                "differentiated through a streamed block"
            )
        needs_grad = torch.is_grad_enabled() and x.requires_grad
        run = _Run(self, x, args, kwargs) if needs_grad else None
        if run is not None and self.block.training:
            run.rng = torch.get_rng_state()
        if self.block.training != self.training:
            self.block.train(self.training)
        streamer._note_forward(self.index, needs_grad)
        weights = streamer._acquire(self.index, backward=False)
        try:
            with torch.no_grad():
                out = functional_call(self.block, weights, (x.detach(), *args), kwargs)
        finally:
            del weights
            streamer._release(self.index, backward=False)
        y, rebuild = _first_tensor(out)
        if run is None:
            return out
        run.output = y
        return rebuild(_BlockFunction.apply(x, run))


# ----------------------------------------------------------------------------- weight sources
class _ModuleWeights:
    """Block weights from the blocks' own host tensors."""

    def __init__(self, blocks, device, dtype, pin):
        self.blocks, self.device, self.dtype, self.pin = blocks, device, dtype, pin
        first = next((t for b in blocks for t in b.parameters()), None)
        self.in_place = (first is None or (device is None or first.device == device)) and dtype is None

    def tensors(self, i) -> dict[str, torch.Tensor]:
        block = self.blocks[i]
        return {**dict(block.named_parameters()), **dict(block.named_buffers())}

    def nbytes(self, i) -> int:
        return _nbytes(self.tensors(i).values())

    def host(self, i) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.tensors(i).items()}


class _FolderWeights:
    """Block weights read by name from a checkpoint's safetensors shards."""

    in_place = False

    def __init__(self, checkpoint: _Checkpoint, blocks, prefixes, dtype, expected_dtype, strip):
        self.checkpoint, self.blocks, self.dtype = checkpoint, blocks, dtype
        self.entries, self.extra = [], []
        for block, prefix in zip(blocks, prefixes):
            entries, extra = {}, {}
            persistent = {
                f"{m}.{b}".lstrip(".")
                for m, mod in block.named_modules()
                for b in mod._buffers
                if b not in mod._non_persistent_buffers_set
            }
            for local, t in [*block.named_parameters(), *block.named_buffers()]:
                if local in persistent or isinstance(t, nn.Parameter):
                    entries[local] = checkpoint.entry(
                        _lookup(checkpoint, f"{prefix}.{local}", strip), t.shape, t.dtype, expected_dtype
                    )
                else:
                    extra[local] = t  # a non-persistent buffer the constructor computed
            self.entries.append(entries)
            self.extra.append(extra)
        self.sizes = [
            sum(math.prod(t.shape) * t.element_size() for t in [*b.parameters(), *b.buffers()])
            for b in blocks
        ]

    def nbytes(self, i) -> int:
        return self.sizes[i]

    pin = False

    def host(self, i) -> dict[str, torch.Tensor]:
        out = self.checkpoint.load(self.entries[i], pin=self.pin)
        out.update({k: v.detach() for k, v in self.extra[i].items()})
        return out


def _checkpoint_aliases(model, names) -> dict[str, str]:
    """Model tensor name -> checkpoint tensor name for checkpoints saved under legacy names
    (transformers' own renaming rules, e.g. GPT-NeoX ``embed_out`` -> ``lm_head``)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        renames = [t for t in get_model_conversion_mapping(model) if type(t).__name__ == "WeightRenaming"]
    except Exception:  # an older or newer transformers without these rules: names as stored
        return {}
    out = {}
    for stored in names:
        key = stored
        for rule in renames:
            key = rule.rename_source_key(key)[0]
        if key != stored:
            out[key] = stored
    return out


def _lookup(checkpoint: _Checkpoint, name: str, strip: str | None) -> str:
    """A model tensor name as the checkpoint spells it (legacy renamings, with or without the
    base-model prefix)."""
    if name in checkpoint.files:
        return name
    if name in checkpoint.aliases:
        return checkpoint.aliases[name]
    if not strip or not name.startswith(strip + "."):
        return name
    short = name[len(strip) + 1 :]
    return short if short in checkpoint.files else name


# ----------------------------------------------------------------------------- the streamer
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


def _block_names(model: nn.Module, where: str) -> list[str]:
    try:
        names = residual_points(model)
    except FusedStatsError as exc:
        raise FusedStatsError(f"stream_blocks: no recognisable block stack in {where}: {exc}") from None
    return names


def _swap(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    parent, _, key = name.rpartition(".")
    container = model.get_submodule(parent) if parent else model
    old = container._modules[key]
    container._modules[key] = new
    return old


def _resident_tensors(model: nn.Module, names: list[str]):
    """``(module, attribute, tensor, is_parameter, full name)`` of every non-block tensor slot
    (tied weights appear once per slot)."""
    prefixes = tuple(n + "." for n in names)
    out = []
    for mname, module in model.named_modules(remove_duplicate=False):
        if mname in names or mname.startswith(prefixes):
            continue
        for kind, table in (("p", module._parameters), ("b", module._buffers)):
            for attr, t in table.items():
                if t is not None:
                    out.append((module, attr, t, kind == "p", f"{mname}.{attr}".lstrip(".")))
    return out


def stream_blocks(source, device=None, dtype=None, prefetch: int = 1) -> BlockStreamer:
    """A model whose block stack is streamed block by block (module docstring).

    Parameters
    ----------
    source : nn.Module or str or Path
        A module whose weights are in host memory (changed in place until ``close()``, then
        restored exactly), or a local HF checkpoint folder (``config.json`` plus
        ``model.safetensors`` or sharded ``model-*-of-*.safetensors`` with
        ``model.safetensors.index.json``).
    device : None, str or torch.device
        Where blocks run and the resident parts live (default: the module's device; CPU for a folder).
    dtype : None or torch.dtype
        Cast floating-point weights to this dtype (default: as stored / as the config says).
    prefetch : {0, 1}
        Load the next block while the current one computes.

    Returns
    -------
    BlockStreamer
        ``.model``, ``.block_bytes``, ``.resident_bytes``, ``.peak_resident_bytes``, ``close()``.
    """
    if prefetch not in (0, 1) or isinstance(prefetch, bool):
        raise FusedStatsError(f"prefetch must be 0 or 1, got {prefetch!r}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise FusedStatsError(f"dtype must be a torch.dtype or None, got {dtype!r}")
    dev = _resolve_device(device)
    if isinstance(source, nn.Module):
        return _from_module(source, dev, dtype, prefetch)
    if isinstance(source, (str, os.PathLike)):
        return _from_folder(Path(source), dev, dtype, prefetch)
    raise FusedStatsError(
        f"stream_blocks needs an nn.Module or a checkpoint folder, got {type(source).__name__}"
    )


def _set_use_cache(model, value):
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "use_cache"):
        return lambda: None
    old = config.use_cache
    config.use_cache = value
    return lambda: setattr(config, "use_cache", old)


def _from_module(model: nn.Module, dev, dtype, prefetch) -> BlockStreamer:
    names = _block_names(model, type(model).__name__)
    if any(isinstance(model.get_submodule(n), StreamedBlock) for n in names):
        raise FusedStatsError(
            "stream_blocks: this model's blocks are already streamed; close() the other streamer first"
        )
    blocks = [model.get_submodule(n) for n in names]
    resident = _resident_tensors(model, names)
    first = next((t for b in blocks for t in b.parameters()), None)
    if dev is None:
        dev = first.device if first is not None else torch.device("cpu")
    weights = _ModuleWeights(blocks, dev, dtype, pin=dev.type == "cuda")
    flags = [(m, m.training) for m in model.modules()]
    # resident tensors: moved/cast by swapping the tensor in each slot (restored at close)
    originals = []
    moved: dict[int, torch.Tensor] = {}
    for module, attr, t, is_param, _ in resident:
        target_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if t.device == dev and t.dtype == target_dtype:
            continue
        originals.append((module, attr, t, is_param))
        if id(t) not in moved:
            data = t.detach().to(device=dev, dtype=target_dtype)
            moved[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if is_param else data
        (module._parameters if is_param else module._buffers)[attr] = moved[id(t)]
    restore_cache = _set_use_cache(model, False)

    def restore():
        for name, block in zip(names, blocks):
            _swap(model, name, block)
        for module, attr, t, is_param in originals:
            (module._parameters if is_param else module._buffers)[attr] = t
        for m, training in flags:
            m.training = training
        restore_cache()

    streamer = BlockStreamer(model, names, weights, dev, dtype, prefetch, restore)
    for i, (name, block) in enumerate(zip(names, blocks)):
        _swap(model, name, StreamedBlock(streamer, i, block))
    seen = {}
    for _, _, t, _, _ in _resident_tensors(model, names):
        seen[id(t)] = t
    streamer.resident_bytes = _nbytes(seen.values())
    return streamer


def _from_folder(folder: Path, dev, dtype, prefetch) -> BlockStreamer:
    if not folder.is_dir():
        raise FusedStatsError(f"stream_blocks: checkpoint folder {folder} does not exist")
    if not (folder / "config.json").is_file():
        raise FusedStatsError(f"stream_blocks: {folder} has no config.json")
    try:
        import transformers
    except ImportError:
        raise FusedStatsError(
            "stream_blocks from a folder needs transformers: pip install 'fused-stats[hf]'"
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise FusedStatsError(f"stream_blocks: cannot read {folder / 'config.json'}: {exc}") from None
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    declared = declared if isinstance(declared, torch.dtype) else None
    build_dtype = dtype or declared or torch.float32
    checkpoint = _Checkpoint(folder)
    config.use_cache = False
    try:
        with _parameters_on_meta():
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=build_dtype)
    except (ValueError, KeyError) as exc:
        raise FusedStatsError(
            f"stream_blocks: {folder / 'config.json'} does not describe a causal LM: {exc}"
        ) from None
    names = _block_names(model, f"the model built from {folder / 'config.json'}")
    blocks = [model.get_submodule(n) for n in names]
    strip = getattr(model, "base_model_prefix", None)
    checkpoint.aliases = _checkpoint_aliases(model, list(checkpoint.files))
    dev = dev or torch.device("cpu")
    # resident tensors: every slot of one tensor object gets the same loaded tensor (tied weights)
    slots: dict[int, list] = {}
    for module, attr, t, is_param, full in _resident_tensors(model, names):
        slots.setdefault(id(t), []).append((module, attr, t, is_param, full))
    entries, keep = {}, {}
    for key, group in slots.items():
        module, attr, t, is_param, full = group[0]
        persistent = is_param or attr not in module._non_persistent_buffers_set
        found = [_lookup(checkpoint, g[4], strip) for g in group]
        found = [n for n in found if n in checkpoint.files]
        if found:
            entries[key] = checkpoint.entry(found[0], t.shape, t.dtype, declared)
        elif is_param or (persistent and t.device.type == "meta"):
            raise FusedStatsError(
                f"tensor {full!r} is missing from the checkpoint in {folder} (shape {tuple(t.shape)})"
            )
        else:
            keep[key] = t
    weights = _FolderWeights(checkpoint, blocks, names, dtype, declared, strip)
    weights.pin = dev.type == "cuda"
    loaded = checkpoint.load(entries)
    resident_seen = []
    for key, group in slots.items():
        t = group[0][2]
        if key in loaded:
            data = loaded[key]
            if dtype is not None and data.is_floating_point():
                data = data.to(dtype)
            elif data.is_floating_point():
                data = data.to(t.dtype)
        else:
            data = keep[key]
        data = data.to(dev)
        new = nn.Parameter(data, requires_grad=False) if group[0][3] else data
        resident_seen.append(data)
        for module, attr, _, is_param, _ in group:
            (module._parameters if is_param else module._buffers)[attr] = new
    model.eval()

    def restore():
        for name, block in zip(names, blocks):
            _swap(model, name, block)

    streamer = BlockStreamer(model, names, weights, dev, dtype, prefetch, restore)
    for i, (name, block) in enumerate(zip(names, blocks)):
        _swap(model, name, StreamedBlock(streamer, i, block))
    streamer.resident_bytes = _nbytes(resident_seen)
    return streamer
