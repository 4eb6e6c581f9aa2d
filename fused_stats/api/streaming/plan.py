"""Memory plan: accumulator bytes per insertion point before a probe run starts.

One :class:`~fused_stats.GradStats` of dimension ``d`` holds (fp64, 8 bytes a number)

* always: the centre ``c``, ``s`` and ``t`` (``3 d`` numbers) and four scalars
  (``A1, A2, max|q|, Σ|q|``);
* ``dense``: ``S`` (``d²`` numbers), whatever the number of samples;
* ``pool`` with ``N`` samples: the rows ``Y`` (``N d``) and their Gram matrix (``N²``);
* ``auto``: the pool while ``N d + N² ≤ d²`` (``N ≤ N* ≈ 0.618 d``), the dense ``S`` after, so never
  more than dense.

These are :meth:`GradStats.planned_nbytes` (the same count :meth:`GradStats.state_nbytes` reports for
a live accumulator). A probe keeps one accumulator per point and stream (train and held-out test),
so a run needs ``points × streams`` of them. Not included: the model and the activations autograd
keeps; a probe step adds one point's gradient at a time (reduced by its hook, then dropped) and
every point's reduced rows until the commit (``unit="sample"``: ``B × d`` fp64 a point;
``"position"``/``"flat"``: ``N × d`` fp64 a point, or one point at a time with ``atomic=False``),
and transients while a batch is folded in (one accumulator at a time: a pool append
briefly holds the old and the new Gram matrix; ``auto`` crossing ``N*`` briefly holds the pool and
``S``; per-batch centred rows ``B × d``).

Shapes come from ``dim`` and ``points`` or from a model config with ``hidden_size`` and
``num_hidden_layers`` (HF LLaMA / GPT-NeoX; GPT-2's ``n_embd`` / ``n_layer`` also work), one point
per block (the residual stream after each block).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ...accumulators import GradStats, auto_pool_limit
from ...errors import FusedStatsError

# (hidden size, number of blocks) of common model shapes, for sizing without a config file
PRESETS = {
    "gpt2": (768, 12),
    "pythia-1b": (2048, 16),
    "llama-7b": (4096, 32),
    "llama-13b": (5120, 40),
    "llama-70b": (8192, 80),
}
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_INTERMEDIATE_KEYS = ("intermediate_size", "n_inner", "ffn_dim")


@dataclass(frozen=True)
class MemoryPlan:
    """Accumulator bytes for one probe configuration (all byte counts are exact, not rounded)."""

    label: str
    dim: int
    points: int
    streams: int
    pool_size: int | None  # samples per accumulator assumed for pool / auto (None: not given)
    auto_switch: int  # auto turns dense above this many samples
    dense: int  # bytes per accumulator
    pool: int | None  # bytes per accumulator holding pool_size samples
    auto: int  # bytes per accumulator (the dense bound when pool_size is not given)
    auto_mode: str  # what auto holds at pool_size: "pool" or "dense"

    @property
    def accumulators(self) -> int:
        return self.points * self.streams

    def per_point(self, mode: str) -> int | None:
        """Bytes per insertion point (all streams) for ``mode`` in dense / pool / auto."""
        value = self._per_accumulator(mode)
        return None if value is None else value * self.streams

    def total(self, mode: str) -> int | None:
        """Bytes for the whole probe (every point and stream)."""
        value = self._per_accumulator(mode)
        return None if value is None else value * self.accumulators

    def _per_accumulator(self, mode: str) -> int | None:
        if mode not in ("dense", "pool", "auto"):
            raise FusedStatsError(f"mode must be 'dense', 'pool' or 'auto', got {mode!r}")
        return getattr(self, mode)

    def to_dict(self) -> dict:
        out = asdict(self)
        for mode in ("dense", "pool", "auto"):
            out[f"per_point_{mode}"] = self.per_point(mode)
            out[f"total_{mode}"] = self.total(mode)
        return out


def model_shape(model) -> tuple[int, int]:
    """``(hidden size, number of blocks)`` from a config dict, a JSON path or a config object."""
    if isinstance(model, (str, Path)):
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise FusedStatsError(f"cannot read a model config from {str(model)!r}: {exc}") from exc
    elif isinstance(model, dict):
        config = model
    else:
        config = {key: getattr(model, key) for key in _HIDDEN_KEYS + _LAYER_KEYS if hasattr(model, key)}
    if isinstance(config.get("text_config"), dict) and not any(k in config for k in _HIDDEN_KEYS):
        config = config["text_config"]  # multimodal configs nest the language model's
    hidden = next((config[k] for k in _HIDDEN_KEYS if isinstance(config.get(k), int)), None)
    layers = next((config[k] for k in _LAYER_KEYS if isinstance(config.get(k), int)), None)
    if hidden is None or layers is None:
        raise FusedStatsError(
            f"model config needs a hidden size (one of {_HIDDEN_KEYS}) and a block count (one of "
            f"{_LAYER_KEYS}); got keys {sorted(config)[:20]}"
        )
    return int(hidden), int(layers)


def model_intermediate(model) -> int | None:
    """MLP width ``F`` of a preset of :data:`STREAM_PRESETS` or of a config (JSON path, model
    folder or dict): ``intermediate_size`` (``n_inner``, ``ffn_dim``); GPT-2's ``n_inner: null``
    is HF's ``4 d``. None when the config names no MLP width."""
    if isinstance(model, str) and model in STREAM_PRESETS:
        return STREAM_PRESETS[model][2]
    if isinstance(model, dict):
        config = model
    else:
        path = Path(model)
        path = path / "config.json" if path.is_dir() else path
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise FusedStatsError(f"cannot read a model config from {str(model)!r}: {exc}") from exc
    if isinstance(config.get("text_config"), dict) and not any(k in config for k in _HIDDEN_KEYS):
        config = config["text_config"]
    width = next((config[k] for k in _INTERMEDIATE_KEYS if isinstance(config.get(k), int)), None)
    if width is None and config.get("model_type") == "gpt2" and "n_inner" in config:
        width = 4 * model_shape(config)[0]
    return width


def _positive(name: str, value, allow_zero: bool = False) -> int:
    low = 0 if allow_zero else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise FusedStatsError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def plan_memory(
    dim: int | None = None,
    points: int | None = None,
    pool_size: int | None = None,
    model=None,
    streams: int = 2,
    label: str | None = None,
) -> MemoryPlan:
    """Bytes per accumulator, per point and in total for the dense, pool and auto modes.

    Give ``dim`` and ``points``, or ``model`` (a config dict / JSON path / config object, see
    :func:`model_shape`; ``dim`` or ``points`` given too override it) or a preset name from
    :data:`PRESETS`. ``pool_size``: the number of samples each accumulator will see (for
    ``pool`` and ``auto``); without it ``pool`` is unknown and ``auto`` is its dense bound.
    ``streams``: 2 for a probe with train and test streams, 1 for one stream.
    """
    if model is not None:
        if isinstance(model, str) and model in PRESETS:
            hidden, layers = PRESETS[model]
            label = label or model
        else:
            hidden, layers = model_shape(model)
            label = label or (Path(model).stem if isinstance(model, (str, Path)) else "model")
        dim = hidden if dim is None else dim
        points = layers if points is None else points
    if dim is None or points is None:
        raise FusedStatsError("plan_memory needs dim and points, or a model config")
    dim = _positive("dim", dim)
    points = _positive("points", points)
    streams = _positive("streams", streams)
    if pool_size is not None:
        pool_size = _positive("pool_size", pool_size, allow_zero=True)
    switch = auto_pool_limit(dim)
    dense = GradStats.planned_nbytes(dim, "dense")
    pool = None if pool_size is None else GradStats.planned_nbytes(dim, "pool", pool_size)
    if pool_size is not None and pool_size <= switch:
        auto, auto_mode = pool, "pool"
    else:
        auto, auto_mode = dense, "dense"
    return MemoryPlan(
        label=label or f"d={dim}",
        dim=dim,
        points=points,
        streams=streams,
        pool_size=pool_size,
        auto_switch=switch,
        dense=dense,
        pool=pool,
        auto=auto,
        auto_mode=auto_mode,
    )


def human_count(n: int) -> str:
    """A parameter count with the unit that shows it (4 digits): 960, 2.592k, 202.4M, 1.5G."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def format_table(plans) -> str:
    """A plain-text table: bytes per accumulator and for the whole probe, per mode."""
    header = (
        f"{'shape':<12}{'d':>6}{'points':>7}{'streams':>8}{'pool N':>8}{'auto N*':>8}"
        f"{'dense/acc':>12}{'pool/acc':>12}{'auto/acc':>12}"
        f"{'dense total':>13}{'pool total':>13}{'auto total':>13}"
    )
    lines = [header, "-" * len(header)]
    for p in plans:
        lines.append(
            f"{p.label:<12}{p.dim:>6}{p.points:>7}{p.streams:>8}"
            f"{'-' if p.pool_size is None else p.pool_size:>8}{p.auto_switch:>8}"
            f"{human_bytes(p.dense):>12}{human_bytes(p.pool):>12}{human_bytes(p.auto):>12}"
            f"{human_bytes(p.total('dense')):>13}{human_bytes(p.total('pool')):>13}"
            f"{human_bytes(p.total('auto')):>13}"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- weight streaming
# full shapes of common models for the weight-streaming plan: (hidden, blocks, intermediate,
# attention heads, key/value heads, vocabulary, tied embeddings)
STREAM_PRESETS = {
    "gpt2": (768, 12, 3072, 12, 12, 50257, True),
    "pythia-1b": (2048, 16, 8192, 8, 8, 50304, False),
    "llama-7b": (4096, 32, 11008, 32, 32, 32000, False),
    "llama-13b": (5120, 40, 13824, 40, 40, 32000, False),
    "llama-70b": (8192, 80, 28672, 64, 8, 128256, False),  # LLaMA-3 70B
}


@dataclass(frozen=True)
class StreamPlan:
    """Memory of a weight-streamed probe step (:func:`fused_stats.stream_blocks`), in bytes.

    Device: the resident parts (embeddings, final norm, head), ``(1 + prefetch)`` blocks, one
    block's activations while its backward is recomputed, the gradient entering that block and
    the one it passes down (``2 N d`` numbers for ``N`` tokens: each point's gradient is reduced by
    its hook as it arrives and then dropped), the reduced rows kept until the step commits
    (``unit="sample"``: ``L B d`` fp64 for ``B`` samples; with ``cross=`` also the features
    ``L N r`` fp64) and the accumulators. Host: the saved block inputs (``L N d`` numbers) and,
    when the weights are streamed from host memory rather than from a checkpoint folder, the blocks.
    """

    label: str
    tokens: int
    dtype_bytes: int
    prefetch: int
    block_params: int
    resident_params: int
    blocks: int
    block_bytes: int
    resident_bytes: int
    streamed_blocks_bytes: int  # (1 + prefetch) blocks
    block_activation_bytes: int
    gradient_bytes: int  # the gradient entering the recomputed block and the one it returns
    reduced_bytes: int  # every point's reduced rows and cross features until the commit
    accumulator_bytes: int
    saved_input_bytes: int  # host
    host_weight_bytes: int  # host, when streaming from host memory
    cross_feature_bytes: int = 0  # the cross features, the part of reduced_bytes that cross_rank adds

    @property
    def device_bytes(self) -> int:
        return (
            self.resident_bytes
            + self.streamed_blocks_bytes
            + self.block_activation_bytes
            + self.gradient_bytes
            + self.reduced_bytes
            + self.accumulator_bytes
        )

    @property
    def model_bytes(self) -> int:
        return self.resident_bytes + self.blocks * self.block_bytes

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(device_bytes=self.device_bytes, model_bytes=self.model_bytes)
        return out


def _stream_shape(model) -> tuple:
    if isinstance(model, str) and model in STREAM_PRESETS:
        return STREAM_PRESETS[model]
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FusedStatsError(f"cannot read a model config from {str(model)!r}: {exc}") from exc
    d, layers = model_shape(config)

    def get(*keys, default=None):
        return next((config[k] for k in keys if isinstance(config.get(k), int)), default)

    heads = get("num_attention_heads", "n_head", default=1)
    return (
        d,
        layers,
        get("intermediate_size", "n_inner", default=4 * d) or 4 * d,
        heads,
        get("num_key_value_heads", default=heads),
        get("vocab_size", default=0),
        bool(config.get("tie_word_embeddings", False)),
    )


def _count_on_meta(model) -> tuple[int, int] | None:
    """``(largest block's parameters, the rest)`` of the model transformers builds from the config
    ``model`` (a folder or config JSON) on the meta device; None without transformers or for a
    config it cannot build (the formula of :func:`plan_streaming` is used then)."""
    try:
        import torch
        import transformers

        from ..probe.points import residual_points

        path = Path(model)
        folder = path if path.is_dir() else path.parent
        if not path.is_dir() and path.name != "config.json":
            fields = json.loads(path.read_text())
            config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        else:
            config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        with torch.device("meta"):
            built = transformers.AutoModelForCausalLM.from_config(config)
        names = residual_points(built)
    except Exception:  # any config transformers cannot build: the formula
        return None
    blocks = [sum(p.numel() for p in built.get_submodule(n).parameters()) for n in names]
    total = sum(p.numel() for p in built.parameters())  # tied weights once
    return max(blocks), total - sum(blocks)


def plan_streaming(
    model,
    tokens: int = 8192,
    dtype_bytes: int = 2,
    prefetch: int = 1,
    streams: int = 2,
    pool_size: int | None = None,
    from_folder: bool = True,
    samples: int = 8,
    cross_rank: int | None = None,
) -> StreamPlan:
    """:class:`StreamPlan` of a LLaMA-shaped model (a preset of :data:`STREAM_PRESETS`, or a
    config JSON / model folder) probed with weights streamed block by block.

    Counted per block: attention ``2 d² + 2 d d_kv`` (``d_kv = d · kv_heads / heads``), a gated MLP
    ``3 d f`` and two norms ``2 d``. One block's activations: ``N (8 d + 3 f)`` numbers (what
    autograd keeps for a LLaMA block's recomputed backward with fused attention, an estimate).
    Accumulators: :func:`plan_memory`'s ``auto`` total at ``pool_size`` (its dense bound without).
    For a config or folder (not a preset), the block and resident parameters are counted on the
    model transformers builds from it on the meta device, when it can: every architecture
    exactly, a mixture-of-experts block with all its experts, router and shared expert.
    ``samples``: sequences a batch (``unit="sample"`` keeps ``samples × d`` fp64 rows a point until
    the commit); ``cross_rank``: the rank of a ``cross=`` block (its fp64 features, ``N r`` a point,
    are kept from the forward to the point's gradient).
    """
    tokens = _positive("tokens", tokens)
    samples = _positive("samples", samples)
    if cross_rank is not None:
        cross_rank = _positive("cross_rank", cross_rank)
    if prefetch not in (0, 1):
        raise FusedStatsError(f"prefetch must be 0 or 1, got {prefetch!r}")
    d, layers, ff, heads, kv, vocab, tied = _stream_shape(model)
    d_kv = d * kv // max(heads, 1)
    block = 2 * d * d + 2 * d * d_kv + 3 * d * ff + 2 * d
    resident = vocab * d * (1 if tied else 2) + d
    counted = None if isinstance(model, str) and model in STREAM_PRESETS else _count_on_meta(model)
    if counted is not None:
        block, resident = counted
    b = dtype_bytes
    cross_features = layers * tokens * (cross_rank or 0) * 8
    acc = plan_memory(dim=d, points=layers, pool_size=pool_size, streams=streams).total("auto")
    label = model if isinstance(model, str) and model in STREAM_PRESETS else Path(model).stem
    return StreamPlan(
        label=label,
        tokens=tokens,
        dtype_bytes=b,
        prefetch=prefetch,
        block_params=block,
        resident_params=resident,
        blocks=layers,
        block_bytes=block * b,
        resident_bytes=resident * b,
        streamed_blocks_bytes=(1 + prefetch) * block * b,
        block_activation_bytes=tokens * (8 * d + 3 * ff) * b,
        gradient_bytes=2 * tokens * d * b,
        reduced_bytes=layers * samples * d * 8 + cross_features,
        accumulator_bytes=acc,
        saved_input_bytes=layers * tokens * d * b,
        host_weight_bytes=0 if from_folder else layers * block * b,
        cross_feature_bytes=cross_features,
    )


def format_stream_plan(p: StreamPlan) -> str:
    """Lines of a weight-streaming plan, device and host memory itemised."""
    h = human_bytes
    return "\n".join(
        [
            f"{p.label}: {p.blocks} blocks of {human_count(p.block_params)} parameters "
            f"({h(p.block_bytes)} each at {p.dtype_bytes} bytes), model {h(p.model_bytes)}; "
            f"{p.tokens} tokens a batch, prefetch {p.prefetch}",
            f"  device: resident parts {h(p.resident_bytes)} + {1 + p.prefetch} blocks "
            f"{h(p.streamed_blocks_bytes)} + one block's activations {h(p.block_activation_bytes)} "
            f"+ the gradients in and out of that block {h(p.gradient_bytes)} + every point's reduced "
            f"rows {h(p.reduced_bytes - p.cross_feature_bytes)}"
            + (f" + every point's cross features {h(p.cross_feature_bytes)}" if p.cross_feature_bytes else "")
            + f" + accumulators {h(p.accumulator_bytes)} = {h(p.device_bytes)}",
            f"  host: saved block inputs {h(p.saved_input_bytes)}"
            + (
                f" + block weights {h(p.host_weight_bytes)}"
                if p.host_weight_bytes
                else " (weights read from the checkpoint's shards)"
            ),
        ]
    )


def plan_tangent(
    dim: int,
    intermediate: int,
    points: int,
    projection: int | None = None,
    streams: int = 2,
    bias_maps: int = 0,
    w_in_bytes: int = 4,
) -> dict:
    """Bytes of the CrossStats that probe the exact tangent of a new layer (``cross=protocol``).

    The features are the inputs of the layer's zero maps, ``r = d + f`` (+1 per zero bias: GPT-2
    and GPT-NeoX have 2), so each accumulator holds ``Σ c_i`` (d × r, fp64) and no ``w_in`` (the
    features enter CrossStats as they are), or, with ``projection = k``, the k × r projection
    (``w_in_bytes`` a number: 4 for fp32 models, 8 for fp64) and then ``Σ c_i`` is d × k.
    ``block_params``: the probe also keeps each candidate's new layer (built once, on the model's
    device and dtype), ``4 d² + 3 d f + 2 d`` parameters for a LLaMA layer with as many KV heads
    as heads (fewer with grouped KV heads).
    """
    for name, value in (
        ("dim", dim),
        ("intermediate", intermediate),
        ("points", points),
        ("streams", streams),
    ):
        _positive(name, value)
    _positive("bias_maps", bias_maps, allow_zero=True)
    if projection is not None:
        _positive("projection", projection)
    r = dim + intermediate + bias_maps
    k = r if projection is None else projection
    w_in = 0 if projection is None else w_in_bytes * k * r
    per = 8 * (dim * k + 4) + w_in
    return {
        "dim": dim,
        "features": r,
        "rank": k,
        "projection": projection,
        "c_sum_bytes": 8 * dim * k,
        "w_in_bytes": w_in,
        "per_accumulator": per,
        "per_point": per * streams,
        "total": per * streams * points,
        "points": points,
        "streams": streams,
        "block_params": 4 * dim * dim + 3 * dim * intermediate + 2 * dim,
    }
