"""Integrations with the tools researchers already train and interpret models with.

* :mod:`fused_stats.integrations.transformers` — ``FusedStatsCallback`` for HF ``Trainer``;
* :mod:`fused_stats.integrations.lightning` — ``FusedStatsLightningCallback`` for Lightning;
* :mod:`fused_stats.api.training.step_logging` — the argument checks, step records and metrics
  the two callbacks share.

Each submodule imports its peer library only when it is imported itself.
"""
