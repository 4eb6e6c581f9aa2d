"""Which architecture a model is, for growth: one table of adapters keyed by ``config.model_type``.

Role: :data:`ADAPTERS` holds, per HF ``model_type``, everything growth and its tangent need to
know of that family (an :class:`Adapter`); :data:`RESNET_BLOCKS` does the same for the project's
ResNet blocks (:mod:`fused_stats.networks.resnet`), keyed by their classes. :func:`describe` maps a
model to an :class:`Architecture`: its adapter, the block containers and the *boundaries* where a
block can be inserted. A boundary is a residual point (the output of block ``i``: the new block
takes position ``i + 1``) or, for a transformer, the *input point*, the module whose output
(times the adapter's ``input_scale``) is the stream entering block 0 (position 0). Nothing is
recognised by the names of a block's submodules: a model_type outside the table is refused.

The function-preserving origin of a new block (``init="zero"``):

* pre-norm blocks (``origin="zero_maps"``): the branch's last maps (weights and biases) at 0, so
  the block adds an exact ``+0`` to the stream;
* post-norm blocks (``origin="norm_scale"``: Gemma2, Gemma3, OLMo2, EXAONE 4; the branch output
  passes a norm after its last map): the scale of that norm at the value where it outputs 0,
  ``w = -1`` for Gemma's ``x̂ (1 + w)``, ``w = 0`` for a plain ``w x̂``;
* ResNet blocks: the last BatchNorm's scale and shift at 0 (the zero-init residual of Goyal et al.
  2017, "Accurate, large minibatch SGD", section 5.1), in a block built without its trailing ReLU
  (``out_relu=False``: ``z + F(z)``), so the zero block is the identity on any stream and smooth at
  its origin.

``branch_scale`` (Granite ``residual_multiplier``) multiplies the branch output before the
residual add; ``input_scale`` multiplies the input point's output before block 0 (Granite
``embedding_multiplier``; Gemma's ``sqrt(hidden)`` lives inside its scaled embedding module, so
the input point's output already carries it).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ...errors import FusedStatsError
from ...networks.resnet import BasicBlock, Bottleneck

LLAMA_ATTN_MLP = ("self_attn.o_proj", "mlp.down_proj")
GATED_MLP = (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj")
POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True)
class Adapter:
    """How growth handles one model family (see the module docstring)."""

    model_type: str
    stack: tuple[str, str]  # the block stack: (CausalLM form, bare model form)
    input_point: tuple[str, str]  # module whose output is the stream into block 0, same two forms
    origin_modules: tuple[str, ...]  # relative to a block
    origin: str = "zero_maps"  # "zero_maps" | "norm_scale"
    origin_value: float = 0.0  # the norm scale's value at the origin ("norm_scale")
    mlp_inputs: tuple[str, ...] | None = GATED_MLP[0]  # maps whose output rows grow (gated: 2)
    mlp_output: str | None = GATED_MLP[1]  # map whose input columns grow
    mlp_refused: str | None = None  # why mlp_width is refused, if it is
    conv1d: bool = False  # weights stored (in, out) (transformers Conv1D)
    # the MLP input map's outputs are this many equal parts, one per role (Phi3's fused
    # gate_up_proj: 2, gate then up); new rows go at the end of each part
    mlp_chunks: int = 1
    # config attribute holding the MLP width (None: intermediate_size, ffn_hidden_size or n_inner,
    # the first the config has); GPT-J's config may carry an unused intermediate_size too
    mlp_size: str | None = None
    layer_lists: tuple[str, ...] = ()  # per-layer config lists kept in step on depth growth
    input_scale: str | None = None  # config attribute: factor between input point and block 0
    branch_scale: str | None = None  # config attribute: factor between branch and residual add
    # (config attribute, value, why): a config variant growth refuses (its zero block would not
    # add an exact +0, e.g. a residual taken after the input norm)
    config_refusals: tuple[tuple[str, object, str], ...] = ()

    def scale(self, config, name: str | None) -> float:
        if name is None or config is None:
            return 1.0
        value = getattr(config, name, None)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise FusedStatsError(
                f"model_type {self.model_type!r}: config.{name} is {value!r}, expected a number"
            )
        return float(value)


def _llama_like(model_type: str, **extra) -> Adapter:
    fields = {
        "stack": ("model.layers", "layers"),
        "input_point": ("model.embed_tokens", "embed_tokens"),
        "origin_modules": LLAMA_ATTN_MLP,
        "layer_lists": ("layer_types",),
    }
    fields.update(extra)
    return Adapter(model_type, **fields)


_POST_NORM_REFUSAL = (
    "the MLP output passes a norm before the residual add, so new units' gradient needs that "
    "norm's Jacobian, which the width tangent does not include"
)

_POST_NORM_WIDTH = {"mlp_inputs": None, "mlp_output": None, "mlp_refused": _POST_NORM_REFUSAL}

ADAPTERS: dict[str, Adapter] = {
    a.model_type: a
    for a in (
        _llama_like("llama"),
        _llama_like("mistral"),
        _llama_like("qwen2"),
        _llama_like("qwen3"),
        _llama_like("gemma"),
        _llama_like("olmo"),
        _llama_like("cohere"),
        _llama_like("stablelm"),
        _llama_like("smollm3", layer_lists=("layer_types", "no_rope_layers")),
        _llama_like("granite", input_scale="embedding_multiplier", branch_scale="residual_multiplier"),
        _llama_like("phi3", mlp_inputs=("mlp.gate_up_proj",), mlp_chunks=2),
        _llama_like("glm", mlp_inputs=("mlp.gate_up_proj",), mlp_chunks=2),
        _llama_like(
            "glm4",
            origin_modules=("post_self_attn_layernorm", "post_mlp_layernorm"),
            origin="norm_scale",
            **_POST_NORM_WIDTH,
        ),
        _llama_like("olmo3", origin_modules=POST_NORMS, origin="norm_scale", **_POST_NORM_WIDTH),
        _llama_like("seed_oss"),
        _llama_like("ernie4_5"),
        _llama_like("internlm3"),
        _llama_like("cohere2"),
        _llama_like("exaone"),
        # ungated MLPs: act(up_proj u), then down_proj
        _llama_like("arcee", mlp_inputs=("mlp.up_proj",)),
        _llama_like("apertus", mlp_inputs=("mlp.up_proj",)),
        _llama_like("nemotron", mlp_inputs=("mlp.up_proj",)),
        _llama_like(
            "bitnet",
            mlp_inputs=None,
            mlp_output=None,
            mlp_refused=(
                "its MLP normalises the hidden units (ffn_sub_norm, an RMSNorm over all of them) before "
                "down_proj, so a new unit rescales the old ones and zero output columns do not keep the function"
            ),
        ),
        _llama_like(
            "persimmon",
            origin_modules=("self_attn.dense", "mlp.dense_4h_to_h"),
            mlp_inputs=("mlp.dense_h_to_4h",),
            mlp_output="mlp.dense_4h_to_h",
        ),
        # parallel attention and MLP on one input norm
        _llama_like(
            "phi",
            input_point=("model.embed_dropout", "embed_dropout"),
            origin_modules=("self_attn.dense", "mlp.fc2"),
            mlp_inputs=("mlp.fc1",),
            mlp_output="mlp.fc2",
        ),
        _llama_like("helium"),
        _llama_like(
            "starcoder2",
            origin_modules=("self_attn.o_proj", "mlp.c_proj"),
            mlp_inputs=("mlp.c_fc",),
            mlp_output="mlp.c_proj",
        ),
        _llama_like(
            "gemma2",
            origin_modules=POST_NORMS,
            origin="norm_scale",
            origin_value=-1.0,
            **_POST_NORM_WIDTH,
        ),
        _llama_like(
            "gemma3_text",
            origin_modules=POST_NORMS,
            origin="norm_scale",
            origin_value=-1.0,
            **_POST_NORM_WIDTH,
        ),
        _llama_like("olmo2", origin_modules=POST_NORMS, origin="norm_scale", **_POST_NORM_WIDTH),
        _llama_like("exaone4", origin_modules=POST_NORMS, origin="norm_scale", **_POST_NORM_WIDTH),
        Adapter(
            "gpt2",
            stack=("transformer.h", "h"),
            input_point=("transformer.drop", "drop"),
            origin_modules=("attn.c_proj", "mlp.c_proj"),
            mlp_inputs=("mlp.c_fc",),
            mlp_output="mlp.c_proj",
            conv1d=True,
        ),
        Adapter(
            "gpt_bigcode",
            stack=("transformer.h", "h"),
            input_point=("transformer.drop", "drop"),
            origin_modules=("attn.c_proj", "mlp.c_proj"),
            mlp_inputs=("mlp.c_fc",),
            mlp_output="mlp.c_proj",
        ),
        # parallel or serial attention and MLP, one or two input norms: every variant's branches
        # end in self_attention.dense and mlp.dense_4h_to_h, added to the stream
        Adapter(
            "falcon",
            stack=("transformer.h", "h"),
            input_point=("transformer.word_embeddings", "word_embeddings"),
            origin_modules=("self_attention.dense", "mlp.dense_4h_to_h"),
            mlp_inputs=("mlp.dense_h_to_4h",),
            mlp_output="mlp.dense_4h_to_h",
        ),
        *(
            Adapter(
                name,
                stack=("transformer.h", "h"),
                input_point=("transformer.drop", "drop"),
                origin_modules=("attn.out_proj", "mlp.fc_out"),
                mlp_inputs=("mlp.fc_in",),
                mlp_output="mlp.fc_out",
                mlp_size="n_inner",
            )
            for name in ("gptj", "codegen")
        ),
        Adapter(
            "bloom",
            stack=("transformer.h", "h"),
            input_point=("transformer.word_embeddings_layernorm", "word_embeddings_layernorm"),
            origin_modules=("self_attention.dense", "mlp.dense_4h_to_h"),
            mlp_inputs=None,
            mlp_output=None,
            mlp_refused=(
                "its MLP width is fixed at 4 x hidden_size in the code (no config field holds it), so a "
                "widened model would not load back"
            ),
            config_refusals=(
                (
                    "apply_residual_connection_post_layernorm",
                    True,
                    "the residual is the input norm's output, so a zero block outputs that norm, not its input",
                ),
            ),
        ),
        Adapter(
            "mpt",
            stack=("transformer.blocks", "blocks"),
            input_point=("transformer.wte", "wte"),
            origin_modules=("attn.out_proj", "ffn.down_proj"),
            mlp_inputs=None,
            mlp_output=None,
            mlp_refused=(
                "its MLP adds the residual inside its own forward(hidden_states, residual), and its width "
                "is expansion_ratio x d_model"
            ),
        ),
        # a Mamba block: x + mixer(norm(x)), the mixer's out_proj at zero
        Adapter(
            "mamba",
            stack=("backbone.layers", "layers"),
            input_point=("backbone.embeddings", "embeddings"),
            origin_modules=("mixer.out_proj",),
            mlp_inputs=None,
            mlp_output=None,
            mlp_refused="its blocks have no MLP, only a state-space mixer",
        ),
        Adapter(
            "gpt_neox",
            stack=("gpt_neox.layers", "layers"),
            input_point=("gpt_neox.emb_dropout", "emb_dropout"),
            origin_modules=("attention.dense", "mlp.dense_4h_to_h"),
            mlp_inputs=("mlp.dense_h_to_4h",),
            mlp_output="mlp.dense_4h_to_h",
        ),
    )
}

# the project's ResNet blocks: (origin module, its width), keyed by class
RESNET_BLOCKS: dict[type, Adapter] = {
    BasicBlock: Adapter("resnet_basic", ("", ""), ("", ""), ("bn2",), mlp_inputs=None, mlp_output=None),
    Bottleneck: Adapter("resnet_bottleneck", ("", ""), ("", ""), ("bn3",), mlp_inputs=None, mlp_output=None),
}


# model_types refused with a reason (others outside ADAPTERS: refused as unknown)
_MOE = (
    "its MLP is a mixture of experts routed per token, the experts stored as stacked parameter "
    "tensors: the tangent of a zero expert output is no linear map's input features, and width "
    "growth of routed experts is not one MLP's"
)
_NO_INPUT_POINT = (
    "the stream into block 0 (token plus position embeddings, scaled) is summed in the model's "
    "forward, not output by a module, so the input boundary has no point to read"
)

REFUSED: dict[str, str] = {
    "mixtral": _MOE,
    "qwen2_moe": _MOE,
    "qwen3_moe": _MOE,
    "olmoe": _MOE,
    "doge": (
        "its blocks scale the residual by learned vectors (input_residual, post_attention_residual), "
        "whose gradient at a new block (q * z) the tangent does not include"
    ),
    "gpt_neo": (
        "its per-layer attention kinds (global / local) are kept as the run-length config.attention_types, "
        "which growth does not rewrite, so a grown model would reload with other layer kinds"
    ),
    "opt": _NO_INPUT_POINT,
    "xglm": _NO_INPUT_POINT,
    "biogpt": _NO_INPUT_POINT,
    "gemma3": (
        "its stream into block 0 is the token embeddings with image features scattered into them "
        "(no module outputs it, so the input boundary has no exact tangent), and its config keeps "
        "the per-layer lists in text_config; its text-only form, model_type 'gemma3_text', is supported"
    ),
}


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


@dataclass
class Boundary:
    """One place a block can go: after ``point``, at ``position`` of ``container``."""

    point: str
    container: str
    position: int  # index the new block takes in the container
    neighbour: str  # the block next to it (the one before; block 0 for the input boundary)


@dataclass
class Architecture:
    """What growth needs to know about a model (see the module docstring)."""

    kind: str  # the model_type, or "resnet"
    adapter: Adapter
    containers: tuple[str, ...]
    boundaries: dict[str, Boundary]
    input_point: str | None

    @property
    def transformer(self) -> bool:
        return self.kind != "resnet"


def _get(model: nn.Module, path: str):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _describe_resnet(model: nn.Module) -> Architecture | None:
    stages = [
        name
        for name, mod in model.named_children()
        if isinstance(mod, nn.Sequential) and len(mod) and all(type(b) in RESNET_BLOCKS for b in mod)
    ]
    if not stages:
        return None
    classes = {type(b) for s in stages for b in model.get_submodule(s)}
    if len(classes) != 1:
        raise FusedStatsError(
            f"{type(model).__name__} mixes block classes {sorted(c.__name__ for c in classes)}; growth "
            "needs one block class"
        )
    bounds = {}
    for stage in stages:
        for i in range(len(model.get_submodule(stage))):
            name = f"{stage}.{i}"
            bounds[name] = Boundary(name, stage, i + 1, name)
    return Architecture("resnet", RESNET_BLOCKS[classes.pop()], tuple(stages), bounds, None)


def describe(model: nn.Module) -> Architecture:
    """The :class:`Architecture` of ``model``; :class:`FusedStatsError` for one growth cannot handle
    (a model_type outside :data:`ADAPTERS`, a model whose structure is not its entry's)."""
    if not isinstance(model, nn.Module):
        raise FusedStatsError(f"growth needs a torch.nn.Module, got {type(model).__name__}")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or not model_type:
        arch = _describe_resnet(model)
        if arch is not None:
            return arch
        raise FusedStatsError(
            f"growth does not support {type(model).__name__}: it grows HF models of the model_types "
            f"{supported_model_types()} and the ResNets of fused_stats.networks.resnet"
        )
    adapter = ADAPTERS.get(model_type)
    if model_type in REFUSED:
        raise FusedStatsError(
            f"growth refuses model_type {model_type!r} ({type(model).__name__}): {REFUSED[model_type]}; "
            f"supported model_types: {supported_model_types()}"
        )
    for key, value, why in adapter.config_refusals if adapter is not None else ():
        if getattr(config, key, None) == value:
            raise FusedStatsError(
                f"growth refuses {type(model).__name__} ({model_type}) with config.{key}={value!r}: {why}"
            )
    if adapter is None:
        raise FusedStatsError(
            f"growth has no adapter for model_type {model_type!r} ({type(model).__name__}); supported "
            f"model_types: {supported_model_types()}"
        )
    for path, inp in zip(adapter.stack, adapter.input_point):
        stack = _get(model, path)
        if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
            continue
        if len({type(b) for b in stack}) != 1:
            raise FusedStatsError(
                f"{type(model).__name__} ({model_type}): the blocks of {path!r} are of several classes"
            )
        missing = [m for m in adapter.origin_modules if _get(stack[0], m) is None]
        inner = getattr(stack[0], "block", None)
        if missing and isinstance(inner, nn.Module) and all(_get(inner, m) is not None for m in missing):
            raise FusedStatsError(
                f"{type(model).__name__} ({model_type}): its blocks are wrapped ({type(stack[0]).__name__}, "
                "as fs.stream_blocks streams them, with weights loaded block by block); growth and its "
                "tangent probe build and run a new block next to the model's own, so give them the model "
                "itself, not its streamed form"
            )
        if missing:
            raise FusedStatsError(
                f"{type(model).__name__} ({model_type}): its blocks lack {missing}, the modules the "
                f"growth adapter of {model_type!r} puts at the origin"
            )
        bounds = {
            f"{path}.{i}": Boundary(f"{path}.{i}", path, i + 1, f"{path}.{i}") for i in range(len(stack))
        }
        if _get(model, inp) is None:
            raise FusedStatsError(f"{type(model).__name__} ({model_type}) has no input point {inp!r}")
        # the input boundary first: growth points are listed in depth order
        bounds = {inp: Boundary(inp, path, 0, f"{path}.0"), **bounds}
        return Architecture(model_type, adapter, (path,), bounds, inp)
    raise FusedStatsError(
        f"{type(model).__name__} ({model_type}) has no block stack at {list(adapter.stack)}, where the "
        f"growth adapter of {model_type!r} expects it"
    )


def growth_points(model: nn.Module) -> list[str]:
    """The model's growth boundaries in depth order (the input boundary first, for a transformer):
    the names a :class:`~fused_stats.GrowthProtocol` may list as candidates."""
    return list(describe(model).boundaries)


def boundary(arch: Architecture, model: nn.Module, point: str) -> Boundary:
    """The boundary named ``point``, or a :class:`FusedStatsError` listing the valid ones."""
    if not isinstance(point, str) or point not in arch.boundaries:
        names = list(arch.boundaries)
        shown = names if len(names) <= 10 else [*names[:6], "...", *names[-2:]]
        raise FusedStatsError(
            f"candidate {point!r} is not a residual point or block boundary of {type(model).__name__} "
            f"({arch.kind}); growth can insert after: {shown}"
        )
    return arch.boundaries[point]
