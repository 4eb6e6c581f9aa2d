"""The exact tangent space of the block growth would insert: a feature source for ``fs.Probe``.

Role: at a candidate point ``p`` the protocol's new block ``h`` (exactly the block ``fs.grow``
inserts after ``p``: same protocol, same seed, same weights) is function preserving at the
origin of its model_type's adapter (:mod:`.architecture`). Pre-norm blocks: the parameters that
write into the stream start at zero (LLaMA ``o_proj``/``down_proj``, GPT-2
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

Post-norm blocks (Gemma2/3, OLMo2, EXAONE 4): the origin is the output norms' scale ``w`` where
they output 0; a norm ``x̂ w`` or ``x̂ (1 + w)`` is linear in ``w`` with slope ``x̂``, so
``∂ℓ_i/∂w = Σ_t q_t ⊙ x̂_t`` (:meth:`GrowthTangent.norm_terms`, a CrossStats of width 1 like the
ResNet tangent below). A branch scale ``β`` (Granite ``residual_multiplier``) multiplies the
features; at the input boundary the block runs on ``s z`` (Granite ``embedding_multiplier``) and
the features are divided by ``s``, as the probe's ``q`` there is ``s`` times the stream gradient.
:meth:`GrowthTangent.check_point` checks one sample of this against autograd at each candidate's
first use; every other kind below has its own check (``check_cross_block_point``,
``check_width_point``, ``check_channel_point``): one sample, a seeded random gradient, autograd
through an fp64 copy of what ``fs.grow`` would produce (:mod:`.tangent_check`).

ResNet blocks (``family="layer"``): the zero parameters are the last BatchNorm's scale ``γ`` and
shift ``β``; the new block is ``z + γ ⊙ x̂ + β`` with no ReLU after the sum (``out_relu=False``,
:mod:`fused_stats.networks.resnet`), so its output gradient is the stream gradient ``q_t`` at the
candidate and

    ∂ℓ_i/∂γ = Σ_t q_t ⊙ x̂_t,   ∂ℓ_i/∂β = Σ_t q_t,

per channel, ``t`` the pixels and ``x̂`` the new block's normalised conv output (its BatchNorms in
eval mode, as the probe runs the model, so samples stay independent, with running statistics
calibrated on the first batch the probe sees at the candidate: the batch's own mean and biased
variance, which train mode normalises by (:mod:`.batchnorm`); ``fs.grow(...,
batchnorm_stats=probe)`` inserts the block with them). These are true derivatives: the block is smooth at its
origin (a trailing ReLU on ``z + 0``, ``z`` a ReLU output with exact zeros, would leave only
one-sided ones there). The features are ``x_t = [x̂_t ; 1]`` (2C) and ``cross_terms`` turns
``(q, x)`` into ``(1, x ⊙ [q ; q])``: a CrossStats of width 1 whose ``c_i`` is the 2C-vector of
those gradients.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import FusedStatsError
from ...ops.cross_twin import apply_activation, seeded_w_in
from ..probe.fold import cross_view
from . import blocks
from .batchnorm import BatchNormCalibration
from .plan import GrowthPlan
from .protocol import register_feature_source
from .scores import ADAM_EPS, candidate_scores
from .sub_batches import SubBatches
from .tangent_check import TangentSelfCheck


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
        # a cache is recognised by its class (transformers' Cache and its subclasses), whatever
        # keyword a block takes it under (past_key_values, cache, layer_past)
        if any(cls.__name__ == "Cache" for cls in type(value).__mro__):
            out[key] = None
        else:
            out[key] = value
    if "use_cache" in out:
        out["use_cache"] = False
    return out


@dataclass
class SplitHalf:
    """Half A of one candidate's train stream: the tangent sum and samples of the even train
    steps, and ``n_seen``, the stream's samples after the last step seen (−1: no split, samples
    came in another way)."""

    a_sum: torch.Tensor | None = None
    n_a: int = 0
    n_seen: int = 0
    open_even: bool = False  # an even step is under way: A holds −c_sum until it ends

    def off(self) -> None:
        self.a_sum, self.n_a, self.n_seen = None, 0, -1


class GrowthTangent(TangentSelfCheck, BatchNormCalibration):
    """The feature source (:class:`fused_stats.api.probe.spec.FeatureSource`) of a growth
    protocol on ``model``: at each candidate, the features of the new block's origin parameters.

    ``protocol``: a :class:`~fused_stats.GrowthProtocol` (its plan on ``model`` is built here, once)
    or a :class:`~.plan.GrowthPlan` (``model`` then defaults to the plan's).
    ``new_block(model, protocol, point)`` defaults to the plan's block (:func:`.blocks.block_for`)
    and ``zeroed_modules(block, family)`` to the origin modules of the model's adapter
    (:mod:`.architecture`), so the probed block is the one ``fs.grow`` inserts. Blocks are built
    once per point, on the model's dtype and device, and kept in ``blocks``. ``self_check``: at
    the first use of each candidate, one sample's tangent from the feature code is compared with
    autograd through an fp64 copy of the block (:meth:`check_point`); off: ``self_check=False``.
    """

    def __init__(
        self,
        protocol,
        model: nn.Module | None = None,
        new_block=None,
        zeroed_modules=None,
        self_check: bool = True,
    ):
        plan = protocol if isinstance(protocol, GrowthPlan) else None
        if plan is not None:
            protocol, model = plan.protocol, plan.model if model is None else model
        if model is None:
            raise FusedStatsError("GrowthTangent needs the model (or a GrowthPlan, which holds it)")
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
        if not isinstance(self_check, bool):
            raise FusedStatsError(f"self_check must be True or False, got {self_check!r}")
        meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
        if meta is not None:
            raise FusedStatsError(
                f"the tangent probe runs the new block on the model's own stream and builds it from the "
                f"model's weights, but {type(model).__name__} has meta-device parameters ({meta!r}, e.g. a "
                "model of fs.stream_blocks); load its weights first"
            )
        self.protocol, self.model = protocol, model
        if plan is None:
            plan = GrowthPlan.build(model, protocol)
        else:
            plan.require_current(model)
        self.plan = plan
        arch = plan.architecture
        self.arch, self.adapter = arch, arch.adapter
        self.self_check, self.checked = self_check, set()
        self.check_errors: dict[str, float] = {}  # point -> relative error of its self-check
        self._neighbours: dict[str, str] = {}
        self.channelwise = self.normwise = False
        self._grown: dict[str, str] = {}  # mlp_width: candidate -> the block whose MLP grows
        self.units: dict[str, blocks.NewUnits] = {}
        self._unit_norms: dict[str, dict[str, nn.Module]] = {}
        config = getattr(model, "config", None)
        self.branch_scale = self.adapter.scale(config, self.adapter.branch_scale)
        self.input_scale = self.adapter.scale(config, self.adapter.input_scale)
        if self.family == "mlp_width":
            blocks.zeroed_modules(self.adapter, "mlp_width")  # refuses a family without width growth
            self._mlp_inputs = self.adapter.mlp_inputs
            # the probe reads the features from the MLP's input (spec.source_features)
            self.input_features = self.unit_features
            self._grown = {p: entry.target for p, entry in plan.candidates.items()}
        else:
            self._neighbours = {p: entry.source for p, entry in plan.candidates.items()}
            if self.family == "layer" and not arch.transformer:
                # a zero BatchNorm scale and shift: per-channel terms from the point's conv map
                self.channelwise = True
                self.output_features, self.cross_terms = self.map_features, self.channel_terms
            elif self.family == "layer" and self.adapter.origin == "norm_scale":
                # a norm scale at its origin: per-entry terms q ⊙ x̂ (norm_terms)
                self.normwise = True
                self.cross_terms = self.norm_terms
        adapter = self.adapter
        self._new_block = new_block or (lambda model, protocol, point: blocks.block_for(plan, point))
        self._zeroed = zeroed_modules or (lambda block, family: blocks.zeroed_modules(adapter, family))
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
        # per candidate: half A of the train stream (:meth:`before_step`)
        self.split_halves: dict[str, SplitHalf] = {}
        # per candidate: the B-sized sub-batches of the train stream (protocol.train_batch_size)
        self.train_batch_size = getattr(protocol, "train_batch_size", None)
        self.sub_batches: dict[str, SubBatches] = {}
        # ResNet: per candidate, the new block's BatchNorm statistics (:mod:`.batchnorm`)
        self.batchnorm_stats: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        # the input scale is a fact of the model's forward (e.g. where an embedding scale is
        # applied, which moved between transformers releases): checked even with self_check off
        if arch.input_point in protocol.candidates and self.family != "cross_block":
            self.check_input_scale()

    def stream_scale(self, point: str) -> float:
        """The factor between the point's output and the stream the new block reads: the
        adapter's input scale at the input boundary, else 1."""
        return self.input_scale if point == self.arch.input_point else 1.0

    def feature_scale(self, point: str) -> float:
        """The factor of the features: the branch scale (between the block's origin and the
        residual add), over the stream scale (``q`` at the input point is the stream gradient
        times it)."""
        return self.branch_scale / self.stream_scale(point)

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
                if self.normwise:
                    origin = self.adapter.origin_value
                    weight = getattr(module, "weight", None)
                    if (
                        not isinstance(weight, torch.Tensor)
                        or weight.dim() != 1
                        or bool((weight != origin).any())
                    ):
                        raise FusedStatsError(
                            f"new block at {point!r} ({self.adapter.model_type}): the scale of norm {name!r} "
                            f"must be {origin} everywhere at the origin; the block would not be function preserving"
                        )
                    maps.append((name, int(weight.numel()), False))
                    continue
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
            units = self.units[point] = blocks.units_for(self.plan, point)
        return units

    def unit_features(self, point: str, module: nn.Module, u: torch.Tensor) -> torch.Tensor:
        """``h_t`` (B, T, width): the new hidden units of the MLP ``module`` on its input ``u``."""
        if self.self_check and point not in self.checked:
            self.checked.add(point)
            self.check_errors[point] = self.check_width_point(point, u)
        return self._unit_features(point, module, u)

    def _unit_features(self, point: str, module: nn.Module, u: torch.Tensor) -> torch.Tensor:
        units = self.new_units(point)
        pre = []
        for name in self._mlp_inputs:
            axis, w = units.pieces[f"{name}.weight"]
            w = w.to(dtype=u.dtype, device=u.device)
            y = u @ (w if axis == 1 else w.T)  # Conv1D pieces are (in, new) columns, Linear (new, in)
            bias = units.pieces.get(f"{name}.bias")
            if bias is not None:
                y = y + bias[1].to(dtype=u.dtype, device=u.device)
            pre.extend(y.chunk(self.adapter.mlp_chunks, dim=-1))  # a fused map: gate, then up
        act = next(
            (getattr(module, a) for a in MLP_ACTIVATIONS if getattr(module, a, None) is not None), None
        )
        if act is None:
            raise FusedStatsError(f"MLP {type(module).__name__} at {point!r} has none of {MLP_ACTIVATIONS}")
        # gated (LLaMA): act(gate) ⊙ up, the input of down_proj; else act(fc)
        h = act(pre[0]) * pre[1] if len(pre) == 2 else act(pre[0])
        # the MLP output is multiplied by the branch scale before the residual add (Granite)
        return h if self.branch_scale == 1.0 else h * self.branch_scale

    def raw_rank(self, point: str) -> int:
        """``r``: the columns of the full tangent ``C`` (inputs of the zero maps, +1 per bias)."""
        if self.family == "mlp_width":
            return int(self.protocol.width)
        self.block(point)
        if self.channelwise:  # a BatchNorm's scale and shift: two terms per channel
            return sum(2 * width for _, width, _ in self.maps[point])
        if self.normwise:  # a norm's scale: one term per entry
            return sum(width for _, width, _ in self.maps[point])
        return sum(width + int(bias) for _, width, bias in self.maps[point])

    def feature_rank(self, point: str) -> int:
        return self.raw_rank(point)

    def feature_ranks(self) -> dict[str, int]:
        """``r`` at every candidate whose block is built (all of them for ``mlp_width``); no
        block is built here."""
        built = self.protocol.candidates if self.family == "mlp_width" else list(self.maps)
        return {point: self.raw_rank(point) for point in built}

    def before_step(self, probe, stream: str) -> None:
        """Open the split of the train stream into halves by step parity (A: train steps 0, 2,
        4, …; B: the rest, ``c_sum − A``): on an even step ``A −= c_sum`` now and
        :meth:`after_step` adds ``c_sum`` back, so A gains exactly the step's tangent sum with one
        d × r fp64 sum per candidate (no per-sample rows, no snapshot). Not under a projection."""
        if stream != "train" or self.projection is not None:
            return
        even = probe.steps["train"] % 2 == 0
        for point in self.protocol.candidates:
            acc = probe.cross_stats.get(point)
            if acc is None or acc.n == 0:
                self.split_halves.pop(point, None)  # a fresh (or cleared) stream starts a fresh split
            n = 0 if acc is None else acc.n
            half = self.split_halves.setdefault(point, SplitHalf())
            if half.n_seen != n:
                half.off()  # samples came in another way (load_state, all-reduce)
            half.open_even = even and half.n_seen >= 0
            if half.open_even and acc is not None:
                half.a_sum = -acc.c_sum.detach().clone() if half.a_sum is None else half.a_sum.sub_(acc.c_sum)
                half.n_a -= n
            if self.train_batch_size is not None:
                if n == 0:
                    self.sub_batches.pop(point, None)
                eps = getattr(self.protocol, "adam_eps", ADAM_EPS)
                self.sub_batches.setdefault(point, SubBatches(self.train_batch_size, eps)).begin(acc, even)

    def after_step(self, probe, stream: str) -> None:
        """Close :meth:`before_step`'s split for the step (also after a refused or failed one,
        whose unchanged ``c_sum`` cancels)."""
        if stream != "train" or self.projection is not None:
            return
        for point in self.protocol.candidates:
            sub = self.sub_batches.get(point)
            if sub is not None:
                sub.end(probe.cross_stats.get(point))
            half = self.split_halves.get(point)
            if half is None or half.n_seen < 0:
                continue
            acc = probe.cross_stats.get(point)
            n = 0 if acc is None else acc.n
            if half.open_even and acc is not None:
                half.a_sum = acc.c_sum.detach().clone() if half.a_sum is None else half.a_sum.add_(acc.c_sum)
                half.n_a += n
            half.open_even, half.n_seen = False, n

    def split_half(self, point: str, probe):
        """``(A sum, n_A)`` at ``point`` or None (no split kept for the stream as it is now)."""
        half = self.split_halves.get(point)
        acc = probe.cross_stats.get(point)
        if half is None or acc is None or half.n_seen != acc.n or half.a_sum is None:
            return None
        return half.a_sum, half.n_a

    def candidate_scores(self, probe) -> dict[str, dict]:
        """Per candidate the probe has measured: the first-step inner products, the mean
        per-sample squared norm and the split Adam score (:func:`.scores.candidate_scores`, for
        the report)."""
        eps = getattr(self.protocol, "adam_eps", ADAM_EPS)
        projected = self.projection is not None
        return {
            point: candidate_scores(
                probe.cross_stats.get(point),
                probe.test_cross_stats.get(point),
                eps,
                projected,
                half=self.split_half(point, probe),
                train_batch_size=self.train_batch_size,
                sub_batches=self.sub_batches.get(point),
            )
            for point in self.protocol.candidates
            if probe.cross_stats.get(point) is not None
        }

    def zero_parameters(self) -> dict[str, list[str]]:
        """The new blocks' parameters at their origin, named by the model's architecture row
        (:meth:`.plan.GrowthPlan.zero_parameters`), for the report and the advice."""
        return self.plan.zero_parameters()

    def feature_w_in(self, point: str, dtype=torch.float32, device=None) -> torch.Tensor | None:
        """None (the exact tangent: the features are given to CrossStats as they are, no r × r
        identity stored) or the protocol's fixed ``k × r`` projection."""
        r = self.raw_rank(point)
        if self.projection is None:
            return None
        return seeded_w_in(self.projection, r, self.seed, dtype).to(device)

    def map_features(self, point: str, act: torch.Tensor, feature_dim: int = 1) -> torch.Tensor:
        """ResNet: ``[x̂_t ; 1]`` (B, H·W, 2C), ``x̂`` the new block's last BatchNorm input,
        normalised with its running statistics (calibrated on the first ``act`` seen at ``point``),
        the block run on the candidate's output ``act``
        (B, C, H, W), whose channels (axis 1) the probe must read as its features."""
        block = self.block(point)
        _, channels, _ = self.maps[point][0]
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
        # on the first batch seen here, before anything is measured (and self-checked)
        self.calibrate_point(point, block, act)
        if self.self_check and point not in self.checked:
            self.checked.add(point)
            self.check_errors[point] = self.check_channel_point(point, act)
        return self._map_features(point, block, act)

    def _map_features(self, point: str, block: nn.Module, act: torch.Tensor) -> torch.Tensor:
        bn = block.get_submodule(self.maps[point][0][0])
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

    def norm_terms(self, point: str, q: torch.Tensor, z: torch.Tensor, x: torch.Tensor):
        """Post-norm blocks: ``(1, x ⊙ [q ; q ; ...])``, ``x`` the normalised inputs of the origin
        norms (one copy of ``q`` per norm): ``Σ_t`` of the pair is ``[∂ℓ/∂w₁ ; ∂ℓ/∂w₂ ; ...]``, as
        the norm is linear in its scale with slope ``x̂`` (for ``x̂ w`` and ``x̂ (1 + w)`` alike)."""
        x = x.to(torch.float64)
        q = q.to(torch.float64)
        copies = x.shape[-1] // q.shape[-1]
        return torch.ones(*q.shape[:2], 1, dtype=x.dtype, device=x.device), x * torch.cat(
            [q] * copies, dim=-1
        )

    def _unit_norm(self, name: str, norm: nn.Module) -> nn.Module:
        """A copy of ``norm`` with its scale one above the origin: its output is the slope of the
        norm in its scale, ``x̂``, computed by the norm's own code (its dtype and rounding)."""
        unit = copy.deepcopy(norm)
        with torch.no_grad():
            unit.weight.fill_(self.adapter.origin_value + 1.0)
        return unit

    def features(self, point: str, module: nn.Module, z: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """``x_t`` (B, T, r): the new block run on the stream ``z`` (B, T, d) (times the input
        scale at the input boundary): the inputs of its zero maps (+1 per bias), or the normalised
        inputs of its origin norms, times :meth:`feature_scale`."""
        block = self.block(point)
        if self.family == "cross_block":
            if self.self_check and point not in self.checked:
                self.checked.add(point)
                self.check_errors[point] = self.check_cross_block_point(point, z)
            return self.cross_block_features(block, z)
        kwargs = block_call_kwargs(kwargs)
        if self.self_check and point not in self.checked:
            self.checked.add(point)
            self.check_errors[point] = self.check_point(point, z, kwargs)
        units = self._unit_norms.get(point)
        if units is None and self.normwise:
            units = self._unit_norms[point] = {
                name: self._unit_norm(name, block.get_submodule(name)) for name, _, _ in self.maps[point]
            }
        return self._features(point, block, units, z, kwargs)

    def _features(self, point, block, units, z, kwargs) -> torch.Tensor:
        inputs: dict[str, torch.Tensor] = {}
        handles = []
        for name, _, _ in self.maps[point]:

            def pre(mod, args, name=name):
                inputs[name] = args[0]

            handles.append(block.get_submodule(name).register_forward_pre_hook(pre))
        scale = self.stream_scale(point)
        try:
            with torch.no_grad():
                # Granite: inputs_embeds * embedding_multiplier, a Python float
                block(z if scale == 1.0 else z * scale, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        parts = []
        for name, width, bias in self.maps[point]:
            x = inputs.get(name)
            if x is not None and units is not None:
                with torch.no_grad():
                    x = units[name](x)
            if x is None or tuple(x.shape[:-1]) != tuple(z.shape[:-1]) or x.shape[-1] != width:
                raise FusedStatsError(
                    f"new block at {point!r}: the input of {name!r} has shape "
                    f"{None if x is None else tuple(x.shape)}, expected {(*z.shape[:-1], width)}"
                )
            parts.append(x)
            if bias:
                parts.append(torch.ones(*z.shape[:-1], 1, dtype=x.dtype, device=x.device))
        x = torch.cat(parts, dim=-1)
        factor = self.feature_scale(point)
        return x if factor == 1.0 else x * factor

    @staticmethod
    def cross_block_features(block: nn.Module, z: torch.Tensor) -> torch.Tensor:
        """``φ(W_in z)``: the input of the cross block's zero map ``W_out``."""
        return apply_activation(z.to(block.w_in.dtype) @ block.w_in.T, block.activation)


MLP_ACTIVATIONS = ("act_fn", "act", "activation_fn")  # the MLP's activation module, by family


register_feature_source(GrowthTangent)
