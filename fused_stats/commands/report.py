"""``fused-stats report``: render one or several JSON reports as markdown tables and PNG plots,
and, with ``--sweep width|depth``, a sweep table (median and range over seeds per x value,
Spearman's ρ against x with a permutation p-value) and the sweep plot. Monitor logs (``.jsonl``
from ``fs.MonitorLog``) are summarised and plotted as trajectories over training steps
(d_align, AG_max, |C| per point), one table and one plot per run when a log holds several runs.
Every input is read and checked before anything is written."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import FusedStatsError
from .args import check_out_folder


def register(sub) -> None:
    p = sub.add_parser(
        "report",
        help="render JSON reports to tables and plots (and sweeps)",
        description=__doc__.replace("``", "'"),
    )
    p.add_argument(
        "reports",
        nargs="*",
        help="report .json files (e.g. fused_stats_out/runs/*.json), "
        "or monitor logs (.jsonl) written during training",
    )
    p.add_argument("--out", default="fused_stats_out/report", help="output folder")
    p.add_argument(
        "--force", action="store_true", help="write into an --out folder that is not empty (default: refuse)"
    )
    p.add_argument(
        "--sweep",
        choices=["width", "depth"],
        default=None,
        help="also summarise the reports as a sweep over width or depth: meta['width'] / meta['depth'], "
        "else the model config's hidden_size / num_hidden_layers (default: no sweep)",
    )
    p.add_argument("--point", default="last", help="point used by --sweep: last, first, an index or a name")
    p.add_argument("--no-plots", action="store_true", help="write markdown only, no PNG plots")
    p.add_argument(
        "--suite",
        metavar="DIR",
        default=None,
        help="re-render a suite folder's suite.json, suite.md and plots from its finished runs (default: none)",
    )
    p.set_defaults(func=cmd_report)


def _report_suite(args) -> int:
    from ..api.suite.runner import collect, write_suite

    if args.reports:
        raise FusedStatsError("give report files or --suite DIR, not both")
    out = Path(args.suite)
    suite, pending = collect(out, partial=True)
    written = write_suite(out, suite, plots=not args.no_plots)
    if pending:
        print(f"{len(pending)} run(s) not finished yet, left out: {', '.join(pending)}")
    if suite["failed"]:
        print(f"failed runs: {', '.join(suite['failed'])}")
    print("wrote " + ", ".join(str(w) for w in written))
    return 0


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
    from ..api.report.document import Report, fmt, plot_sweep, sweep_summary

    if args.suite:
        return _report_suite(args)
    if not args.reports:
        raise FusedStatsError("give report .json files, monitor logs, or --suite DIR")
    paths = [Path(p) for p in args.reports]
    logs = [p for p in paths if p.suffix == ".jsonl" or _is_monitor_log(p)]
    if logs:
        return _report_monitor_logs(paths, logs, args)
    from ..api.report.document import SWEEP_CONFIG_KEYS, sweep_rows, sweep_value

    reports = [Report.from_json(p) for p in paths]  # a bad file raises before anything is written
    point = int(args.point) if args.point.lstrip("-").isdigit() else args.point
    if args.sweep:
        missing = [str(p) for p, r in zip(paths, reports) if sweep_value(r, args.sweep) is None]
        if missing:
            raise FusedStatsError(
                f"--sweep {args.sweep} needs meta[{args.sweep!r}] or a config "
                f"{' / '.join(SWEEP_CONFIG_KEYS[args.sweep])} in every report; missing in "
                f"{', '.join(missing)}"
            )
        sweep_rows(reports, args.sweep, point)  # a bad --point raises here, before any output
    out = check_out_folder(args.out, args.force)
    written = []
    for stem, report in zip(_stems(paths), reports):
        written.append(report.to_markdown_file(out / f"{stem}.md"))
        if not args.no_plots:
            written.append(report.plot(out / f"{stem}.png"))
    if len(reports) == 1:
        print(reports[0].to_markdown())
    else:
        print(
            f"{'report':<28} {'model':<22} {'width':>5} {'depth':>5} {'seed':>4} "
            f"{'points':>6} {'d_align(last)':>14} {'AG_max(last)':>13}"
        )
        for path, report in zip(paths, reports):
            last = report.points[-1]["train"] if report.points else None
            m = report.meta
            print(
                f"{path.name:<28} {report.model['class']:<22} {fmt(sweep_value(report, 'width')):>5} "
                f"{fmt(sweep_value(report, 'depth')):>5} {fmt(m.get('seed')):>4} {len(report.points):>6} "
                f"{fmt(last and last['d_align']):>14} {fmt(last and last['ag_max']):>13}"
            )
    if args.sweep:
        print()
        print(f"== sweep over {args.sweep} ==")
        print(sweep_summary(reports, args.sweep, point))
        if not args.no_plots:
            written.append(plot_sweep(reports, args.sweep, out / f"sweep_{args.sweep}.png", point))
    print("wrote " + ", ".join(str(w) for w in written))
    return 0


def _is_monitor_log(path: Path) -> bool:
    from ..api.training.monitor_log import is_monitor_log

    return is_monitor_log(path)


def _report_monitor_logs(paths: list[Path], logs: list[Path], args) -> int:
    """Training-time monitor logs: a first/last table and a trajectory plot per log, and per run
    when a log holds several runs (a file appended to by separate runs)."""
    from ..api.training.monitor_log import plot_monitor_log, read_monitor_log, split_runs, summary_markdown

    if len(logs) != len(paths):
        raise FusedStatsError(
            f"give either report .json files or monitor logs (.jsonl), not both: logs "
            f"{[str(p) for p in logs]}, reports {[str(p) for p in paths if p not in logs]}"
        )
    records = [read_monitor_log(p) for p in logs]  # a bad file raises before anything is written
    out = check_out_folder(args.out, args.force)
    written = []
    for path, stem, recs in zip(logs, _stems(logs), records):
        runs = split_runs(recs)
        for number, (run, run_records) in enumerate(runs.items(), 1):
            if len(runs) == 1:
                print(f"== {path} ==")
                name = stem
            else:
                print(f"== {path}: run {number} of {len(runs)} (id {run}) ==")
                tag = re.sub(r"[^A-Za-z0-9_.-]", "_", str(run)) if run else ""
                name = f"{stem}-run{number}" + (f"-{tag}" if tag else "")
            print(summary_markdown(run_records))
            if not args.no_plots:
                written.append(plot_monitor_log(run_records, out / f"{name}.png"))
    if written:
        print("wrote " + ", ".join(str(w) for w in written))
    return 0
