"""Direct residual interventions: measured vs first-order predicted test-loss change.

Role: check on a real model that the probe's statistics predict what a growth step does. At a
residual point a zero-initialised parameter is inserted (function preserving, see
:func:`fused_stats.insert_zero_block`), one gradient step of size ``η`` is taken on it with the
*training* batches, and the change of the *test* loss is measured and compared with its
first-order prediction (width paper, "direct residual intervention"; depth paper for the block;
docs/design.md, section 2).

The gradient step is on the mean per-sample training loss ``L_M = (1/M) Σ_i ℓ_i``, while the
probe's ``q_i`` are per-sample gradients, so the step direction is their mean:

* ``kind="bias"`` (``h(z) = b``, added at every position): ``∂ℓ_i/∂b = q_i = Σ_t ∂ℓ_i/∂z_t``, so
  ``μ_M = (Σ_i q_i)/M`` (the train GradStats' ``raw_sum / M``) and the step is ``b = −η μ_M``.
  With ``g_K = (Σ_j q_j)/K`` from the test batches, the test loss ``L_K = (1/K) Σ_j ℓ_j`` changes
  to first order by ``−η μ_Mᵀ g_K``.
* ``kind="block"`` (``h(z) = W_out φ(W_in z)``, ``W_out = 0``): ``∂ℓ_i/∂W_out = c_i =
  Σ_t q_t φ(W_in z_t)ᵀ``, so ``C_M = (Σ_i c_i)/M`` (the train CrossStats' ``c_sum / M``), the step
  is ``W_out = −η C_M`` and the predicted change is ``−η <C_M, C_K>_F``.

Beside the SGD step, the zero-state Adam / AdamW first step ``−η s`` with ``s = d/(|d| + ε)``
elementwise (``d`` the SGD direction above: bias-corrected moments of one gradient; weight decay
of a zero parameter is zero) is taken from the zero block too, predicted ``−η ⟨s, g_K⟩``
(``adam_rows``; :mod:`.scores`).

The measured first-order change is the **central difference** ``(L_K(θ₀ + Δ) − L_K(θ₀ − Δ))/2``
(``θ₀ = 0`` the zero parameter, ``Δ`` the step): the step against its mirror step. The curvature
term ``½ Δᵀ H Δ`` is the same on both sides and cancels, so measured / predicted is
``1 + O(η²)``; the one-sided change ``L_K(θ₀ + Δ) − L_K(θ₀)`` (kept as ``one_sided``) carries that
curvature at ``O(η)`` relative. It matters for the zero-state Adam step: its ``s`` is about
``sign(d)``, a step of size ``η`` in *every* coordinate, so at a given ``η`` its curvature term is
far larger than the SGD step's and its one-sided ratio can even have the wrong sign. Every loss is
the mean of the per-sample losses over every test sample, computed in ``eval()`` mode like the
probe. Run the model in fp64 to see the ratio at small ``η`` (the change is ``O(η)`` against a loss
of ``O(1)``).

The inserted parameter acts at every position, so its gradient sums over every position: the probe
runs with ``mask="none"``. The model is left exactly as it was: the block is removed in a
``finally`` clause and only the block's own parameter is ever written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ...errors import FusedStatsError
from ..probe.spec import CrossSpec
from .insert import insert_zero_block, remove_inserted_block
from .scores import ADAM_EPS, adam_direction

F64 = torch.float64
KINDS = ("bias", "block")


@dataclass(frozen=True)
class InterventionRow:
    eta: float
    predicted: float  # first-order change of the mean test loss
    measured: float  # central difference (L(θ₀ + Δ) − L(θ₀ − Δ))/2 of the mean test loss
    ratio: float | None  # measured / predicted (None when predicted == 0: no ratio to form)
    one_sided: float  # L(θ₀ + Δ) − L(θ₀): the step's whole change, curvature included


@dataclass
class Intervention:
    """Result of :func:`intervene`: one row per step size."""

    point: str
    kind: str
    M: int  # training samples behind the step
    K: int  # test samples behind the measured loss
    base_loss: float  # mean test loss with the zero block (= the unmodified model's)
    inner: float  # μ_Mᵀ g_K (bias) or <C_M, C_K>_F (block)
    rows: list[InterventionRow] = field(default_factory=list)
    adam_inner: float = math.nan  # <s, g_K> with s = d/(|d| + eps), d the SGD direction
    adam_rows: list[InterventionRow] = field(default_factory=list)
    adam_eps: float = ADAM_EPS

    def to_dict(self) -> dict:
        return {
            "point": self.point,
            "kind": self.kind,
            "M": self.M,
            "K": self.K,
            "base_loss": self.base_loss,
            "inner": self.inner,
            "rows": [r.__dict__.copy() for r in self.rows],
            "adam_eps": self.adam_eps,
            "adam_inner": self.adam_inner,
            "adam_rows": [r.__dict__.copy() for r in self.adam_rows],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Intervention:
        """The inverse of :meth:`to_dict` (e.g. read back from a JSON file)."""
        fields = {k: v for k, v in data.items() if k not in ("rows", "adam_rows")}
        return cls(
            **fields,
            rows=[InterventionRow(**r) for r in data["rows"]],
            adam_rows=[InterventionRow(**r) for r in data["adam_rows"]],
        )

    def to_markdown(self) -> str:
        what = "μ_Mᵀg_K" if self.kind == "bias" else "<C_M, C_K>_F"
        lines = [
            f"Direct intervention ({self.kind}) at `{self.point}`: M = {self.M} train, "
            f"K = {self.K} test samples, base test loss {self.base_loss:.6g}, {what} = "
            f"{self.inner:.4g}",
            "",
            *_table(self.rows),
        ]
        if self.adam_rows:
            lines += [
                "",
                f"Zero-state Adam/AdamW first step (eps = {self.adam_eps:g}): <s, g_K> = {self.adam_inner:.4g}",
                "",
                *_table(self.adam_rows),
            ]
        return "\n".join(lines)


TABLE_HEADER = "| eta | predicted | measured (central) | ratio | one-sided step |"


def _table(rows: list[InterventionRow]) -> list[str]:
    lines = [TABLE_HEADER, "|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = "not estimable (predicted 0)" if r.ratio is None else f"{r.ratio:.4f}"
        lines.append(f"| {r.eta:.3g} | {r.predicted:.4g} | {r.measured:.4g} | {ratio} | {r.one_sided:.4g} |")
    return lines


def _etas(eta) -> list[float]:
    values = list(eta) if isinstance(eta, (list, tuple)) else [eta]
    if not values:
        raise FusedStatsError("eta: give a step size or a non-empty list of them")
    out = []
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise FusedStatsError(f"eta must be a float or a list of floats, got {v!r}") from None
        if not math.isfinite(f) or f <= 0:
            raise FusedStatsError(f"eta values must be finite and > 0, got {v!r}")
        out.append(f)
    return out


def mean_loss(model: nn.Module, batches: list, loss_fn) -> tuple[float, int]:
    """``(mean of the per-sample losses over all batches, number of samples)``, in eval mode."""
    total = torch.zeros((), dtype=F64)
    count = 0
    with torch.no_grad():
        for batch in batches:
            losses = loss_fn(model, batch)
            if not isinstance(losses, torch.Tensor) or losses.dim() != 1:
                raise FusedStatsError(
                    f"loss_fn must return per-sample losses of shape (B,), got "
                    f"{getattr(losses, 'shape', type(losses).__name__)}"
                )
            total += losses.detach().to(device="cpu", dtype=F64).sum()
            count += losses.shape[0]
    if count == 0:
        raise FusedStatsError("intervene: the test batches hold no samples")
    return float(total) / count, count


def _loss_at(
    model: nn.Module, param: nn.Parameter, value: torch.Tensor, test_batches: list, loss_fn
) -> float:
    """The mean test loss with the inserted parameter set to ``value``."""
    with torch.no_grad():
        param.copy_(value.to(dtype=param.dtype, device=param.device))
    return mean_loss(model, test_batches, loss_fn)[0]


def intervene(
    model: nn.Module,
    point: str,
    train_batches,
    test_batches,
    eta,
    kind: str = "bias",
    loss_fn=None,
    spec: CrossSpec | None = None,
    feature_dim: int | None = None,
    backend: str = "auto",
    adam_eps: float = ADAM_EPS,
) -> Intervention:
    """Measured vs predicted test-loss change of one gradient step on a parameter inserted at
    ``point`` (module docstring).

    Parameters
    ----------
    model : nn.Module
        Left bit-identical (parameters, buffers, modules, hooks, training flags).
    point : str
        Module name whose output is the residual stream (e.g. from :func:`fs.residual_points`).
    train_batches, test_batches : iterables of batches
        ``loss_fn(model, batch)`` must give per-sample losses (B,). The test batches are read twice
        (probe and measurement), so they are materialised as a list.
    eta : float or list of float
        Step sizes (> 0).
    kind : {"bias", "block"}
    spec : fs.CrossSpec, optional
        The block's features for ``kind="block"`` (default ``CrossSpec()``).
    feature_dim : int, optional
        The stream's feature axis (default: the probe's choice, 1 for NCHW maps, else -1).
    adam_eps : float
        The ε of the zero-state Adam step (default torch's 1e-8).

    Returns
    -------
    Intervention
        ``rows`` of ``(eta, predicted, measured, ratio, one_sided)``: ``measured`` is the central
        difference ``(L(θ₀ + Δ) − L(θ₀ − Δ))/2``, ``one_sided`` the step's own change
        ``L(θ₀ + Δ) − L(θ₀)`` (module docstring); ``to_markdown()`` gives a table.
    """
    from ..probe.driver import Probe

    if kind not in KINDS:
        raise FusedStatsError(f"kind must be one of {KINDS}, got {kind!r}")
    if loss_fn is None or not callable(loss_fn):
        raise FusedStatsError("intervene needs loss_fn(model, batch) -> per-sample losses (B,)")
    etas = _etas(eta)
    if isinstance(adam_eps, bool) or not isinstance(adam_eps, (int, float)) or not 0 < adam_eps < math.inf:
        raise FusedStatsError(f"adam_eps must be a finite float > 0, got {adam_eps!r}")
    if kind == "block":
        spec = spec or CrossSpec()
        if not isinstance(spec, CrossSpec):
            raise FusedStatsError(f"spec must be a fused_stats.CrossSpec, got {type(spec).__name__}")
    test_batches = list(test_batches)
    probe = Probe(
        model,
        points=[point],
        unit="sample",
        second_moment="auto",
        cross=spec if kind == "block" else None,
        backend=backend,
        feature_dim=feature_dim,
    )
    probe.run(train_batches, loss_fn, stream="train", mask="none", progress=False)
    probe.run(test_batches, loss_fn, stream="test", mask="none", progress=False)
    train, test = probe.stats.get(point), probe.test_stats.get(point)
    if train is None or train.n == 0 or test is None or test.n == 0:
        raise FusedStatsError(f"intervene at {point!r}: need samples in both the train and the test batches")
    M, K = train.n, test.n
    if kind == "bias":
        step_dir = train.raw_sum() / M
        inner = float(step_dir @ (test.raw_sum() / K))
    else:
        step_dir = probe.cross_stats[point].c_sum / M
        inner = float((step_dir * (probe.test_cross_stats[point].c_sum / K)).sum())
    test_dir = test.raw_sum() / K if kind == "bias" else probe.test_cross_stats[point].c_sum / K
    adam_dir = adam_direction(step_dir, adam_eps)
    adam_inner = float((adam_dir * test_dir).sum())
    fd = probe.feature_dims[point]
    modes = [(m, m.training) for m in model.modules()]
    block = insert_zero_block(model, point, kind, spec, feature_dim=fd, dim=probe.dims[point])
    try:
        param = block.bias if kind == "bias" else block.w_out
        if kind == "block":
            # exactly the features the probe used (same W_in, no re-draw or dtype round trip)
            block.w_in = probe.cross_stats[point].w_in.to(dtype=block.w_in.dtype, device=block.w_in.device)
        model.eval()
        base, count = mean_loss(model, test_batches, loss_fn)
        tables = {}
        for label, direction, per_unit in (("sgd", step_dir, inner), ("adam", adam_dir, adam_inner)):
            rows = tables[label] = []
            for e in etas:
                after, mirror = (
                    _loss_at(model, param, sign * -e * direction, test_batches, loss_fn) for sign in (1, -1)
                )
                predicted = -e * per_unit
                measured = (after - mirror) / 2
                ratio = measured / predicted if predicted != 0 else None
                rows.append(InterventionRow(e, predicted, measured, ratio, one_sided=after - base))
    finally:
        remove_inserted_block(model, point)
        for m, training in modes:
            m.training = training
    if count != K:
        raise FusedStatsError(
            f"intervene: the probe counted K={K} test samples but the loss "
            f"averaged {count}; every test sample needs at least one position"
        )
    return Intervention(
        point=point,
        kind=kind,
        M=M,
        K=K,
        base_loss=base,
        inner=inner,
        rows=tables["sgd"],
        adam_inner=adam_inner,
        adam_rows=tables["adam"],
        adam_eps=float(adam_eps),
    )
