"""fused-stats grow-demo --quick end to end, its statistics against independent references, and
the tangent line of fused-stats plan."""

from __future__ import annotations

import itertools
import json

import pytest
import scipy.stats
import torch
import transformers

import fused_stats as fs
from fused_stats.api.streaming.plan import plan_tangent
from fused_stats.cli import main
from fused_stats.demo.growth import (
    SCORES,
    paired_test,
    stratified_rank_test,
    training_flops_per_token,
)
from fused_stats.demo.models import build_llama

# the demo's checks of the scores: realised quantity, and whether the input boundary is left out
CHECKS = {
    "drop_alone": ("candidate_drop", False),
    "gain_continued": ("candidate_gain_continued", False),
    "gain_continued_blocks": ("candidate_gain_continued", True),
}


def llama_flops_per_token(width: int, depth: int) -> int:
    """6 x the parameters of the demo's byte-level LLaMA a token multiplies by: the blocks (q, k,
    v, o; gate, up, down; two RMSNorms), the final norm and the LM head (256 bytes)."""
    d, f, V = width, 4 * width, 256
    return 6 * (depth * (4 * d * d + 3 * d * f + 2 * d) + d + V * d)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("grow_demo")
    assert main(["grow-demo", "--quick", "--out", str(out)]) == 0
    assert (out / "growth_demo.png").stat().st_size > 1000
    return json.loads((out / "growth_demo.json").read_text()), (out / "growth_demo.md").read_text()


def test_quick_run_end_to_end(quick_run):
    record, text = quick_run
    cfg = record["config"]
    assert len(record["runs"]) == len(cfg["seeds"]) == 2
    for run in record["runs"]:
        ranked = [c["point"] for c in run["advice"]["ranked"]]
        assert sorted(ranked) == sorted(run["candidates"]) and len(ranked) == cfg["depth"] + 1
        arms = run["arms"]
        # the advisor's choice: the Holm-significant candidate of largest |C|², or no growth
        significant = [c for c in run["advice"]["ranked"] if not c["saturated"]]
        top = max(significant, key=lambda c: c["cross_frob2"])["point"] if significant else None
        assert arms["top"]["point"] == arms["copy"]["point"] == top
        assert arms["last"]["point"] == ranked[-1]
        assert arms["even"]["point"] == run["candidates"][len(run["candidates"]) // 2]
        assert arms["scratch_steps"]["steps"] == cfg["steps1"] + cfg["steps2"]
        assert top is not None  # the quick runs grow, so the copy is a model of its own
        assert (
            arms["copy"]["init"] == "copy" and arms["copy"]["held_out_loss"] != arms["top"]["held_out_loss"]
        )
        # FLOPs of a grown arm: steps1 at the shallow depth, steps2 one block deeper (explicit counts)
        tokens = cfg["batch_size"] * cfg["seq_len"]

        def per_token(depth):
            return llama_flops_per_token(cfg["width"], depth)

        for arm in ("top", "copy"):
            expected = (
                per_token(cfg["depth"]) * cfg["steps1"] + per_token(cfg["depth"] + 1) * cfg["steps2"]
            ) * tokens
            assert arms[arm]["flops"] == expected
        assert arms["stay"]["flops"] == per_token(cfg["depth"]) * (cfg["steps1"] + cfg["steps2"]) * tokens
        # equal FLOPs: within one scratch step of the grown run's training FLOPs
        step = arms["scratch_flops"]["flops"] / arms["scratch_flops"]["steps"]
        assert abs(arms["scratch_flops"]["flops"] - arms["top"]["flops"]) <= step / 2 + 1e-6 * step
        # top, last and even are continued arms of their candidate; the gain is stay minus the arm
        for arm in ("top", "last", "even"):
            point = arms[arm]["point"]
            assert run["candidate_gain_continued"][point] == (
                arms["stay"]["held_out_loss"] - arms[arm]["held_out_loss"]
            )
        assert arms["stay"]["point"] is None and arms["stay"]["init"] == "none"
        assert all(torch.isfinite(torch.tensor(v["held_out_loss"])) for v in arms.values())
        # every score of every candidate, oriented as a predicted drop, and its rho with the drop
        by_point = {c["point"]: c for c in run["advice"]["ranked"]}
        for point in run["candidates"]:
            scores = run["candidate_scores"][point]
            assert scores["cross_frob2"] == by_point[point]["cross_frob2"]
            assert scores["gain_sgd"] == -by_point[point]["predicted_change_sgd"]
            assert scores["gain_adam"] == -by_point[point]["predicted_change_adam"]
            assert scores["signal_fraction"] == by_point[point]["signal_fraction"]
            assert scores["curvature_gain"] == pytest.approx(
                scores["grad_sq"] ** 2 / (2 * scores["ghg"]), rel=1e-12
            )
    for check, (key, blocks_only) in CHECKS.items():
        for name in SCORES:
            pooled = record["summary"]["scores"][check][name]
            rhos = []
            for r in record["runs"]:
                points = [c for c in r["candidates"] if not (blocks_only and c == "model.embed_tokens")]
                xs = [r["candidate_scores"][c][name] for c in points]
                rhos.append(scipy.stats.spearmanr(xs, [r[key][c] for c in points])[0])
            assert pooled["rho_per_seed"] == pytest.approx(rhos, abs=1e-12)
            assert pooled["mean_rho"] == pytest.approx(sum(rhos) / len(rhos), abs=1e-12)
            assert pooled["p_sign_flip"] == paired_test([v for v in rhos if v == v])
            best = [
                max(points, key=lambda c: r["candidate_scores"][c][name])
                == max(points, key=lambda c: r[key][c])
                for r in record["runs"]
                for points in [
                    [c for c in r["candidates"] if not (blocks_only and c == "model.embed_tokens")]
                ]
            ]
            assert pooled["top_is_best"] == sum(best)
    by_candidate = record["summary"]["gain_continued_by_candidate"]
    for point, v in by_candidate.items():
        gains = [r["candidate_gain_continued"][point] for r in record["runs"]]
        assert v["mean"] == pytest.approx(sum(gains) / len(gains), abs=1e-15)
        assert (
            v["min"] == min(gains) and v["max"] == max(gains) and v["positive"] == sum(g > 0 for g in gains)
        )
        assert v["best"] == sum(
            max(r["candidates"], key=lambda c: r["candidate_gain_continued"][c]) == point
            for r in record["runs"]
        )
    agreement = [
        scipy.stats.spearmanr(
            [r["candidate_drop"][c] for c in r["candidates"]],
            [r["candidate_gain_continued"][c] for c in r["candidates"]],
        )[0]
        for r in record["runs"]
    ]
    assert record["summary"]["drop_vs_gain_continued"]["mean_rho"] == pytest.approx(
        sum(agreement) / len(agreement), abs=1e-12
    )
    assert "Which candidate" in text and "curvature_gain" in text
    losses = [r["arms"]["top"]["held_out_loss"] for r in record["runs"]]
    summary = record["summary"]["held_out_loss"]["top"]
    assert summary["mean"] == pytest.approx(sum(losses) / 2, rel=1e-12)
    assert "Held-out loss" in text and "Where growth helps" in text and "not a test" in text
    assert "gain over no growth after" in text


def test_continued_gain_replayed_by_hand(quick_run):
    """Seed 0 replayed without the probe, the advisor or any deep copy: the shallow model trained
    steps1 steps (AdamW, warm-up + cosine over steps1 + steps2), then (a) trained on ungrown
    (the stay arm) and (b) grown by a zero layer at a boundary with its AdamW and schedule
    carried, trained steps2 more steps on the next text. The record's losses and gains equal
    the replay's."""
    from fused_stats.demo.corpus import StdlibCorpus
    from fused_stats.demo.models import eval_loss, lr_factor, lr_for

    record, _ = quick_run
    cfg, run = record["config"], record["runs"][0]
    seed, B, total = run["seed"], cfg["batch_size"], cfg["steps1"] + cfg["steps2"]
    corpus = StdlibCorpus(cfg["seq_len"], probe_windows=cfg["probe_batches"] * B)
    held_out = list(corpus.batches("test", seed, B, cfg["eval_batches"]))
    protocol = fs.GrowthProtocol(run["candidates"], family="layer", init="zero", seed=seed)

    def train(model, opt, sched, start, count):
        model.train()
        for ids in corpus.batches("train", seed, B, count, start=start * B):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        model.eval()

    def replay(point):
        model = build_llama(cfg["width"], cfg["depth"], cfg["seq_len"], seed)
        opt = torch.optim.AdamW(
            model.parameters(), lr=lr_for(cfg["width"], cfg["base_lr"]), betas=(0.9, 0.95), weight_decay=0.0
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(min(s, total - 1), total))
        train(model, opt, sched, 0, cfg["steps1"])
        assert eval_loss(model, held_out) == pytest.approx(run["shallow_held_out_loss"], abs=1e-12)
        if point is not None:
            fs.grow(model, protocol, at=[point], optimizer=opt)
        train(model, opt, sched, cfg["steps1"], cfg["steps2"])
        return eval_loss(model, held_out)

    stay = replay(None)
    assert run["arms"]["stay"]["held_out_loss"] == pytest.approx(stay, abs=1e-9)
    # the drop of a zero layer trained alone: only its parameters, a fresh AdamW without schedule
    point = run["candidates"][1]
    model = build_llama(cfg["width"], cfg["depth"], cfg["seq_len"], seed)
    lr = lr_for(cfg["width"], cfg["base_lr"])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(min(s, total - 1), total))
    train(model, opt, sched, 0, cfg["steps1"])
    base = eval_loss(model, held_out)
    new = set(fs.grow(model, protocol, at=[point]).new_parameters)
    for name, param in model.named_parameters():
        param.requires_grad_(name in new)
    alone = torch.optim.AdamW(
        [q for n, q in model.named_parameters() if n in new], lr=lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    train(
        model,
        alone,
        torch.optim.lr_scheduler.LambdaLR(alone, lambda s: 1.0),
        cfg["steps1"],
        cfg["short_steps"],
    )
    assert run["candidate_drop"][point] == pytest.approx(base - eval_loss(model, held_out), abs=1e-9)
    for point in (run["candidates"][0], run["candidates"][-1]):
        grown = replay(point)
        assert run["candidate_gain_continued"][point] == pytest.approx(stay - grown, abs=1e-9)


def test_saturated_everywhere_grows_nothing(tmp_path, monkeypatch):
    """advice.top None (saturated everywhere): the "top" and "copy" arms are the shallow model
    trained on, not grown: same loss, the shallow model's FLOPs per token, init "none"."""
    from fused_stats.api.growth.advise import Advice
    from fused_stats.demo.growth import GrowthDemoConfig, run_growth_demo

    monkeypatch.setattr(Advice, "top", property(lambda self: None))
    monkeypatch.setattr(Advice, "saturated_everywhere", property(lambda self: True))
    # record what the scorers return, to check the demo files the symmetric split score and the gain
    returned = {}
    real_split, real_curvature = fs.split_adam_score, fs.curvature_gain

    def split(model, protocol, point, *rest):
        returned[("split", point)] = result = real_split(model, protocol, point, *rest)
        return result

    def curvature(model, protocol, point, *rest):
        returned[("curvature", point)] = result = real_curvature(model, protocol, point, *rest)
        return result

    monkeypatch.setattr(fs, "split_adam_score", split)
    monkeypatch.setattr(fs, "curvature_gain", curvature)
    cfg = GrowthDemoConfig.quick(
        seeds=(0,), steps1=2, steps2=2, short_steps=1, probe_batches=3, curvature_batches=3, eval_batches=1
    )
    lines = []
    record = run_growth_demo(cfg, tmp_path, echo=lines.append)
    arms = record["runs"][0]["arms"]
    assert arms["top"]["point"] is None and arms["copy"]["point"] is None
    assert arms["top"]["init"] == arms["copy"]["init"] == "none"
    assert arms["top"]["held_out_loss"] == arms["copy"]["held_out_loss"] == arms["stay"]["held_out_loss"]
    shallow = build_llama(cfg.width, cfg.depth, cfg.seq_len, 0)
    tokens = (cfg.steps1 + cfg.steps2) * cfg.batch_size * cfg.seq_len
    assert arms["top"]["flops"] == pytest.approx(training_flops_per_token(shallow) * tokens, rel=1e-12)
    assert any("advisor top none (saturated everywhere: no growth)" in line for line in lines)
    # the verdict on that seed says how many boundaries gained after continued training anyway
    gains = record["runs"][0]["candidate_gain_continued"]
    said = [line for line in lines if "seed 0 was saturated everywhere" in line]
    assert len(said) == 1
    if any(v > 0 for v in gains.values()):
        assert f"at {sum(v > 0 for v in gains.values())} of {len(gains)} boundaries" in said[0]
        assert f"{max(gains.values()):+.4f} at {max(gains, key=gains.get)}" in said[0]
    else:
        assert "no zero layer gained" in said[0]
    run = record["runs"][0]
    for point in run["candidates"]:
        scores, result = run["candidate_scores"][point], returned[("split", point)]
        assert scores["split_adam"] == (result.a_on_b + result.b_on_a) / 2 and result.a_on_b != result.b_on_a
        assert scores["curvature_gain"] == returned[("curvature", point)].gain
        assert returned[("curvature", point)].n == cfg.curvature_batches * cfg.batch_size
        assert result.n_a + result.n_b == cfg.probe_batches * cfg.batch_size


def test_paired_sign_flip_test():
    assert paired_test([1.0, 2.0, 3.0]) == 0.25  # only all + and all - reach |sum| = 6
    diffs = [0.3, -0.1, 0.2, 0.05]
    sums = [abs(sum(s * d for s, d in zip(signs, diffs))) for signs in itertools.product((1, -1), repeat=4)]
    assert paired_test(diffs) == sum(v >= abs(sum(diffs)) - 1e-12 for v in sums) / 16


def test_stratified_rank_test_against_brute_force():
    """Exact: every joint within-seed permutation of the drops, the mean of scipy's per-seed rho
    (ties included); the random branch agrees within its Monte Carlo error."""
    gen = torch.Generator().manual_seed(3)
    groups = [
        (torch.randn(3, generator=gen).tolist(), torch.randn(3, generator=gen).tolist()),
        ([0.5, 0.1, 0.1, 0.9], torch.randn(4, generator=gen).tolist()),
    ]

    def mean_rho(ys_list):
        return sum(scipy.stats.spearmanr(xs, ys)[0] for (xs, _), ys in zip(groups, ys_list)) / len(groups)

    observed = mean_rho([ys for _, ys in groups])
    null = [
        mean_rho([list(a), list(b)])
        for a in itertools.permutations(groups[0][1])
        for b in itertools.permutations(groups[1][1])
    ]
    expected_p = sum(abs(v) >= abs(observed) - 1e-12 for v in null) / len(null)
    rho, p = stratified_rank_test(groups)
    assert rho == pytest.approx(observed, abs=1e-12) and p == pytest.approx(expected_p, abs=1e-12)
    assert len(null) == 144 and 0 < p < 1
    rho_mc, p_mc = stratified_rank_test(groups, permutations=100, seed=1)  # 144 > 100: random branch
    assert rho_mc == rho and abs(p_mc - expected_p) < 0.15
    # a constant side or fewer than 3 pairs leaves its group out; none left: undefined
    assert stratified_rank_test(groups + [([1.0, 1.0, 1.0], [0.3, 0.2, 0.1])]) == (rho, p)
    assert stratified_rank_test(groups + [([0.1, 0.2], [0.4, 0.3])]) == (rho, p)
    nan_rho, nan_p = stratified_rank_test([([1.0, 1.0, 1.0], [0.3, 0.2, 0.1])])
    assert nan_rho != nan_rho and nan_p != nan_p


def test_flops_per_token_counts_blocks_and_head():
    width, depth = 32, 3
    model = build_llama(width, depth, 64, seed=0)
    d, f, V = width, 4 * width, 256
    per_layer = 4 * d * d + 3 * d * f + 2 * d  # q, k, v, o; gate, up, down; two RMSNorms
    assert training_flops_per_token(model) == 6 * (depth * per_layer + d + V * d)


def test_plan_counts_the_tangent(capsys):
    assert main(["plan", "--dim", "4096", "--points", "32", "--tangent", "11008"]) == 0
    text = capsys.readouterr().out
    assert "r = 15104 features" in text and "C is 4096 x 15104" in text
    # the new layers the probe keeps: LLaMA-7B's 202,383,360 parameters a layer (6.74e9 total,
    # minus 2 x 32000 x 4096 embeddings and the final norm, over 32 layers), 12.44 GiB in bf16 for
    # the 33 candidates (32 block outputs and the input boundary)
    assert "33 candidates" in text and "202.4M parameters each" in text and "12.44 GiB in bf16" in text
    assert "about 4 training steps' compute per candidate and batch (132 per batch for all 33)" in text
    # against the state of a live tangent probe (fp32 tiny LLaMA, with and without projection)
    cfg = transformers.LlamaConfig(
        vocab_size=30,
        hidden_size=12,
        intermediate_size=20,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    for projection in (None, 7):
        protocol = fs.GrowthProtocol(["model.layers.0"], projection=projection)
        probe = fs.Probe(model, points=["model.layers.0"], cross=protocol)
        probe.step({"input_ids": torch.randint(0, 30, (3, 6))}, fs.causal_lm_loss)
        acc = probe.cross_stats["model.layers.0"]
        t = plan_tangent(12, 20, 1, projection=projection, streams=1)
        assert t["rank"] == acc.rank and t["features"] == acc.in_dim == 32
        assert t["c_sum_bytes"] == acc.c_sum.numel() * acc.c_sum.element_size()
        held = 0 if acc.w_in is None else acc.w_in.numel() * acc.w_in.element_size()
        assert t["w_in_bytes"] == held and (acc.w_in is None) == (projection is None)
        assert t["per_accumulator"] == 8 * (acc.c_sum.numel() + 4) + held
        # the kept new layer: fewer parameters than the bound with one KV head of two
        kept = sum(p.numel() for p in probe.cross.blocks["model.layers.0"].parameters())
        assert kept == t["block_params"] - 2 * 12 * 6  # k_proj, v_proj are 12 x 6, not 12 x 12


def test_depth_ladder_quick(tmp_path):
    """grow-demo --ladder --quick: one layer a rung, the stay arm's steps at equal FLOPs (explicit
    parameter counts), the realised gain as stay minus grown, rho across rungs against scipy."""
    out = tmp_path / "ladder"
    assert main(["grow-demo", "--ladder", "--quick", "--out", str(out)]) == 0
    record = json.loads((out / "depth_ladder.json").read_text())
    cfg = record["config"]

    def per_token(depth):
        return llama_flops_per_token(cfg["width"], depth)

    assert len(record["runs"]) == 2
    for index, run in enumerate(record["runs"]):
        rungs = run["rungs"]
        assert [g["depth"] for g in rungs] == list(range(1, cfg["rungs"] + 1))
        for g in rungs:
            assert g["stay_steps"] == round(cfg["budget"] * per_token(g["depth"] + 1) / per_token(g["depth"]))
            assert g["realised_gain"] == g["stay_loss"] - g["grown_loss"]
            assert g["saturated_everywhere"] == (g["top_p_adjusted"] > cfg["alpha"])
        for name in SCORES:
            xs = [g["scores"][name] for g in rungs]
            ys = [g["realised_gain"] for g in rungs]
            got = record["summary"]["scores"][name]["rho_per_seed"][index]
            assert got == pytest.approx(scipy.stats.spearmanr(xs, ys)[0], abs=1e-12)
    assert "When to stop" in (out / "depth_ladder.md").read_text()


@pytest.mark.filterwarnings("ignore::scipy.stats.ConstantInputWarning")  # the constant score, on purpose
def test_summary_of_synthetic_runs_against_scipy():
    """summarize on made-up runs whose two realised quantities rank the candidates differently:
    each score's mean per-seed rho with each quantity, the drop-vs-gain agreement, the
    per-boundary gains and the arm table, all against scipy and plain arithmetic."""
    from fused_stats.demo.growth import ARMS, GrowthDemoConfig, summarize

    gen = torch.Generator().manual_seed(11)
    candidates = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2"]

    def values():
        return dict(
            zip(candidates, torch.randn(len(candidates), generator=gen, dtype=torch.float64).tolist())
        )

    runs = []
    for seed in range(3):
        run = {
            "seed": seed,
            "candidates": candidates,
            "input_point": "model.embed_tokens",
            "candidate_drop": values(),
            "candidate_gain_continued": values(),
            "candidate_scores": {c: {} for c in candidates},
            "arms": {a: {"held_out_loss": 2 + float(torch.rand((), generator=gen))} for a in ARMS},
            # seed 1: saturated everywhere, so the advisor's top is None, not its first-ranked candidate
            "advice": {"saturated_everywhere": seed == 1, "ranked": [{"point": candidates[seed]}]},
        }
        run["arms"]["top"]["point"] = None if seed == 1 else candidates[seed]
        for name in SCORES:
            for c, v in values().items():
                run["candidate_scores"][c][name] = v
        if seed == 0:  # a constant score: its rho is undefined in this seed
            for c in candidates:
                run["candidate_scores"][c]["curvature_gain"] = 0.5
        runs.append(run)
    summary, lines = summarize(GrowthDemoConfig.quick(depth=3, seeds=(0, 1, 2)), runs)

    def mean_rho(x_key, y_key):  # x_key, y_key: run -> candidate -> value
        return sum(
            scipy.stats.spearmanr([x_key(r)[c] for c in candidates], [y_key(r)[c] for c in candidates])[0]
            for r in runs
        ) / len(runs)

    for check, (key, blocks_only) in CHECKS.items():
        points = candidates[1:] if blocks_only else candidates
        per_seed = {
            name: [
                scipy.stats.spearmanr(
                    [r["candidate_scores"][c][name] for c in points], [r[key][c] for c in points]
                )[0]
                for r in runs
            ]
            for name in SCORES
        }
        assert per_seed["curvature_gain"][0] != per_seed["curvature_gain"][0]  # NaN
        for name in SCORES:
            got = summary["scores"][check][name]
            defined = [v for v in per_seed[name] if v == v]
            assert got["mean_rho"] == pytest.approx(sum(defined) / len(defined), abs=1e-12)
            assert got["seeds_defined"] == len(defined) and got["positive_seeds"] == sum(
                v > 0 for v in defined
            )
            best = sum(
                max(points, key=lambda c: r["candidate_scores"][c][name])
                == max(points, key=lambda c: r[key][c])
                for r in runs
                if name != "curvature_gain" or r["seed"] != 0  # a constant score has no top
            )
            assert got["top_is_best"] == best
            # the difference to the default's rho, seed by seed; seeds where either is NaN left out
            minus = [a - b for a, b in zip(per_seed[name], per_seed["cross_frob2"]) if a == a and b == b]
            if name == "cross_frob2":
                assert got["minus_default"] is None
            else:
                assert got["minus_default"]["mean"] == pytest.approx(sum(minus) / len(minus), abs=1e-12)
                assert got["minus_default"]["p_sign_flip"] == paired_test(minus)
    drops_vs_gains = mean_rho(lambda r: r["candidate_drop"], lambda r: r["candidate_gain_continued"])
    assert summary["drop_vs_gain_continued"]["mean_rho"] == pytest.approx(drops_vs_gains, abs=1e-12)
    assert abs(drops_vs_gains) < 0.99  # the two quantities differ, so a swap would be seen
    for c in candidates:
        gains = [r["candidate_gain_continued"][c] for r in runs]
        assert summary["gain_continued_by_candidate"][c]["mean"] == pytest.approx(sum(gains) / 3, abs=1e-15)
    stay = [r["arms"]["stay"]["held_out_loss"] - r["arms"]["scratch_flops"]["held_out_loss"] for r in runs]
    assert summary["paired_vs_scratch_flops"]["stay"]["mean"] == pytest.approx(sum(stay) / 3, abs=1e-15)
    assert summary["saturated_everywhere"] == [False, True, False]
    assert any("saturated everywhere in 1 of 3 seeds" in line for line in lines)
    skipped = runs[1]
    first = skipped["candidate_gain_continued"][candidates[1]]
    top = skipped["arms"]["stay"]["held_out_loss"] - skipped["arms"]["top"]["held_out_loss"]
    said = [line for line in lines if "first-ranked candidate was not Holm-significant" in line]
    assert len(said) == 1 and "in 1 of 3 seeds (1)" in said[0]
    assert f"gained {first:+.4f} on average after continued training, the advisor's top {top:+.4f}" in said[0]
