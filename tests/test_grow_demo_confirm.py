"""Tests of the pre-registered grow-demo claims table (fused_stats/demo/confirm.py), on the
exploratory run's own JSON (bench/results/grow_demo_scores_cpu.json) and edited copies of it.

References: paired differences and their exact sign-flip p recomputed here over all 2^10 sign
vectors; Holm's adjustment written out as the step-down maximum; the statuses by hand.
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest

import fused_stats as fs
from fused_stats.demo.confirm import claims_lines, claims_table, default_score

BENCH = Path(__file__).resolve().parents[1] / "bench" / "results" / "grow_demo_scores_cpu.json"


@pytest.fixture(scope="module")
def exploratory():
    return json.loads(BENCH.read_text())


def relabelled(data, offset=100):
    out = copy.deepcopy(data)
    for r in out["runs"]:
        r["seed"] += offset
    return out


def sign_flip(diffs):
    total = abs(sum(diffs))
    hits = sum(abs(sum(s * d for s, d in zip(signs, diffs))) >= total - 1e-12
               for signs in itertools.product((1, -1), repeat=len(diffs)))  # fmt: skip
    return hits / 2 ** len(diffs)


def by_id(rows):
    return {r["id"]: r for r in rows}


def test_the_exploratory_run_against_itself(exploratory):
    rows = by_id(claims_table(exploratory, relabelled(exploratory)))
    diffs = [
        r["arms"]["top"]["held_out_loss"] - r["arms"]["copy"]["held_out_loss"] for r in exploratory["runs"]
    ]
    assert rows["A4"]["confirmatory"][0] == pytest.approx(sum(diffs) / len(diffs), rel=1e-12)
    assert rows["A4"]["confirmatory"][1] == pytest.approx(sign_flip(diffs), rel=1e-12)
    gains = [
        sum(v for k, v in r["candidate_gain_continued"].items() if k != "model.embed_tokens") / 6
        for r in exploratory["runs"]
    ]
    assert rows["B1"]["confirmatory"][0] == pytest.approx(sum(gains) / len(gains), rel=1e-12)
    assert rows["B1"]["confirmatory"][1] == pytest.approx(sign_flip(gains)) and min(gains) > 0
    cf2 = exploratory["summary"]["scores"]["gain_continued"]["cross_frob2"]
    assert rows["C1"]["confirmatory"] == [cf2["mean_rho"], cf2["p_stratified_permutation"]]
    # every claim as docs/grow_demo_confirm.md lists it for seeds 0-9
    for cid in ("A1", "A2", "A3", "A4", "B1", "B2", "B3", "C1", "C5", "C8", "C9", "D1"):
        assert rows[cid]["status"] == rows[cid]["exploratory_status"] == "confirmed", cid
    for cid in ("C10", "D2", "D3"):
        assert rows[cid]["status"] == "not contradicted", cid
    assert default_score(list(rows.values())) == "cross_frob2"


def test_holm_over_the_directional_claims(exploratory):
    rows = [r for r in claims_table(exploratory, relabelled(exploratory)) if r["kind"] == "directional"]
    ps = [r["confirmatory"][1] for r in rows]
    m, order, running = len(ps), sorted(range(len(ps)), key=lambda i: ps[i]), 0.0
    expected = [0.0] * m
    for j, i in enumerate(order):
        running = max(running, min(1.0, (m - j) * ps[i]))
        expected[i] = running
    assert [r["holm"] for r in rows] == pytest.approx(expected)
    assert m == 16


def test_failures_are_reported_and_move_the_default(exploratory):
    conf = relabelled(exploratory)
    conf["summary"]["paired_vs_scratch_flops"]["top"].update(mean=0.01, p_value=0.3)
    conf["summary"]["scores"]["gain_continued"]["cross_frob2"].update(
        mean_rho=0.2, p_stratified_permutation=0.2
    )
    conf["summary"]["gain_continued_by_candidate"]["model.embed_tokens"]["best"] = 5
    rows = claims_table(exploratory, conf)
    got = by_id(rows)
    assert got["A1"]["status"] == got["C1"]["status"] == got["B3"]["status"] == "not confirmed"
    assert got["A1"]["exploratory_status"] == "confirmed"
    assert default_score(rows) == "split_adam"
    conf["summary"]["scores"]["gain_continued_blocks"]["split_adam"].update(p_stratified_permutation=0.09)
    assert default_score(claims_table(exploratory, conf)) == "cross_frob2 (no score's ranking replicated)"
    # the switch needs the score confirmed on the exploratory seeds too
    conf["summary"]["scores"]["gain_continued_blocks"]["split_adam"].update(p_stratified_permutation=0.001)
    assert default_score(claims_table(exploratory, conf)) == "split_adam"
    weak = copy.deepcopy(exploratory)
    weak["summary"]["scores"]["gain_continued_blocks"]["split_adam"].update(p_stratified_permutation=0.2)
    assert default_score(claims_table(weak, conf)) == "cross_frob2 (no score's ranking replicated)"
    # best in most seeds, but another boundary has the larger mean gain: B3 fails
    conf["summary"]["gain_continued_by_candidate"]["model.embed_tokens"]["best"] = 9
    assert by_id(claims_table(exploratory, conf))["B3"]["status"] == "confirmed"
    conf["summary"]["gain_continued_by_candidate"]["model.layers.0"]["mean"] = 1.0
    assert by_id(claims_table(exploratory, conf))["B3"]["status"] == "not confirmed"
    # a significant effect the wrong way does not confirm a directional claim
    conf["summary"]["top_minus_last"].update(mean=0.004, p_value=0.01)
    assert by_id(claims_table(exploratory, conf))["A3"]["status"] == "not confirmed"


def test_a_null_is_contradicted_by_a_significant_effect(exploratory):
    conf = relabelled(exploratory)
    conf["summary"]["scores"]["gain_continued_blocks"]["gain_sgd"]["minus_default"].update(
        mean=0.2, p_sign_flip=0.01
    )
    conf["summary"]["drop_vs_gain_continued"].update(mean_rho=0.3, p_stratified_permutation=0.04)
    rows = by_id(claims_table(exploratory, conf))
    assert rows["C10"]["status"] == rows["D3"]["status"] == "contradicted"
    assert rows["C10"]["confirmatory"] == [0.2, 0.01]
    assert default_score(list(rows.values())) != "cross_frob2"  # C10 contradicted: the rule moves on
    lines = claims_lines(list(rows.values()))
    assert len(lines) == 2 + len(rows) and "| C10 |" in lines[2 + 16]


def test_shared_seeds_are_refused(exploratory):
    with pytest.raises(fs.FusedStatsError, match=r"confirmatory seeds \[0, 1"):
        claims_table(exploratory, relabelled(exploratory, offset=0))
    broken = relabelled(exploratory)
    del broken["summary"]["scores"]["drop_alone"]["gain_adam"]
    with pytest.raises(fs.FusedStatsError, match=r"summary\.scores\.drop_alone\.gain_adam"):
        claims_table(exploratory, broken)


def test_the_confirm_flag_and_its_preregistered_seeds(exploratory):
    from fused_stats.cli import build_parser
    from fused_stats.demo.confirm import CONFIRM_SEEDS, EXPLORATORY_JSON, confirm_seeds

    args = build_parser().parse_args(["grow-demo", "--confirm", "--exploratory", "x.json"])
    assert args.confirm and args.exploratory == "x.json"
    assert not build_parser().parse_args(["grow-demo"]).confirm
    # docs/grow_demo_confirm.md: "Seeds 100–109 (10 seeds, as many as the exploratory set)"
    assert CONFIRM_SEEDS == (100, 101, 102, 103, 104, 105, 106, 107, 108, 109)
    assert confirm_seeds(True) == (100, 101) and confirm_seeds(False) == CONFIRM_SEEDS
    assert "**Seeds 100–109**" in (BENCH.parents[2] / "docs" / "grow_demo_confirm.md").read_text()
    assert not set(CONFIRM_SEEDS) & {r["seed"] for r in exploratory["runs"]}
    assert {r["seed"] for r in exploratory["runs"]} == set(range(10)) and EXPLORATORY_JSON == BENCH


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--exploratory", "x.json"], "--exploratory is read by --confirm only"),
        (["--confirm", "--seeds", "3"], "no --seeds"),
        (["--confirm", "--ladder"], "no --ladder"),
        (["--confirm", "--exploratory", "missing.json"], "no such file"),
        (["--confirm", "--exploratory", "shared.json"], "uses the confirmatory seeds [100]"),
    ],
)
def test_confirm_refusals_write_nothing(argv, needle, exploratory, tmp_path, capsys, monkeypatch):
    from fused_stats.cli import main

    monkeypatch.chdir(tmp_path)
    shared = copy.deepcopy(exploratory)
    shared["runs"][3]["seed"] = 100
    (tmp_path / "shared.json").write_text(json.dumps(shared))
    assert main(["grow-demo", "--quick", "--out", "o", *argv]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_quick_confirm_run_writes_the_table(exploratory, tmp_path, capsys):
    from fused_stats.cli import main

    out = tmp_path / "c"
    assert main(["grow-demo", "--confirm", "--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads((out / "growth_demo.json").read_text())
    assert [r["seed"] for r in record["runs"]] == [100, 101]
    conf = json.loads((out / "confirm.json").read_text())
    assert conf["confirmatory_seeds"] == [100, 101] and conf["exploratory_seeds"] == list(range(10))
    rows = by_id(conf["claims"])
    assert len(rows) == 20
    # A1 by hand from the confirmatory run's arms; the exploratory column from the committed JSON
    diffs = [
        r["arms"]["top"]["held_out_loss"] - r["arms"]["scratch_flops"]["held_out_loss"]
        for r in record["runs"]
    ]
    assert rows["A1"]["confirmatory"] == pytest.approx([sum(diffs) / 2, sign_flip(diffs)])
    top = exploratory["summary"]["paired_vs_scratch_flops"]["top"]
    assert rows["A1"]["exploratory"] == pytest.approx([top["mean"], top["p_value"]])
    for cid, row in rows.items():
        effect, p = row["confirmatory"]
        hit = p is not None and effect is not None and not isinstance(p, bool) and p < 0.05
        if row["kind"] == "directional":
            want = (
                "confirmed"
                if hit and (effect < 0) == (cid in ("A1", "A2", "A3", "A4", "C9", "D1"))
                else "not confirmed"
            )
            assert row["status"] == want, cid
    assert conf["default_score"].startswith("cross_frob2")
    assert set(conf["confirmed"]) | set(conf["not_confirmed"]) == set(rows) - {"C10", "D2", "D3"}
    md = (out / "confirm.md").read_text()
    for cid in rows:
        assert f"| {cid} |" in md and f"| {cid} |" in printed
    assert f"default score by the pre-registered rule: {conf['default_score']}" in md


# seven directional claims with given (effect, p); A1 significant the wrong way; a rule and a null
# claim outside the Holm family
GIVEN = {
    "C1": (">", 0.3, 0.001),
    "A1": ("<", 0.1, 0.002),
    "C5": (">", 0.2, 0.011),
    "C4": (">", 0.25, 0.012),
    "C6": (">", 0.22, 0.0125),
    "A2": ("<", -0.05, 0.04),
    "A3": ("<", -0.05, 0.3),
}


def given_claims(given=GIVEN):
    rows = [
        (cid, cid, "directional", sign, lambda d, e=e, p=p: (e, p)) for cid, (sign, e, p) in given.items()
    ]
    rows.append(("B3", "a rule", "rule", None, lambda d: (7, True)))
    rows.append(("C10", "a null", "null", ">", lambda d: (0.3, 0.001)))
    return rows


def test_confirmed_holm_is_the_holm_step_down_by_hand(exploratory, tmp_path, monkeypatch):
    import fused_stats.demo.confirm as confirm

    monkeypatch.setattr(confirm, "CLAIMS", given_claims())
    record = confirm.write_confirm(exploratory, relabelled(exploratory), tmp_path, echo=lambda line: None)
    assert json.loads((tmp_path / "confirm.json").read_text()) == json.loads(json.dumps(record))
    # Holm by hand over the m = 7 directional p-values, ascending: 0.001 (x7), 0.002 (x6), 0.011
    # (x5 = 0.055 >= 0.05: the step-down stops here), then each adjusted p is the running maximum
    holm = {"C1": 7 * 0.001, "A1": 6 * 0.002, "C5": 5 * 0.011, "C4": 5 * 0.011, "C6": 5 * 0.011}
    holm.update(A2=2 * 0.04, A3=0.3)
    rows = by_id(record["claims"])
    assert {cid: rows[cid]["holm"] for cid in holm} == pytest.approx(holm, rel=1e-12)
    assert rows["B3"]["holm"] is None and rows["C10"]["holm"] is None
    # rejected by Holm: C1 and A1 (p below 0.05/7 and 0.05/6); A1's effect has the wrong sign.
    # C6's 3 x 0.0125 < 0.05 does not count: the step-down stopped at C5
    assert record["confirmed_holm"] == ["C1"]
    assert record["confirmed"] == ["C1", "C5", "C4", "C6", "A2", "B3"]
    assert rows["C10"]["status"] == "contradicted" and record["contradicted"] == ["C10"]
    # the Holm column of confirm.md shows the same numbers, and the count line says one survives
    md = (tmp_path / "confirm.md").read_text()
    for cid, value in holm.items():
        line = next(x for x in md.splitlines() if x.startswith(f"| {cid} |"))
        assert float(line.rstrip(" |").rsplit("|", 1)[1]) == pytest.approx(value, rel=1e-3), cid
    assert "1 survive Holm (alpha 0.05)" in md


def test_a_holm_p_of_exactly_alpha_does_not_survive(exploratory, monkeypatch):
    import fused_stats.demo.confirm as confirm

    # m = 5: 0.001 x 5 = 0.005 survives; 0.0125 x 4 = 0.05 exactly (x4 is exact in binary) does
    # not: the pre-registered rule is p < alpha, for the unadjusted and the Holm-adjusted p alike
    given = {"C1": (">", 0.3, 0.001), "C5": (">", 0.2, 0.0125), "C4": (">", 0.2, 0.02)}
    given.update(C6=(">", 0.2, 0.03), A1=("<", -0.1, 0.3))
    monkeypatch.setattr(confirm, "CLAIMS", given_claims(given))
    record, _ = confirm.confirm_summary(exploratory, relabelled(exploratory))
    assert by_id(record["claims"])["C5"]["holm"] == 0.05
    assert record["confirmed_holm"] == ["C1"]
    assert record["confirmed"] == ["C1", "C5", "C4", "C6", "B3"]
