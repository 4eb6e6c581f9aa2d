"""The user-facing layer, grouped by what a user does (bottom to top): ``report`` (documents,
markdown, plots, sweeps); ``probe`` (the driver, its accumulator table, hooks, points, feature
axis, losses, CrossSpec); ``training``, ``state``, ``growth`` and ``streaming`` above the probe.
The layers are enforced by the import-linter contracts in pyproject.toml."""
