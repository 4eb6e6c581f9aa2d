"""When to stop: a depth ladder grown one layer at a time at the advisor's choice.

Role: the stopping-rule half of ``grow-demo`` (``--ladder``). Per seed, a depth-1 byte-level
LLaMA is trained ``budget`` steps (AdamW, constant learning rate); then at every rung:

1. probe every block boundary with the protocol's new layer (train and held-out probe windows)
   and advise (Holm–Bonferroni): record the verdict (saturated everywhere or not) and the top
   candidate's scores (the advisor's first-ranked boundary, also when saturated everywhere);
2. grown arm: grow one zero layer there (optimizer carried, zero state for the new parameters)
   and train ``budget`` steps; stay arm: train the same model at the same depth for the steps
   that cost the grown arm's FLOPs (``budget × flops(deeper) / flops(current)`` rounded, FLOPs
   per token as :func:`.growth.training_flops_per_token`), on the same text;
3. realised gain = held-out loss of the stay arm minus that of the grown arm (positive: the
   growth paid for its compute); the ladder climbs with the grown arm.

Across rungs, per score, Spearman's ρ between the top candidate's score and the realised gain
per seed, pooled by :func:`.growth.stratified_rank_test`. A first-order score says whether a
descent direction exists for a small step at the new layer; the realised gain says whether the
deeper model beat the shallower one for equal compute after training.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch

from ..errors import FusedStatsError
from .growth import SCORES, scores_before_growth, stratified_rank_test, training_flops_per_token


@dataclass
class LadderConfig:
    width: int = 32
    rungs: int = 6
    seeds: tuple = (0, 1, 2, 3, 4)
    seq_len: int = 64
    batch_size: int = 16
    budget: int = 48
    probe_batches: int = 4
    curvature_batches: int = 3
    eval_batches: int = 8
    base_lr: float = 3e-3
    alpha: float = 0.05

    @classmethod
    def quick(cls, **overrides) -> LadderConfig:
        base = dict(
            width=16, rungs=3, seeds=(0, 1), budget=2, probe_batches=3, curvature_batches=3, eval_batches=2
        )
        base.update(overrides)
        return cls(**base)

    def validate(self) -> None:
        if self.width < 16 or self.width % 16:
            raise FusedStatsError(f"width must be a multiple of 16 (head size), got {self.width}")
        for name in ("rungs", "budget", "eval_batches", "curvature_batches"):
            if getattr(self, name) < 1:
                raise FusedStatsError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.curvature_batches < 3:
            # fs.curvature_gain: |g|² from two halves of its batches, gᵀHg from three groups
            raise FusedStatsError(
                f"the curvature gain needs curvature_batches >= 3, got {self.curvature_batches}"
            )
        if self.probe_batches < 2 or self.curvature_batches > self.probe_batches:
            raise FusedStatsError(
                f"need probe_batches >= 2 and curvature_batches <= probe_batches, got "
                f"{self.probe_batches}, {self.curvature_batches}"
            )
        if len(set(self.seeds)) != len(self.seeds) or not self.seeds:
            raise FusedStatsError(f"seeds must be distinct and not empty, got {self.seeds}")


def _train(model, opt, batches) -> None:
    model.train()
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


def ladder_seed(corpus, cfg: LadderConfig, seed: int, echo=print) -> dict:
    import fused_stats as fs

    from ..api.growth.architecture import describe
    from ..api.growth.plan import GrowthPlan
    from .models import build_llama, eval_loss, lr_for

    B = cfg.batch_size
    held_out = list(corpus.batches("test", seed, B, cfg.eval_batches))
    position = 0

    def text(count: int, start: int):
        return corpus.batches("train", seed, B, count, start=start * B)

    model = build_llama(cfg.width, 1, cfg.seq_len, seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr_for(cfg.width, cfg.base_lr), betas=(0.9, 0.95), weight_decay=0.0
    )
    _train(model, opt, text(cfg.budget, position))
    position += cfg.budget
    rungs = []
    for _ in range(cfg.rungs):
        depth = model.config.num_hidden_layers
        loss = eval_loss(model, held_out)
        arch = describe(model)
        candidates = [arch.input_point] + [f"model.layers.{i}" for i in range(depth)]
        protocol = fs.GrowthProtocol(candidates, family="layer", init="zero", seed=seed)
        # one plan for the probe, the scores and the growth of this rung
        plan = GrowthPlan.from_architecture(model, protocol, arch)
        probe = fs.Probe(model, points=candidates, cross=plan, second_moment="dense")
        train_batches = []
        for stream in ("train", "test"):
            for ids in corpus.probe_batches(stream, B, cfg.probe_batches):
                probe.step({"input_ids": ids}, fs.causal_lm_loss, stream=stream)
                if stream == "train":
                    train_batches.append({"input_ids": ids})
        advice = fs.advise(probe, protocol, alpha=cfg.alpha)
        first = advice.ranked[0]
        scores = scores_before_growth(model, plan, [first], train_batches, cfg.curvature_batches)[first.point]
        stay, stay_opt = copy.deepcopy((model, opt))
        fs.grow(model, plan, at=[first.point], init="zero", optimizer=opt)
        _train(model, opt, text(cfg.budget, position))
        stay_steps = max(
            1, round(cfg.budget * training_flops_per_token(model) / training_flops_per_token(stay))
        )
        _train(stay, stay_opt, text(stay_steps, position))
        position += stay_steps
        grown_loss, stay_loss = eval_loss(model, held_out), eval_loss(stay, held_out)
        rung = {
            "depth": depth,
            "held_out_loss": loss,
            "saturated_everywhere": advice.saturated_everywhere,
            "top": first.point,
            "top_p_adjusted": first.p_adjusted,
            "scores": scores,
            "grown_loss": grown_loss,
            "stay_loss": stay_loss,
            "stay_steps": stay_steps,
            "realised_gain": stay_loss - grown_loss,
        }
        rungs.append(rung)
        echo(
            f"seed {seed} depth {depth} -> {depth + 1} at {first.point}: "
            f"{'saturated everywhere' if advice.saturated_everywhere else 'not saturated'} "
            f"(top Holm p {first.p_adjusted:.3g}), |C|² {first.cross_frob2:.3g}; grown {grown_loss:.4f} vs "
            f"stay {stay_loss:.4f} ({stay_steps} steps): gain {rung['realised_gain']:+.4f}"
        )
    return {"seed": seed, "rungs": rungs}


def summarize_ladder(cfg: LadderConfig, runs: list[dict]) -> tuple[dict, list[str]]:
    from ..accumulators.trends import rank_correlation

    n = len(runs)
    lines = [
        f"When to stop: depth 1 -> {cfg.rungs + 1}, {cfg.budget} steps after each growth, {n} seeds; realised "
        "gain = held-out loss of staying at the same depth for the same FLOPs minus that of the grown model:",
        f"{'seed':>4} {'depth':>5} {'top':<18} {'saturated':>9} {'|C|²':>9} {'Adam':>8} {'curv':>9} {'gain':>8}",
    ]
    for r in runs:
        for g in r["rungs"]:
            s = g["scores"]
            curv = math.nan if s["curvature_gain"] is None else s["curvature_gain"]
            lines.append(
                f"{r['seed']:>4} {g['depth']:>5} {g['top']:<18} {g['saturated_everywhere']!s:>9} "
                f"{s['cross_frob2']:9.3g} {s['gain_adam'] or math.nan:8.3g} {curv:9.3g} {g['realised_gain']:+8.4f}"
            )
    summary = {"scores": {}}
    for name in SCORES:
        groups = [
            (
                [math.nan if g["scores"][name] is None else g["scores"][name] for g in r["rungs"]],
                [g["realised_gain"] for g in r["rungs"]],
            )
            for r in runs
        ]
        per_seed = [rank_correlation(xs, ys)[0] for xs, ys in groups]
        mean_rho, p = stratified_rank_test(groups)
        summary["scores"][name] = {
            "rho_per_seed": per_seed,
            "mean_rho": mean_rho,
            "p_stratified_permutation": p,
        }
        lines.append(
            f"rho({name}, realised gain) across rungs: per seed "
            + " ".join(f"{v:+.2f}" for v in per_seed)
            + f"; mean {mean_rho:+.2f}, stratified permutation p {p:.3f}"
        )
    gains = [g["realised_gain"] for r in runs for g in r["rungs"]]
    saturated = [g for r in runs for g in r["rungs"] if g["saturated_everywhere"]]
    summary["saturated_rungs"] = len(saturated)
    summary["positive_gains"] = sum(v > 0 for v in gains)
    lines.append(
        f"saturated everywhere at {len(saturated)} of {len(gains)} rungs"
        + (
            " (realised gain there: " + ", ".join(f"{g['realised_gain']:+.4f}" for g in saturated) + ")"
            if saturated
            else ""
        )
        + f"; growth beat staying for equal FLOPs at {summary['positive_gains']} of {len(gains)} rungs."
    )
    return summary, lines


def run_ladder(cfg: LadderConfig, out, echo=print) -> dict:
    import json
    from pathlib import Path

    from ..accumulators.persistence import write_text_atomic
    from .corpus import StdlibCorpus

    cfg.validate()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    out = Path(out)
    corpus = StdlibCorpus(cfg.seq_len, probe_windows=cfg.probe_batches * cfg.batch_size)
    runs = [ladder_seed(corpus, cfg, seed, echo) for seed in cfg.seeds]
    summary, lines = summarize_ladder(cfg, runs)
    lines.append(f"total: {time.perf_counter() - wall0:.0f} s wall, {time.process_time() - cpu0:.0f} s CPU")
    for line in lines:
        echo(line)
    out.mkdir(parents=True, exist_ok=True)
    record = {"config": cfg.__dict__, "runs": runs, "summary": summary}
    write_text_atomic(out / "depth_ladder.json", json.dumps(record, indent=1, default=float) + "\n")
    write_text_atomic(
        out / "depth_ladder.md", "# fused-stats grow-demo --ladder\n\n```\n" + "\n".join(lines) + "\n```\n"
    )
    return record
