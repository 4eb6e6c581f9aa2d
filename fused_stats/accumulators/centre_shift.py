"""Moving the centre of centred second- and fourth-order sums exactly (docs/design.md, section 2).

:class:`~fused_stats.accumulators.grad_stats.GradStats` keeps its sums about a centre ``c``
(``y_i = q_i − c``). Moving that centre by ``δ`` is a pure function of the sums, with no new data::

    s' = s − nδ                 S' = S − δsᵀ − sδᵀ + nδδᵀ          A1' = A1 − 2δᵀs + n|δ|²
    t' = t − 2Sδ − A1δ + |δ|²s + 2(δᵀs)δ − n|δ|²δ
    A2' = A2 − 4δᵀt + 4δᵀSδ + 2|δ|²A1 − 4|δ|²δᵀs + n|δ|⁴

and in pool form ``Y' = Y − 1δᵀ``, ``G' = G − u1ᵀ − 1uᵀ + |δ|² 11ᵀ`` with ``u = Yδ``. Merging, all-reduce
and the finalisation at ``q̄`` all go through :func:`shift`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

F64 = torch.float64
__all__ = ["shift"]


def shift(sums: Mapping, delta: torch.Tensor) -> dict:
    """The centred sums after moving their centre by ``delta`` (a pure function; new tensors).

    ``sums``: ``n``, ``s``, ``t``, ``a1``, ``a2`` and either ``S`` (dense) or ``pool`` and ``gram``
    (a pool of centred rows). With ``δ = delta`` (docs/design.md, section 2)::

        s' = s − nδ            S' = S − δsᵀ − sδᵀ + nδδᵀ            A1' = A1 − 2δᵀs + n|δ|²
        t' = t − 2Sδ − A1δ + |δ|²s + 2(δᵀs)δ − n|δ|²δ
        A2' = A2 − 4δᵀt + 4δᵀSδ + 2|δ|²A1 − 4|δ|²δᵀs + n|δ|⁴
        pool: Y' = Y − 1δᵀ,  G' = G − u1ᵀ − 1uᵀ + |δ|² 11ᵀ  with  u = Yδ

    Returns the moved ``s, t, a1, a2`` and ``S`` or ``pool, gram`` (``a1``, ``a2`` as 0-d fp64).
    """
    n, s, t = sums["n"], sums["s"], sums["t"]
    a1, a2 = float(sums["a1"]), float(sums["a2"])
    dense = sums.get("S") is not None
    dd = float(delta @ delta)
    ds = float(delta @ s)
    if dense:
        S = sums["S"]
        S_delta = S @ delta
        dSd = float(delta @ S_delta)
    else:
        pool = sums["pool"]
        u = pool @ delta
        S_delta = pool.T @ u
        dSd = float(u @ u)
    out = {
        "s": s - n * delta,
        "t": t - 2 * S_delta - a1 * delta + dd * s + 2 * ds * delta - n * dd * delta,
        "a1": torch.tensor(a1 - 2 * ds + n * dd, dtype=F64, device=s.device),
        "a2": torch.tensor(
            a2 - 4 * float(delta @ t) + 4 * dSd + 2 * dd * a1 - 4 * dd * ds + n * dd * dd,
            dtype=F64,
            device=s.device,
        ),
    }
    if dense:
        # one new (d, d) tensor updated by three rank-one additions (no d x d temporaries)
        moved = S.clone()
        moved.addr_(delta, s, alpha=-1).addr_(s, delta, alpha=-1).addr_(delta, delta, alpha=n)
        out["S"] = moved
    else:
        out["pool"] = pool - delta
        out["gram"] = sums["gram"] - u[:, None] - u[None, :] + dd
    return out
