"""``fused-stats advise``: rank a growth protocol's candidates from saved probe reports.

The reports must have been written by a probe built with ``cross=GrowthProtocol(...)`` (they
record the protocol and its digest); several reports (e.g. candidates probed in separate runs)
are combined when they share the protocol and were measured on one model (their fingerprints
agree); reports probed with ``unit="position"`` are refused. Writes ``advice.json``, ``advice.md``
and ``advice.png`` to ``--out`` (a folder that holds files is refused without ``--force``) and
prints the markdown; "saturated everywhere" is said plainly. ``--optimizer`` (with ``--lr`` and its
settings): the first-step prediction for that optimizer needs the tangents of a live probe, which
reports do not keep; it says so and prints the per-unit-step numbers (``probe --growth`` with the
same options prints the prediction)."""

from __future__ import annotations

from . import optimizer_args
from .args import check_out_folder, positive_float, positive_int


def register(sub) -> None:
    p = sub.add_parser(
        "advise",
        help="rank growth candidates (saturation test, Holm-Bonferroni) from saved reports",
        description=__doc__.replace("``", "'"),
    )
    p.add_argument("reports", nargs="+", help="report .json files written under one growth protocol")
    p.add_argument("--out", default="fused_stats_out/advice", help="output folder")
    p.add_argument("--alpha", type=positive_float, default=0.05, help="family-wise level of the test")
    p.add_argument(
        "--M",
        type=positive_int,
        default=None,
        help="certificate train size, with --K (default: the protocol's budget, else the report's train n)",
    )
    p.add_argument(
        "--K",
        type=positive_int,
        default=None,
        help="certificate test size, with --M (default: the protocol's budget, else the report's test n)",
    )
    p.add_argument("--no-plot", action="store_true", help="write JSON and markdown only")
    p.add_argument(
        "--force", action="store_true", help="write into an --out folder that is not empty (default: refuse)"
    )
    optimizer_args.add_optimizer_arguments(p)
    p.set_defaults(func=cmd_advise)


def cmd_advise(args) -> int:
    from ..api.growth.advise import advise
    from ..api.report.document import Report

    settings = optimizer_args.optimizer_settings(args)
    out = check_out_folder(args.out, args.force)
    reports = [Report.from_json(p) for p in args.reports]  # a bad file raises before any output
    advice = advise(reports, alpha=args.alpha, M=args.M, K=args.K)
    written = [advice.to_json(out / "advice.json")]
    (out / "advice.md").write_text(advice.to_markdown())
    written.append(out / "advice.md")
    if not args.no_plot:
        written.append(advice.plot(out / "advice.png"))
    print(advice.to_markdown())
    print("wrote " + ", ".join(str(w) for w in written))
    if settings is not None:
        print("\n".join(optimizer_args.unit_step_lines(advice, settings)))
    return 0
