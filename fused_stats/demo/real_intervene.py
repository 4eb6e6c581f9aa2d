"""The real-model demo's direct interventions: one optimizer step on a zero bias or a zero layer
inserted at a boundary, its measured change of the test loss against the probe's prediction.

Role: the width paper's direct intervention and the depth paper's growth step on a pretrained LLM.

* **Zero bias** ``b = 0`` added to the stream after the boundary block (:func:`fused_stats.insert_zero_block`):
  its gradient is the per-sample vector ``q_i``, so the train step's gradient is the probe's train
  mean ``μ_M`` and the first-order change of the mean test loss is ``⟨Δb, g_K⟩`` with the test mean
  ``g_K`` (both from the probe's GradStats at the point).
* **Zero layer** (the growth family ``"layer"``, ``init="zero"``): a copy of the model grown by
  :func:`fused_stats.grow` at the boundary; the new layer's output maps start at zero and their
  train gradient is the tangent probe's train mean ``C_M`` (per parameter, the columns the
  prediction reads); the prediction is :func:`fused_stats.predicted_change` for the optimizer.

The test loss is computed from the stream cached right after the boundary block (:class:`TailLoss`):
the blocks below it are the same in every variant, so only the blocks above run again; the cached
path is checked once against the whole model's loss (equal to round-off, else refused).

Each step ``Δ`` is torch's own first step (``torch.optim.SGD`` / ``AdamW`` with zero state, default
settings) from that gradient. The measured first-order change is the **central difference**
``(L(θ₀ + Δ) − L(θ₀ − Δ))/2`` of the mean test loss: the step against its mirror step, so the
second-order (curvature) term cancels and what is left is ``⟨Δ, ∇L_K⟩ + O(|Δ|³)``; the one-sided
change ``L(θ₀ + Δ) − L(θ₀)`` (what a training step does) is shown beside it. Step sizes are set
from the train stream alone: ``η`` such that the train-side prediction is ``−target`` nats for
each target in ``targets``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..errors import FusedStatsError

F64 = torch.float64
OPTIMIZERS = {"SGD": torch.optim.SGD, "AdamW": torch.optim.AdamW}


@dataclass(frozen=True)
class StepRow:
    """One step size of one optimizer at one inserted parameter."""

    optimizer: str
    eta: float
    predicted: float  # first-order change of the mean test loss
    central: float  # (L(+Δ) − L(−Δ))/2
    one_sided: float  # L(+Δ) − L(0)

    @property
    def ratio(self) -> float | None:
        """central / predicted; None where the prediction is 0."""
        return self.central / self.predicted if self.predicted != 0 else None

    def to_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


class _FromStream(nn.Module):
    """``model`` run on a cached stream as its input embeddings, with its block stack cut to
    ``layers`` (what ``causal_lm_loss`` calls: its ``input_ids`` only give the targets)."""

    def __init__(self, model, layers, stream):
        super().__init__()
        self.model, self.layers, self.stream = model, layers, stream

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        backbone = self.model.model
        whole = backbone.layers
        backbone.layers = self.layers
        try:
            return self.model(inputs_embeds=self.stream, attention_mask=attention_mask, **kwargs)
        finally:
            backbone.layers = whole


class TailLoss:
    """The mean test loss (``fs.causal_lm_loss``, per sequence, averaged) of a model that equals
    ``model`` up to and including block ``point``, computed from ``point``'s cached output:
    ``loss(m, start, shift)`` runs ``m.model.layers[start:]`` on the cached stream plus ``shift``.
    For a decoder whose backbone takes ``inputs_embeds`` and runs ``model.layers`` in order
    (LLaMA and its kin); checked against the whole model at construction."""

    def __init__(self, model, point: str, batches, whole_loss: float):
        stack = getattr(getattr(model, "model", None), "layers", None)
        names = [f"model.layers.{k}" for k in range(len(stack or []))]
        if point not in names:
            raise FusedStatsError(
                f"the interventions need a decoder with model.model.layers; {point!r} is not one"
            )
        self.index = names.index(point)
        self.batches = batches
        self.streams = []
        captured = {}
        handle = model.get_submodule(point).register_forward_hook(
            lambda mod, args, out: captured.__setitem__(
                "z", (out[0] if isinstance(out, tuple) else out).detach()
            )
        )
        try:
            with torch.no_grad():
                for batch in batches:
                    model(**batch)
                    self.streams.append(captured.pop("z"))
        finally:
            handle.remove()
        cached = self.loss(model, self.index + 1)
        if not math.isclose(cached, whole_loss, rel_tol=1e-6, abs_tol=0.0):
            raise FusedStatsError(
                f"the loss from the stream cached at {point!r} is {cached!r}, the whole model's {whole_loss!r}: "
                "this model's backbone does not run as a plain stack of blocks"
            )

    def loss(self, model, start: int, shift: torch.Tensor | None = None) -> float:
        import fused_stats as fs

        from ..api.growth.intervene import mean_loss

        layers = nn.ModuleList(list(model.model.layers)[start:])

        def from_stream(_, pair):
            batch, z = pair
            stream = z if shift is None else z + shift.to(z.dtype)
            return fs.causal_lm_loss(_FromStream(model, layers, stream), batch)

        return mean_loss(model, list(zip(self.batches, self.streams)), from_stream)[0]


def torch_first_step(name: str, grads: dict[str, torch.Tensor], eta: float) -> dict[str, torch.Tensor]:
    """Torch's own first update (zero state, default settings) of optimizer ``name`` at lr ``eta``
    on zero parameters with these gradients: ``{name: Δθ}``."""
    params = {k: torch.zeros_like(g, requires_grad=True) for k, g in grads.items()}
    for k, p in params.items():
        p.grad = grads[k].clone()
    OPTIMIZERS[name](list(params.values()), lr=eta).step()
    return {k: p.detach().clone() for k, p in params.items()}


def step_sizes(train_inner: dict[str, float], targets) -> dict[str, list[float]]:
    """Per optimizer, ``η = target / ⟨u, g_M⟩`` (``u``: the update per unit lr): the train-side
    prediction of each step is ``−target``."""
    return {name: [t / inner for t in targets] if inner > 0 else [] for name, inner in train_inner.items()}


def _central(set_params, test_loss, delta: dict, base: float) -> tuple[float, float]:
    set_params(delta, 1.0)
    plus = test_loss()
    set_params(delta, -1.0)
    minus = test_loss()
    return (plus - minus) / 2, plus - base


def bias_intervention(tail: TailLoss, model, point: str, mu_train, g_test, base: float, targets) -> dict:
    """A zero bias added to the stream after ``point``: rows per optimizer and step size (module
    docstring); the bias shifts the cached stream, which is what the inserted parameter does."""
    grads = {"bias": mu_train.to(F64)}
    unit = {name: torch_first_step(name, grads, 1.0)["bias"] for name in OPTIMIZERS}
    inner = {name: -float(u @ mu_train.to(F64)) for name, u in unit.items()}
    shift = {}

    def set_params(delta, sign):
        shift["b"] = sign * delta["bias"]

    rows = []
    for name, etas in step_sizes(inner, targets).items():
        for eta in etas:
            delta = torch_first_step(name, grads, eta)
            predicted = float(delta["bias"] @ g_test.to(F64))
            central, one_sided = _central(
                set_params, lambda: tail.loss(model, tail.index + 1, shift["b"]), delta, base
            )
            rows.append(StepRow(name, eta, predicted, central, one_sided))
    return {"point": point, "kind": "zero bias", "parameters": int(mu_train.numel()), "rows": rows}


def layer_intervention(tail: TailLoss, model, probe, protocol, point: str, base: float, targets) -> dict:
    """A zero layer grown at ``point`` in a copy of ``model``: rows per optimizer and step size;
    the prediction is :func:`fused_stats.predicted_change` of the tangent probe ``probe``."""
    import fused_stats as fs
    from fused_stats.api.growth.first_step import tangent_record

    record = tangent_record(probe, point)
    grown = copy.deepcopy(model)
    result = fs.grow(grown, protocol, at=[point])  # the same name-seeded block the probe measured
    block = grown.get_submodule(result.positions[point])
    params = {rel: block.get_parameter(rel) for rel, _, _ in record.segments}
    grads = {rel: record.c_train[:, a:b].reshape(params[rel].shape) for rel, a, b in record.segments}
    origin = {rel: p.detach().clone() for rel, p in params.items()}
    unit_updates = {name: torch_first_step(name, grads, 1.0) for name in OPTIMIZERS}
    inner = {
        name: -sum(float((u[rel] * grads[rel]).sum()) for rel in grads) for name, u in unit_updates.items()
    }

    def set_params(delta, sign):
        with torch.no_grad():
            for rel, p in params.items():
                p.copy_((origin[rel] + sign * delta[rel]).to(p.dtype))

    rows = []
    for name, etas in step_sizes(inner, targets).items():
        for eta in etas:
            optimizer = OPTIMIZERS[name](model.parameters(), lr=eta)
            predicted = fs.predicted_change(probe, optimizer)[point].change
            delta = torch_first_step(name, grads, eta)
            # the new layer is block index + 1 of the grown copy: run it and everything above
            central, one_sided = _central(set_params, lambda: tail.loss(grown, tail.index + 1), delta, base)
            rows.append(StepRow(name, eta, predicted, central, one_sided))
    size = sum(p.numel() for p in params.values())
    return {"point": point, "kind": "zero layer", "parameters": int(size), "rows": rows}


def intervention_lines(item: dict) -> list[str]:
    """The Markdown table of one intervention (rows of :class:`StepRow` or their dicts)."""
    lines = [
        f"**{item['kind']}** after `{item['point']}` ({item['parameters']:,} trained entries):",
        "",
        "| optimizer | eta | predicted | measured (central) | ratio | one-sided step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in item["rows"]:
        r = row.to_dict() if isinstance(row, StepRow) else row
        ratio = "—" if r["ratio"] is None or not math.isfinite(r["ratio"]) else f"{r['ratio']:.4f}"
        lines.append(
            f"| {r['optimizer']} | {r['eta']:.3g} | {r['predicted']:.4g} | {r['central']:.4g} | {ratio} "
            f"| {r['one_sided']:.4g} |"
        )
    return lines
