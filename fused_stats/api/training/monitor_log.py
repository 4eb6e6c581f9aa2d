"""Time series of a probe's estimates over training: a JSON-lines log and its trajectory plots.

Role: :class:`MonitorLog` appends, every ``every`` observed steps, one JSON object per line with the
current estimates at every point; :func:`read_monitor_log` reads such a file back and
:func:`plot_monitor_log` draws the trajectories (what ``fused-stats report LOG.jsonl`` shows). No
statistics are computed here: the numbers are the accumulators' finalised estimates
(docs/design.md, section 2): ``mu_norm2 = |μ|²``, ``d_par = |μ|⁴/μᵀΣμ``, ``d_2 = |μ|⁴/tr(Σ²)``,
``d_align = min(d_par, d_2)``, ``AG_max = max_i |q_i|`` and ``AG_mean`` (the depth paper's plateau
indicator), and, when the probe has cross-gradient statistics, ``|C|_F²`` (its unbiased
U-statistic, depth paper) with ``|C|_F`` and the saturation verdict.

Two modes:

* ``window=False`` (default, *cumulative*): each line holds the estimates of everything the
  stream accumulated since the probe started;
* ``window=True``: after each line is written, the stream's accumulators are emptied, so each line
  describes only the last ``every`` steps (a moving picture of a model that changes while it
  trains; needs ``every × batch ≥ 4`` samples per point for the degree-4 estimates).

Line format (``"format": "fused_stats.monitor"``, version 1)::

    {"format": "fused_stats.monitor", "version": 1, "run": str, "step": int, "time": unix seconds,
     "elapsed_s": float, "stream": "train" | "test", "mode": "cumulative" | "window",
     "meta": {...},
     "points": {name: {"n": int, "d_align": float | null, "d_par": ..., "d_2": ..., "mu_norm2": ...,
                       "mu_norm4": ..., "mu_sigma_mu": ..., "trace_sigma2": ..., "ag_max": ...,
                       "ag_mean": ..., and with cross statistics "cross_frob2",
                       "cross_frob2_se", "cross_frob", "p_value", "saturated"}}}

A point with fewer than 4 samples has ``null`` estimates. Non-finite floats are written as the
strings ``"Infinity"`` / ``"-Infinity"`` / ``"NaN"`` (strict JSON, as in probe reports) and read
back as floats. Lines are appended and flushed one by one, so a crashed run keeps every line
written so far. A run's end is written too: :meth:`MonitorLog.close` (or leaving
``with MonitorLog(...) as log:``) writes one more line for the steps observed since the last one
(the last partial window, e.g. steps 101..120 with ``every=50``), so nothing observed is missing
from the log; the training callbacks do the same in ``on_train_end``.

An existing log is never extended by accident: ``MonitorLog`` on a file that already holds lines
raises unless ``mode="append"`` (add lines; pass the old ``run_id`` to continue that run, or
leave it out to start a new run in the same file) or ``mode="overwrite"`` (the file is replaced
at the first line written). Every line carries its run id (``"run"``, random unless given), and
:func:`split_runs` separates the runs of a file; :func:`plot_monitor_log` and
:func:`summary_markdown` take one run (``fused-stats report`` writes a table and a plot per run).

With ``all_reduce=True`` (DDP), every rank must call the log at the same steps: copies of the
accumulators are merged over the process group (the probe's own accumulators stay local, so later
merges count nothing twice) and only rank 0 writes; with ``cross=`` the merged line carries the
merged ``|C|`` fields too.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
import weakref
from pathlib import Path

from ...errors import FusedStatsError
from ..report.schema import decode, encode

FORMAT = "fused_stats.monitor"
VERSION = 1
FIELDS = (
    "n",
    "d_align",
    "d_par",
    "d_2",
    "mu_norm2",
    "mu_norm4",
    "mu_sigma_mu",
    "trace_sigma2",
    "ag_max",
    "ag_mean",
)
WRITE_MODES = (None, "append", "overwrite")
CROSS_FIELDS = ("cross_frob2", "cross_frob2_se", "cross_frob", "p_value", "saturated")
# panels of the trajectory plot: (key, title, log scale)
AXIS_LABELS = {"d_align": "d_align", "ag_max": "AG_max", "cross_frob": "|C|_F"}
PANELS = (
    ("d_align", "d_align = min(d_par, d_2)", True),
    ("ag_max", "AG_max = max_i |q_i|", True),
    ("cross_frob", "|C|_F (cross-gradient)", True),
)


class MonitorLog:
    """Append the probe's current estimates to a JSON-lines file every ``every`` steps.

    Parameters
    ----------
    path : str or Path
        The ``.jsonl`` file (appended to; its folder is created). Ranks other than 0 may pass
        None when ``all_reduce=True``.
    every : int
        Write a line after every ``every``-th observed step.
    window : bool
        False: cumulative estimates; True: empty the stream's accumulators after each line
        (module docstring).
    all_reduce : bool
        Merge the ranks' statistics (a collective) before estimating; rank 0 writes.
    meta : dict, optional
        Copied into every line (e.g. run name, width, learning rate).
    mode : {None, "append", "overwrite"}
        What to do when ``path`` already holds lines: None (default) raises
        :class:`FusedStatsError`, ``"append"`` adds lines, ``"overwrite"`` replaces the file at the
        first line written.
    run_id : str, optional
        Written into every line (default: a random 12-digit hex id); pass a previous run's id with
        ``mode="append"`` to continue that run after a restart.

    Examples
    --------
    >>> with fs.MonitorLog("run.jsonl", every=10) as log:               # doctest: +SKIP
    ...     for batch in loader:
    ...         with probe.observe(loss_reduction="token_mean", log=log):
    ...             model(**batch).loss.backward()
    """

    def __init__(
        self,
        path,
        every: int = 1,
        window: bool = False,
        all_reduce: bool = False,
        meta: dict | None = None,
        group=None,
        mode: str | None = None,
        run_id: str | None = None,
    ):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise FusedStatsError(f"every must be a positive int, got {every!r}")
        if meta is not None and not isinstance(meta, dict):
            raise FusedStatsError(f"meta must be a dict, got {type(meta).__name__}")
        if path is None and not all_reduce:
            raise FusedStatsError(
                "MonitorLog needs a path (None is allowed only for ranks > 0 with all_reduce=True)"
            )
        if mode not in WRITE_MODES:
            raise FusedStatsError(f"mode must be one of {WRITE_MODES}, got {mode!r}")
        if run_id is not None and (not isinstance(run_id, str) or not run_id.strip()):
            raise FusedStatsError(f"run_id must be a non-empty string, got {run_id!r}")
        self.path = None if path is None else Path(path)
        if self.path is not None and mode is None and _holds_lines(self.path):
            raise FusedStatsError(
                f"monitor log {str(self.path)!r} already exists; pass mode='append' to add this "
                "run's lines to it or mode='overwrite' to replace it"
            )
        if self.path is not None and self.path.is_dir():
            raise FusedStatsError(f"monitor log {str(self.path)!r} is a folder, not a file")
        self.mode = mode
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self._replace = mode == "overwrite"
        self.every = every
        self.window = bool(window)
        self.all_reduce = bool(all_reduce)
        self.group = group
        self.meta = dict(meta or {})
        self.count = 0  # observed steps seen
        self.lines = 0  # lines written (by this process)
        self.last: dict | None = None
        self.closed = False
        self._start = time.time()
        # stream -> (weak probe, step) of steps observed since that stream's last line: what
        # close() still owes the file (weak: the log must not keep a finished probe alive)
        self._unwritten: dict[str, tuple] = {}

    def __repr__(self) -> str:
        mode = "window" if self.window else "cumulative"
        return (
            f"MonitorLog({str(self.path)!r}, every={self.every}, {mode}, run={self.run_id!r}, "
            f"lines={self.lines})"
        )

    def observed(self, probe, stream: str = "train", step: int | None = None) -> dict | None:
        """Count one observed step; on every ``every``-th, write a line (returned as a dict)."""
        self._check_open()
        self.count += 1
        if self.count % self.every:
            self._unwritten[stream] = (weakref.ref(probe), self.count if step is None else step)
            return None
        return self.write(probe, stream=stream, step=self.count if step is None else step)

    def write(self, probe, stream: str = "train", step: int | None = None) -> dict:
        """Write one line now with ``stream``'s current estimates (and reset it in window mode)."""
        self._check_open()
        probe.check_stream(stream)
        self._unwritten.pop(stream, None)
        source = self._reduced(probe) if self.all_reduce else probe
        record = {
            "format": FORMAT,
            "version": VERSION,
            "run": self.run_id,
            "step": int(self.count if step is None else step),
            "time": time.time(),
            "elapsed_s": time.time() - self._start,
            "stream": stream,
            "mode": "window" if self.window else "cumulative",
            "meta": dict(self.meta),
            "points": {name: point_record(source, name, stream) for name in probe.points},
        }
        if self._is_writer():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(encode(record), allow_nan=False)
            with open(self.path, "w" if self._replace else "a", encoding="utf-8") as handle:
                handle.write(text + "\n")
                handle.flush()
            self._replace = False
            self.lines += 1
        if self.window:
            # the probe creates fresh accumulators at its next step
            probe.clear_stream(stream)
        self.last = record
        return record

    def close(self) -> list[dict]:
        """End the run: write one line per stream for the steps observed since its last line
        (the partial window at the end of training) and refuse further lines. Returns the
        records written now; closing again does nothing. With ``all_reduce=True`` every rank
        must close (the last lines are merged like any other)."""
        if self.closed:
            return []
        written = []
        try:
            for stream, (ref, step) in list(self._unwritten.items()):
                probe = ref()
                if probe is not None:
                    written.append(self.write(probe, stream=stream, step=step))
        finally:
            self._unwritten.clear()
            self.closed = True
        return written

    def __enter__(self) -> MonitorLog:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # a failed run still gets its last steps written: the file is what is left of it
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise FusedStatsError(
                f"monitor log {str(self.path)!r} was closed (its run ended); open a new "
                "MonitorLog (mode='append') to log more"
            )

    def _is_writer(self) -> bool:
        if not self.all_reduce:
            return True
        import torch.distributed as dist

        rank = dist.get_rank(self.group) if dist.is_available() and dist.is_initialized() else 0
        if rank == 0 and self.path is None:
            raise FusedStatsError("MonitorLog: rank 0 needs a path")
        return rank == 0

    def _reduced(self, probe):
        """A shallow copy of the probe whose accumulators are merged COPIES of the probe's own."""
        from ..state.distributed import all_reduce_probe

        return all_reduce_probe(probe.state_copy(), self.group)


def _holds_lines(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def point_record(probe, name: str, stream: str) -> dict:
    """``{"n", "d_align", ...}`` of one point (null estimates below 4 samples)."""
    acc = probe.table.get(("grad", stream, name))
    n = 0 if acc is None else int(acc.n)
    out = {key: None for key in FIELDS}
    out["n"] = n
    if acc is not None and n >= 4:
        est = acc.estimate().to_dict()
        for key in FIELDS:
            out[key] = est.get(key)
    if probe.cross is not None:
        try:
            sat = probe.saturation(name, stream=stream).to_dict()
        except FusedStatsError:  # no cross samples yet, or too few
            sat = None
        for key in CROSS_FIELDS:
            out[key] = None if sat is None else sat.get(key)
    return out


def read_monitor_log(path) -> list[dict]:
    """The records of a monitor log, in file order (blank lines skipped)."""
    path = Path(path)
    if not path.exists():
        raise FusedStatsError(f"monitor log {str(path)!r} does not exist")
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = decode(json.loads(line))
            except json.JSONDecodeError as exc:
                raise FusedStatsError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
            if not isinstance(record, dict) or record.get("format") != FORMAT:
                raise FusedStatsError(
                    f"{path}:{number}: not a fused_stats monitor record (format "
                    f"{record.get('format') if isinstance(record, dict) else type(record).__name__!r}, "
                    f"expected {FORMAT!r})"
                )
            if (
                record.get("version") != VERSION
                or not isinstance(record.get("points"), dict)
                or not isinstance(record.get("step"), int)
            ):
                raise FusedStatsError(
                    f"{path}:{number}: monitor record version {record.get('version')!r} with "
                    f"keys {sorted(record)}; expected version {VERSION} with an int step and points"
                )
            records.append(record)
    if not records:
        raise FusedStatsError(f"monitor log {str(path)!r} holds no records")
    return records


def is_monitor_log(path) -> bool:
    """True when the first non-blank line of ``path`` is a monitor record (cheap sniff)."""
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    data = json.loads(line)
                    return isinstance(data, dict) and data.get("format") == FORMAT
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return False


def trajectories(records: list[dict], key: str, stream: str | None = None) -> dict[str, tuple]:
    """``{point: (steps, values)}`` of ``key`` (missing / non-finite values are left out)."""
    out: dict[str, tuple[list, list]] = {}
    for record in records:
        if stream is not None and record.get("stream") != stream:
            continue
        for name, point in record["points"].items():
            value = point.get(key)
            steps, values = out.setdefault(name, ([], []))
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                steps.append(record["step"])
                values.append(float(value))
    return out


def split_runs(records: list[dict]) -> dict:
    """``{run id: records}`` in file order. Lines without a run id (logs written before run ids
    existed) form the run ``None``, or, when their step goes backwards (a second run appended to
    the file), the runs ``"unnamed-1"``, ``"unnamed-2"``, ... split at each such restart."""
    runs: dict = {}
    unnamed: list[list[dict]] = []
    for record in records:
        run = record.get("run")
        if run is not None:
            runs.setdefault(run, []).append(record)
        elif unnamed and record["step"] > unnamed[-1][-1]["step"]:
            unnamed[-1].append(record)
        else:
            unnamed.append([record])
    if len(unnamed) == 1:
        return {None: unnamed[0], **runs}
    return {**{f"unnamed-{i}": part for i, part in enumerate(unnamed, 1)}, **runs}


def _one_run(records: list[dict], what: str) -> None:
    runs = split_runs(records)
    if len(runs) > 1:
        raise FusedStatsError(
            f"{what}: the records belong to {len(runs)} runs ({', '.join(map(repr, runs))}); "
            "give one run's records (split_runs)"
        )


def summary_markdown(records: list[dict]) -> str:
    """A markdown table of the first and last logged values of each point (one run)."""
    _one_run(records, "summary_markdown")
    first, last = records[0], records[-1]
    run = f"run {last['run']}, " if last.get("run") else ""
    lines = [
        f"monitor log: {run}{len(records)} records, steps {first['step']} .. {last['step']} "
        f"({last.get('mode', '?')}, stream {last.get('stream', '?')})",
        "",
        "| point | n | d_align (first -> last) | AG_max (first -> last) | ‖C‖_F (last) |",
        "|---|---|---|---|---|",
    ]

    def f(value):
        return "-" if not isinstance(value, (int, float)) or isinstance(value, bool) else f"{value:.4g}"

    for name, point in last["points"].items():
        start = first["points"].get(name, {})
        lines.append(
            f"| {name} | {point.get('n')} | {f(start.get('d_align'))} -> {f(point.get('d_align'))} "
            f"| {f(start.get('ag_max'))} -> {f(point.get('ag_max'))} | {f(point.get('cross_frob'))} |"
        )
    return "\n".join(lines) + "\n"


def _plain_log_labels(ax) -> None:
    """Log-axis tick labels as plain numbers ("2.6", "0.003", "1e-05") instead of matplotlib's
    "2.6×10⁰"; which ticks get a label (minor ones only on a short range) stays matplotlib's."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x, vmin, vmax):
            return f"{x:.2g}"

    ax.yaxis.set_major_formatter(Plain(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def plot_monitor_log(source, path, stream: str | None = None) -> Path:
    """PNG of d_align, AG_max and (when logged) |C|_F per point against the training step.

    ``source``: a log path or the records of :func:`read_monitor_log`, of one run (a log holding
    several runs raises; :func:`split_runs` separates them). Points are coloured from shallow
    (light) to deep (dark); values <= 0 on a log axis are marked on a floor. Returns the written
    path.
    """
    from matplotlib import cm
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from ..report.plots import save_figure

    records = read_monitor_log(source) if isinstance(source, (str, os.PathLike)) else list(source)
    if not records:
        raise FusedStatsError("plot_monitor_log: no records")
    _one_run(
        records,
        f"plot_monitor_log({str(source)!r})"
        if isinstance(source, (str, os.PathLike))
        else "plot_monitor_log",
    )
    panels = [
        (key, title, logy)
        for key, title, logy in PANELS
        if any(v for _, v in trajectories(records, key, stream).values())
    ]
    if not panels:
        raise FusedStatsError(
            "monitor log: no finite d_align / AG_max / |C| values to plot (every point "
            "had fewer than 4 samples at every logged step?)"
        )
    fig = Figure(figsize=(4.6 * len(panels) + 2.2, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    names = list(records[-1]["points"])
    colours = cm.viridis_r([0.15 + 0.8 * i / max(len(names) - 1, 1) for i in range(len(names))])
    for ax, (key, title, logy) in zip(axes, panels):
        series = trajectories(records, key, stream)
        positives = [v for _, values in series.values() for v in values if v > 0]
        # a log axis when there is a positive value; values <= 0 (d_align = 0: no certificate,
        # or a negative unbiased |C|^2) are drawn as triangles on a floor below the smallest one
        floor = min(positives) / 3 if logy and positives else None
        marked = False
        for colour, name in zip(colours, names):
            steps, values = series.get(name, ([], []))
            if not steps:
                continue
            marker = "." if len(steps) < 40 else None
            if floor is None:
                ax.plot(steps, values, marker=marker, color=colour, label=name, linewidth=1.2)
                continue
            shown = [v if v > 0 else float("nan") for v in values]
            ax.plot(steps, shown, marker=marker, color=colour, label=name, linewidth=1.2)
            low = [s for s, v in zip(steps, values) if v <= 0]
            if low:
                marked = True
                ax.plot(low, [floor] * len(low), linestyle="none", marker="v", color=colour, markersize=4)
        if floor is not None:
            ax.set_yscale("log")
            _plain_log_labels(ax)
        ax.set_title(title + ("\n(v on the floor: value <= 0)" if marked else ""), fontsize=10)
        ax.set_ylabel(AXIS_LABELS[key] + (" (log scale)" if floor is not None else ""))
        ax.set_xlabel("training step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:  # beside the panels, never over the curves
        fig.legend(handles, labels, loc="outside right upper", fontsize=7, title="point", title_fontsize=8)
    mode = records[-1].get("mode", "cumulative")
    run = f", run {records[-1]['run']}" if records[-1].get("run") else ""
    fig.suptitle(f"training-time monitoring ({mode} estimates, {len(records)} records{run})", fontsize=11)
    return save_figure(fig, path, dpi=110)
