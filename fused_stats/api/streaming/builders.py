"""Building a weight-streamed model: :func:`stream_blocks` from a module or a checkpoint folder.

Role: :func:`stream_blocks` turns a model (an ``nn.Module`` in host memory, or a local Hugging Face
checkpoint folder) into one whose repeated blocks (LLaMA ``model.layers``, GPT-NeoX
``gpt_neox.layers``, GPT-2 ``transformer.h``, ResNet stage blocks: the blocks
:func:`fused_stats.residual_points` finds) hold their weights only while they run; embeddings,
final norm and head stay resident on ``device``. Each block is replaced by a
:class:`~fused_stats.api.streaming.recompute.StreamedBlock` at the same module name, so the
probe's points are unchanged; the recomputation runs the same operations on the same values, so
all statistics are exact. Cost: one extra forward per block.

For a folder, the model is built from ``config.json`` with every parameter on the meta device
(buffers real: rotary tables and masks are computed by the constructors, on the CPU and in the
dtype ``from_pretrained`` computes them in), the resident tensors are read once, and each block's
tensors are read by name from the safetensors shards whenever the block runs
(:mod:`~fused_stats.api.streaming.shards`; checked first, so a bad checkpoint raises before a step
folds anything). Streamed blocks run without a KV cache (``config.use_cache`` is set to False).
"""

from __future__ import annotations

import copy
import math
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ...errors import FusedStatsError
from ...networks.pretrained import resolve_model
from ..probe.points import residual_points
from .recompute import StreamedBlock
from .shards import CheckpointShards
from .streamer import BlockStreamer


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


def _init_buffers_as_from_pretrained(model) -> None:
    """Recompute the buffers a checkpoint does not hold (non-persistent rotary tables, masks) the
    way ``from_pretrained`` does, so that they are bit-identical to its model's.

    ``from_config`` computes them in its constructors and ``post_init`` inside the build's dtype
    context; ``from_pretrained`` builds on the meta device and recomputes them with the model's own
    ``initialize_weights`` after leaving that context, i.e. in the caller's default dtype, then
    casts into the buffer (GPT-J's ``embed_positions``: an fp32 table in an fp64 buffer, 4e-8 away
    from the fp64 one). The same call is made here: every module is marked uninitialised, the
    parameters are still on the meta device (their initialisers do nothing there), and whatever
    the checkpoint holds is loaded over the buffers afterwards.
    """
    initialize = getattr(model, "initialize_weights", None)
    if not callable(initialize):
        return  # not a transformers model: its constructors' buffers are all there is
    for module in model.modules():
        module._is_hf_initialized = False
    initialize()


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
    """Block weights read by name from a checkpoint's safetensors shards.

    A tensor the checkpoint stores in pieces (a mixture-of-experts block saved one expert at a
    time, fused into one ``experts.gate_up_proj`` by ``from_pretrained``) is assembled from its
    pieces by transformers' own converter for it (:func:`_converted_tensors`), after the pieces
    are read into the block's buffer.
    """

    in_place = False

    def __init__(self, checkpoint: CheckpointShards, model, blocks, prefixes, dtype, expected_dtype, strip):
        self.checkpoint, self.model, self.blocks, self.dtype = checkpoint, model, blocks, dtype
        self.prefixes = prefixes
        converted = _converted_tensors(model, list(checkpoint.files))
        self.entries, self.extra, self.groups = [], [], []
        for block, prefix in zip(blocks, prefixes):
            entries, extra, groups = {}, {}, {}
            persistent = {
                f"{m}.{b}".lstrip(".")
                for m, mod in block.named_modules()
                for b in mod._buffers
                if b not in mod._non_persistent_buffers_set
            }
            for local, t in [*block.named_parameters(), *block.named_buffers()]:
                if not (local in persistent or isinstance(t, nn.Parameter)):
                    extra[local] = t  # a non-persistent buffer the constructor computed
                    continue
                name = _lookup(checkpoint, f"{prefix}.{local}", strip)
                group = converted.get(f"{prefix}.{local}")
                if name in checkpoint.files or group is None:
                    entries[local] = checkpoint.entry(name, t.shape, t.dtype, expected_dtype)
                    continue
                first, template, sources = group
                if first not in groups:
                    groups[first] = (template, sources)
                    for key, _ in sources:
                        _, shape = checkpoint.specs[checkpoint.files[key]][key]
                        entries[f"\0{key}"] = checkpoint.entry(key, shape, t.dtype, expected_dtype)
            self.entries.append(entries)
            self.extra.append(extra)
            self.groups.append(groups)
        self.sizes = [
            sum(math.prod(t.shape) * t.element_size() for t in [*b.parameters(), *b.buffers()])
            for b in blocks
        ]

    def nbytes(self, i) -> int:
        return self.sizes[i]

    pin = False

    def host(self, i) -> dict[str, torch.Tensor]:
        out = self.checkpoint.load(self.entries[i], pin=self.pin)
        if self.groups[i]:
            out.update(self._assemble(i, out))
        out.update({k: v.detach() for k, v in self.extra[i].items()})
        return out

    def _assemble(self, i, loaded) -> dict[str, torch.Tensor]:
        """Block ``i``'s converted tensors from their pieces (popped from ``loaded``)."""
        prefix, block = self.prefixes[i], self.blocks[i]
        shapes = {k: tuple(t.shape) for k, t in [*block.named_parameters(), *block.named_buffers()]}
        out = {}
        for first, (template, sources) in self.groups[i].items():
            converter = copy.deepcopy(template)  # it collects tensors: one fresh copy per use
            for key, pattern in sources:
                converter.add_tensor(first, key, pattern, loaded.pop(f"\0{key}"))
            with torch.no_grad():
                produced = converter.convert(first, model=self.model, config=self.model.config)
            for target, t in produced.items():
                t = t[0] if isinstance(t, list) else t
                local = target[len(prefix) + 1 :]
                if not target.startswith(prefix + ".") or local not in shapes:
                    continue
                if tuple(t.shape) != shapes[local]:
                    raise FusedStatsError(
                        f"tensor {target!r} assembled from {[k for k, _ in sources][:3]}... in "
                        f"{self.checkpoint.folder} has shape {tuple(t.shape)}; the config gives {shapes[local]}"
                    )
                out[local] = t
        return out


def _converted_tensors(model, stored) -> dict[str, tuple]:
    """Model tensor name -> ``(first target, converter, [(checkpoint name, source pattern)])`` for
    every tensor that ``from_pretrained`` assembles from several checkpoint tensors.

    Built with transformers' own loading rules (``get_model_conversion_mapping`` and
    ``rename_source_key``, as ``convert_and_load_state_dict_in_model`` uses them), so every layout
    that ``from_pretrained`` accepts is read the same way; pieces are ordered as it orders them
    (``dot_natural_key``: expert 10 after expert 9). Empty when this transformers has no such rules.
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        mapping = get_model_conversion_mapping(model)
    except Exception:  # an older or newer transformers without these rules: names as stored
        return {}
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    if not converters:
        return {}
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    groups: dict[str, tuple] = {}
    for key in sorted(stored, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if pattern is None or renamed not in meta:
            continue
        template = by_pattern[pattern]
        _, _, sources = groups.setdefault(renamed, (renamed, template, []))
        sources.append((key, pattern))
    out = {}
    for first, (_, template, sources) in groups.items():
        for target in template.target_patterns:  # one group may give several tensors (q, k, v)
            out[first.replace(template.target_patterns[0], target)] = (first, template, sources)
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


def _lookup(checkpoint: CheckpointShards, name: str, strip: str | None) -> str:
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
        ``model.safetensors.index.json``); a known pretrained name or a ``.gguf`` file is read from
        its converted folder (:func:`fused_stats.pretrained_folder`).
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
        # a known pretrained name or a .gguf file: its converted folder (fs.pretrained_folder)
        return _from_folder(Path(resolve_model(source)), dev, dtype, prefetch)
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
    checkpoint = CheckpointShards(folder)
    config.use_cache = False
    try:
        with _parameters_on_meta():
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=build_dtype)
    except (ValueError, KeyError) as exc:
        raise FusedStatsError(
            f"stream_blocks: {folder / 'config.json'} does not describe a causal LM: {exc}"
        ) from None
    _init_buffers_as_from_pretrained(model)
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
    weights = _FolderWeights(checkpoint, model, blocks, names, dtype, declared, strip)
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
