"""Folding a batch into a probe's accumulators: the staged fold and the in-backward fold of
:meth:`fused_stats.Probe.step` (docs/design.md, section 5).

**Kinds** (what a probe keeps at each point, and how each is made and fed) are
:mod:`fused_stats.api.probe.kinds`; the folds below never branch on a kind's name.

**Staged fold** (:func:`fold`): every point's output ``z`` and gradient ``∂L/∂z`` given at once
(:meth:`Probe.fold`, used by :meth:`Probe.observe` and by steps with callbacks or one row per
sample); every accumulator is prepared before any is committed (all or nothing), the points of a
kind share batched calls (``prepare_many``/``commit_many``, given a stack for (B, d) points).

**In-backward fold** (:class:`StepFold`): the forward hook of each point registers a tensor hook
on its output and keeps only what the gradient's reduction needs — the point's mask and, with
``cross=``, the features ``φ(W_in z)`` (B, T, r), never ``z``; the tensor hook reduces the
gradient as autograd produces it (``prepare``: the unit's rows, e.g. (B, d) sums for
``unit="sample"``) and returns, so the (B, T, d) gradient is freed before the next point's
arrives. Only the step's own backward's gradients count, one per point
(:class:`~fused_stats.api.probe.sink.GradientSink`: a ``torch.autograd.grad`` inside the loss is
not an arrival). Atomic (default): the reduced rows are committed after the backward, together, or
not at all. Per point (``atomic=False``): each point is committed in its hook; a failure then leaves the
points whose gradients arrived earlier (those nearer the loss) holding the batch and no other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ...accumulators import CrossStats, GradStats
from ...errors import FusedStatsError
from .kinds import (  # noqa: F401  (re-exported)
    BUILTIN_KINDS,
    REGISTRY,
    Kind,
    cross_accumulator,
    point_of,
    register_kind,
    unregister_kind,
)
from .masks import flat_masked, point_mask
from .sink import GradientSink
from .spec import is_feature_source, source_features, source_terms


@dataclass
class PointCapture:
    """What one step saw at one point; handed to callbacks registered with :meth:`Probe.add_callback`.

    ``activation``: the point's forward output ``z`` (detached), ``grad``: ``∂L/∂z`` (same shape),
    ``mask``: the counted positions (B, *positions) bool or None, ``feature_dim``: the feature axis
    of both tensors. Extension point for statistics that need ``z`` as well as ``q`` (the depth
    probe's cross-gradient ``Σ_t q_t φ(W_in z_t)ᵀ``).
    """

    point: str
    stream: str
    activation: torch.Tensor
    grad: torch.Tensor
    mask: torch.Tensor | None
    unit: str
    feature_dim: int


def cross_dtype(z: torch.Tensor) -> torch.dtype:
    """The dtype of a new cross block's ``W_in`` for an output ``z``."""
    return torch.float64 if z.dtype == torch.float64 else torch.float32


def cross_view(t: torch.Tensor, fd: int) -> torch.Tensor:
    """``t`` with its features last and its positions flattened: (B, P, d)."""
    last = fd % t.dim() == t.dim() - 1  # features already last: no view to make
    t = t if last else t.movedim(fd, -1)
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


# the cross statistics count the positions the gradient statistics count (see cross_positions)
SAME_MASK = object()


def cross_mask(m, B: int, P: int):
    """A point's mask (B,) or (B, *positions) as the (B, P) mask of :func:`cross_view`."""
    if m is None:
        return None
    return m[:, None].expand(B, P) if m.dim() == 1 else m.reshape(B, P)


def nonfinite_message(kind, name, stream, grad_shape, grad_dtype, act_shape, act_dtype) -> str:
    if REGISTRY[kind].reads == "cross":
        return (
            f"non-finite cross-gradient sums at point {name!r} ({stream} stream): NaN/Inf "
            f"in the activation (shape {tuple(act_shape)}, dtype {act_dtype}) or the "
            "gradient at a counted position, or values so large that they overflow"
        )
    return (
        f"non-finite activation gradient at point {name!r} ({stream} stream, grad shape "
        f"{tuple(grad_shape)}, dtype {grad_dtype}): NaN/Inf at a counted position, or "
        "values so large that |q|^4 overflows"
    )


def skip_or_raise(probe, stream: str, what: str, policy: str) -> bool:
    """A step some point rejects: counted and skipped (``nonfinite="skip"``) or an error."""
    if policy == "skip":
        probe.skipped_steps[stream] += 1
        return False
    raise FusedStatsError(
        f"{what}; nothing was accumulated. Pass nonfinite='skip' to skip such steps and count them"
    )


def check_dim(probe, stream, name, shape, dim) -> None:
    """A point's width must be the one its other stream holds."""
    if ("grad", stream, name) not in probe.table and name in probe.dims and probe.dims[name] != dim:
        raise FusedStatsError(
            f"point {name!r}: output shape {tuple(shape)} gives dim {dim}, but the "
            f"other stream has dim {probe.dims[name]}"
        )


def commit(probe, plan) -> None:
    """Commit ``plan`` = [(key, acc, prepared)] (every entry finite): each kind's accumulators
    together (``commit_many`` folds their sums in fewer calls), then keep them in the table."""
    by_kind: dict[str, list] = {}
    for entry in plan:
        by_kind.setdefault(entry[0][0], []).append(entry)
    for entries in by_kind.values():
        keys, accs, prepared = zip(*entries)
        type(accs[0]).commit_many(accs, prepared)
        for key, acc in zip(keys, accs):
            probe.table.setdefault(key, acc)
            if key[0] == "grad":
                probe.dims[key[2]] = acc.dim


def _prepare_grouped(args, unit):
    """``prepare`` of ``args`` = [(acc, grad, mask, feature_dim)]: one ``prepare_many`` per
    accumulator class that has one (the points share batched calls), else one by one."""
    out: list = [None] * len(args)
    groups: dict[type, list[int]] = {}
    for i, (acc, *_rest) in enumerate(args):
        groups.setdefault(type(acc), []).append(i)
    for cls, idx in groups.items():
        accs, gs, ms, fds = zip(*(args[i] for i in idx))
        if hasattr(cls, "prepare_many"):
            done = cls.prepare_many(accs, gs, ms, unit, fds)
        else:
            done = [a.prepare(g, m, unit, fd) for a, g, m, fd in zip(accs, gs, ms, fds)]
        for i, p in zip(idx, done):
            out[i] = p
    return out


# ---------------------------------------------------------------------------- the staged fold
def fold(
    probe,
    stream: str,
    activations: Mapping,
    grads: Mapping,
    positions_mask=None,
    nonfinite=None,
    cross_positions=SAME_MASK,
) -> bool:
    """:meth:`fused_stats.Probe.fold` (its docstring)."""
    probe.check_stream(stream)
    if positions_mask is None and probe._fold_stacked(stream, activations, grads):
        return True
    policy = probe.nonfinite if nonfinite is None else nonfinite
    unit, kinds = probe.unit, probe.kinds
    grad_args, grad_keys = [], []  # GradStats-like kinds: prepared together below
    cross_args, cross_keys = [], []
    for name in probe.points:
        act, grad = activations[name], grads[name]
        fd = probe.feature_dim(name, act)
        m = point_mask(name, act.shape, fd, act.device, positions_mask)
        xm = (
            m
            if cross_positions is SAME_MASK
            else point_mask(name, act.shape, fd, act.device, cross_positions)
        )
        g = grad
        if unit == "flat" and m is not None:
            g, m = flat_masked(g, m, fd), None
        dim = math.prod(act.shape[1:]) if unit == "flat" else act.shape[fd]
        check_dim(probe, stream, name, act.shape, dim)
        for kind in kinds:
            key = (kind, stream, name)
            acc = probe.table.get(key)
            if REGISTRY[kind].reads == "cross":
                z = cross_view(act.detach(), fd)
                cm = cross_mask(xm, z.shape[0], z.shape[1])
                # a feature source's features of the block run on z; z itself for a CrossSpec
                x = source_features(probe, name, z, cm, act.detach(), fd)
                cg, x = source_terms(probe.cross, name, cross_view(g, fd), z, x)
                if acc is None:  # kept only if the step commits
                    acc = probe.new_accumulator(kind, stream, name, cg.shape[-1], cross_dtype(z), z.device)
                cross_args.append((acc, cg, x, cm))
                cross_keys.append(key)
            else:
                if acc is None:
                    acc = probe.new_accumulator(kind, stream, name, dim, device=g.device)
                grad_args.append((acc, g, m, fd if unit != "flat" else -1))
                grad_keys.append(key)
    prepared_at = dict(zip(grad_keys, zip((a[0] for a in grad_args), _prepare_grouped(grad_args, unit))))
    if cross_args:
        # the points share batched calls where their batches allow (CrossStats.prepare_many)
        accs, cgs, zs, cms = zip(*cross_args)
        prepared_at.update(zip(cross_keys, zip(accs, type(accs[0]).prepare_many(accs, cgs, zs, cms, unit))))
    plan = []
    for name in probe.points:
        for kind in kinds:
            key = (kind, stream, name)
            acc, prepared = prepared_at[key]
            if not prepared.finite:
                g, a = grads[name], activations[name]
                return skip_or_raise(
                    probe,
                    stream,
                    nonfinite_message(kind, name, stream, g.shape, g.dtype, a.shape, a.dtype),
                    policy,
                )
            plan.append((key, acc, prepared))
    commit(probe, plan)
    for name in probe.points:
        probe.feature_dims[name] = probe.feature_dim(name, activations[name])
    probe.steps[stream] += 1
    if probe._callbacks:
        for name in probe.points:
            act, fd = activations[name], probe.feature_dims[name]
            m = point_mask(name, act.shape, fd, act.device, positions_mask)
            g = grads[name]
            if unit == "flat" and m is not None:
                g, m = flat_masked(g, m, fd), None
            for fn in probe._callbacks:
                fn(PointCapture(name, stream, act.detach(), g, m, unit, fd))
    return True


def fold_stacked(probe, stream: str, activations, grads) -> bool:
    """:func:`fold` of the common case with the fewest calls: ``unit="sample"``, nothing
    masked, every point's accumulators already made, every point's output and gradient of
    one (B, d) shape, kinds ``grad`` and ``cross`` only, no callbacks. The points' gradients
    are stacked once for both kinds (``prepare_many`` / ``commit_many`` of the stack); the result is
    the general path's, bit for bit. Returns False with nothing changed where that does not
    apply or a batch is not finite: the general path then folds, refuses or skips it."""
    points, kinds = probe.points, probe.kinds
    if (
        probe.unit != "sample"
        or probe._callbacks
        or len(points) < 2
        or not set(kinds) <= {"grad", "cross"}
        or is_feature_source(probe.cross)  # its features are not the point's output
    ):
        return False
    gaccs = [probe.table.get(("grad", stream, p)) for p in points]
    caccs = [probe.table.get(("cross", stream, p)) for p in points] if "cross" in kinds else []
    if any(a is None for a in gaccs) or any(a is None for a in caccs):
        return False
    g0, a0 = grads[points[0]], activations[points[0]]
    if not isinstance(g0, torch.Tensor) or not isinstance(a0, torch.Tensor) or g0.dim() != 2:
        return False
    gs, acts = [], []
    for name in points:
        g, a = grads[name], activations[name]
        if (
            not isinstance(g, torch.Tensor)
            or not isinstance(a, torch.Tensor)
            or g.shape != g0.shape
            or a.shape != g0.shape
            or g.dtype != g0.dtype
            or a.dtype != a0.dtype
            or g.device != g0.device
            or a.device != g0.device
            or probe.feature_dims.get(name) not in (1, -1)
        ):
            return False
        gs.append(g)
        acts.append(a.detach())
    G = torch.stack(gs)
    grad_batch = GradStats.prepare_many(gaccs, G)
    if grad_batch is None or not all(grad_batch.finite):
        return False
    if caccs:
        A = torch.stack(acts)
        cross_batch = CrossStats.prepare_many(caccs, G.unsqueeze(2), A.unsqueeze(2))
        if cross_batch is None or not all(cross_batch.finite):
            return False
    GradStats.commit_many(gaccs, grad_batch)
    if caccs:
        CrossStats.commit_many(caccs, cross_batch)
    probe.steps[stream] += 1
    return True


# ---------------------------------------------------------------------------- the in-backward fold
@dataclass
class _Point:
    """What one step keeps of one point between its forward hook and its gradient."""

    name: str
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    fd: int | None  # None until resolved (a (B, d) output: only if the step does not stage)
    mask: torch.Tensor | None
    dim: int
    cross_mask: torch.Tensor | None = None  # the positions the cross statistics sum over
    accs: dict = field(default_factory=dict)  # kind -> accumulator (new ones kept on commit)
    z: torch.Tensor | None = None  # only for one-row-per-sample points (B, d) or callbacks
    phi: torch.Tensor | None = None  # cross features (B, P, r)
    out: torch.Tensor | None = None  # the output itself while it is kept (with z)
    pending: tuple | None = None  # (module, kwargs) of a kept point: its features wait for backward
    grad: torch.Tensor | None = None  # staged mode only
    prepared: dict | None = None  # kind -> Prepared, once the gradient has been reduced
    committed: bool = False
    version: int = 0  # of z when it was captured: a kept z must not change before it is read


def _one_row_per_sample(shape, fd) -> bool:
    return math.prod(shape) == shape[0] * shape[fd % len(shape)]


class StepFold:
    """The fold of one :meth:`fused_stats.Probe.step` inside its backward (module docstring).

    :meth:`on_output` is the forward hook's callback, :meth:`backward` runs the backward (the
    tensor hooks reduce each gradient), :meth:`finish` commits.
    Steps with callbacks, or where every point has one row per sample (unit "sample", (B, d)
    outputs, nothing masked: the gradients are already the reduced rows), stage the gradients and
    fold them with :func:`fold` (its stacked calls); ``atomic=False`` never stages.
    """

    def __init__(self, probe, stream: str, positions_mask, atomic: bool = True, cross_positions=SAME_MASK):
        self.probe, self.stream, self.positions_mask, self.atomic = probe, stream, positions_mask, atomic
        self.cross_positions = cross_positions
        self.kinds = probe.kinds
        # callbacks read z and the whole gradient; a feature source's block reads the call
        # arguments of modules that may run after the point (the staged fold computes its features)
        self.raw = bool(probe._callbacks) or is_feature_source(probe.cross)
        self.points: dict[str, _Point] = {}
        self.staged = self.raw
        self.stopped = False  # per-point mode: a point was refused, later ones are not folded
        # the step's own backward is the only source of gradients (nested autograd.grad ignored)
        self.sink = GradientSink(probe.points, own_backward=True)
        self.root = None  # the summed loss's grad_fn: which points its graph reaches

    # ---- forward
    def on_output(self, name: str, module, z: torch.Tensor, kwargs) -> None:
        pt = _Point(name, tuple(z.shape), z.dtype, z.device, None, None, 0, version=z._version)
        self.points[name] = pt
        if z.dim() == 2 and not self.raw:
            # (B, d): one row per sample on any feature axis, no larger than the gradient rows kept
            # anyway; whether the step stages them (the staged fold then resolves the rest) or
            # hooks them is known after the forward
            pt.out, pt.z, pt.pending = z, z.detach(), (module, kwargs)
            return
        self._resolve(pt, z)
        if self.raw or _one_row_per_sample(z.shape, pt.fd):
            pt.out, pt.z, pt.pending = z, z.detach(), (module, kwargs)
        else:
            pt.phi = self._features(pt, module, z, kwargs)
            self._hook(pt, z)

    def _resolve(self, pt: _Point, z: torch.Tensor) -> None:
        """The point's feature axis, mask, width and accumulators (a new cross one for its W_in)."""
        probe, name = self.probe, pt.name
        pt.fd = fd = probe.feature_dim(name, z)
        pt.mask = point_mask(name, z.shape, fd, z.device, self.positions_mask)
        pt.cross_mask = (
            pt.mask
            if self.cross_positions is SAME_MASK
            else point_mask(name, z.shape, fd, z.device, self.cross_positions)
        )
        pt.dim = math.prod(z.shape[1:]) if probe.unit == "flat" else z.shape[fd]
        check_dim(probe, self.stream, name, z.shape, pt.dim)
        for kind in self.kinds:
            acc = probe.table.get((kind, self.stream, name))
            # a raw step's staged fold makes its own (a feature source's width may not be z's)
            if acc is None and not self.raw and REGISTRY[kind].reads == "cross":
                acc = probe.new_accumulator(kind, self.stream, name, z.shape[fd], cross_dtype(z), z.device)
            pt.accs[kind] = acc

    def _hook(self, pt: _Point, z: torch.Tensor) -> None:
        self.sink.watch(pt.name, z)
        z.register_hook(lambda g: self._on_grad(pt, g))

    def _features(self, pt: _Point, module, z, kwargs):
        for kind in self.kinds:
            if REGISTRY[kind].reads == "cross":
                cz = cross_view(z.detach(), pt.fd)
                cm = cross_mask(pt.cross_mask, cz.shape[0], cz.shape[1])
                return self.probe.cross_features(pt.name, module, cz, kwargs, pt.accs[kind], cm)
        return None

    def modified_in_place(self) -> list[str]:
        """Points whose kept output (one row per sample, or for callbacks) changed in place after
        the forward hook: what is read from it would not be the point's output."""
        return [pt.name for pt in self.points.values() if pt.z is not None and pt.z._version != pt.version]

    def backward(self, total: torch.Tensor, leaves) -> None:
        """The step's one backward of ``total`` (the summed losses). Staged (callbacks, or one
        row per sample everywhere): one ``autograd.grad`` with respect to every point's output,
        as the staged fold takes them; otherwise down to ``leaves`` only, the hooks reducing."""
        pts = [self.points[name] for name in self.probe.points]
        self.staged = self.raw or (
            self.atomic
            and self.probe.unit == "sample"
            and self.positions_mask is None
            and all(pt.out is not None for pt in pts)
        )
        if self.staged:
            grads = torch.autograd.grad(
                total, [pt.out for pt in pts], allow_unused=True, materialize_grads=True
            )
            for pt, g in zip(pts, grads):
                pt.grad, pt.out = g, None
            return
        for pt in pts:
            if pt.out is not None:
                module, kwargs = pt.pending
                if pt.fd is None:
                    self._resolve(pt, pt.z)
                pt.phi = self._features(pt, module, pt.z, kwargs)
                self._hook(pt, pt.out)
                pt.out = pt.z = pt.pending = None
        self.root = total.grad_fn
        with self.sink.own_backward_of(total):
            torch.autograd.grad(total, leaves, allow_unused=True)

    # ---- backward
    def _on_grad(self, pt: _Point, g: torch.Tensor) -> None:
        # a gradient of another backward (the loss's own autograd.grad) or a second arrival
        # (refused by the sink's check) is not folded
        if self.sink.accept(pt.name) and not self.stopped:
            self._receive(pt, g)

    def _receive(self, pt: _Point, g: torch.Tensor) -> None:
        pt.prepared = self._prepare(pt, g)
        pt.phi = None  # its gradient is reduced: the features are not needed any more
        if not self.atomic:
            self._commit_point(pt)

    def _prepare(self, pt: _Point, g: torch.Tensor) -> dict:
        probe, unit, stream = self.probe, self.probe.unit, self.stream
        m, gg = pt.mask, g
        if unit == "flat" and m is not None:
            gg, m = flat_masked(g, m, pt.fd), None
        out = {}
        for kind in self.kinds:
            acc = pt.accs[kind]
            if REGISTRY[kind].reads == "cross":
                cg = cross_view(g, pt.fd)
                cm = cross_mask(pt.cross_mask, cg.shape[0], cg.shape[1])
                out[kind] = acc.prepare(cg, mask=cm, unit=unit, features=pt.phi)
            else:
                if acc is None:
                    acc = pt.accs[kind] = probe.new_accumulator(
                        kind, stream, pt.name, pt.dim, device=g.device
                    )
                out[kind] = acc.prepare(gg, m, unit, pt.fd if unit != "flat" else -1)
        return out

    def _refusal(self, pt: _Point) -> str | None:
        for kind in self.kinds:
            if not pt.prepared[kind].finite:
                return nonfinite_message(kind, pt.name, self.stream, pt.shape, pt.dtype, pt.shape, pt.dtype)
        return None

    def _commit_point(self, pt: _Point) -> None:
        what = self._refusal(pt)
        if what is not None:
            self.stopped = True
            if self.probe.nonfinite == "skip":
                return
            raise FusedStatsError(
                f"{what}; this point and the points whose gradients arrive after it were not "
                "accumulated (atomic=False commits each point as its gradient arrives). Pass "
                "nonfinite='skip' to skip such steps and count them"
            )
        self._plan_commit([pt])

    def _plan_commit(self, pts) -> None:
        plan = [
            ((kind, self.stream, pt.name), pt.accs[kind], pt.prepared[kind])
            for pt in pts
            for kind in self.kinds
        ]
        commit(self.probe, plan)
        for pt in pts:
            pt.committed = True
            self.probe.feature_dims[pt.name] = pt.fd

    # ---- after the backward
    def finish(self) -> bool:
        probe, stream = self.probe, self.stream
        ordered = [self.points[name] for name in probe.points]
        if self.staged:
            acts = {pt.name: pt.z for pt in ordered}
            grads = {pt.name: pt.grad for pt in ordered}
            return fold(probe, stream, acts, grads, self.positions_mask, cross_positions=self.cross_positions)
        # one arrival per point, or none where the loss's graph does not reach the point: its
        # gradient is then exactly zero
        for name in self.sink.check(self.root):
            pt = self.points[name]
            if not self.stopped:
                self._receive(pt, torch.zeros(pt.shape, dtype=pt.dtype, device=pt.device))
        if not self.atomic:
            if all(pt.committed for pt in ordered):
                probe.steps[stream] += 1
                return True
            probe.skipped_steps[stream] += 1
            return False
        for pt in ordered:
            what = self._refusal(pt)
            if what is not None:
                return skip_or_raise(probe, stream, what, probe.nonfinite)
        self._plan_commit(ordered)
        probe.steps[stream] += 1
        return True
