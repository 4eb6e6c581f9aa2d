"""The depth probe's block spec: :class:`CrossSpec` describes the zero-output block
``h(z) = W_out φ(W_in z)`` whose cross-gradient ``C = E[Σ_t q_t φ(W_in z_t)ᵀ]`` the probe measures
(depth paper; docs/design.md, section 2). It lives with the probe, which builds a CrossStats per
point from it; growth (:mod:`fused_stats.api.growth`) inserts the same block.

A :class:`FeatureSource` generalises the block: features ``x_t`` that a new block computes from
the whole sample (a transformer layer run on ``z`` with the point's attention mask and rotary
embeddings), so ``C = E[Σ_t q_t x_tᵀ]`` is the per-sample gradient of its zero maps
(docs/design.md, section 2.10). Layers above the probe hand theirs in as an object with a
``feature_source(model)`` method (a growth protocol), so the probe never imports them; the
driver's hooks into sources are the helpers at the end.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ...errors import FusedStatsError
from ...ops.cross_twin import ACTIVATIONS, seeded_w_in

DEFAULT_RANK = 64


@dataclass(frozen=True)
class CrossSpec:
    """The zero-output block probed for depth saturation.

    ``rank`` features ``φ(W_in z)`` with ``W_in`` (rank, d) drawn from N(0, 1/d) with ``seed``
    unless ``w_in`` is given; ``activation`` in ``gelu, relu, silu, tanh, identity, constant``
    (``constant``: φ ≡ 1, i.e. a bias-only block, for which ``C = μ``).

    ``rank`` defaults to :data:`DEFAULT_RANK` (64) without ``w_in`` and to ``w_in``'s row count
    with it; a ``rank`` given together with a ``w_in`` of another row count is an error.
    """

    rank: int | None = None
    activation: str = "gelu"
    seed: int = 0
    w_in: torch.Tensor | None = None

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise FusedStatsError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.rank is not None and (
            not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1
        ):
            raise FusedStatsError(f"rank must be a positive int, got {self.rank!r}")
        if self.w_in is None:
            rank = DEFAULT_RANK if self.rank is None else self.rank
        else:
            if not isinstance(self.w_in, torch.Tensor) or self.w_in.dim() != 2:
                raise FusedStatsError(
                    "w_in must be a tensor of shape (rank, d), got "
                    + (
                        f"shape {tuple(self.w_in.shape)}"
                        if isinstance(self.w_in, torch.Tensor)
                        else type(self.w_in).__name__
                    )
                )
            rows = int(self.w_in.shape[0])
            if self.rank is not None and self.rank != rows:
                raise FusedStatsError(
                    f"CrossSpec(rank={self.rank}, w_in of shape {tuple(self.w_in.shape)}): w_in has "
                    f"{rows} rows, so the block's rank is {rows}; drop rank= or pass a w_in with "
                    f"{self.rank} rows"
                )
            rank = rows
        object.__setattr__(self, "rank", rank)  # frozen: the resolved rank, read by every user

    def projection(self, dim: int, dtype=torch.float32, device=None) -> torch.Tensor:
        """``W_in`` for a stream of width ``dim``."""
        if self.w_in is not None:
            if self.w_in.shape[1] != dim:
                raise FusedStatsError(
                    f"CrossSpec.w_in has shape {tuple(self.w_in.shape)}, the point's width is {dim}"
                )
            return self.w_in.detach().to(dtype=dtype, device=device)
        return seeded_w_in(self.rank, dim, self.seed, dtype).to(device)


# ---------------------------------------------------------------------------- feature sources
@runtime_checkable
class FeatureSource(Protocol):
    """What ``fs.Probe(cross=...)`` needs of a block whose features are not ``φ(W_in z_t)``.

    A zero-output block ``W_out x_t(z)`` (``W_out = 0``) whose inputs ``x_t`` may depend on the
    whole sample (a transformer layer's attention output, its MLP hidden) has the cross-gradient
    ``C = E[Σ_t q_t x_tᵀ]``; its per-sample terms are exactly the per-sample gradients of
    ``W_out``. The probe hands the source each point's output ``z`` (B, P, d, features last) with
    the forward arguments the point's module received, and feeds ``x`` to a CrossStats as its
    "activation" with ``w_in = feature_w_in(point)`` and activation ``"identity"``: ``φ = w_in x``,
    i.e. ``x`` itself for an identity ``w_in``, or a fixed random projection of it.

    * ``features(point, module, z, kwargs) -> (B, P, r)``: ``x`` at every position (no grad);
    * ``feature_rank(point) -> int``: ``r``, the width of ``x``;
    * ``feature_w_in(point, dtype, device) -> (k, r) or None``: a projection, or None: the
      features enter as they are (CrossStats in features-given mode, no ``r × r`` identity).

    Optional: ``call_point(point)``, the module whose call arguments are recorded (default the
    point); ``gradient_point(point)``, the module whose output carries ``q`` and ``z`` for the
    point (default the point: a zero map read elsewhere, e.g. new MLP units of the next block,
    whose output columns write into that block's output); ``input_features(point, module, u)``,
    used instead of ``features`` when the features are a function of the first positional input
    ``u`` of the ``call_point`` module (e.g. the MLP's normalised input);
    ``output_features(point, act, feature_dim)``, used instead of ``features`` when they need the
    point's output ``act`` in its own layout (a conv map (B, C, H, W); ``feature_dim``: the axis
    the probe reads as features), returning (B, P, r) in the order of the probe's (B, P, d)
    view; ``cross_terms(point, q, z, x) -> (q', x')``, for zero parameters that are not a linear
    map's weight (a BatchNorm scale: per channel), the pair whose ``Σ_t q'_t x'_tᵀ`` is the
    per-sample gradient (the accumulator's width is ``q'``'s); ``protocol``, an object whose
    ``candidates`` are the probe's points when ``fs.Probe`` is given none.
    """

    def features(self, point: str, module, z: torch.Tensor, kwargs: dict) -> torch.Tensor: ...

    def feature_rank(self, point: str) -> int: ...

    def feature_w_in(self, point: str, dtype=torch.float32, device=None) -> torch.Tensor: ...


def resolve_cross(cross, model):
    """The probe's ``cross=`` argument as it is kept: None, a :class:`CrossSpec`, or a
    :class:`FeatureSource` (an object with a ``feature_source(model)`` method, e.g. a growth
    protocol, is turned into its source bound to ``model``)."""
    if cross is None or isinstance(cross, CrossSpec):
        return cross
    make = getattr(cross, "feature_source", None)
    if callable(make) and not isinstance(cross, FeatureSource):
        cross = make(model)
    if not isinstance(cross, FeatureSource):
        raise FusedStatsError(
            "cross must be None, a fused_stats.CrossSpec, a GrowthProtocol or a feature source "
            f"(features, feature_rank, feature_w_in), got {type(cross).__name__}"
        )
    return cross


def gradient_points(cross, points) -> dict[str, str]:
    """Point name -> the module whose output is captured for it, where a feature source moves it."""
    where = getattr(cross, "gradient_point", None) if is_feature_source(cross) else None
    if where is None:
        return {}
    return {name: where(name) for name in points}


def source_points(cross) -> list[str] | None:
    """The points a probe with this ``cross=`` measures by default: a feature source's
    ``protocol.candidates`` (a growth protocol's, its input boundary included), else None."""
    candidates = (
        getattr(getattr(cross, "protocol", None), "candidates", None) if is_feature_source(cross) else None
    )
    return list(candidates) if candidates else None


def is_feature_source(cross) -> bool:
    return cross is not None and not isinstance(cross, CrossSpec) and isinstance(cross, FeatureSource)


class PointKwargs:
    """Records, during one forward, the positional and keyword arguments each point's module was
    called with (``register_forward_hook(with_kwargs=True)``), for a feature source that runs a
    new block on the point's output: the block needs the same attention mask and rotary position
    embeddings. Does nothing unless ``source`` is a :class:`FeatureSource`."""

    def __init__(self, model, points, source):
        self.model, self.points = model, list(points)
        self.active, self.source = is_feature_source(source), source
        self.calls: dict[str, tuple[tuple, dict]] = {}
        self._handles: list = []

    def __enter__(self):
        if self.active:
            where = getattr(self.source, "call_point", None)
            for name in self.points:
                # a source may read another module's call (an embedding's carries no mask)
                module = self.model.get_submodule(where(name) if where else name)

                def hook(mod, args, kwargs, out, name=name):
                    self.calls[name] = (tuple(args), dict(kwargs))

                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        return False


def source_features(
    probe, name: str, z: torch.Tensor, mask, act: torch.Tensor | None = None, feature_dim: int = -1
) -> torch.Tensor:
    """The "activation" a probe's CrossStats gets at ``name``: ``z`` (B, P, d) itself for a
    :class:`CrossSpec`; for a feature source, its features of the block run on ``z`` (or on
    ``act``, the point's output in its own layout, for a source with ``output_features``) with the
    arguments recorded by :class:`PointKwargs` at the last step, zero at uncounted positions
    (padding enters nothing, also when the block gives non-finite values there)."""
    source = probe.cross
    if not is_feature_source(source):
        return z
    calls = getattr(probe, "_point_calls", None) or {}
    if name not in calls:
        raise FusedStatsError(
            f"point {name!r}: the feature source needs the arguments the module was called with; "
            "they are recorded by Probe.step only (not by observe or a bare fold)"
        )
    where = getattr(source, "call_point", None)
    module = probe.model.get_submodule(where(name) if where else name)
    from_input = getattr(source, "input_features", None)
    from_output = getattr(source, "output_features", None)
    with torch.no_grad():
        if from_output is not None:
            x = from_output(name, z if act is None else act, -1 if act is None else feature_dim)
        elif from_input is not None:
            args, _ = calls[name]
            if not args or not isinstance(args[0], torch.Tensor):
                raise FusedStatsError(
                    f"point {name!r}: {type(module).__name__} was called without a positional tensor "
                    "input; the feature source reads its features from that input"
                )
            x = from_input(name, module, args[0])
        else:
            x = source.features(name, module, z, call_kwargs(module, *calls[name]))
    B, P = z.shape[:2]
    rank = source.feature_rank(name)
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != (B, P, rank):
        raise FusedStatsError(
            f"feature source at point {name!r} returned "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}, expected "
            f"{(B, P, rank)}"
        )
    if mask is not None:
        x = torch.where(mask.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x


def source_terms(source, name: str, q: torch.Tensor, z: torch.Tensor, x: torch.Tensor):
    """``(q, x)`` as a probe's CrossStats at ``name`` takes them: as they are, or the pair of a
    source's ``cross_terms`` (checked: same positions as ``q``)."""
    terms = getattr(source, "cross_terms", None) if is_feature_source(source) else None
    if terms is None:
        return q, x
    q2, x2 = terms(name, q, z, x)
    if (
        not isinstance(q2, torch.Tensor)
        or not isinstance(x2, torch.Tensor)
        or q2.dim() != 3
        or x2.dim() != 3
        or tuple(q2.shape[:2]) != tuple(q.shape[:2])
        or tuple(x2.shape[:2]) != tuple(q.shape[:2])
    ):
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (q2, x2)]
        raise FusedStatsError(
            f"feature source at point {name!r}: cross_terms returned {shapes}, expected "
            f"({q.shape[0]}, {q.shape[1]}, ·) each"
        )
    return q2, x2


def call_kwargs(module, args: tuple, kwargs: dict) -> dict:
    """A module call's arguments after the stream (``args[0]``) as keywords (positional ones
    bound to ``module.forward``'s parameter names: GPT-2 blocks get the mask positionally)."""
    if len(args) <= 1:
        return dict(kwargs)
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise FusedStatsError(
            f"cannot bind the arguments of {type(module).__name__}.forward to pass them to a new block: {exc}"
        ) from exc
    out = dict(bound.arguments)
    first = next(iter(inspect.signature(module.forward).parameters))
    out.pop(first, None)
    extra = out.pop("kwargs", None)  # a **kwargs parameter collects the rest
    if isinstance(extra, dict):
        out.update(extra)
    return out


def cross_w_in(cross, point: str, dim: int, dtype, device) -> tuple[torch.Tensor | None, str]:
    """``(w_in, activation)`` of the CrossStats a probe keeps at ``point``; ``w_in`` None: a
    feature source's features taken as they are (``feature_rank(point)`` of them)."""
    if is_feature_source(cross):
        return cross.feature_w_in(point, dtype=dtype, device=device), "identity"
    return cross.projection(dim, dtype=dtype, device=device), cross.activation


def protocol_record(cross, probe=None) -> dict | None:
    """The growth protocol behind a feature source, verbatim with its digest (for reports), the
    width ``r`` of the full tangent at each point the source has measured (``feature_ranks``:
    a projected ``|C Pᵀ|²`` is rescaled by ``r / k`` from it), the parameters of the new blocks at
    their origin in this model (``model_zero_parameters``, from a source that names them), the
    structure of the model measured (``model_structure``: the source's plan's block counts and
    growth record length: the plan's ``structure``) and, given the ``probe``, the
    source's per-candidate scores from its accumulators (``scores``: ``candidate_scores(probe)``)."""
    protocol = getattr(cross, "protocol", None)
    if protocol is None or not hasattr(protocol, "to_dict"):
        return None
    record = {"digest": protocol.digest, "protocol": protocol.to_dict()}
    ranks = getattr(cross, "feature_ranks", None)
    if callable(ranks):
        record["feature_ranks"] = dict(ranks())
    zero = getattr(cross, "zero_parameters", None)
    if callable(zero):
        # named by the source from the model's own architecture (a post-norm block's norm scales)
        record["model_zero_parameters"] = dict(zero())
    plan = getattr(cross, "plan", None)
    if isinstance(getattr(plan, "structure", None), dict):
        # the model as measured: advice from this record is refused once the model changed
        record["model_structure"] = copy.deepcopy(plan.structure)
    scores = getattr(cross, "candidate_scores", None)
    if probe is not None and callable(scores):
        record["scores"] = scores(probe)
    return record
