"""The suite's comparison: tables over runs × points, trends against the labels, plots.

The statistics and their trends are :mod:`fused_stats.api.suite.cells` (relative depths,
the cells, Spearman's ρ per group of runs); their rendering is :mod:`fused_stats.api.suite.markdown`
(the tables) and :mod:`fused_stats.api.suite.plots` (the figures). This module hands all of them on
under the names the runner and callers use.
"""

from __future__ import annotations

from .cells import (
    NOT_DESIGN,
    TREND_LABELS,
    budget_point,
    column_text,
    columns,
    design_labels,
    max_cross_frob2,
    nested,
    pick_point,
    relative_depths,
    run_order,
    run_statistics,
    statistics,
    trend_groups,
    trend_rows,
)
from .markdown import depth_sufficiency, render_markdown
from .plots import (
    PLOTS,
    plot_budgets,
    plot_depth,
    plot_growth,
    plot_saturation,
    plot_steps,
    plot_width,
    render_plots,
)

__all__ = [
    "NOT_DESIGN",
    "PLOTS",
    "TREND_LABELS",
    "budget_point",
    "column_text",
    "columns",
    "depth_sufficiency",
    "design_labels",
    "max_cross_frob2",
    "nested",
    "pick_point",
    "plot_budgets",
    "plot_depth",
    "plot_growth",
    "plot_saturation",
    "plot_steps",
    "plot_width",
    "relative_depths",
    "render_markdown",
    "render_plots",
    "run_order",
    "run_statistics",
    "statistics",
    "trend_groups",
    "trend_rows",
]
