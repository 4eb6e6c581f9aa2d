"""Benchmark suites: one job probes a family of checkpoints on the same windows and compares them.

``spec`` reads and checks the suite file (TOML) and finds the runs and their labels; ``data``
builds the shared windows once per tokenizer and records their SHA-256; ``runner`` executes a
shard of the runs resumably (``runs/<name>.json`` written atomically with its key: suite
file, windows, checkpoint and package version, :mod:`.identity`)
and writes ``suite.json`` when every run is finished; ``compare`` renders ``suite.md`` and the
plots (trends with Spearman's ρ and the exact permutation p-value of
:mod:`fused_stats.accumulators.trends`). docs/design.md, section "Benchmark suites".
"""
