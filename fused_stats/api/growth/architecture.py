"""Which architecture a model is, for growth: its block stack, boundaries and zero-output parts.

Role: :func:`describe` maps a model to an :class:`Architecture`: the kind (``"llama"``,
``"gpt2"``, ``"gpt_neox"``, ``"resnet"``), the block containers (one ``ModuleList`` for a
transformer; one ``Sequential`` per stage for a ResNet) and the *boundaries* where a block can be
inserted. A boundary is a residual point (the output of block ``i`` of a container: the new block
takes position ``i + 1``) or, for a transformer, the module whose output is the stream entering
block 0 (``model.embed_tokens``, ``transformer.drop``, ``gpt_neox.emb_dropout``: position 0).

The zero-output parts are the residual branch's last maps, so that a block with them at zero adds
an exact +0 to the stream (``z + 0 = z`` bit for bit):

* LLaMA: ``self_attn.o_proj``, ``mlp.down_proj``; GPT-2: ``attn.c_proj``, ``mlp.c_proj``;
  GPT-NeoX: ``attention.dense``, ``mlp.dense_4h_to_h`` (weights and biases);
* the project's ResNet blocks (:mod:`fused_stats.networks.resnet`): the last BatchNorm's scale and
  shift (``bn2`` of a basic block, ``bn3`` of a bottleneck): the zero-init residual of Goyal et al.
  (2017, "Accurate, large minibatch SGD", section 5.1). The block's output ``relu(0 + z)`` equals
  ``z`` because ``z`` is itself a block output after a ReLU.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ...errors import FusedStatsError
from ...networks.resnet import BasicBlock, Bottleneck

# kind -> (stack path, module producing the stream into block 0)
TRANSFORMER_STACKS = {
    "llama": ("model.layers", "model.embed_tokens"),
    "gpt2": ("transformer.h", "transformer.drop"),
    "gpt_neox": ("gpt_neox.layers", "gpt_neox.emb_dropout"),
}
# the bare *Model forms (LlamaModel, GPT2Model, GPTNeoXModel)
BARE_STACKS = {
    "llama": ("layers", "embed_tokens"),
    "gpt2": ("h", "drop"),
    "gpt_neox": ("layers", "emb_dropout"),
}

# kind -> submodules of one block whose output is the residual branch's last map
ZEROED_MODULES = {
    "llama": ("self_attn.o_proj", "mlp.down_proj"),
    "gpt2": ("attn.c_proj", "mlp.c_proj"),
    "gpt_neox": ("attention.dense", "mlp.dense_4h_to_h"),
    "resnet_basic": ("bn2",),
    "resnet_bottleneck": ("bn3",),
}

# kind -> (input maps whose output rows grow, output map whose input columns grow) of the MLP
MLP_PARTS = {
    "llama": (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"),
    "gpt2": (("mlp.c_fc",), "mlp.c_proj"),
    "gpt_neox": (("mlp.dense_h_to_4h",), "mlp.dense_4h_to_h"),
}

# the attribute path of the submodule carrying ``layer_idx`` (the KV-cache slot) per kind
LAYER_IDX_OWNERS = {"llama": "self_attn", "gpt2": "attn", "gpt_neox": "attention"}


def _kind_of_block(block: nn.Module) -> str | None:
    def has(path: str) -> bool:
        try:
            block.get_submodule(path)
        except AttributeError:
            return False
        return True

    if isinstance(block, BasicBlock):
        return "resnet_basic"
    if isinstance(block, Bottleneck):
        return "resnet_bottleneck"
    for kind, parts in (
        ("llama", ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
        ("gpt2", ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")),
        ("gpt_neox", ("attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")),
    ):
        if all(has(p) for p in parts):
            return kind
    return None


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

    kind: str  # "llama" | "gpt2" | "gpt_neox" | "resnet"
    block_kind: str  # kind of the blocks: ZEROED_MODULES key
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


def describe(model: nn.Module) -> Architecture:
    """The :class:`Architecture` of ``model``; :class:`FusedStatsError` for one growth cannot handle."""
    if not isinstance(model, nn.Module):
        raise FusedStatsError(f"growth needs a torch.nn.Module, got {type(model).__name__}")
    for table in (TRANSFORMER_STACKS, BARE_STACKS):
        for kind, (path, inp) in table.items():
            stack = _get(model, path)
            if not isinstance(stack, nn.ModuleList) or len(stack) == 0:
                continue
            if {_kind_of_block(b) for b in stack} != {kind} or len({type(b) for b in stack}) != 1:
                continue
            bounds = {
                f"{path}.{i}": Boundary(f"{path}.{i}", path, i + 1, f"{path}.{i}") for i in range(len(stack))
            }
            input_point = inp if _get(model, inp) is not None else None
            if input_point is not None:
                bounds[input_point] = Boundary(input_point, path, 0, f"{path}.0")
            return Architecture(kind, kind, (path,), bounds, input_point)
    stages = [
        name
        for name, mod in model.named_children()
        if isinstance(mod, nn.Sequential)
        and len(mod)
        and all(isinstance(b, (BasicBlock, Bottleneck)) for b in mod)
    ]
    if stages:
        block_kinds = {_kind_of_block(b) for s in stages for b in model.get_submodule(s)}
        if len(block_kinds) != 1:
            raise FusedStatsError(
                f"{type(model).__name__} mixes block kinds {sorted(block_kinds)}; growth needs one block class"
            )
        bounds = {}
        for stage in stages:
            for i in range(len(model.get_submodule(stage))):
                name = f"{stage}.{i}"
                bounds[name] = Boundary(name, stage, i + 1, name)
        return Architecture("resnet", block_kinds.pop(), tuple(stages), bounds, None)
    raise FusedStatsError(
        f"growth does not support {type(model).__name__}: it grows HF LLaMA (model.layers), GPT-2 "
        f"(transformer.h), GPT-NeoX (gpt_neox.layers) and the ResNets of fused_stats.networks.resnet"
    )


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
