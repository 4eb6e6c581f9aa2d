"""Training-time monitoring: the probe's statistics from the user's own training step.

Role: :class:`Observation` (returned by :meth:`fused_stats.Probe.observe`) is a context manager
around a training step's forward and backward. Forward hooks at the probe's points register
tensor hooks (``z.register_hook``) on each point's output ``z``; during the user's backward they
receive ``G = ∂ℒ/∂z`` and only keep a reference to it (the hook returns ``None``, so the gradient
that flows on, every weight gradient and the optimizer step are untouched). When the block exits,
the gradients are rescaled to those of the per-sample losses and folded into the probe's
accumulators by the same code as :meth:`~fused_stats.Probe.step` (``Probe.fold``: the same
masks, units, validation, callbacks and all-or-nothing update).

**Per-sample scaling** (``q_b = s_b G_b / loss_scale``, with ``s_b`` from the declared loss
reduction): :mod:`fused_stats.api.training.scales`.

**Which tensor gets the gradient.** A point's forward hook may run more than once per step: HF
gradient checkpointing in older transformers versions checkpoints the module call, hooks included,
so the forward is replayed during the backward (newer versions keep hooks outside the checkpoint).
With ``use_reentrant=False`` the first forward's output receives the gradient and the replay's
never does; with ``use_reentrant=True`` the first forward runs without grad (no tensor hook is
registered) and the replay's output receives it. Statistics are therefore keyed by the gradients
that *arrive*: exactly one per point and step, whatever ran forward, counted by the probe's
gradient sink (:class:`fused_stats.api.probe.sink.GradientSink`, the one ``Probe.step`` uses). Two
arrivals at one point (a module reused in one forward, two backward passes in one block, or a
``torch.autograd.grad`` inside the loss, which this block cannot tell from the training backward)
are rejected: use one ``observe`` per forward/backward pair (micro-batch), and ``Probe.step`` for
a loss that takes its own gradients. A point that ran with grad and got no gradient (a backward
with ``inputs=`` that stops above it) is rejected too. The lean path sums the counted positions
with the probe's mask (:func:`fused_stats.api.probe.masks.point_mask`, ``position_sums``).

**Checks** (made at exit, before anything is folded; a rejected step changes no accumulator):
a missing declaration, a ``scale`` of the wrong shape or with non-positive entries, no gradient at
any point (``backward`` not called inside the block), a point that never ran, unequal batch sizes,
in-place changes of a captured output. When the model's own output carries a ``loss`` and the
backward went through it (HF models given ``labels``), its incoming gradient ``w`` is recorded:
that loss is a token mean, so it implies ``s_b = N/(w n_b)``; a declaration that disagrees raises
(a warning when ``scale`` was given explicitly, as the user's loss may hold other terms). Without
that evidence, ``"mean"`` with labels whose ``n_b`` differ by 2x or more warns (a token-mean loss
may have been meant).

**Differences from Probe.step by design.** The model runs in the user's mode: with dropout active
the gradients are those of the dropped-out network, and a ``BatchNorm`` in training mode couples
the samples of a batch through its batch statistics, so ``G_b`` is no longer one sample's gradient
(a warning says so once per probe). ``Probe.step`` runs in ``eval()``.

**Memory.** The gradients of all points are held until the block exits (the backward's end): one
extra activation-sized tensor per point, the size of what gradient checkpointing keeps.

**DDP.** Each rank folds its own samples; ``fused_stats.api.state.distributed.all_reduce_probe``
merges on demand (and :class:`~fused_stats.MonitorLog` can log the merged estimates). The per-rank
loss is what the rank differentiates, so ``"mean"`` means the local batch mean (DDP averages the
weight gradients over ranks, not the activation gradients).
"""

from __future__ import annotations

import numbers
import warnings
import weakref
from collections.abc import Mapping

import torch
from torch import nn

from ...accumulators.base import NONFINITE_POLICIES, Nonfinite
from ...errors import FusedStatsError
from ..probe.hooks import split_output
from ..probe.masks import point_mask, position_sums
from ..probe.sink import GradientSink
from .scales import (  # noqa: F401  (re-exported)
    LOSS_REDUCTIONS,
    SCALE_RTOL,
    UNEQUAL_COUNTS,
    check_declaration,
    check_scale,
    loss_of,
    per_sample_scales,
    scale_value,
    scaled,
    token_counts,
)

_UNSET = object()
_active: weakref.WeakSet = weakref.WeakSet()  # probes inside an observe block
_bn_warned: weakref.WeakSet = weakref.WeakSet()


class _Record:
    """One forward call of one point: the output ``z`` and, once it arrives, ``∂ℒ/∂z`` (kept
    whole, or already reduced to per-sample sums in the lean path)."""

    __slots__ = ("arrivals", "grad", "modified", "name", "owner", "reduced", "tensor", "version")

    def __init__(self, owner: Observation, name: str, tensor: torch.Tensor):
        self.owner = owner
        self.name = name
        self.tensor = tensor
        self.version = tensor._version
        self.grad: torch.Tensor | None = None
        self.reduced: torch.Tensor | None = None
        self.modified = False
        self.arrivals = 0

    def receive(self, grad: torch.Tensor) -> None:
        # never raise here (it would break the user's backward) and never return a tensor
        # (it would replace the gradient); problems are reported at exit (the sink's check)
        first = self.owner.sink.accept(self.name)
        self.arrivals += 1
        if not first:
            return
        g = grad.detach()
        # an in-place change downstream happens in the forward, so it shows by now
        self.modified = self.tensor._version != self.version
        try:
            self.reduced = self.owner._reduce(self, g)
        except Exception:  # any failure: keep the whole gradient, check at exit
            self.reduced = None
        if self.reduced is None:
            self.grad = g
        elif not self.owner._keep_activations:
            # only the shape matters from here on: free the activation (a stride-0 stand-in)
            t = self.tensor
            self.tensor = torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)


class Observation:
    """Context manager returned by :meth:`fused_stats.Probe.observe` (module docstring); where
    one ``with`` block cannot span the step, :meth:`open` and :meth:`close` do the same.

    Parameters
    ----------
    probe : fused_stats.Probe
    loss_reduction : {"mean", "sum", "token_mean"}, optional
        How the training loss combines per-sample losses; needed unless ``scale`` is given.
    scale : (B,) tensor, optional
        Per-sample factors ``s_b`` (``q_b = s_b ∂ℒ/∂z_b``); overrides ``loss_reduction``.
    mask : as for :meth:`Probe.step`
        Counted positions, resolved against ``batch``.
    stream : {"train", "test"}
    batch : mapping, optional
        Where masks and token counts come from. Default: the keyword arguments of the probe's
        model's forward call inside the block (``model(**batch)``), plus its first positional
        argument as ``input_ids`` when it is a (B, T) integer tensor.
    loss_scale : float or GradScaler
        Factor the declared loss was multiplied by before ``backward`` (divided out).
    log : fused_stats.MonitorLog, optional
        Told about every folded step (it writes every ``every`` steps).
    step : int, optional
        The training step number written to ``log`` (default: the log's own count).
    nonfinite : {"raise", "skip"}, optional
        Overrides the probe's policy for this step (e.g. ``"skip"`` with a fp16 GradScaler,
        whose overflow steps carry inf gradients).

    After a successful exit: :attr:`folded` is True, :attr:`scale` holds the ``s_b / loss_scale``
    used, :attr:`batch_size` the batch size and :attr:`loss_weight` the gradient that reached the
    model's own ``loss`` (None when the backward did not go through one).
    """

    def __init__(
        self,
        probe,
        loss_reduction: str | None = None,
        scale=None,
        mask=None,
        stream: str = "train",
        batch=None,
        loss_scale=1.0,
        log=None,
        step: int | None = None,
        nonfinite: Nonfinite | None = None,
    ):
        probe.check_stream(stream)
        if loss_reduction is None and scale is None:
            raise FusedStatsError(
                "observe needs loss_reduction='mean' | 'sum' | 'token_mean' (how the training loss "
                "combines the per-sample losses: a batch mean, a sum, or HF's mean over all valid "
                "tokens of the batch) or per-sample factors scale=(B,) tensor; the captured "
                "gradients must be rescaled to per-sample-loss gradients"
            )
        if loss_reduction is not None and loss_reduction not in LOSS_REDUCTIONS:
            raise FusedStatsError(f"loss_reduction must be one of {LOSS_REDUCTIONS}, got {loss_reduction!r}")
        if nonfinite is not None and nonfinite not in NONFINITE_POLICIES:
            raise FusedStatsError(f"nonfinite must be one of {NONFINITE_POLICIES} or None, got {nonfinite!r}")
        if step is not None and (not isinstance(step, numbers.Integral) or isinstance(step, bool)):
            raise FusedStatsError(f"step must be an int or None, got {step!r}")
        if log is not None and not callable(getattr(log, "observed", None)):
            raise FusedStatsError(f"log must be a fused_stats.MonitorLog, got {type(log).__name__}")
        if batch is not None and not isinstance(batch, (Mapping, torch.Tensor)):
            raise FusedStatsError(
                f"batch must be a mapping (e.g. the dict given to the model) or a "
                f"tensor, got {type(batch).__name__}"
            )
        if not (
            isinstance(loss_scale, numbers.Real)
            or hasattr(loss_scale, "get_scale")
            or isinstance(loss_scale, torch.Tensor)
        ):
            raise FusedStatsError(
                f"loss_scale must be a number or a GradScaler, got {type(loss_scale).__name__}"
            )
        if not hasattr(loss_scale, "get_scale"):
            scale_value(loss_scale)  # a constant can be checked now, before the training step
        self.probe = probe
        self.loss_reduction = loss_reduction
        self.explicit_scale = None if scale is None else check_scale(scale)
        self.mask = mask
        self.stream = stream
        self.batch = batch
        self.loss_scale = loss_scale
        self.log = log
        self.step = step
        self.nonfinite = nonfinite
        # results
        self.folded = False
        self.scale: torch.Tensor | None = None
        self.batch_size: int | None = None
        self.loss_weight: float | None = None
        self._reset_capture()

    def _reset_capture(self):
        self._records: dict[str, list[_Record]] = {name: [] for name in self.probe.points}
        # the user's backward: every arrival counts, one per point (a nested autograd.grad too)
        self.sink = GradientSink(self.probe.points, own_backward=False, where="probe.observe")
        self._problems: list[str] = []
        self._calls: list[tuple[tuple, dict]] = []
        self._loss_grads: list[float] = []
        self._handles: list = []
        self._tensor_handles: list = []  # a backward after the block must not reach the records
        self._entered = False
        self._mask_cache = _UNSET
        # lean path: with unit="sample" and nothing that needs the whole gradient (callbacks,
        # cross statistics), each gradient is reduced to per-sample sums the moment it arrives
        probe = self.probe
        self._keep_activations = probe.needs_activations
        self._lean = probe.unit == "sample" and not self._keep_activations

    # ------------------------------------------------------------------ hooks
    def __enter__(self) -> Observation:
        return self.open()

    def open(self) -> Observation:
        """Start capturing: register the hooks, as entering ``with probe.observe(...)`` does.

        For training loops that split a step over callbacks (the HF and Lightning integrations);
        every ``open()`` must be paired with :meth:`close`, also when training raises.
        """
        probe = self.probe
        if self._entered:
            raise FusedStatsError("this Observation is already in use; call probe.observe(...) per step")
        if probe in _active:
            raise FusedStatsError("probe.observe blocks cannot be nested on the same probe")
        if torch.is_inference_mode_enabled():
            raise FusedStatsError("probe.observe cannot run inside torch.inference_mode(): it needs autograd")
        probe.check_layout()
        self._reset_capture()
        self.folded = False
        self._warn_batchnorm()
        try:
            model = probe.model
            for name in probe.points:
                module = model.get_submodule(name)
                self._handles.append(module.register_forward_hook(self._point_hook(name)))
            self._handles.append(model.register_forward_pre_hook(self._call_hook, with_kwargs=True))
            self._handles.append(model.register_forward_hook(self._output_hook))
        except BaseException:
            self._remove()
            raise
        _active.add(probe)
        self._entered = True
        return self

    def _remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        while self._tensor_handles:
            self._tensor_handles.pop().remove()

    def _point_hook(self, name: str):
        def hook(module, args, output):
            tensor, _ = split_output(output)
            if tensor is None or not tensor.is_floating_point():
                self._problems.append(
                    f"point {name!r} ({type(module).__name__}) returned "
                    f"{type(output).__name__ if tensor is None else tensor.dtype}; expected a "
                    "floating-point tensor or a tuple/list starting with one"
                )
                return None
            # a forward without grad (eval, or the first pass of a reentrant checkpoint) gets no
            # gradient; only outputs that take part in a backward are recorded
            if torch.is_grad_enabled() and tensor.requires_grad:
                record = _Record(self, name, tensor)
                self._records[name].append(record)
                self.sink.watch(name, tensor)
                self._tensor_handles.append(tensor.register_hook(record.receive))
            return None

        return hook

    def _call_hook(self, module, args, kwargs):
        if torch.is_grad_enabled():
            self._calls.append((args, dict(kwargs)))
        return None

    def _output_hook(self, module, args, output):
        loss = loss_of(output)
        if loss is not None and torch.is_grad_enabled():
            self._tensor_handles.append(loss.register_hook(self._loss_grad))
        return None

    def _loss_grad(self, grad):
        self._loss_grads.append(float(grad.detach().sum()))
        return None

    def _warn_batchnorm(self) -> None:
        probe = self.probe
        if probe in _bn_warned:
            return
        bns = [
            n
            for n, m in probe.model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
        ]
        if bns:
            _bn_warned.add(probe)
            warnings.warn(
                f"probe.observe: {len(bns)} BatchNorm modules (e.g. {bns[0]!r}) are in training "
                "mode; their batch statistics couple the samples, so the observed gradients are not "
                "exactly per-sample gradients (Probe.step runs in eval mode)",
                stacklevel=3,
            )

    # ------------------------------------------------------------------ exit
    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close(fold=exc_type is None)
        return False

    def close(self, fold: bool = True) -> bool:
        """Stop capturing: remove every hook and drop the step's tensors, as leaving the
        with-block does.

        ``fold=True`` (the step's backward is done): the captured gradients are checked and
        folded, raising as the with-block would; ``fold=False`` (training failed or stopped
        mid-step): nothing is folded. Closing an observation that is not open does nothing.
        Returns :attr:`folded`.
        """
        if not self._entered:
            return self.folded
        self._remove()
        _active.discard(self.probe)
        self._entered = False
        try:
            if fold:
                self._finish()
        finally:
            # drop every reference to the step's tensors, whatever happened
            self._records = {name: [] for name in self.probe.points}
            self._calls = []
        return self.folded

    def _positions_mask(self):
        """The counted-position mask of this step's batch (as ``Probe.step`` resolves it), once."""
        if self._mask_cache is _UNSET:
            batch = self._the_batch()
            self._mask_cache = self.probe.mask_for(batch if batch is not None else {}, self.mask)
        return self._mask_cache

    def _reduce(self, record: _Record, g: torch.Tensor) -> torch.Tensor | None:
        """Lean path: ``r_b = Σ_{t counted} G[b, t]`` (B, d), or None to keep ``G`` whole.

        Per-sample scaling commutes with the sum over positions, so ``s_b r_b`` at exit is the
        ``q_b`` that ``Probe.fold`` would form from the whole scaled gradient; only (B, d) per point
        is kept instead of (B, *positions, d). The counted positions are the probe's own
        (:func:`~fused_stats.api.probe.masks.point_mask`, :func:`position_sums`). The whole
        gradient is kept where the feature axis is not last or the mask does not fit (the fold
        names the mismatch at exit).
        """
        if not self._lean or g.dim() < 2 or g.shape != record.tensor.shape:
            return None
        probe, name = self.probe, record.name
        fd = probe.feature_dim(name, record.tensor)
        if fd % g.dim() != g.dim() - 1:
            return None
        try:
            m = point_mask(name, g.shape, fd, g.device, self._positions_mask())
        except FusedStatsError:
            return None
        return position_sums(g, m)

    def _the_batch(self):
        if self.batch is not None:
            return self.batch
        if not self._calls:
            return None
        args, kwargs = self._calls[0]
        batch = dict(kwargs)
        if (
            args
            and isinstance(args[0], torch.Tensor)
            and "input_ids" not in batch
            and args[0].dim() == 2
            and not args[0].is_floating_point()
        ):
            batch["input_ids"] = args[0]
        return batch

    def _gradients(self):
        """``({point: record}, B)``: the one record per point whose gradient arrived, or raise."""
        probe = self.probe
        if self._problems:
            raise FusedStatsError("probe.observe: " + "; ".join(self._problems[:3]))
        arrived = {name: [r for r in recs if r.arrivals] for name, recs in self._records.items()}
        if not any(arrived.values()):
            ran = [n for n, recs in self._records.items() if recs]
            raise FusedStatsError(
                "probe.observe: no gradient reached any point during the block "
                f"(points that ran forward with grad: {ran or 'none'}); call loss.backward() inside "
                "the with-block, with gradients enabled"
            )
        never = [n for n, recs in self._records.items() if not recs]
        if never:
            raise FusedStatsError(
                f"probe.observe: points {never} did not run forward with gradients enabled during "
                "the block; nothing was accumulated"
            )
        # exactly one arrival per point; without the loss's graph at hand, a point that ran with
        # grad and got none is refused (a zero would be exact only if the loss ignored it)
        self.sink.check()
        chosen: dict[str, _Record] = {}
        for name in probe.points:
            record = arrived[name][0]
            if record.modified or record.tensor._version != record.version:
                raise FusedStatsError(
                    f"probe.observe: the output of point {name!r} was modified in place after the "
                    "forward hook saw it (e.g. an in-place activation downstream); its gradient "
                    "would be wrong. Probe another module or make that operation out of place"
                )
            if record.grad is not None and tuple(record.grad.shape) != tuple(record.tensor.shape):
                raise FusedStatsError(
                    f"probe.observe: gradient of shape {tuple(record.grad.shape)} at point {name!r} "
                    f"whose output has shape {tuple(record.tensor.shape)}"
                )
            chosen[name] = record
        shapes = {n: tuple(r.tensor.shape) for n, r in chosen.items()}
        B = shapes[probe.points[0]][0] if shapes[probe.points[0]] else None
        other = {n: shape for n, shape in shapes.items() if not shape or shape[0] != B}
        if other:
            raise FusedStatsError(
                f"probe.observe: points have different batch sizes: {probe.points[0]!r} has {B}, {other}"
            )
        return chosen, B

    def _scales(self, batch, B):
        return per_sample_scales(batch, B, self.loss_reduction, self.explicit_scale, self.probe.points[0])

    def _check_declaration(self, s, keep, counts, total, loss_scale):
        weight = check_declaration(
            s, keep, counts, total, loss_scale, self._loss_grads, self.loss_reduction, self.explicit_scale
        )
        if weight is not None:
            self.loss_weight = weight

    def _finish(self) -> None:
        probe = self.probe
        chosen, B = self._gradients()
        batch = self._the_batch()
        loss_scale = scale_value(self.loss_scale)
        s, keep, counts, total = self._scales(batch, B)
        self._check_declaration(s, keep, counts, total, loss_scale)
        factor = s / loss_scale
        positions_mask = self._positions_mask()
        if any(r.reduced is not None for r in chosen.values()):
            acts, grads, mask = self._lean_batch(chosen, factor, keep, positions_mask, B)
        else:
            # the whole gradients, folded exactly as Probe.step folds its own
            acts = {n: r.tensor.detach() for n, r in chosen.items()}
            grads = {n: scaled(r.grad, factor, B) for n, r in chosen.items()}
            mask = positions_mask
            if not bool(keep.all()):
                # samples without a loss term: excluded from the counted positions
                if mask is None:
                    mask = keep
                else:
                    pm = mask if mask.dtype == torch.bool else mask != 0
                    mask = pm & keep.to(pm.device).view((B,) + (1,) * (pm.dim() - 1))
        folded = probe.fold(self.stream, acts, grads, mask, nonfinite=self.nonfinite)
        self.scale = factor
        self.batch_size = B
        self.folded = folded
        if folded and self.log is not None:
            self.log.observed(probe, stream=self.stream, step=self.step)

    def _lean_batch(self, chosen, factor, keep, positions_mask, B):
        """(B, d) per-sample sums for every point and a (B,) mask of the samples that exist.

        Points whose gradient was kept whole (the lean reduction declined) get their uncounted
        positions zeroed instead, so a (B,) mask is right for them too (``unit="sample"`` sums
        the positions, and a zeroed position adds nothing).
        """
        probe = self.probe
        rows = keep.clone()
        pm = None
        if positions_mask is not None:
            pm = positions_mask if positions_mask.dtype == torch.bool else positions_mask != 0
            rows &= pm.reshape(B, -1).any(dim=1).cpu() if pm.dim() > 1 else pm.cpu()
        acts, grads = {}, {}
        for name, record in chosen.items():
            if record.reduced is not None:
                # the (B, d) sums as (B, 1, ..., 1, d), of the output's rank: the feature axis the
                # probe resolves for the output (an explicit feature_dim=2 included) is theirs too
                r = record.reduced
                r = r.reshape(r.shape[0], *([1] * (record.tensor.dim() - 2)), r.shape[-1])
                acts[name] = torch.zeros((), dtype=r.dtype, device=r.device).expand(r.shape)
                grads[name] = scaled(r, factor, B)
                continue
            g = record.grad
            acts[name] = record.tensor.detach()
            if pm is not None and pm.dim() > 1:
                fd = probe.feature_dim(name, record.tensor)
                keep_pos = point_mask(name, g.shape, fd, g.device, pm).unsqueeze(fd % g.dim())
                g = torch.where(keep_pos, g, torch.zeros((), dtype=g.dtype, device=g.device))
            grads[name] = scaled(g, factor, B)
        return acts, grads, rows.to(next(iter(grads.values())).device)
