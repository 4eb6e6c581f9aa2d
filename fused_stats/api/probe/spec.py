"""The depth probe's block spec: :class:`CrossSpec` describes the zero-output block
``h(z) = W_out φ(W_in z)`` whose cross-gradient ``C = E[Σ_t q_t φ(W_in z_t)ᵀ]`` the probe measures
(depth paper; docs/design.md, section 2). It lives with the probe, which builds a CrossStats per
point from it; growth (:mod:`fused_stats.api.growth`) inserts the same block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import FusedStatsError
from ...ops.cross_twin import ACTIVATIONS, seeded_w_in

DEFAULT_RANK = 64


@dataclass(frozen=True)
class CrossSpec:
    """The zero-output block probed for depth saturation.

    ``rank`` features ``φ(W_in z)`` with ``W_in`` (rank, d) drawn from N(0, 1/d) with ``seed``
    unless ``w_in`` is given; ``activation`` in ``gelu, relu, silu, tanh, identity, constant``
    (``constant``: φ ≡ 1, i.e. a bias-only block, for which ``C = μ``).

    ``rank`` defaults to :data:`DEFAULT_RANK` (64) without ``w_in`` and to ``w_in``'s row count
    with it; a ``rank`` given together with a ``w_in`` of another row count is an error.
    """

    rank: int | None = None
    activation: str = "gelu"
    seed: int = 0
    w_in: torch.Tensor | None = None

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise FusedStatsError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.rank is not None and (
            not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1
        ):
            raise FusedStatsError(f"rank must be a positive int, got {self.rank!r}")
        if self.w_in is None:
            rank = DEFAULT_RANK if self.rank is None else self.rank
        else:
            if not isinstance(self.w_in, torch.Tensor) or self.w_in.dim() != 2:
                raise FusedStatsError(
                    "w_in must be a tensor of shape (rank, d), got "
                    + (
                        f"shape {tuple(self.w_in.shape)}"
                        if isinstance(self.w_in, torch.Tensor)
                        else type(self.w_in).__name__
                    )
                )
            rows = int(self.w_in.shape[0])
            if self.rank is not None and self.rank != rows:
                raise FusedStatsError(
                    f"CrossSpec(rank={self.rank}, w_in of shape {tuple(self.w_in.shape)}): w_in has "
                    f"{rows} rows, so the block's rank is {rows}; drop rank= or pass a w_in with "
                    f"{self.rank} rows"
                )
            rank = rows
        object.__setattr__(self, "rank", rank)  # frozen: the resolved rank, read by every user

    def projection(self, dim: int, dtype=torch.float32, device=None) -> torch.Tensor:
        """``W_in`` for a stream of width ``dim``."""
        if self.w_in is not None:
            if self.w_in.shape[1] != dim:
                raise FusedStatsError(
                    f"CrossSpec.w_in has shape {tuple(self.w_in.shape)}, the point's width is {dim}"
                )
            return self.w_in.detach().to(dtype=dtype, device=device)
        return seeded_w_in(self.rank, dim, self.seed, dtype).to(device)
