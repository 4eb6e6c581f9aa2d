"""The growth demo's experiment: one seed's arms, trained and measured (:mod:`.growth` summarises).

Per seed, on the demo's corpus (:mod:`.corpus`) and models (:mod:`.models`):

1. train a shallow byte-level LLaMA (``depth`` blocks) for ``steps1`` steps (AdamW, warm-up +
   cosine over the *whole* run of ``steps1 + steps2`` steps);
2. probe it (:class:`fused_stats.Probe` with ``cross=protocol``: the exact tangent of a new
   layer at every block boundary) on the reserved train / held-out windows and rank the
   boundaries with :func:`fused_stats.advise` (Holm–Bonferroni);
3. continue training: the shallow model unchanged (``stay``: no growth) and, at every
   candidate, the model grown by one zero-output layer (:func:`fused_stats.grow`, optimizer
   carried: new parameters start with zero Adam state), each for ``steps2`` more steps on the
   same text; a candidate's realised gain is the stay arm's held-out loss minus its own. The arms
   ``top`` (the advisor's top candidate, ``advice.top``: the Holm-significant candidate of
   largest ``|C|_F²``), ``last`` (the candidate it ranks last) and ``even`` (the middle boundary:
   evenly spaced growth of one block) are three of these; ``copy`` is a G_stack-style copy of
   the neighbour at the top candidate. Saturated everywhere (``advice.top`` is None): the
   advisor says not to grow, so ``top`` and ``copy`` are the stay arm (``init="none"``);
4. train the final architecture (``depth + 1`` blocks) from scratch for ``steps1 + steps2``
   steps (``scratch_steps``) and for the steps that cost the grown run's training FLOPs
   (``scratch_flops``; FLOPs per token ``6 × (non-embedding parameters + LM head)``, Kaplan et
   al. 2020, "Scaling laws for neural language models", section 2.1);
5. per candidate, every score before growth (``SCORES``: ``|C|_F²``, the signal fraction, the
   predicted first-step drops per unit step for SGD ``⟨C_M, C_K⟩`` and zero-state Adam
   ``⟨s_M, C_K⟩``, the split Adam score ``⟨s_A, C_B⟩`` on the train probe batches, and the
   curvature-aware gain ``|g|⁴/(2gᵀHg)`` on ``curvature_batches`` of them); then insert a zero
   layer, train only it for ``short_steps`` AdamW steps, and record the held-out loss drop.

Every arm's training FLOPs count ``6 ×`` the parameters each token multiplies by
(:func:`training_flops_per_token`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from ..errors import FusedStatsError

ARMS = ("stay", "top", "last", "even", "copy", "scratch_steps", "scratch_flops")
# what a candidate realised, per seed: the held-out drop of a zero layer there trained alone for
# short_steps, and the held-out gain over no growth after steps2 steps of the whole grown model
REALISED = {
    "candidate_drop": "drop of the new layer trained alone",
    "candidate_gain_continued": "gain over no growth, whole model trained on",
}
# every score oriented so that larger predicts a larger held-out drop
SCORES = ("cross_frob2", "signal_fraction", "gain_sgd", "gain_adam", "split_adam", "curvature_gain")


@dataclass
class GrowthDemoConfig:
    width: int = 32
    depth: int = 6
    seeds: tuple = tuple(range(10))
    seq_len: int = 64
    batch_size: int = 16
    steps1: int = 96
    steps2: int = 48
    short_steps: int = 12
    probe_batches: int = 6
    curvature_batches: int = 3
    eval_batches: int = 8
    base_lr: float = 3e-3
    alpha: float = 0.05
    extra: dict = field(default_factory=dict)

    @classmethod
    def quick(cls, **overrides) -> GrowthDemoConfig:
        base = dict(
            width=16,
            depth=3,
            seeds=(0, 1),
            steps1=8,
            steps2=4,
            short_steps=2,
            probe_batches=3,
            curvature_batches=3,
            eval_batches=2,
        )
        base.update(overrides)
        return cls(**base)

    def validate(self) -> None:
        if self.width < 16 or self.width % 16:
            raise FusedStatsError(f"width must be a multiple of 16 (head size), got {self.width}")
        if self.depth < 1:
            raise FusedStatsError(f"depth must be >= 1, got {self.depth}")
        if len(self.seeds) < 1 or len(set(self.seeds)) != len(self.seeds):
            raise FusedStatsError(f"seeds must be distinct, got {self.seeds}")
        for name in ("steps1", "steps2", "short_steps", "probe_batches", "curvature_batches", "eval_batches"):
            if getattr(self, name) < 1:
                raise FusedStatsError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.probe_batches * self.batch_size < 4:
            raise FusedStatsError("the probe needs >= 4 samples per stream")
        if self.probe_batches < 2:
            raise FusedStatsError(f"the split Adam score needs probe_batches >= 2, got {self.probe_batches}")
        if self.curvature_batches < 3:
            # fs.curvature_gain: |g|² from two halves of its batches, gᵀHg from three groups
            raise FusedStatsError(
                f"the curvature gain needs curvature_batches >= 3, got {self.curvature_batches}"
            )
        if self.curvature_batches > self.probe_batches:
            raise FusedStatsError(
                f"curvature_batches ({self.curvature_batches}) must be <= probe_batches ({self.probe_batches})"
            )


def training_flops_per_token(model) -> float:
    """``6 ×`` the parameters every token multiplies by (blocks and LM head; the input
    embedding is a lookup)."""
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    return 6.0 * params


def _schedule(total: int):
    from .models import lr_factor

    return lambda s: lr_factor(min(s, total - 1), total)


def _optimizer(model, lr: float, total: int):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, _schedule(total))


def _steps(model, opt, sched, batches) -> int:
    model.train()
    tokens = 0
    for ids in batches:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        tokens += ids.numel()
    model.eval()
    return tokens


def run_seed(corpus, cfg: GrowthDemoConfig, seed: int, echo=print) -> dict:
    """One seed of the experiment (module docstring); returns a JSON-able dict."""
    import fused_stats as fs

    from ..api.growth.architecture import describe
    from .models import build_llama, eval_loss, lr_for

    B, lr = cfg.batch_size, lr_for(cfg.width, cfg.base_lr)
    total = cfg.steps1 + cfg.steps2
    held_out = list(corpus.batches("test", seed, B, cfg.eval_batches))

    def text(start_step: int, count: int):
        return corpus.batches("train", seed, B, count, start=start_step * B)

    t0 = time.perf_counter()
    shallow = build_llama(cfg.width, cfg.depth, cfg.seq_len, seed)
    opt, sched = _optimizer(shallow, lr, total)
    tokens1 = _steps(shallow, opt, sched, text(0, cfg.steps1))
    base_loss = eval_loss(shallow, held_out)

    # probe the shallow model at every block boundary with the protocol's own new layer
    arch = describe(shallow)
    candidates = [arch.input_point] + [f"model.layers.{i}" for i in range(cfg.depth)]
    protocol = fs.GrowthProtocol(candidates, family="layer", init="zero", seed=seed)
    probe = fs.Probe(shallow, points=candidates, cross=protocol, second_moment="dense")
    train_batches = []
    for stream, split in (("train", "train"), ("test", "test")):
        for ids in corpus.probe_batches(split, B, cfg.probe_batches):
            probe.step({"input_ids": ids}, fs.causal_lm_loss, stream=stream)
            if stream == "train":
                train_batches.append({"input_ids": ids})
    advice = fs.advise(probe, protocol, alpha=cfg.alpha)
    scores = scores_before_growth(shallow, protocol, advice.ranked, train_batches, cfg.curvature_batches)
    ranked = [c.point for c in advice.ranked]
    # the advisor's choice: its top Holm-significant candidate; saturated everywhere (None) means
    # it advises no growth, so "top" and "copy" then continue the shallow model unchanged
    top = advice.top.point if advice.top is not None else None

    def continue_training(point, init: str) -> dict:
        """The shallow model grown at ``point`` (None: not grown), optimizer carried, then
        ``steps2`` more steps on the same text as every other arm."""
        model, o, s = copy.deepcopy((shallow, opt, sched))
        if point is not None:
            fs.grow(model, protocol, at=[point], init=init, optimizer=o)
        tokens2 = _steps(model, o, s, text(cfg.steps1, cfg.steps2))
        return {
            "point": point,
            "init": init if point is not None else "none",
            "held_out_loss": eval_loss(model, held_out),
            "flops": training_flops_per_token(shallow) * tokens1 + training_flops_per_token(model) * tokens2,
        }

    # realised gain of every candidate after continued training of the whole model, against no
    # growth for the same steps (all candidates add the same layer, so their ranking does not
    # depend on whether "no growth" gets equal steps or equal FLOPs)
    stay = continue_training(None, "none")
    continued = {point: continue_training(point, "zero") for point in candidates}
    arms = {
        "stay": stay,
        "top": dict(stay if top is None else continued[top]),
        "last": dict(continued[ranked[-1]]),
        "even": dict(continued[candidates[len(candidates) // 2]]),
        "copy": dict(stay) if top is None else continue_training(top, "copy"),
    }
    grown_flops = arms["top"]["flops"]
    deep = build_llama(cfg.width, cfg.depth + 1, cfg.seq_len, seed)
    per_step = training_flops_per_token(deep) * B * cfg.seq_len
    flop_steps = max(1, round(grown_flops / per_step))
    for arm, steps in (("scratch_steps", total), ("scratch_flops", flop_steps)):
        model = copy.deepcopy(deep)
        o, s = _optimizer(model, lr, steps)
        tokens = _steps(model, o, s, text(0, steps))
        arms[arm] = {
            "point": None,
            "init": "scratch",
            "steps": steps,
            "held_out_loss": eval_loss(model, held_out),
            "flops": training_flops_per_token(model) * tokens,
        }

    # realised gain per candidate: a zero layer there, only it trained for a few steps
    drops = {}
    for point in candidates:
        model = copy.deepcopy(shallow)
        result = fs.grow(model, protocol, at=[point])
        names = set(result.new_parameters)
        params = [p for n, p in model.named_parameters() if n in names]
        for n, p in model.named_parameters():
            p.requires_grad_(n in names)
        o = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        _steps(model, o, None, text(cfg.steps1, cfg.short_steps))
        drops[point] = base_loss - eval_loss(model, held_out)
    realised = {
        "candidate_drop": drops,
        "candidate_gain_continued": {
            c: stay["held_out_loss"] - continued[c]["held_out_loss"] for c in candidates
        },
    }
    out = {
        "seed": seed,
        "shallow_held_out_loss": base_loss,
        "candidate_scores": scores,
        "candidates": candidates,
        "input_point": arch.input_point,
        "advice": advice.to_dict(),
        "arms": arms,
        **realised,
        "seconds": time.perf_counter() - t0,
    }
    from ..accumulators.trends import rank_correlation

    gains = realised["candidate_gain_continued"]
    rho, _ = rank_correlation([scores[c]["cross_frob2"] for c in candidates], [gains[c] for c in candidates])
    echo(
        f"seed {seed}: shallow held-out {base_loss:.4f}; advisor top "
        + (top if top is not None else "none (saturated everywhere: no growth)")
        + f", last {ranked[-1]}; "
        + ", ".join(f"{a} {v['held_out_loss']:.4f}" for a, v in arms.items())
        + f"; rho(|C|², continued gain) = {rho:.2f}; {out['seconds']:.0f} s"
    )
    return out


def scores_before_growth(shallow, protocol, candidates, train_batches, curvature_batches: int) -> dict:
    """Every score (``SCORES``; None where undefined) of each advised candidate (the advisor's
    ``Candidate`` entries) before growth, each oriented so that larger predicts a larger
    held-out drop; the curvature gain on the first ``curvature_batches`` train batches."""
    import fused_stats as fs

    out = {}
    for c in candidates:
        curvature = fs.curvature_gain(
            shallow, protocol, c.point, train_batches[:curvature_batches], fs.causal_lm_loss
        )
        split = fs.split_adam_score(shallow, protocol, c.point, train_batches, fs.causal_lm_loss)
        out[c.point] = {
            "cross_frob2": c.cross_frob2,
            "signal_fraction": c.signal_fraction,
            "gain_sgd": None if c.predicted_change_sgd is None else -c.predicted_change_sgd,
            "gain_adam": None if c.predicted_change_adam is None else -c.predicted_change_adam,
            "split_adam": split.score,
            "curvature_gain": curvature.gain,
            "grad_sq": curvature.grad_sq,
            "ghg": curvature.ghg,
        }
    return out
