"""The streamed block: a proxy whose backward recomputes the real block from its saved input.

Role: :class:`StreamedBlock` stands in for one block at the block's module name. Its forward has
the streamer materialise the block's weights, runs the real block without grad, keeps only the
block's input ``x`` (on the host when the device is a GPU), drops the weights and returns the
output ``y`` through :class:`_BlockFunction`, an identity for autograd. That Function's backward
materialises the weights again, recomputes ``y = f(x)`` with grad from the saved input (the same
RNG state when the block is in training mode) and returns ``∂L/∂x = (∂y/∂x)ᵀ ∂L/∂y``: gradient
checkpointing at block granularity (Chen et al. 2016, "Training deep nets with sublinear memory
cost"), so autograd never holds a block's weights and every point hook sees the in-memory
gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from ...errors import FusedStatsError


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

    def __init__(self, streamer, index: int, block: nn.Module):
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
