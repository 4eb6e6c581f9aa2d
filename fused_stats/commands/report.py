"""``fused-stats report``: render one or several JSON reports as markdown tables and PNG plots,
and, with ``--sweep width|depth``, a sweep table (median and range over seeds per x value,
Spearman's ρ against x with a permutation p-value) and the sweep plot."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("report", help="render JSON reports to tables and plots (and sweeps)",
                       description=__doc__.replace("``", "'"))
    p.add_argument("reports", nargs="+", help="report .json files (e.g. fused_stats_out/runs/*.json)")
    p.add_argument("--out", default="fused_stats_out/report", help="output folder")
    p.add_argument("--sweep", choices=["width", "depth"], default=None,
                   help="also summarise the reports as a sweep over meta['width'] or meta['depth']")
    p.add_argument("--point", default="last",
                   help="point used by --sweep: last, first, an index or a name (default: last)")
    p.add_argument("--no-plots", action="store_true")
    p.set_defaults(func=cmd_report)


def _stems(paths: list[Path]) -> list[str]:
    """Output names: the file stem, made unique with the parent folder name when stems repeat."""
    stems = [p.stem for p in paths]
    out = []
    for p, stem in zip(paths, stems):
        out.append(f"{p.parent.name}-{stem}" if stems.count(stem) > 1 else stem)
    seen: dict[str, int] = {}
    for i, name in enumerate(out):  # still clashing (same folder names): number them
        if name in seen:
            out[i] = f"{name}-{i}"
        seen[name] = i
    return out


def cmd_report(args) -> int:
    from ..api.report import Report, fmt, plot_sweep, sweep_summary

    paths = [Path(p) for p in args.reports]
    reports = [Report.from_json(p) for p in paths]  # a bad file raises before anything is written
    point = int(args.point) if args.point.lstrip("-").isdigit() else args.point
    out = Path(args.out)
    written = []
    for path, stem, report in zip(paths, _stems(paths), reports):
        written.append(report.to_markdown_file(out / f"{stem}.md"))
        if not args.no_plots:
            written.append(report.plot(out / f"{stem}.png"))
    if len(reports) == 1:
        print(reports[0].to_markdown())
    else:
        print(f"{'report':<28} {'model':<22} {'width':>5} {'depth':>5} {'seed':>4} "
              f"{'points':>6} {'d_align(last)':>14} {'AG_max(last)':>13}")
        for path, report in zip(paths, reports):
            last = report.points[-1]["train"] if report.points else None
            m = report.meta
            print(f"{path.name:<28} {report.model['class']:<22} {fmt(m.get('width')):>5} "
                  f"{fmt(m.get('depth')):>5} {fmt(m.get('seed')):>4} {len(report.points):>6} "
                  f"{fmt(last and last['d_align']):>14} {fmt(last and last['ag_max']):>13}")
    if args.sweep:
        print()
        print(f"== sweep over {args.sweep} ==")
        print(sweep_summary(reports, args.sweep, point))
        if not args.no_plots:
            written.append(plot_sweep(reports, args.sweep, out / f"sweep_{args.sweep}.png", point))
    print("wrote " + ", ".join(str(w) for w in written))
    return 0
