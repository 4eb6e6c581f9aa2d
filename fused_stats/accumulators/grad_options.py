"""The options of a GradStats: its second-moment representation and its unit of sample.

``second_moment``: ``dense`` keeps ``S = Σ y yᵀ`` (d × d), ``pool`` keeps the rows ``Y`` (N × d) and
``G = Y Yᵀ``, ``auto`` keeps a pool while it is no larger, ``N d + N² ≤ d²`` (:func:`auto_pool_limit`),
then turns dense. ``unit``: a sample is a whole sample (its counted positions summed), one position,
or the sample flattened to one vector.
"""

from __future__ import annotations

import math
from typing import Literal

SecondMoment = Literal["auto", "dense", "pool"]
Unit = Literal["sample", "position", "flat"]
SECOND_MOMENTS: tuple[str, ...] = ("auto", "dense", "pool")
UNITS: tuple[str, ...] = ("sample", "position", "flat")


def auto_pool_limit(dim: int) -> int:
    """Largest pool size N with ``N d + N² ≤ d²`` (pool no larger than the dense matrix)."""
    n = int(dim * (math.sqrt(5.0) - 1.0) / 2.0)
    while n * dim + n * n > dim * dim:
        n -= 1
    while (n + 1) * dim + (n + 1) ** 2 <= dim * dim:
        n += 1
    return max(n, 0)
