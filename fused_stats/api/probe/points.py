"""Insertion points: which modules' outputs are the residual stream after each block.

Role: :func:`residual_points` maps a model to the module names whose *output* is the residual
stream ``z_l`` after block ``l``, in depth order; :func:`resolve_points` turns the ``points``
argument of :class:`fused_stats.Probe` into such a list and rejects unknown names with the
candidates listed. No statistics are computed here.

Detection is structural, tried in this order:

0. **Hooked transformers** (TransformerLens ``HookedTransformer``): a ``blocks`` stack whose
   blocks carry a ``hook_resid_post`` hook point; the points are the hook names
   ``blocks.{i}.hook_resid_post`` (the residual stream after block ``i``, as TransformerLens
   names it), so probe and TransformerLens' own hooks agree on the names.
1. **Transformer block stacks.** A non-empty ``ModuleList`` (or ``Sequential``) of modules *of a
   single class* under a known attribute path: ``model.layers`` (HF LLaMA
   ``*ForCausalLM``), ``layers`` (``LlamaModel``, ``GPTNeoXModel``), ``gpt_neox.layers`` (GPT-NeoX /
   Pythia), ``transformer.h`` and ``h`` (GPT-2), ``model.decoder.layers``, ``decoder.layers``,
   ``transformer.layers``, ``encoder.layer``. Each element's output is the stream after that block
   (before any final norm).
2. **Residual blocks** (ResNets): modules that carry a skip path, recognised by a ``downsample``
   (torchvision ``BasicBlock``/``Bottleneck``), ``shortcut`` (CIFAR ResNets, HF ``ResNet*Layer``) or
   ``skip`` attribute, whether that attribute is a module, ``Identity`` or ``None``. Only the
   outermost such blocks count, in registration order (the order of ``layer1..layer4`` / stages).
3. **Any other homogeneous stack**: if the model holds exactly one outermost ``ModuleList`` whose
   elements share one class and hold parameters, its elements are the points.

A model matching none of these raises :class:`FusedStatsError`; pass module names explicitly then.
"""

from __future__ import annotations

import difflib

from torch import nn

from ...errors import FusedStatsError

# Where HF-style models keep their block stack, most specific first.
KNOWN_STACKS = (
    "model.layers",
    "gpt_neox.layers",
    "transformer.h",
    "model.decoder.layers",
    "transformer.layers",
    "decoder.layers",
    "encoder.layer",
    "layers",
    "h",
)
SKIP_ATTRIBUTES = ("downsample", "shortcut", "skip")


def _get(model: nn.Module, path: str):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _homogeneous_stack(module) -> bool:
    """A non-empty ModuleList/Sequential whose children are all of one class."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) == 0:
        return False
    kinds = {type(child) for child in module}
    return len(kinds) == 1


def _has_skip(module: nn.Module) -> bool:
    # a weight-streamed stand-in (fused_stats.api.streaming.recompute) is the block it streams
    module = getattr(module, "streamed_block", module)
    # ``self.downsample = None`` is a plain attribute, so hasattr (not _modules) is the test
    return any(attr in vars(module) or attr in module._modules for attr in SKIP_ATTRIBUTES)


def _outermost(names: list[str]) -> list[str]:
    """Drop names nested inside another name of the list (keeps order)."""
    out: list[str] = []
    for name in names:
        if not any(name.startswith(kept + ".") for kept in out):
            out.append(name)
    return out


RESIDUAL_HOOK = "hook_resid_post"


def _hooked_points(model: nn.Module) -> list[str] | None:
    stack = _get(model, "blocks")
    if stack is None or not _homogeneous_stack(stack):
        return None
    if not all(isinstance(getattr(block, RESIDUAL_HOOK, None), nn.Module) for block in stack):
        return None
    return [f"blocks.{i}.{RESIDUAL_HOOK}" for i in range(len(stack))]


def _stack_points(model: nn.Module) -> list[str] | None:
    for path in KNOWN_STACKS:
        stack = _get(model, path)
        if stack is not None and _homogeneous_stack(stack):
            return [f"{path}.{i}" for i in range(len(stack))]
    return None


def _residual_block_points(model: nn.Module) -> list[str] | None:
    names = [name for name, mod in model.named_modules() if name and _has_skip(mod)]
    names = _outermost(names)
    return names or None


def _generic_stack_points(model: nn.Module) -> list[str] | None:
    stacks = [
        name
        for name, mod in model.named_modules()
        if name
        and isinstance(mod, nn.ModuleList)
        and _homogeneous_stack(mod)
        and any(True for _ in mod[0].parameters())
    ]
    stacks = _outermost(stacks)
    if len(stacks) != 1:
        return None
    stack = model.get_submodule(stacks[0])
    return [f"{stacks[0]}.{i}" for i in range(len(stack))]


def residual_points(model: nn.Module) -> list[str]:
    """Module names whose output is the residual stream after each block, in depth order.

    Supports TransformerLens ``HookedTransformer`` (``blocks.{i}.hook_resid_post``), HF LLaMA (``model.layers.{i}``), GPT-NeoX (``gpt_neox.layers.{i}``), GPT-2
    (``transformer.h.{i}``) and their bare ``*Model`` forms, torchvision-style ResNets (each
    ``BasicBlock``/``Bottleneck`` in ``layer1..layer4``) and CIFAR ResNets; see the module docstring
    for the structural rules.

    Examples
    --------
    >>> from fused_stats.networks.resnet import cifar_resnet20
    >>> residual_points(cifar_resnet20(width=4))[:2]
    ['layer1.0', 'layer1.1']
    """
    if not isinstance(model, nn.Module):
        raise FusedStatsError(f"residual_points needs a torch.nn.Module, got {type(model).__name__}")
    for finder in (_hooked_points, _stack_points, _residual_block_points, _generic_stack_points):
        found = finder(model)
        if found:
            return found
    stacks = [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and name
    ]
    raise FusedStatsError(
        f"no residual stream found in {type(model).__name__}: no block stack under "
        f"{', '.join(KNOWN_STACKS)}, no block with a {'/'.join(SKIP_ATTRIBUTES)} skip attribute "
        f"and no single homogeneous ModuleList. Pass module names as points explicitly; "
        f"containers seen: {stacks[:20]}"
    )


def _suggestions(model: nn.Module, name: str) -> str:
    # the keyword "residual" is a candidate too: a typo of it reads as a module name
    if difflib.get_close_matches(name, ["residual"], n=1, cutoff=0.75):
        return 'did you mean points="residual" (the residual stream after each block)?'
    all_names = [n for n, _ in model.named_modules() if n]
    close = difflib.get_close_matches(name, all_names, n=5, cutoff=0.5)
    try:
        residual = residual_points(model)
    except FusedStatsError:
        residual = []
    parts = []
    if close:
        parts.append(f"closest names: {close}")
    if residual:
        shown = residual if len(residual) <= 8 else [*residual[:4], "...", *residual[-2:]]
        parts.append(f"residual points: {shown}")
    if not parts:
        parts.append(f"top-level modules: {[n for n, _ in model.named_children()]}")
    return "; ".join(parts)


def resolve_points(model: nn.Module, points) -> list[str]:
    """The list of module names meant by ``points``.

    ``points`` is ``"residual"`` (:func:`residual_points`), one module name, or a sequence of
    module names (kept in the given order, which is taken as depth order). Unknown names raise
    :class:`FusedStatsError` listing candidates; duplicates are rejected.
    """
    if isinstance(points, str):
        if points == "residual":
            return residual_points(model)
        points = [points]
    try:
        names = list(points)
    except TypeError:
        raise FusedStatsError(
            f"points must be 'residual', a module name or a list of module names, got {type(points).__name__}"
        ) from None
    if not names:
        raise FusedStatsError("points is empty: give 'residual' or at least one module name")
    modules = dict(model.named_modules())
    seen = set()
    for name in names:
        if not isinstance(name, str):
            raise FusedStatsError(f"point names must be str, got {name!r} ({type(name).__name__})")
        if name not in modules or name == "":
            raise FusedStatsError(
                f"point {name!r} is not a module of {type(model).__name__}; {_suggestions(model, name)}"
            )
        if name in seen:
            raise FusedStatsError(f"point {name!r} is listed twice")
        seen.add(name)
    return names
