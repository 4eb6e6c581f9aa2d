"""The probe driver: per-sample activation gradients at insertion points of any ``nn.Module``.

Role: :class:`Probe` runs the user's per-sample loss, takes ONE activation-only backward for all
points and folds the gradients into one :class:`~fused_stats.GradStats` per point and stream
(docs/design.md, sections 4 and 5). What one step computes, for per-sample losses ``ℓ_1..ℓ_B``::

    L = Σ_b ℓ_b                       (a sum, never a mean: a mean would scale every q by 1/B)
    G_p = ∂L/∂z_p                     (z_p: the output of point p, e.g. (B, T, d) or (B, C, H, W))

and, because sample ``b``'s activations influence only ``ℓ_b`` (eval mode: no batch statistics,
no dropout), ``G_p[b] = ∂ℓ_b/∂z_p[b]``: the per-sample activation gradient. The accumulator then
forms, with the counted positions ``P_b`` of sample ``b`` (see *Masks*):

* ``unit="sample"``: ``q_b = Σ_{t∈P_b} G_p[b, t]`` — the gradient of ``ℓ_b`` with respect to a bias
  added to the stream at the counted positions (the width paper's direct residual intervention);
  for conv maps the positions are the H×W pixels, so ``q_b ∈ R^C``;
* ``unit="position"``: every counted ``G_p[b, t]`` is a sample;
* ``unit="flat"``: ``q_b`` is the whole ``G_p[b]`` flattened (uncounted positions set to 0).

**Activation-only backward.** Parameters get ``requires_grad=False`` for the step, the first point
to run becomes a fresh leaf (nothing below it is kept or differentiated), and
``torch.autograd.grad(L, [z_1..z_L])`` returns every point's gradient in one pass without any
weight-gradient product (:mod:`fused_stats.api.probe.hooks`). The model runs in ``eval()``; hooks,
``requires_grad`` flags and every module's ``training`` flag are restored on every exit path.

**Masks** (what counts as a position). ``mask=None`` (default): the batch's ``attention_mask``
(B, T) if the batch is a mapping holding one, else every position. ``mask="labels"``: the positions
that emit a supervised prediction, exactly the target set of :func:`~fused_stats.causal_lm_loss`:
position ``t`` counts when ``labels[b, t+1] ≠ −100`` and ``attention_mask`` is nonzero at ``t`` and
``t+1`` (HF convention: ``labels`` aligned with ``input_ids``, the logits at ``t`` predict token
``t+1``). The last position and the last real token before padding predict nothing and have an
exactly zero gradient, so with ``unit="position"`` on causal LMs use ``mask="labels"``: the default
counts them as zero samples. Gradients at a counted position still include all later losses, as
attention lets them depend on ``z_t``.
``mask="none"``: every position. A (B, T) or (B,) tensor, or a callable ``batch -> tensor``:
nonzero = counted; a (B,) mask selects whole samples. A sample with no counted position is not a
sample. With ``cross=`` under ``mask="labels"`` (``unit="sample"``) the cross statistics sum over
every real position of those samples, prompt included (:meth:`Probe.cross_mask_for`): the exact
per-sample gradient of the zero block.

**The accumulator table.** :attr:`Probe.table` maps ``(kind, stream, point)`` to an accumulator:
kind ``"grad"`` (:class:`~fused_stats.GradStats`), ``"cross"`` (:class:`~fused_stats.CrossStats`,
with ``cross=``), ``"norm_hist"`` (:class:`~fused_stats.accumulators.NormHistogram`, with
``norm_histogram=``); stream ``"train"`` or ``"test"``. :attr:`stats`, :attr:`test_stats`,
:attr:`cross_stats` and :attr:`test_cross_stats` are live views ``point -> accumulator`` of it.
Checkpoints, the all-reduce, merges and logs iterate the table. Drivers other than :meth:`step`
(:meth:`observe`, streamed or sharded models) use :meth:`fold`, :meth:`mask_for`,
:meth:`feature_dim`, :meth:`new_accumulator` and :attr:`needs_activations`.

**Train and test streams.** :attr:`stats` (train) and :attr:`test_stats` (held-out) hold one
accumulator per point; what is read from them (estimates, certificates, saturation, reports) is
:mod:`fused_stats.api.probe.readout`.
"""

from __future__ import annotations

import copy as _copy
import weakref
from collections.abc import Mapping

import torch
from torch import nn

from ...accumulators import (
    Accumulator,
    NormHistogram,
)
from ...accumulators.base import Nonfinite
from ...accumulators.grad_stats import NONFINITE_POLICIES, SECOND_MOMENTS, UNITS, SecondMoment, Unit
from ...backend import Backend, validate_backend
from ...contracts import all_finite
from ...errors import FusedStatsError
from .feature_axis import resolve_feature_dim
from .fold import REGISTRY, SAME_MASK, PointCapture, StepFold, fold_stacked  # noqa: F401  (PointCapture re-exported)
from .fold import fold as fold_batch
from .hooks import ActivationCapture, FrozenEval, submodule
from .masks import MASK_MODES, counted_positions  # noqa: F401  (MASK_MODES re-exported)
from .points import resolve_points
from .readout import ProbeReadout, model_summary  # noqa: F401  (model_summary re-exported)
from .spec import PointKwargs, gradient_points, is_feature_source, source_points
from .table import STREAMS, TableView, check_stream


class Probe(ProbeReadout):
    """Activation-gradient statistics at insertion points of ``model`` (module docstring).

    Parameters
    ----------
    model : nn.Module
    points : None, "residual", str or list of str
        ``"residual"`` = :func:`fused_stats.residual_points`; otherwise module names (any module).
        None (default): the growth protocol's candidates for ``cross=GrowthProtocol`` (input
        boundary included), else ``"residual"``. Each name is bound to the module it names now:
        a step after the model's layout changed (e.g. ``fs.grow`` inserted a layer, so
        ``model.layers.0`` is the new block) is refused, naming the point.
    unit : {"sample", "position", "flat"}
    second_moment : {"auto", "dense", "pool"}
        Passed to every :class:`GradStats`; ``"pool"`` keeps per-sample vectors (needed by
        :meth:`misalignment`).
    cross : None or fs.CrossSpec
        The depth probe: one :class:`~fused_stats.accumulators.cross_stats.CrossStats`
        per point and stream (:attr:`cross_stats`, :attr:`test_cross_stats`) for the zero-output
        block ``W_out φ(W_in z)`` that reads the point's output ``z`` and writes into the stream at
        the same point, so its cross-gradient is ``Σ_t q_t φ(W_in z_t)ᵀ`` over the counted
        positions, with this probe's mask and ``unit`` ("sample" or "position"; conv maps:
        channels are the features, pixels the positions). :meth:`saturation` gives the test.
    pool_capacity : int, optional
    backend : {"auto", "triton", "torch"}
    feature_dim : None, int or dict
        The feature axis of each point's output. ``None``: -1 for (B, d) and (B, T, d) streams, 1
        for the (B, C, ...) maps of convolutional modules; any other output of 4 or more dimensions
        (e.g. attention heads (B, T, H, d_head)) needs it (:mod:`fused_stats.api.probe.feature_axis`).
        An int applies to every point; a dict maps point names to ints (others auto).
    nonfinite : {"raise", "skip"}
        A step whose gradient is NaN/Inf at a counted position raises (default) or is skipped and
        counted in :attr:`skipped_steps`; either way no accumulator changes.
    norm_histogram : bool or dict
        Also keep a :class:`~fused_stats.accumulators.NormHistogram` of ``|q_i|`` per point and
        stream (a dict: its ``low``/``high``/``bins``); needs unit "sample" or "position".

    Examples
    --------
    >>> import torch, fused_stats as fs
    >>> from fused_stats.networks.resnet import cifar_resnet20
    >>> model = cifar_resnet20(width=4, seed=0)
    >>> probe = fs.Probe(model, second_moment="dense")
    >>> x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    >>> probe.step((x, y), fs.classification_loss)
    >>> probe.stats["layer3.2"].n
    8
    """

    def __init__(
        self,
        model: nn.Module,
        points=None,
        unit: Unit = "sample",
        second_moment: SecondMoment = "auto",
        cross=None,
        pool_capacity: int | None = None,
        backend: Backend = "auto",
        feature_dim=None,
        nonfinite: Nonfinite = "raise",
        norm_histogram: bool | Mapping = False,
    ):
        if not isinstance(model, nn.Module):
            raise FusedStatsError(f"Probe needs a torch.nn.Module, got {type(model).__name__}")
        if unit not in UNITS:
            raise FusedStatsError(f"unit must be one of {UNITS}, got {unit!r}")
        if second_moment not in SECOND_MOMENTS:
            raise FusedStatsError(f"second_moment must be one of {SECOND_MOMENTS}, got {second_moment!r}")
        if nonfinite not in NONFINITE_POLICIES:
            raise FusedStatsError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if pool_capacity is not None and (not isinstance(pool_capacity, int) or pool_capacity < 1):
            raise FusedStatsError(f"pool_capacity must be a positive int or None, got {pool_capacity!r}")
        if cross is not None:
            from .spec import resolve_cross

            cross = resolve_cross(cross, model)  # a CrossSpec, or a feature source (growth's block)
            if unit == "flat":
                raise FusedStatsError(
                    "cross= needs unit='sample' or 'position' (a cross-gradient sums "
                    "q_t φ_tᵀ over positions); got unit='flat'"
                )
        if norm_histogram and unit == "flat":
            raise FusedStatsError("norm_histogram= needs unit='sample' or 'position'; got unit='flat'")
        if not isinstance(norm_histogram, (bool, Mapping)):
            raise FusedStatsError(f"norm_histogram must be a bool or a dict, got {norm_histogram!r}")
        self.norm_histogram = (
            dict(norm_histogram) if isinstance(norm_histogram, Mapping) else ({} if norm_histogram else None)
        )
        if self.norm_histogram is not None:
            unknown = sorted(set(self.norm_histogram) - {"low", "high", "bins"})
            if unknown:
                raise FusedStatsError(f"norm_histogram takes low, high and bins; got {unknown}")
            NormHistogram(1, **self.norm_histogram)  # the settings are checked now, not at a step
        if points is None:
            points = source_points(cross) or "residual"
        self.points = resolve_points(model, points)
        self.cross = cross
        self.model = model
        self.unit = unit
        self.second_moment = second_moment
        self.pool_capacity = pool_capacity
        self.backend = validate_backend(backend)
        self.nonfinite = nonfinite
        self._feature_dim_arg = self._check_feature_dim(feature_dim)
        self.feature_dims: dict[str, int] = {}  # resolved at the first step
        self.dims: dict[str, int] = {}
        # (kind, stream, point) -> accumulator; created at a point's first committed step
        self.table: dict[tuple[str, str, str], Accumulator] = {}
        self.steps = {s: 0 for s in STREAMS}
        self.skipped_steps = {s: 0 for s in STREAMS}
        self._callbacks: list = []

    # ------------------------------------------------------------------ the table
    @property
    def kinds(self) -> tuple[str, ...]:
        """The accumulator kinds this probe keeps at every point ("grad" and, as configured,
        "cross", "norm_hist", or a kind added by :func:`fused_stats.api.probe.fold.register_kind`)."""
        return tuple(name for name, kind in REGISTRY.items() if kind.enabled(self))

    def accumulators(self, kind: str = "grad", stream: str = "train") -> TableView:
        """The live view ``point -> accumulator`` of ``kind`` in ``stream``."""
        self.check_stream(stream)
        if kind not in REGISTRY:
            raise FusedStatsError(f"kind must be one of {tuple(REGISTRY)}, got {kind!r}")
        return TableView(self.table, kind, stream, self.points)

    @property
    def stats(self) -> TableView:
        """Train-stream GradStats per point (a view of :attr:`table`)."""
        return TableView(self.table, "grad", "train", self.points)

    @property
    def test_stats(self) -> TableView:
        """Test-stream GradStats per point."""
        return TableView(self.table, "grad", "test", self.points)

    @property
    def cross_stats(self) -> TableView:
        """Train-stream CrossStats per point (``cross=``)."""
        return TableView(self.table, "cross", "train", self.points)

    @property
    def test_cross_stats(self) -> TableView:
        """Test-stream CrossStats per point (``cross=``)."""
        return TableView(self.table, "cross", "test", self.points)

    def check_stream(self, stream: str) -> str:
        return check_stream(stream)

    def clear_stream(self, stream: str) -> None:
        """Drop every accumulator of ``stream`` (the next step creates fresh ones)."""
        self.check_stream(stream)
        for key in [k for k in self.table if k[1] == stream]:
            del self.table[key]

    def state_copy(self) -> Probe:
        """A shallow copy of this probe (same model and settings) holding copies of every
        accumulator and counter, e.g. to all-reduce without touching this probe's state."""
        out = _copy.copy(self)
        out.table = {key: acc.copy() for key, acc in self.table.items()}
        out.steps, out.skipped_steps = dict(self.steps), dict(self.skipped_steps)
        out.dims, out.feature_dims = dict(self.dims), dict(self.feature_dims)
        out._callbacks = list(self._callbacks)
        return out

    def new_accumulator(
        self, kind: str, stream: str, point: str, dim: int, dtype=None, device=None
    ) -> Accumulator:
        """An empty accumulator of ``kind`` with this probe's settings for ``point`` (the one
        place a probe creates accumulators; :data:`fused_stats.api.probe.fold.REGISTRY` says how).
        Named like the point (test stream: ``"<point> [test]"``); ``dtype``: of a cross block's
        ``W_in`` (default fp32); ``device``: where the state lives (None: the first batch's device)."""
        if kind not in REGISTRY:
            raise FusedStatsError(f"kind must be one of {tuple(REGISTRY)}, got {kind!r}")
        name = point if stream == "train" else f"{point} [test]"
        return REGISTRY[kind].make(self, name, dim, dtype, device)

    @property
    def needs_activations(self) -> bool:
        """Whether folding needs each point's forward output as well as its gradient."""
        return bool(self._callbacks) or self.cross is not None

    # ------------------------------------------------------------------ set-up helpers
    def _check_feature_dim(self, feature_dim):
        if feature_dim is None or (isinstance(feature_dim, int) and not isinstance(feature_dim, bool)):
            return feature_dim
        if isinstance(feature_dim, Mapping):
            unknown = [k for k in feature_dim if k not in self.points]
            if unknown:
                raise FusedStatsError(
                    f"feature_dim names {unknown} that are not points; points: {self.points}"
                )
            bad = {k: v for k, v in feature_dim.items() if not isinstance(v, int) or isinstance(v, bool)}
            if bad:
                raise FusedStatsError(f"feature_dim values must be ints, got {bad}")
            return dict(feature_dim)
        raise FusedStatsError(f"feature_dim must be None, an int or a dict point -> int, got {feature_dim!r}")

    def _resolve_feature_dim(self, name: str, activation: torch.Tensor) -> int:
        arg = self._feature_dim_arg
        fd = arg.get(name) if isinstance(arg, dict) else arg
        return resolve_feature_dim(
            self.model.get_submodule(gradient_points(self.cross, [name]).get(name, name)),
            activation,
            name,
            fd,
            where=f" to fs.Probe (for every point, or {{{name!r}: axis}})",
        )

    def add_callback(self, fn) -> None:
        """Call ``fn(PointCapture)`` for every point after each successful step (e.g. extra
        statistics that need the forward activation ``z`` as well as its gradient)."""
        if not callable(fn):
            raise FusedStatsError(f"callback must be callable, got {type(fn).__name__}")
        self._callbacks.append(fn)

    def cross_features(self, point: str, module, z: torch.Tensor, kwargs, acc, mask) -> torch.Tensor:
        """The cross block's features of ``point``, computed in its forward hook so that the step
        keeps them (B, P, r) instead of the output ``z`` (B, P, d): for a :class:`CrossSpec`,
        ``φ(W_in z)`` of ``acc`` (:meth:`CrossStats.features`). ``module`` and its forward
        ``kwargs`` (e.g. an attention mask) are there for specs whose features need them."""
        return acc.features(z, mask)

    @property
    def model(self) -> nn.Module:
        """The probed model. Setting it binds the points to the new model's modules."""
        return self._model

    @model.setter
    def model(self, model: nn.Module) -> None:
        self._model = model
        # what each name (and the module its gradient is read at) resolves to now
        self._bound_modules = {
            where: weakref.ref(submodule(model, where))
            for where in dict.fromkeys([*self.points, *gradient_points(self.cross, self.points).values()])
        }

    def check_layout(self) -> None:
        """Refuse to fold when a point name now names another module than at construction (the
        model was edited, e.g. grown: its statistics would mix two modules in one accumulator)."""
        for where, ref in self._bound_modules.items():
            try:
                now = submodule(self.model, where)
            except AttributeError:
                now = None
            then = ref()
            if now is not then:
                seen = "no module" if now is None else f"a {type(now).__name__} (id {id(now):#x})"
                was = (
                    "a module since deleted"
                    if then is None
                    else f"a {type(then).__name__} (id {id(then):#x})"
                )
                raise FusedStatsError(
                    f"point {where!r} now names {seen}, not {was} it named when this probe was "
                    "made: the model's layout changed (e.g. fs.grow inserted a block). Make a new "
                    "fs.Probe for the new layout; nothing was accumulated"
                )

    # ------------------------------------------------------------------ masks
    def mask_for(self, batch, mask) -> torch.Tensor | None:
        """The counted-position mask of ``batch`` (module docstring), or None = everything."""
        return counted_positions(batch, mask)

    def cross_mask_for(self, batch, mask, positions_mask):
        """The positions the cross statistics sum ``q_t x_tᵀ`` over, for ``positions_mask`` =
        :meth:`mask_for` of ``batch`` and ``mask``: the same, except under ``mask="labels"`` with
        ``unit="sample"``, where they are every real position (the batch's ``attention_mask``) of
        the samples that have a supervised target. A zero block writes into the stream at every
        position, and a prompt position's gradient is not zero (later targets depend on it), so
        the per-sample gradient of its ``W_out`` sums over all of them; padding has ``q_t = 0``."""
        labels = isinstance(mask, str) and mask == "labels"
        if self.cross is None or not labels or self.unit != "sample" or positions_mask is None:
            return positions_mask
        targets = positions_mask.reshape(positions_mask.shape[0], -1).any(dim=1)
        real = counted_positions(batch, "attention")
        real = torch.ones_like(positions_mask) if real is None else real != 0
        return real.to(positions_mask.device) & targets[:, None]

    # ------------------------------------------------------------------ the step
    def step(self, batch, loss_fn, stream: str = "train", mask=None, atomic: bool = True) -> None:
        """Fold one batch into ``stream``'s accumulators.

        ``loss_fn(model, batch)`` must return per-sample losses of shape (B,) (e.g.
        :func:`fused_stats.causal_lm_loss`). ``mask``: see the module docstring. The model,
        its parameters, their ``requires_grad`` flags and its modules' training flags are left as
        they were, also when ``loss_fn`` raises. Each point's gradient is reduced inside the
        backward (:mod:`fused_stats.api.probe.fold`). ``atomic=True``: a rejected step changes no
        accumulator. ``atomic=False`` commits each point as its gradient arrives (nothing but the
        point's gradient is held, also for ``unit="position"``/``"flat"``, whose reduced rows are
        N × d fp64 a point); a step refused at one point then leaves the points whose gradients
        arrived before it (those nearer the loss) with the batch, the others without it, and counts
        it in :attr:`skipped_steps` (``nonfinite="skip"``) or raises.
        """
        self.check_stream(stream)
        self.check_layout()
        if torch.is_inference_mode_enabled():
            raise FusedStatsError("Probe.step cannot run inside torch.inference_mode(): it needs autograd")
        if not atomic and (self._callbacks or is_feature_source(self.cross)):
            raise FusedStatsError(
                "atomic=False commits each point in the backward; callbacks and a feature source "
                "(e.g. cross=GrowthProtocol) need the staged step"
            )
        positions_mask = self.mask_for(batch, mask)
        model = self.model
        folding = StepFold(
            self, stream, positions_mask, atomic, self.cross_mask_for(batch, mask, positions_mask)
        )
        capture = ActivationCapture(
            model, self.points, on_output=folding.on_output, modules=gradient_points(self.cross, self.points)
        )
        calls = PointKwargs(model, self.points, self.cross)  # a feature source's block needs them
        before, after = getattr(self.cross, "before_step", None), getattr(self.cross, "after_step", None)
        if callable(before) and callable(after):  # a feature source's per-step state (split halves)
            before(self, stream)
        try:
            # only what changes is recorded and restored
            with FrozenEval(model), torch.enable_grad():  # enable_grad: losses.sum() needs a graph
                try:
                    with capture, calls:
                        losses = loss_fn(model, batch)
                    self._backward(losses, capture, folding)
                finally:
                    capture.remove()
            self._point_calls = calls.calls
            try:
                folding.finish()
            finally:
                self._point_calls = None
        finally:
            if callable(before) and callable(after):
                after(self, stream)

    def observe(
        self, loss_reduction: str | None = None, scale=None, mask=None, stream: str = "train", **options
    ):
        """Collect the statistics during the user's own training step.

        ``with probe.observe(loss_reduction="token_mean"): model(**batch).loss.backward()``:
        tensor hooks at the points receive ``∂ℒ/∂z`` during that backward (weight gradients and
        the optimizer step are untouched), the gradients are rescaled to per-sample-loss
        gradients as :meth:`step` defines them (``"mean"``: ×B, ``"sum"``: ×1, ``"token_mean"``:
        ×N/n_b, or an explicit (B,) ``scale``) and folded in when the block exits. Further
        options (``batch``, ``loss_scale``, ``log``, ``step``, ``nonfinite``) and the checks made:
        :class:`fused_stats.api.training.observe.Observation`.
        """
        from ..training.observe import Observation

        return Observation(
            self, loss_reduction=loss_reduction, scale=scale, mask=mask, stream=stream, **options
        )

    def _backward(self, losses, capture: ActivationCapture, folding: StepFold) -> None:
        """Check the forward's result, then ONE backward of ``Σ_b ℓ_b`` down to the lowest point
        (``inputs=`` the leaves the capture made); the points' tensor hooks reduce the gradients."""
        missing = [p for p in self.points if p not in capture.shapes]
        if missing:
            raise FusedStatsError(
                f"points {missing} did not run during loss_fn (modules never called); ran: {capture.order}"
            )
        shapes = capture.shapes
        B = shapes[self.points[0]][0]
        if not isinstance(losses, torch.Tensor):
            raise FusedStatsError(
                f"loss_fn must return a tensor of per-sample losses, got {type(losses).__name__}"
            )
        if tuple(losses.shape) != (B,):
            hint = " (a scalar: return per-sample losses, not their mean or sum)" if losses.dim() == 0 else ""
            raise FusedStatsError(
                f"loss_fn returned shape {tuple(losses.shape)}{hint}; expected ({B},), one loss per "
                f"sample of the batch (point {self.points[0]!r} has output shape "
                f"{shapes[self.points[0]]})"
            )
        if not losses.is_floating_point():
            raise FusedStatsError(f"loss_fn returned dtype {losses.dtype}; expected a floating-point tensor")
        values = losses.detach()
        if not all_finite(values):
            bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
            raise FusedStatsError(
                f"loss_fn returned non-finite losses for samples {bad[:10]} of {B}: {values[bad[:5]].tolist()}"
            )
        for name in self.points:
            if shapes[name][0] != B:
                raise FusedStatsError(
                    f"point {name!r} has output shape {shapes[name]}; every point needs "
                    f"the batch size {B} on dim 0"
                )
        changed = capture.modified_in_place() + folding.modified_in_place()
        if changed:
            raise FusedStatsError(
                f"the outputs of points {changed} were modified in place after capture (e.g. an "
                "in-place activation downstream); their gradients would be wrong. Probe another "
                "module or make that operation out of place"
            )
        if not losses.requires_grad:
            raise FusedStatsError(
                "the losses do not depend on any probed point (no graph); was the loss computed "
                "under torch.no_grad() or from detached outputs?"
            )
        # sum, never mean: each sample's gradient must be that of its own loss (docs/design.md,
        # section 5)
        folding.backward(losses.sum(), capture.leaves)

    def feature_dim(self, point: str, activation: torch.Tensor) -> int:
        """The feature axis of ``point``'s output: the one fixed at its first step, else inferred
        from ``activation`` (and the ``feature_dim=`` argument)."""
        fd = self.feature_dims.get(point)
        return self._resolve_feature_dim(point, activation) if fd is None else fd

    def fold(
        self,
        stream: str,
        activations: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor],
        positions_mask=None,
        nonfinite: Nonfinite | None = None,
        cross_positions=SAME_MASK,
    ) -> bool:
        """Fold one batch's per-sample activation gradients into every accumulator of ``stream``
        (all or nothing); returns whether it was folded (False: skipped as non-finite).

        ``activations[point]``: the point's forward output ``z`` (its shape fixes the feature
        axis, and the cross statistics read it); ``grads[point]``: ``∂L/∂z`` of the summed
        per-sample losses, same shape; ``positions_mask``: counted positions (B, ...) or None;
        ``cross_positions``: the cross statistics' positions where they differ
        (:meth:`cross_mask_for`).
        Every point and kind is validated and reduced before any accumulator changes, so a step
        that any of them would reject (e.g. a non-finite activation at a counted position, which
        only the cross statistics see) changes none. ``nonfinite`` overrides the probe's policy.
        (:func:`fused_stats.api.probe.fold.fold`.)
        """
        return fold_batch(self, stream, activations, grads, positions_mask, nonfinite, cross_positions)

    def _fold_stacked(self, stream: str, activations, grads) -> bool:
        """The stacked fast path of :meth:`fold` (:func:`fused_stats.api.probe.fold.fold_stacked`)."""
        return fold_stacked(self, stream, activations, grads)

    def run(
        self,
        batches,
        loss_fn,
        stream: str = "train",
        max_batches: int | None = None,
        mask=None,
        progress: bool = True,
    ) -> int:
        """:meth:`step` over an iterable of batches (at most ``max_batches``).

        ``progress``: shown by :class:`fused_stats.progress.Progress` (a bar when stderr is a
        terminal, a plain line now and then when it is redirected, never a carriage return into
        a file; False: nothing). Returns the number of batches folded in.
        """
        from ...progress import Progress

        self.check_stream(stream)
        total = max_batches
        if total is None:
            try:
                total = len(batches)
            except TypeError:
                total = None
        elif hasattr(batches, "__len__"):
            total = min(total, len(batches))
        done = 0
        with Progress(total, f"probe {stream}", enabled=progress, unit="batches") as bar:
            for batch in batches:
                if max_batches is not None and done >= max_batches:
                    break
                self.step(batch, loss_fn, stream=stream, mask=mask)
                done += 1
                bar.update(1)
        return done

    # ------------------------------------------------------------------ scale-out
    def all_reduce(self, group=None) -> Probe:
        """Sum every accumulator (GradStats and, with ``cross=``, CrossStats; both streams) and the
        step counters over the ranks of ``group`` (a collective):
        :func:`fused_stats.api.state.distributed.all_reduce_probe`."""
        from ..state.distributed import all_reduce_probe

        return all_reduce_probe(self, group)

    def save_state(self, directory):
        """Checkpoint every accumulator into ``directory`` (atomic snapshot; returns its folder):
        :func:`fused_stats.api.state.checkpoint.save_probe_state`."""
        from ..state.checkpoint import save_probe_state

        return save_probe_state(self, directory)

    def load_state(self, directory) -> dict:
        """Restore every accumulator from the newest snapshot in ``directory`` (all or nothing;
        returns its manifest): :func:`fused_stats.api.state.checkpoint.load_probe_state`."""
        from ..state.checkpoint import load_probe_state

        return load_probe_state(self, directory)

    def __repr__(self) -> str:
        n = {
            s: next((a.n for (k, st, _), a in self.table.items() if k == "grad" and st == s), 0)
            for s in STREAMS
        }
        return (
            f"Probe({type(self.model).__name__}, points={len(self.points)}, unit={self.unit!r}, "
            f"second_moment={self.second_moment!r}, n_train={n['train']}, n_test={n['test']})"
        )
