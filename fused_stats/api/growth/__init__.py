"""Acting on the statistics: zero-block insertion and the direct residual intervention."""
