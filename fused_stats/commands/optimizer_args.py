"""``--optimizer`` and its settings: the optimizer whose first step on a growth is predicted.

``probe --growth`` builds ``torch.optim.<Optimizer>(model.parameters(), ...)`` from these options
(one param group, no state: the first step of a fresh run) and prints
:func:`fused_stats.predicted_change` per candidate, which needs the mean train and test tangents of
the live probe. ``advise`` reads saved reports, which do not keep them: it says so and prints the
per-unit-step numbers the reports hold. Each option is refused for an optimizer that has no such
setting, before the model loads."""

from __future__ import annotations

import argparse

from .args import positive_float

OPTIMIZERS = {
    "sgd": "SGD",
    "adam": "Adam",
    "adamw": "AdamW",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
    "nadam": "NAdam",
    "radam": "RAdam",
    "adamax": "Adamax",
}
# the settings each torch class takes (torch/optim/*.py)
ADAPTIVE = ("eps", "weight_decay")
SETTINGS = {
    "SGD": ("momentum", "nesterov", "weight_decay"),
    "Adam": ("betas", *ADAPTIVE),
    "AdamW": ("betas", *ADAPTIVE),
    "NAdam": ("betas", *ADAPTIVE),
    "RAdam": ("betas", *ADAPTIVE),
    "Adamax": ("betas", *ADAPTIVE),
    "Adagrad": ADAPTIVE,
    "RMSprop": ("momentum", *ADAPTIVE),
}


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _betas(text: str) -> tuple[float, float]:
    parts = text.replace(",", " ").split()
    try:
        values = tuple(float(v) for v in parts)
    except ValueError:
        values = ()
    if len(values) != 2 or not all(0 <= v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"must be two numbers in [0, 1) as 'b1,b2', got {text!r}")
    return values


def add_optimizer_arguments(parser) -> None:
    group = parser.add_argument_group(
        "first-step prediction", "the optimizer whose first step on each candidate's growth is predicted"
    )
    group.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default=None,
        help="the torch.optim class (one param group over the model, no state; default: none, no prediction)",
    )
    group.add_argument(
        "--lr",
        type=positive_float,
        default=None,
        help="its learning rate (required with --optimizer; default: none)",
    )
    group.add_argument("--eps", type=positive_float, default=None, help="its eps (default: torch's)")
    group.add_argument("--betas", type=_betas, default=None, help="'b1,b2' (default: torch's)")
    group.add_argument(
        "--weight-decay", type=_nonnegative_float, default=None, help="its weight decay (default: torch's)"
    )
    group.add_argument(
        "--momentum", type=_nonnegative_float, default=None, help="SGD / RMSprop momentum (default: torch's)"
    )
    group.add_argument("--nesterov", action="store_true", help="SGD with Nesterov momentum")


def optimizer_settings(args) -> tuple[str, dict] | None:
    """``(torch class name, keyword settings)`` from the options, None without ``--optimizer``;
    raises :class:`FusedStatsError` naming an option the optimizer has no setting for."""
    from ..errors import FusedStatsError

    given = {
        "eps": args.eps,
        "betas": args.betas,
        "weight_decay": args.weight_decay,
        "momentum": args.momentum,
        "nesterov": args.nesterov or None,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if args.optimizer is None:
        if args.lr is not None or given:
            named = ["--lr"] * (args.lr is not None) + [f"--{k.replace('_', '-')}" for k in given]
            raise FusedStatsError(
                f"{', '.join(named)} set(s) an optimizer's settings: name it with --optimizer"
            )
        return None
    name = OPTIMIZERS[args.optimizer]
    if args.lr is None:
        raise FusedStatsError(f"--optimizer {args.optimizer} needs --lr (the prediction is linear in it)")
    foreign = [k for k in given if k not in SETTINGS[name]]
    if foreign:
        raise FusedStatsError(
            f"--optimizer {args.optimizer}: torch.optim.{name} has no setting "
            f"{', '.join('--' + k.replace('_', '-') for k in foreign)} (it takes "
            f"{', '.join('--' + k.replace('_', '-') for k in SETTINGS[name])})"
        )
    if given.get("nesterov") and not given.get("momentum"):
        raise FusedStatsError("--nesterov needs --momentum > 0 (torch's rule)")
    return name, {"lr": args.lr, **given}


def check_prediction_arguments(protocol_arguments: dict | None, batch_size: int) -> None:
    """``probe``'s refusals of ``--optimizer`` before the model loads: it needs ``--growth``, the
    exact tangents (no projection) and, with ``train_batch_size = B``, batches that tile B."""
    from ..errors import FusedStatsError

    if protocol_arguments is None:
        raise FusedStatsError(
            "--optimizer predicts the first step on a growth: it needs --growth PROTOCOL.toml"
        )
    if protocol_arguments.get("projection") is not None:
        raise FusedStatsError(
            "--optimizer needs the exact tangents, and the protocol file sets projection: drop it to predict"
        )
    size = protocol_arguments.get("train_batch_size")
    if size is not None and size % batch_size:
        raise FusedStatsError(
            f"--optimizer with the protocol's train_batch_size = {size}: its sub-batches are whole probe "
            f"steps, so --batch-size must divide {size}, got {batch_size}"
        )


def build_optimizer(settings: tuple[str, dict], model):
    """``torch.optim.<name>(model.parameters(), **settings)``."""
    import torch

    from ..errors import FusedStatsError

    name, kwargs = settings
    try:
        return getattr(torch.optim, name)(model.parameters(), **kwargs)
    except ValueError as exc:  # torch's own checks of the values
        raise FusedStatsError(f"--optimizer {name.lower()}: {exc}") from None


def describe(settings: tuple[str, dict]) -> str:
    name, kwargs = settings
    return f"{name}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"


def prediction_lines(probe, model, settings) -> list[str]:
    """One line per candidate: :func:`fused_stats.predicted_change` of the live ``probe`` for the
    optimizer of ``settings`` built over ``model`` (its groups are the ones the growth joins)."""
    from ..api.growth.first_step import predicted_change

    predictions = predicted_change(probe, build_optimizer(settings, model))
    lines = [f"first-step prediction for {describe(settings)} (change of the mean test loss, one step):"]
    for point, prediction in predictions.items():
        untrained = f" (not trained: {', '.join(prediction.untrained)})" if prediction.untrained else ""
        lines.append(f"  {point}: {prediction.change:+.6g}{untrained}")
    return lines


def unit_step_lines(advice, settings) -> list[str]:
    """What ``advise`` can say from reports: the first-order change at the given lr where the
    reports' per-unit-step numbers give it (SGD; Adam/AdamW at the advice's eps), why not where
    they do not, and the per-unit-step numbers themselves."""
    lr = settings[1]["lr"]
    lines = [
        f"first-step prediction for {describe(settings)} (first order, change of the mean test loss, "
        f"one step at lr {lr:g}):"
    ]
    for c in advice.ranked:
        value, why = at_lr(advice, settings, c)
        lines.append(f"  {c.point}: " + (f"{value:+.6g}" if value is not None else f"n/a ({why})"))
    lines.append(
        "Per unit step (the numbers above divided by lr): SGD -<C_M, C_K>, zero-state Adam -<s_M, C_K> "
        f"at eps {advice.adam_eps:g}; 'fused-stats probe --growth PROTOCOL.toml' with the same "
        "--optimizer options predicts every optimizer from the live tangents:"
    )
    for c in advice.ranked:
        sgd = "n/a" if c.predicted_change_sgd is None else f"{c.predicted_change_sgd:+.6g}"
        adam = "n/a" if c.predicted_change_adam is None else f"{c.predicted_change_adam:+.6g}"
        lines.append(f"  {c.point}: sgd {sgd}, adam {adam}")
    return lines


def at_lr(advice, settings, candidate) -> tuple[float | None, str]:
    """``(change, "")`` of one first step at the settings' lr from a candidate's per-unit-step
    numbers, or ``(None, why)``. On the new zero parameters weight decay adds nothing; SGD's first
    step is ``lr·g`` (Nesterov: ``lr·(1 + momentum)·g``, torch's buffer starts at ``g``); zero-state
    Adam/AdamW's is ``lr·g/(|g| + eps)`` whatever the betas (bias correction)."""
    name, kwargs = settings
    lr = kwargs["lr"]
    if name == "SGD":
        if candidate.predicted_change_sgd is None:
            return None, "no SGD score in the reports"
        factor = 1.0 + kwargs.get("momentum", 0.0) if kwargs.get("nesterov") else 1.0
        return lr * factor * candidate.predicted_change_sgd, ""
    if name in ("Adam", "AdamW"):
        eps = kwargs.get("eps", 1e-8)  # torch's default
        if eps != advice.adam_eps:
            return None, f"the reports' Adam score is at eps {advice.adam_eps:g}, not {eps:g}"
        if candidate.predicted_change_adam is None:
            return None, "no Adam score in the reports"
        return lr * candidate.predicted_change_adam, ""
    return None, f"the reports keep no {name} score; probe --growth predicts it"
