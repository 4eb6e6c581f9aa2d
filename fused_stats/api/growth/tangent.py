"""The exact tangent space of the block growth would insert: a feature source for ``fs.Probe``.

Role: at a candidate point ``p`` the protocol's new block ``h`` (exactly the block ``fs.grow``
inserts after ``p``: same protocol, same seed, same weights) is function preserving because the
parameters that write into the stream start at zero (LLaMA ``o_proj``/``down_proj``, GPT-2
``attn.c_proj``/``mlp.c_proj``, GPT-NeoX ``attention.dense``/``mlp.dense_4h_to_h``). For a zero
linear map ``y = W x (+ b)`` inside the block, the block's output gradient is the stream gradient
``q_t`` at ``p`` (every other path through the block passes a zero map), so

    ∂ℓ_i/∂W = Σ_t q_t x_tᵀ,   ∂ℓ_i/∂b = Σ_t q_t,

and the per-sample gradient of all zero parameters together is ``c_i = Σ_t q_t x_tᵀ`` with
``x_t = [x_t^(1), 1, x_t^(2), 1, ...]``: the inputs of the zero maps, computed by the new block
run on ``z`` itself (with the attention mask and position embeddings the candidate received;
no cache), and a constant feature per zero bias. ``C = E[c_i]`` is the depth paper's first-order
signal for that layer, and ``CrossStats`` with ``w_in = I`` and activation ``identity`` gives
its unbiased ``|C|_F²`` and the saturation test unchanged (docs/design.md, sections 2.7, 2.8).
The width is ``r = Σ in_features (+1 per bias)``, ``d + f`` for a LLaMA layer. With
``protocol.projection = k`` a fixed ``k × r`` Gaussian ``P`` (drawn from the protocol's seed)
gives ``C Pᵀ`` instead: smaller state, and ``C ≠ 0 ⇒ C Pᵀ ≠ 0`` with probability 1 over ``P``
(the boundary is kept, at some loss of power). ``family="cross_block"``: the protocol's
``W_out φ(W_in z)`` block, whose features are ``φ(W_in z_t)``. ``family="mlp_width"``: the
``width`` new hidden units of the MLP of the block that follows the candidate have zero output
columns, whose per-sample gradient is ``Σ_t q'_t h_tᵀ`` with ``q'`` the gradient at that block's
output (the MLP output is added to the stream there) and ``h_t`` the new units on the MLP's own
input ``u_t`` (LLaMA ``silu(W_gate u) ⊙ (W_up u)``, GPT-2 / NeoX ``act(W_fc u)``; the new rows of
``blocks.new_units``, i.e. those ``fs.grow`` appends); so the probe reads ``q`` at
``gradient_point`` and ``u`` as the input of ``call_point`` (the MLP).

ResNet blocks (``family="layer"``): the zero parameters are the last BatchNorm's scale ``γ`` and
shift ``β``; the new block is ``z + γ ⊙ x̂ + β`` with no ReLU after the sum (``out_relu=False``,
:mod:`fused_stats.networks.resnet`), so its output gradient is the stream gradient ``q_t`` at the
candidate and

    ∂ℓ_i/∂γ = Σ_t q_t ⊙ x̂_t,   ∂ℓ_i/∂β = Σ_t q_t,

per channel, ``t`` the pixels and ``x̂`` the new block's normalised conv output (its BatchNorm in
eval mode: running statistics, mean 0 and variance 1 at birth, so samples stay independent; the
probe runs the model in eval mode too). These are true derivatives: the block is smooth at its
origin (a trailing ReLU on ``z + 0``, ``z`` a ReLU output with exact zeros, would leave only
one-sided ones there). The features are ``x_t = [x̂_t ; 1]`` (2C) and ``cross_terms`` turns
``(q, x)`` into ``(1, x ⊙ [q ; q])``: a CrossStats of width 1 whose ``c_i`` is the 2C-vector of
those gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from ...errors import FusedStatsError
from ...ops.cross_twin import apply_activation, seeded_w_in
from ..probe.fold import cross_view
from ..probe.spec import register_feature_source
from . import blocks
from .architecture import MLP_PARTS, boundary
from .protocol import GrowthProtocol

CACHE_KEYS = ("past_key_values", "past_key_value", "layer_past", "cache")


def zero_map_width(name: str, module: nn.Module) -> tuple[int, bool]:
    """``(in_features, has_bias)`` of a zero-initialised linear map (nn.Linear or HF Conv1D,
    whose weight is stored (in, out))."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.bias is not None
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return int(module.weight.shape[0]), getattr(module, "bias", None) is not None
    raise FusedStatsError(
        f"zero-initialised module {name!r} is a {type(module).__name__}; the tangent probe handles "
        "linear maps (nn.Linear, transformers Conv1D) only"
    )


def block_call_kwargs(kwargs: dict) -> dict:
    """The candidate's call arguments for the new block: caches dropped (the block is not part
    of the model's cache; its attention must see this forward only), ``use_cache=False``."""
    out = {}
    for key, value in kwargs.items():
        if key in CACHE_KEYS or type(value).__name__.endswith("Cache"):
            out[key] = None
        else:
            out[key] = value
    if "use_cache" in out:
        out["use_cache"] = False
    return out


class GrowthTangent:
    """The feature source (:class:`fused_stats.api.probe.spec.FeatureSource`) of a growth
    protocol on ``model``: at each candidate, the inputs of the new block's zero maps.

    ``new_block(model, protocol, point)`` and ``zeroed_modules(block, family)`` default to
    :mod:`fused_stats.api.growth.blocks`, so the probed block is the one ``fs.grow`` inserts.
    Blocks are built once per point, on the model's dtype and device, and kept in ``blocks``.
    """

    def __init__(self, protocol, model: nn.Module, new_block=None, zeroed_modules=None):
        self.family = getattr(protocol, "family", "layer")
        if self.family not in ("layer", "cross_block", "mlp_width"):
            raise FusedStatsError(
                f"the tangent probe supports families 'layer', 'mlp_width' and 'cross_block'; got "
                f"family={self.family!r}"
            )
        init = getattr(protocol, "init", "zero")
        if init != "zero":
            raise FusedStatsError(
                f"the tangent probe measures the first-order gain of a function-preserving block: it "
                f"needs init='zero', the protocol has init={init!r} (probe a zero protocol, then "
                f"grow with fs.grow(..., init={init!r}) if wanted)"
            )
        self.protocol, self.model = protocol, model
        self._neighbours: dict[str, str] = {}
        self.channelwise = False
        self._grown: dict[str, str] = {}  # mlp_width: candidate -> the block whose MLP grows
        self.units: dict[str, blocks.NewUnits] = {}
        if self.family == "mlp_width":
            arch = protocol.check(model)
            self._mlp_inputs = MLP_PARTS[arch.kind][0]
            # the probe reads the features from the MLP's input (spec.source_features)
            self.input_features = self.unit_features
            for p in protocol.candidates:
                b = boundary(arch, model, p)
                self._grown[p] = f"{b.container}.{b.position}"
        elif new_block is None or zeroed_modules is None:
            new_block = new_block or blocks.new_block
            zeroed_modules = zeroed_modules or blocks.zeroed_modules
            arch = protocol.check(model)
            self._neighbours = {p: boundary(arch, model, p).neighbour for p in protocol.candidates}
            if not arch.transformer and self.family == "layer":
                # a zero BatchNorm scale and shift: per-channel terms from the point's conv map
                self.channelwise = True
                self.output_features, self.cross_terms = self.map_features, self.channel_terms
        self._new_block, self._zeroed = new_block, zeroed_modules
        self.projection = getattr(protocol, "projection", None)
        if self.projection is not None and (
            not isinstance(self.projection, int) or isinstance(self.projection, bool) or self.projection < 1
        ):
            raise FusedStatsError(
                f"protocol.projection must be None or a positive int, got {self.projection!r}"
            )
        self.seed = int(getattr(protocol, "seed", 0))
        self.blocks: dict[str, nn.Module] = {}
        self.maps: dict[str, list[tuple[str, int, bool]]] = {}

    def block(self, point: str) -> nn.Module:
        """The new block at ``point`` (built on first use), in eval mode, parameters frozen."""
        block = self.blocks.get(point)
        if block is None:
            block = self._new_block(self.model, self.protocol, point)
            param = next(self.model.parameters(), None)
            if param is not None:
                block = block.to(dtype=param.dtype, device=param.device)
            block.eval().requires_grad_(False)
            if self.family == "cross_block":  # W_out φ(W_in z): the features are φ(W_in z) itself
                self.blocks[point], self.maps[point] = block, [("w_out", int(block.w_in.shape[0]), False)]
                return block
            names = list(self._zeroed(block, "layer"))
            if not names or (self.channelwise and len(names) != 1):
                raise FusedStatsError(
                    f"the new block at {point!r} has zero-initialised modules {names}; expected "
                    + ("its last BatchNorm only" if self.channelwise else "at least one")
                )
            maps = []
            for name in names:
                module = block.get_submodule(name)
                nonzero = [k for k, p in module.named_parameters() if bool((p != 0).any())]
                if nonzero:
                    raise FusedStatsError(
                        f"new block at {point!r}: {name!r} is listed as zero-initialised but its "
                        f"{nonzero} are not zero; the block would not be function preserving"
                    )
                if isinstance(module, nn.BatchNorm2d):  # width C; its scale and shift: 2C terms
                    if not self.channelwise:
                        raise FusedStatsError(
                            f"new block at {point!r}: zero-initialised {name!r} is a BatchNorm2d; its "
                            "per-channel tangent is measured for the ResNets growth knows, with the "
                            "default new_block and zeroed_modules"
                        )
                    maps.append((name, int(module.num_features), True))
                else:
                    maps.append((name, *zero_map_width(name, module)))
            self.blocks[point], self.maps[point] = block, maps
        return block

    def call_point(self, point: str) -> str:
        """The module whose call arguments the new block gets: the block before the boundary,
        or block 0 at the input boundary (an embedding is called without mask or rotary);
        for ``mlp_width`` the MLP that grows (its input ``u`` gives the new units)."""
        if self.family == "mlp_width":
            return f"{self._grown[point]}.mlp"
        return self._neighbours.get(point, point)

    def gradient_point(self, point: str) -> str:
        """The module whose output gradient multiplies the features: the candidate itself, or for
        ``mlp_width`` the block whose MLP grows (its MLP output is added to the stream there)."""
        return self._grown.get(point, point)

    def new_units(self, point: str) -> blocks.NewUnits:
        """The new MLP units at ``point`` (``mlp_width``), the ones ``fs.grow`` appends."""
        units = self.units.get(point)
        if units is None:
            units = self.units[point] = blocks.new_units(self.model, self.protocol, point)
        return units

    def unit_features(self, point: str, module: nn.Module, u: torch.Tensor) -> torch.Tensor:
        """``h_t`` (B, T, width): the new hidden units of the MLP ``module`` on its input ``u``."""
        units = self.new_units(point)
        pre = []
        for name in self._mlp_inputs:
            axis, w = units.pieces[f"{name}.weight"]
            w = w.to(dtype=u.dtype, device=u.device)
            y = u @ (w if axis == 1 else w.T)  # Conv1D pieces are (in, new) columns, Linear (new, in)
            bias = units.pieces.get(f"{name}.bias")
            if bias is not None:
                y = y + bias[1].to(dtype=u.dtype, device=u.device)
            pre.append(y)
        act = getattr(module, "act_fn", None) or getattr(module, "act", None)
        if act is None:
            raise FusedStatsError(f"MLP {type(module).__name__} at {point!r} has no act_fn / act")
        # gated (LLaMA): act(gate) ⊙ up, the input of down_proj; else act(fc)
        return act(pre[0]) * pre[1] if len(pre) == 2 else act(pre[0])

    def raw_rank(self, point: str) -> int:
        """``r``: the columns of the full tangent ``C`` (inputs of the zero maps, +1 per bias)."""
        if self.family == "mlp_width":
            return int(self.protocol.width)
        self.block(point)
        if self.channelwise:  # a BatchNorm's scale and shift: two terms per channel
            return sum(2 * width for _, width, _ in self.maps[point])
        return sum(width + int(bias) for _, width, bias in self.maps[point])

    def feature_rank(self, point: str) -> int:
        return self.raw_rank(point)

    def feature_ranks(self) -> dict[str, int]:
        """``r`` at every candidate whose block is built (all of them for ``mlp_width``); no
        block is built here."""
        built = self.protocol.candidates if self.family == "mlp_width" else list(self.maps)
        return {point: self.raw_rank(point) for point in built}

    def feature_w_in(self, point: str, dtype=torch.float32, device=None) -> torch.Tensor | None:
        """None (the exact tangent: the features are given to CrossStats as they are, no r × r
        identity stored) or the protocol's fixed ``k × r`` projection."""
        r = self.raw_rank(point)
        if self.projection is None:
            return None
        return seeded_w_in(self.projection, r, self.seed, dtype).to(device)

    def map_features(self, point: str, act: torch.Tensor, feature_dim: int = 1) -> torch.Tensor:
        """ResNet: ``[x̂_t ; 1]`` (B, H·W, 2C), ``x̂`` the new block's last BatchNorm input,
        normalised with its running statistics, the block run on the candidate's output ``act``
        (B, C, H, W), whose channels (axis 1) the probe must read as its features."""
        block = self.block(point)
        name, channels, _ = self.maps[point][0]
        bn = block.get_submodule(name)
        if act.dim() != 4 or act.shape[1] != channels:
            raise FusedStatsError(
                f"new block at {point!r}: the point's output has shape {tuple(act.shape)}, expected "
                f"(B, {channels}, H, W)"
            )
        if feature_dim % 4 != 1:
            raise FusedStatsError(
                f"point {point!r}: the tangent of a new ResNet block is per channel (axis 1 of "
                f"{tuple(act.shape)}), but the probe reads axis {feature_dim} as the features; "
                "leave feature_dim at its default for this point"
            )
        seen: list[torch.Tensor] = []
        handle = bn.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
        try:
            with torch.no_grad():
                out = block(act.to(bn.weight.dtype))
        finally:
            handle.remove()
        if tuple(out.shape) != tuple(act.shape):
            raise FusedStatsError(
                f"new block at {point!r} maps {tuple(act.shape)} to {tuple(out.shape)}; it must keep the shape"
            )
        # x̂ = (x − running_mean) / sqrt(running_var + eps): BatchNorm2d in eval mode, no affine
        xhat = nn.functional.batch_norm(
            seen[0], bn.running_mean, bn.running_var, None, None, False, 0.0, bn.eps
        )
        return cross_view(torch.cat([xhat, torch.ones_like(xhat)], dim=1), 1)

    def channel_terms(self, point: str, q: torch.Tensor, z: torch.Tensor, x: torch.Tensor):
        """ResNet: ``(1, x ⊙ [q ; q])``; ``q`` (B, P, C) the stream gradient (``z``, the stream
        itself, is not needed: the new block has no ReLU after its sum), ``x`` (B, P, 2C) from
        :meth:`map_features`: ``Σ_t`` of the pair is ``[∂ℓ/∂γ ; ∂ℓ/∂β]``."""
        # in fp64, as the probe keeps cross features: a bf16 product would round every term
        x = x.to(torch.float64)
        q = q.to(torch.float64)
        return torch.ones(*q.shape[:2], 1, dtype=x.dtype, device=x.device), x * torch.cat([q, q], dim=-1)

    def features(self, point: str, module: nn.Module, z: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """``x_t`` (B, T, r): the new block run on ``z`` (B, T, d), inputs of its zero maps."""
        block = self.block(point)
        if self.family == "cross_block":
            return apply_activation(z.to(block.w_in.dtype) @ block.w_in.T, block.activation)
        inputs: dict[str, torch.Tensor] = {}
        handles = []
        for name, _, _ in self.maps[point]:

            def pre(mod, args, name=name):
                inputs[name] = args[0]

            handles.append(block.get_submodule(name).register_forward_pre_hook(pre))
        try:
            with torch.no_grad():
                block(z, **block_call_kwargs(kwargs))
        finally:
            for handle in handles:
                handle.remove()
        parts = []
        for name, width, bias in self.maps[point]:
            x = inputs.get(name)
            if x is None or tuple(x.shape[:-1]) != tuple(z.shape[:-1]) or x.shape[-1] != width:
                raise FusedStatsError(
                    f"new block at {point!r}: the input of {name!r} has shape "
                    f"{None if x is None else tuple(x.shape)}, expected {(*z.shape[:-1], width)}"
                )
            parts.append(x)
            if bias:
                parts.append(torch.ones(*z.shape[:-1], 1, dtype=x.dtype, device=x.device))
        return torch.cat(parts, dim=-1)


register_feature_source(GrowthProtocol, GrowthTangent)
