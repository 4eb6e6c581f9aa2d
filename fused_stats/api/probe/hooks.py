"""Forward hooks that capture insertion-point activations as differentiable tensors.

Role: during one forward pass, :class:`ActivationCapture` records each point's output ``z`` and
substitutes it so that one ``torch.autograd.grad(Σ_b ℓ_b, [z_1, …, z_L])`` returns
``q = ∂(Σ_b ℓ_b)/∂z`` at every point (docs/design.md, section 5, activation-only backward):

* the **first point to run** is replaced by ``z.detach().requires_grad_()``: a fresh leaf, so no
  graph is kept below it (and, with frozen parameters, nothing below it is differentiated);
* a later point whose output already requires grad stays in the graph unchanged — the gradient
  with respect to an intermediate tensor is the total derivative through everything downstream,
  which is what a bias inserted at that point would receive;
* a later point whose output does not depend on an earlier point's (a parallel branch; its output
  may still require grad, through a model input that does) is made a leaf as well: a backward
  down to the leaves would otherwise never reach it. Whether it depends is read from the autograd
  graph (:func:`fused_stats.api.probe.sink.reachable`, a walk that stops at the first earlier
  point found, typically within one block).

Tuple or list outputs (some HF versions return ``(hidden_states, ...)`` from decoder layers) are
captured at element 0 and re-emitted with the same structure (tuple, namedtuple or list). The other
elements are passed on untouched, so they must not be computed from element 0 inside the module
(true of HF layers: attention weights and caches come from the layer's input): for a point that
becomes a leaf, a path from element 0 through another element would not reach the leaf.
A point that runs twice in one forward (a reused module) is rejected: its per-sample gradient
would be ambiguous. Each captured tensor's version counter is recorded so that an in-place change
made downstream (which would make the gradient refer to the modified tensor) is detected instead
of silently giving wrong statistics.

With ``on_output`` (the probe's in-backward fold, :class:`fused_stats.api.probe.fold.StepFold`)
each output is handed to ``on_output(name, module, tensor, kwargs)`` in the forward hook and only
the leaves made here are kept (:attr:`leaves`, the ``inputs=`` of the backward; autograd holds
them anyway): a later point's output is not referenced here, so it lives no longer than autograd
itself keeps it.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import FusedStatsError
from .sink import gradient_node, reachable


def split_output(output):
    """``(tensor, rebuild)``: the captured tensor and a function re-emitting the structure."""
    if isinstance(output, torch.Tensor):
        return output, lambda t: t
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        rest = list(output[1:])
        if isinstance(output, tuple) and hasattr(output, "_fields"):  # namedtuple
            return output[0], lambda t: type(output)(t, *rest)
        kind = type(output) if type(output) in (tuple, list) else tuple
        return output[0], lambda t: kind([t, *rest])
    return None, None


def submodule(model: nn.Module, name: str) -> nn.Module:
    """``model.get_submodule(name)``, walking the registered-children dicts first (a plain dict
    lookup per level instead of ``Module.__getattr__``); anything else goes to ``get_submodule``."""
    module = model
    for part in name.split(".") if name else ():
        child = module._modules.get(part)
        if child is None:
            return model.get_submodule(name)
        module = child
    return module


_set_flag = object.__setattr__  # Module.__setattr__ checks parameter/module types first: slow per call


class FrozenEval:
    """Context manager: the model in eval mode with every parameter's ``requires_grad`` off, the
    flags that were changed set back on exit (also on an error), nothing else touched.

    One traversal of the module tree finds the trainable parameters (each once) and the modules in
    training mode. Modules that keep ``nn.Module.train`` get their flag set directly; a tree where
    any module overrides ``train`` is switched through ``model.eval()``, so that override runs.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        modules = list(model.modules())
        self.training = [m for m in modules if m.training]
        self.custom_train = any(type(m).train is not nn.Module.train for m in modules)
        seen: set[int] = set()
        self.trainable = []
        for m in modules:
            for p in m._parameters.values():
                if p is not None and p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self.trainable.append(p)

    def __enter__(self) -> FrozenEval:
        try:
            for p in self.trainable:
                p.requires_grad_(False)
            if self.custom_train:
                self.model.eval()
            else:
                for m in self.training:
                    _set_flag(m, "training", False)
        except BaseException:
            self.restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        for p in self.trainable:
            p.requires_grad_(True)
        for m in self.training:
            _set_flag(m, "training", True)


class ActivationCapture:
    """Context manager: forward hooks on ``names`` that capture and substitute the outputs.

    After the forward, :attr:`captured` maps each point name to the tensor to differentiate with
    respect to, and :attr:`order` lists the points in the order they ran. Hooks are removed by
    ``__exit__`` and by :meth:`remove` (idempotent), whatever happened in between.
    """

    def __init__(
        self, model: nn.Module, names: list[str], cut_graph: bool = True, on_output=None, modules=None
    ):
        self.model = model
        self.names = list(names)
        # point name -> the module whose output is captured under that name (default: itself)
        self.modules = dict(modules or {})
        self.cut_graph = cut_graph
        self.on_output = on_output
        self.captured: dict[str, torch.Tensor] = {}  # with on_output: the leaves only
        self.leaves: list[torch.Tensor] = []
        self.shapes: dict[str, tuple] = {}
        self.versions: dict[str, int] = {}
        self.order: list[str] = []
        # the autograd nodes of the points that ran so far (kept alive, so their ids stay theirs)
        self._upstream: list = []
        self._upstream_ids: set[int] = set()
        self._handles: list = []

    def __enter__(self) -> ActivationCapture:
        try:
            for name in self.names:
                module = submodule(self.model, self.modules.get(name, name))
                self._handles.append(module.register_forward_hook(self._make_hook(name), with_kwargs=True))
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _make_hook(self, name: str):
        def hook(module, args, kwargs, output):
            if name in self.shapes:
                raise FusedStatsError(
                    f"point {name!r} ({type(module).__name__}) ran more than once in one forward "
                    "pass; a reused module has no single per-sample gradient. Probe a module that "
                    "runs once instead"
                )
            tensor, rebuild = split_output(output)
            if tensor is None:
                raise FusedStatsError(
                    f"point {name!r} ({type(module).__name__}) returned {type(output).__name__}; "
                    "expected a tensor or a tuple/list whose first element is a tensor"
                )
            if not tensor.is_floating_point():
                raise FusedStatsError(
                    f"point {name!r} returned a {tensor.dtype} tensor of shape "
                    f"{tuple(tensor.shape)}; expected a floating-point activation"
                )
            first = not self.shapes
            node = gradient_node(tensor)
            if first:
                replaced = self.cut_graph or node is None
            else:
                replaced = node is None or not reachable(node, self._upstream_ids, first_only=True)
            if replaced:
                tensor = tensor.detach().requires_grad_()
                node = gradient_node(tensor)
            self._upstream.append(node)
            self._upstream_ids.add(id(node))
            self.shapes[name] = tuple(tensor.shape)
            self.versions[name] = tensor._version
            self.order.append(name)
            if replaced:
                self.leaves.append(tensor)
            if self.on_output is None or replaced:
                self.captured[name] = tensor
            if self.on_output is not None:
                self.on_output(name, module, tensor, kwargs)
            return rebuild(tensor) if replaced else None

        return hook

    def modified_in_place(self) -> list[str]:
        """Points whose captured tensor was changed in place after it was captured. With
        ``on_output`` only the leaves are held here: a later output's gradient then comes from its
        tensor hook, registered before any downstream change, so it is the gradient with respect
        to the output as the point produced it, which is what a bias inserted there receives."""
        return [n for n, t in self.captured.items() if t._version != self.versions[n]]
