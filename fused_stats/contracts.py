"""The data contract between the ops layer, the Triton kernels and their torch twins.

What a capture-reduce pass (:class:`BatchSums`) and a cross-gradient pass (:class:`CrossBatch`)
return, the accepted units and activations, and :func:`tuple_sums`, the closed forms both
cross-gradient implementations use. A leaf module: it imports nothing from the package, so the
kernels and the twins can share it without either importing the ops layer above them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

F64 = torch.float64
UNITS_CAPTURED = ("sample", "position")
ACTIVATIONS = ("gelu", "relu", "silu", "tanh", "identity", "constant")
DEFAULT_GROUP_SIZE = 256


@dataclass
class BatchSums:
    """What one capture-reduce pass returns; all sums are float64 on the input's device."""

    rows: torch.Tensor  # (R, d) centred vectors; R = B ("sample") or B*T ("position")
    valid: torch.Tensor  # (R,) bool: which rows are samples
    n: int
    s: torch.Tensor  # (d,)
    t: torch.Tensor  # (d,)
    a1: torch.Tensor  # ()
    a2: torch.Tensor  # ()
    norm_max: torch.Tensor  # ()
    norm_sum: torch.Tensor  # ()

    def valid_rows(self) -> torch.Tensor:
        """The sample rows only, as float64 (what a pool stores)."""
        return self.rows[self.valid].to(torch.float64)


@dataclass
class CrossBatch:
    n: int
    c_sum: torch.Tensor  # (d, r) fp64
    sq_norm_sum: torch.Tensor  # () fp64
    u2: torch.Tensor  # () fp64: Σ_{i≠j} k_ij² within groups
    u3: torch.Tensor  # () fp64: Σ_{i,j,k distinct} k_ij k_jk
    u4: torch.Tensor  # () fp64: Σ_{i,j,k,l distinct} k_ij k_kl
    p2: int
    p3: int
    p4: int


def tuple_sums(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """Sums of ``k_ij²``, ``k_ij k_jk``, ``k_ij k_kl`` over ordered distinct tuples of one group.

    With ``H`` = ``k`` with its diagonal zeroed: ``Σ_{i≠j} h² = |H|_F²``;
    ``Σ_{distinct i,j,k} h_ij h_jk = |H1|² − |H|_F²``; and, expanding ``(1ᵀH1)²`` by how two
    ordered pairs overlap, ``Σ_{distinct i,j,k,l} h_ij h_kl = (1ᵀH1)² − 4·u3 − 2·u2``.
    """
    m = k.shape[0]
    h = k.to(F64) - torch.diag(torch.diagonal(k).to(F64))
    u2 = (h * h).sum()
    row = h.sum(dim=1)
    u3 = (row * row).sum() - u2
    total = row.sum()
    u4 = total * total - 4 * u3 - 2 * u2
    return u2, u3, u4, m * (m - 1), m * (m - 1) * (m - 2), m * (m - 1) * (m - 2) * (m - 3)
