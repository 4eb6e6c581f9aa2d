"""The pre-registered claims of ``grow-demo`` (docs/grow_demo_confirm.md), read from its JSON.

Role: turn two ``growth_demo.json`` dicts, the exploratory run (seeds 0–9) and a confirmatory one
(seeds never used in development), into one row per claim with both sets' effect and p-value and
the confirmatory status. A directional claim is *confirmed* when the confirmatory effect has the
claimed sign and p < α; a null claim ("no score does X") is *contradicted* when some effect has
the excluded sign with p < α, else *not contradicted*. The directional p-values are also Holm
adjusted as one family (:func:`fused_stats.api.growth.advise.holm`). The paired tests are
``growth.paired_test`` (exact sign-flip over seeds), the rank tests those the JSON holds.
:func:`write_confirm` is what ``grow-demo --confirm`` prints and writes (confirm.md, confirm.json).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import FusedStatsError

ALPHA = 0.05
# pre-registered in docs/grow_demo_confirm.md; never used in development
CONFIRM_SEEDS = tuple(range(100, 110))
EXPLORATORY_JSON = Path(__file__).resolve().parents[2] / "bench" / "results" / "grow_demo_scores_cpu.json"
GAIN_CHECKS = ("gain_continued", "gain_continued_blocks")


def _score(data, check, score):
    try:
        entry = data["summary"]["scores"][check][score]
    except KeyError:
        raise FusedStatsError(f"growth_demo.json has no summary.scores.{check}.{score}") from None
    return entry["mean_rho"], entry["p_stratified_permutation"]


def _paired(diffs):
    from .growth import paired_test

    return sum(diffs) / len(diffs), paired_test(diffs)


def _arms_diff(data, a, b):
    return _paired([r["arms"][a]["held_out_loss"] - r["arms"][b]["held_out_loss"] for r in data["runs"]])


def _block_gains(data):
    out = []
    for r in data["runs"]:
        gains = [v for k, v in r["candidate_gain_continued"].items() if k != r["input_point"]]
        out.append(sum(gains) / len(gains))
    return _paired(out)


def _input_gain(data):
    return _paired([r["candidate_gain_continued"][r["input_point"]] for r in data["runs"]])


def _input_best(data):
    by = data["summary"]["gain_continued_by_candidate"]
    point = data["runs"][0]["input_point"]
    top = max(by, key=lambda k: by[k]["mean"])
    n = len(data["runs"])
    return by[point]["best"], top == point and by[point]["best"] >= math.ceil(0.6 * n)


def _nulls(data, checks, key):
    """The most significant effect of the excluded sign over the scores of ``checks``:
    ``(effect, p)`` of the entry with mean > 0 and the smallest p (None, None when no mean > 0)."""
    best = (None, None)
    for check in checks:
        for entry in data["summary"]["scores"][check].values():
            value = entry.get(key) if key else entry
            if not value:
                continue
            mean = value["mean"] if key else value["mean_rho"]
            p = value["p_sign_flip"] if key else value["p_stratified_permutation"]
            if mean is not None and mean > 0 and (best[1] is None or p < best[1]):
                best = (mean, p)
    return best


# (id, claim, kind, sign, reader): kind "directional" (sign "<" or ">"), "null" (an effect with
# sign ">" and p < alpha contradicts it) or "rule" (reader returns (value, holds))
CLAIMS = [
    ("A1", "top ends below scratch_flops", "directional", "<",
     lambda d: (d["summary"]["paired_vs_scratch_flops"]["top"]["mean"],
                d["summary"]["paired_vs_scratch_flops"]["top"]["p_value"])),
    ("A2", "stay ends below scratch_flops", "directional", "<",
     lambda d: (d["summary"]["paired_vs_scratch_flops"]["stay"]["mean"],
                d["summary"]["paired_vs_scratch_flops"]["stay"]["p_value"])),
    ("A3", "the advisor's top beats its last candidate", "directional", "<",
     lambda d: (d["summary"]["top_minus_last"]["mean"], d["summary"]["top_minus_last"]["p_value"])),
    ("A4", "a zero layer at the top candidate beats a copy there", "directional", "<",
     lambda d: _arms_diff(d, "top", "copy")),
    ("B1", "a zero layer gains after the block outputs", "directional", ">", _block_gains),
    ("B2", "a zero layer gains at the input boundary", "directional", ">", _input_gain),
    ("B3", "the input boundary is the best boundary", "rule", None, _input_best),
    ("C1", "cross_frob2 ranks the gain (all 7)", "directional", ">",
     lambda d: _score(d, "gain_continued", "cross_frob2")),
    ("C2", "gain_sgd ranks the gain (all 7)", "directional", ">",
     lambda d: _score(d, "gain_continued", "gain_sgd")),
    ("C3", "gain_adam ranks the gain (all 7)", "directional", ">",
     lambda d: _score(d, "gain_continued", "gain_adam")),
    ("C4", "split_adam ranks the gain (all 7)", "directional", ">",
     lambda d: _score(d, "gain_continued", "split_adam")),
    ("C5", "cross_frob2 ranks the gain (block outputs)", "directional", ">",
     lambda d: _score(d, "gain_continued_blocks", "cross_frob2")),
    ("C6", "split_adam ranks the gain (block outputs)", "directional", ">",
     lambda d: _score(d, "gain_continued_blocks", "split_adam")),
    ("C7", "curvature_gain ranks the gain (block outputs)", "directional", ">",
     lambda d: _score(d, "gain_continued_blocks", "curvature_gain")),
    ("C8", "signal_fraction ranks the gain (block outputs)", "directional", ">",
     lambda d: _score(d, "gain_continued_blocks", "signal_fraction")),
    ("C9", "signal_fraction ranks worse than cross_frob2 (all 7)", "directional", "<",
     lambda d: (d["summary"]["scores"]["gain_continued"]["signal_fraction"]["minus_default"]["mean"],
                d["summary"]["scores"]["gain_continued"]["signal_fraction"]["minus_default"]["p_sign_flip"])),
    ("C10", "null: no score ranks better than cross_frob2", "null", ">",
     lambda d: _nulls(d, GAIN_CHECKS, "minus_default")),
    ("D1", "gain_adam is anti-correlated with the drop alone", "directional", "<",
     lambda d: _score(d, "drop_alone", "gain_adam")),
    ("D2", "null: no score predicts the drop alone", "null", ">", lambda d: _nulls(d, ("drop_alone",), None)),
    ("D3", "null: the drop alone does not predict the gain", "null", ">",
     lambda d: (d["summary"]["drop_vs_gain_continued"]["mean_rho"],
                d["summary"]["drop_vs_gain_continued"]["p_stratified_permutation"])),
]  # fmt: skip


def _status(kind, sign, effect, p) -> str:
    if kind == "rule":
        return "confirmed" if p else "not confirmed"
    hit = effect is not None and p is not None and p < ALPHA and (effect < 0 if sign == "<" else effect > 0)
    if kind == "null":
        return "contradicted" if hit else "not contradicted"
    return "confirmed" if hit else "not confirmed"


def claims_table(exploratory: dict, confirmatory: dict) -> list[dict]:
    """One row per claim of :data:`CLAIMS`: both sets' ``(effect, p)``, the confirmatory status
    and, for directional claims, the Holm-adjusted confirmatory p."""
    from ..api.growth.advise import holm

    seeds_e = {r["seed"] for r in exploratory["runs"]}
    seeds_c = {r["seed"] for r in confirmatory["runs"]}
    if seeds_e & seeds_c:
        raise FusedStatsError(f"confirmatory seeds {sorted(seeds_e & seeds_c)} are exploratory seeds too")
    rows = []
    for cid, text, kind, sign, read in CLAIMS:
        e, c = read(exploratory), read(confirmatory)
        rows.append(
            dict(id=cid, claim=text, kind=kind, exploratory=list(e), confirmatory=list(c),
                 exploratory_status=_status(kind, sign, *e), status=_status(kind, sign, *c), holm=None)
        )  # fmt: skip
    family = [r for r in rows if r["kind"] == "directional"]
    for r, q in zip(family, holm([r["confirmatory"][1] for r in family])):
        r["holm"] = q
    return rows


def default_score(rows: list[dict]) -> str:
    """The pre-registered rule: ``cross_frob2`` stays when C1 and C5 are confirmed and C10 is not
    contradicted; else the score confirmed in both gain checks (in both seed sets) with the larger
    confirmatory block-output ρ; else ``cross_frob2`` with no ranking confirmed."""
    by = {r["id"]: r for r in rows}
    if by["C1"]["status"] == by["C5"]["status"] == "confirmed" and by["C10"]["status"] == "not contradicted":
        return "cross_frob2"
    both = {"split_adam": ("C4", "C6")}  # the only other score with claims in both gain checks
    good = [
        (by[b]["confirmatory"][0], s)
        for s, (a, b) in both.items()
        if all(by[i]["status"] == by[i]["exploratory_status"] == "confirmed" for i in (a, b))
    ]
    return max(good)[1] if good else "cross_frob2 (no score's ranking replicated)"


def claims_lines(rows: list[dict]) -> list[str]:
    """A markdown table of :func:`claims_table`'s rows."""

    def pair(v):
        effect, p = v
        if isinstance(p, bool):
            return f"{effect}, {'holds' if p else 'fails'}"
        return "none" if effect is None else f"{effect:+.4g}, p {p:.3g}"

    out = ["| id | claim | seeds 0–9 | confirmatory | status | Holm p |", "|---|---|---|---|---|---|"]
    for r in rows:
        holm_p = "" if r["holm"] is None else f"{r['holm']:.3g}"
        out.append(
            f"| {r['id']} | {r['claim']} | {pair(r['exploratory'])} | {pair(r['confirmatory'])} | "
            f"{r['status']} | {holm_p} |"
        )
    return out


def confirm_seeds(quick: bool) -> tuple[int, ...]:
    """The pre-registered confirmatory seeds; ``--quick`` (a smoke run) takes the first two."""
    return CONFIRM_SEEDS[:2] if quick else CONFIRM_SEEDS


def load_exploratory(path=None) -> dict:
    """The exploratory ``growth_demo.json`` (default: the committed seeds-0–9 run), checked to
    share no seed with :data:`CONFIRM_SEEDS` before anything runs."""
    path = Path(path) if path is not None else EXPLORATORY_JSON
    try:
        data = json.loads(path.read_text())
        seeds = {r["seed"] for r in data["runs"]}
        data["summary"]["scores"]
    except FileNotFoundError:
        raise FusedStatsError(f"--exploratory {str(path)!r}: no such file (a growth_demo.json)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise FusedStatsError(f"--exploratory {str(path)!r} is not a growth_demo.json ({exc!r})") from None
    if seeds & set(CONFIRM_SEEDS):
        raise FusedStatsError(
            f"--exploratory {str(path)!r} uses the confirmatory seeds {sorted(seeds & set(CONFIRM_SEEDS))}"
        )
    return data


def _saturated(data) -> list[int]:
    return [r["seed"] for r in data["runs"] if r["advice"]["saturated_everywhere"]]


def confirm_summary(exploratory: dict, confirmatory: dict, exploratory_path=None) -> tuple[dict, list[str]]:
    """The claims table, the counts (unadjusted and Holm), the default-score rule's outcome and
    the descriptive verdict (E), as a record and as printable lines."""
    rows = claims_table(exploratory, confirmatory)
    directional = [r for r in rows if r["kind"] != "null"]
    confirmed = [r["id"] for r in directional if r["status"] == "confirmed"]
    holm_kept = [
        r["id"] for r in rows if r["holm"] is not None and r["status"] == "confirmed" and r["holm"] < ALPHA
    ]
    contradicted = [r["id"] for r in rows if r["status"] == "contradicted"]
    default = default_score(rows)
    seeds = [r["seed"] for r in confirmatory["runs"]]
    sat = _saturated(confirmatory)
    record = {
        "exploratory": str(exploratory_path or EXPLORATORY_JSON),
        "exploratory_seeds": [r["seed"] for r in exploratory["runs"]],
        "confirmatory_seeds": seeds,
        "claims": rows,
        "confirmed": confirmed,
        "confirmed_holm": holm_kept,
        "not_confirmed": [r["id"] for r in directional if r["status"] != "confirmed"],
        "contradicted": contradicted,
        "default_score": default,
        "saturated_everywhere_seeds": sat,
    }
    lines = [
        f"grow-demo claims (docs/grow_demo_confirm.md): exploratory seeds {record['exploratory_seeds']} "
        f"vs confirmatory seeds {seeds}",
        "",
        *claims_lines(rows),
        "",
        f"confirmed: {len(confirmed)} of {len(directional)} directional claims ({', '.join(confirmed) or 'none'}); "
        f"{len(holm_kept)} survive Holm (alpha {ALPHA}); not confirmed: {', '.join(record['not_confirmed']) or 'none'}",
        f"null claims contradicted: {', '.join(contradicted) or 'none'}",
        f"default score by the pre-registered rule: {default}",
        f"saturated everywhere in {len(sat)} of {len(seeds)} seeds"
        + (f" ({', '.join(map(str, sat))})" if sat else ""),
    ]
    for seed in sat:
        run = next(r for r in confirmatory["runs"] if r["seed"] == seed)
        gains = run["candidate_gain_continued"]
        lines.append(
            f"  seed {seed}: gain after continued training > 0 at {sum(v > 0 for v in gains.values())} of "
            f"{len(gains)} boundaries: " + ", ".join(f"{k} {v:+.4f}" for k, v in gains.items())
        )
    return record, lines


def write_confirm(exploratory: dict, confirmatory: dict, out, exploratory_path=None, echo=print) -> dict:
    """Print the claims table and write ``confirm.md`` and ``confirm.json`` into ``out``."""
    from ..accumulators.persistence import write_text_atomic

    record, lines = confirm_summary(exploratory, confirmatory, exploratory_path)
    for line in lines:
        echo(line)
    out = Path(out)
    write_text_atomic(out / "confirm.json", json.dumps(record, indent=1, default=float) + "\n")
    write_text_atomic(out / "confirm.md", "# grow-demo --confirm\n\n" + "\n".join(lines) + "\n")
    return record
