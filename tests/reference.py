"""Independent references for the GradStats tests (written without looking at the power-sum code).

Three references, each deliberately simple:

* :func:`brute_force_u` / :func:`brute_force_targets` -- the U-statistics of docs/design.md, section 2,
  literally averaged over every ordered tuple of DISTINCT indices (``itertools.permutations``) of
  the Gram matrix ``g_ij = q_i^T q_j``::

      U1 = avg g_ij      U2 = avg g_ij^2      U3 = avg g_ij g_jk      U4 = avg g_ij g_kl
      |mu|^2 = U1   |mu|^4 = U4   mu^T Sigma mu = U3 - U4   tr(Sigma^2) = U2 - 2 U3 + U4
      tr(Sigma) = avg (g_ii - g_ij) = avg |q_i - q_j|^2 / 2          (i != j)

  The arithmetic is EXACT: every fp64 input is a dyadic rational, so it is scaled to a Python
  integer over a common power-of-two denominator, the Gram matrix and every tuple product are
  Python integers, and the averages are :class:`fractions.Fraction`. Only the final target is
  rounded to fp64. This matters: at mean = 100 x noise the fp64 brute force itself would lose
  ~8 digits of ``tr(Sigma^2)`` to the cancellation ``U2 - 2U3 + U4`` and could not check a 1e-9
  tolerance. Cost is O(n^4) Python-integer products: keep n <= 12.

* :func:`two_pass_targets` -- a two-pass fp64 reference for larger n: centre at the fp64 mean
  (with one correction pass), then the closed forms of docs/design.md, section 2 for sums centred at the
  sample mean, written here from the centred Gram matrix ``H = Y Y^T`` (n x n)::

      A1 = tr H, A2 = sum_i H_ii^2, F = |H|_F^2 (= tr(S^2) with S = Y^T Y), v = Y m,
      kappa = |m|^2, beta = |v|^2 (= m^T S m), tau = sum_i H_ii v_i (= m^T t)

  It is trusted only because ``test_fp32_accuracy.py`` checks it against the exact brute force.

* :func:`per_sample_vectors` -- the per-sample vectors ``q_i`` a batch defines for each ``unit``,
  by explicit Python loops over samples and positions (no reshapes shared with the package).
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import torch

from fused_stats.accumulators import state_differences

TARGETS = ("mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2")


# ----------------------------------------------------------------------------- exact brute force
def _exact_integers(q: np.ndarray) -> tuple[np.ndarray, int]:
    """``q = X / D`` exactly, with ``X`` Python integers (object array) and ``D`` a power of two."""
    ratios = [[float(x).as_integer_ratio() for x in row] for row in q]
    denom = max(den for row in ratios for _, den in row)  # all powers of two: the max is the lcm
    ints = np.empty(q.shape, dtype=object)
    for i, row in enumerate(ratios):
        for k, (num, den) in enumerate(row):
            ints[i, k] = num * (denom // den)
    return ints, denom


def exact_gram(q) -> tuple[np.ndarray, int]:
    """Gram matrix of the rows of ``q`` as Python integers over the denominator ``D**2``."""
    if isinstance(q, torch.Tensor):
        q = q.detach().to("cpu", torch.float64).numpy()
    q = np.asarray(q, dtype=np.float64)
    if not np.isfinite(q).all():
        raise ValueError("reference needs finite inputs")
    ints, denom = _exact_integers(q)
    n = ints.shape[0]
    gram = np.empty((n, n), dtype=object)
    for i in range(n):
        for j in range(n):
            gram[i, j] = sum(a * b for a, b in zip(ints[i], ints[j]))
    return gram, denom


def brute_force_u(q) -> dict[str, Fraction]:
    """Exact U1..U4 (and ``T`` = tr Sigma) over ordered tuples of distinct indices; 4 <= n <= 12."""
    gram, denom = exact_gram(q)
    n = gram.shape[0]
    if not 4 <= n <= 12:
        raise ValueError(f"brute force is meant for 4 <= n <= 12, got n={n}")
    pairs = np.array(list(itertools.permutations(range(n), 2)))
    triples = np.array(list(itertools.permutations(range(n), 3)))
    quads = np.array(list(itertools.permutations(range(n), 4)))
    g_ij = gram[pairs[:, 0], pairs[:, 1]]
    u1 = Fraction(int(g_ij.sum()), len(pairs) * denom**2)
    u2 = Fraction(int((g_ij * g_ij).sum()), len(pairs) * denom**4)
    u3 = Fraction(
        int((gram[triples[:, 0], triples[:, 1]] * gram[triples[:, 1], triples[:, 2]]).sum()),
        len(triples) * denom**4,
    )
    u4 = Fraction(
        int((gram[quads[:, 0], quads[:, 1]] * gram[quads[:, 2], quads[:, 3]]).sum()), len(quads) * denom**4
    )
    # tr(Sigma) = avg over distinct pairs of (g_ii - g_ij) = avg |q_i - q_j|^2 / 2
    tr = Fraction(int((gram[pairs[:, 0], pairs[:, 0]] - g_ij).sum()), len(pairs) * denom**2)
    return {"U1": u1, "U2": u2, "U3": u3, "U4": u4, "T": tr}


def brute_force_targets(q) -> dict[str, float]:
    """The four unbiased targets from :func:`brute_force_u`, rounded to fp64 only at the end."""
    u = brute_force_u(q)
    return {
        "trace_sigma": float(u["T"]),
        "mu_norm2": float(u["U1"]),
        "mu_norm4": float(u["U4"]),
        "mu_sigma_mu": float(u["U3"] - u["U4"]),
        "trace_sigma2": float(u["U2"] - 2 * u["U3"] + u["U4"]),
    }


# ----------------------------------------------------------------------------- two-pass fp64
def two_pass_targets(q) -> dict[str, float]:
    """Two-pass fp64 estimates (module docstring) for any n >= 4."""
    q = torch.as_tensor(q).detach().to("cpu", torch.float64)
    n = q.shape[0]
    m = q.mean(dim=0)
    m = m + (q - m).mean(dim=0)  # second pass: removes the rounding left in the first mean
    y = q - m
    H = y @ y.T
    diag = torch.diagonal(H)
    v = y @ m
    a1 = float(diag.sum())
    a2 = float((diag * diag).sum())
    F = float((H * H).sum())
    kappa = float(m @ m)
    beta = float(v @ v)
    tau = float(diag @ v)
    n2, n3, n4 = n * (n - 1), n * (n - 1) * (n - 2), n * (n - 1) * (n - 2) * (n - 3)
    return {
        "mu_norm2": kappa - a1 / n2,
        "mu_norm4": (
            kappa**2 - 2 * kappa * a1 / n2 - 4 * beta / n2 + 8 * tau / n3 + (a1**2 - 6 * a2 + 2 * F) / n4
        ),
        "mu_sigma_mu": (
            beta / (n - 1) - 2 * tau / ((n - 1) * (n - 2)) + (2 * n * a2 - (n - 1) * F - a1**2) / n4
        ),
        "trace_sigma2": ((n - 1) * (n - 2) * F - n * (n - 1) * a2 + a1**2) / n4,
    }


def term_scale(q) -> float:
    """``mean_i |q_i|^2``: the size of the degree-2 terms every estimator subtracts (fp64)."""
    q = torch.as_tensor(q).detach().to("cpu", torch.float64)
    return float((q * q).sum(dim=1).mean())


# ----------------------------------------------------------------------------- per-sample vectors
def per_sample_vectors(
    grad: torch.Tensor, mask: torch.Tensor | None = None, unit: str = "sample", feature_dim: int = -1
) -> torch.Tensor:
    """The ``q_i`` (fp64, one row each) defined by one ``GradStats.update`` call, by plain loops.

    ``unit="sample"``: sum of the sample's positions with a nonzero mask (a sample with none is
    dropped); ``"position"``: every position with a nonzero mask; ``"flat"``: the whole sample.
    """
    g = grad.detach().to("cpu", torch.float64)
    B = g.shape[0]
    if unit == "flat":
        return torch.stack([g[b].flatten() for b in range(B)])
    fd = feature_dim % g.dim()
    other = [k for k in range(1, g.dim()) if k != fd]  # position dims, in order
    positions = list(itertools.product(*[range(g.shape[k]) for k in other]))
    rows = []
    for b in range(B):
        kept = []
        for pos in positions:
            if mask is not None:
                mval = mask[b] if mask.dim() == 1 else mask[(b, *pos)]
                if float(mval) == 0.0:
                    continue
            index = [b, *([slice(None)] * (g.dim() - 1))]
            for k, p in zip(other, pos):
                index[k] = p
            kept.append(g[tuple(index)])
        if unit == "position":
            rows.extend(kept)
        elif kept:
            total = torch.zeros(g.shape[fd], dtype=torch.float64)
            for vec in kept:
                total = total + vec
            rows.append(total)
    return torch.stack(rows) if rows else torch.zeros(0, g.shape[fd], dtype=torch.float64)


def near_zero_tolerances(regime: str, q, rel: float) -> dict[str, float]:
    """Absolute tolerances for the targets whose population value is ~0 in ``regime``.

    With mu = 0 (or |mu| = 1e-3 noise) the mean-related targets are pure sampling noise, so a
    given sample's exact value can sit arbitrarily close to 0, while every estimator computes it
    as a difference of terms of size mean|q|^2 (degree 2) or its square (degree 4). fp64 can only
    promise an error relative to those terms; tr(Sigma^2) is never ~0 and stays relative.

    Only for comparisons whose REFERENCE is itself fp64 arithmetic with such cancellations (the
    two-pass reference). Against the exact brute force, and between two package paths, the
    package is held to a pure relative tolerance in every regime.
    """
    if regime not in ("mean_zero", "noise_1000x_mean"):
        return {}
    scale = term_scale(q)
    return {"mu_norm2": rel * scale, "mu_norm4": rel * scale**2, "mu_sigma_mu": rel * scale**2}


def assert_targets_close(
    got, want: dict[str, float], rel: float, abs_for: dict[str, float] | None = None, context: str = ""
) -> None:
    """Each target within ``rel`` relative, or within the given absolute tolerance where named."""
    abs_for = abs_for or {}
    failures = []
    for key in TARGETS:
        value = getattr(got, key) if not isinstance(got, dict) else got[key]
        tol = abs_for.get(key, rel * abs(want[key]))
        if not math.isfinite(value) or abs(value - want[key]) > tol:
            failures.append(
                f"{key}: got {value!r}, want {want[key]!r}, |diff| "
                f"{abs(value - want[key]):.3e} > tol {tol:.3e}"
            )
    assert not failures, context + "\n" + "\n".join(failures)


def state_tensors(acc) -> dict[str, torch.Tensor | None]:
    """Every declared state tensor of an accumulator (None where its representation has none)."""
    return {f.name: getattr(acc, f.name) for f in acc.FIELDS}


def assert_state_identical(before: dict, after_acc, counters_before: tuple, context: str = "") -> None:
    """``after_acc``'s state is bit-identical to the snapshot ``before`` (a ``state_dict()``)."""
    # the skip counter is the one entry a skipped batch changes; the caller checks it
    changed = [k for k in state_differences(before, after_acc.state_dict()) if k != "skipped_batches"]
    assert not changed, f"{context}: state entries {changed} changed"
    counters = (after_acc.n, after_acc.mode, after_acc.unit)
    assert counters == counters_before, f"{context}: (n, mode, unit) {counters_before} -> {counters}"


def snapshot(acc) -> tuple[dict, tuple]:
    """The accumulator's ``state_dict()`` (clones) and its (n, mode, unit) counters."""
    return acc.state_dict(), (acc.n, acc.mode, acc.unit)


# ----------------------------------------------------------------------------- test data
# mean-to-noise ratios |mu| / sqrt(tr Sigma) of the four regimes the tests use
REGIMES = {"mean_zero": 0.0, "mean_like_noise": 1.0, "mean_100x_noise": 100.0, "noise_1000x_mean": 1e-3}


def population(d: int, regime: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mu, L)`` in fp64: noise ``L z`` with anisotropic ``Sigma = L L^T`` (a random rotation of
    scales in [0.5, 2]) and a mean of a random direction with ``|mu| = ratio * sqrt(tr Sigma)``."""
    rot, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    scales = 0.5 + 1.5 * torch.rand(d, generator=gen, dtype=torch.float64)
    L = rot * scales  # columns scaled: L L^T = rot diag(scales^2) rot^T
    direction = torch.randn(d, generator=gen, dtype=torch.float64)
    direction = direction / direction.norm()
    mu = REGIMES[regime] * float(scales.square().sum().sqrt()) * direction
    return mu, L


def draw(shape: tuple, mu: torch.Tensor, L: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fresh iid vectors ``mu + L z`` of the given leading shape (features last), fp64."""
    z = torch.randn(*shape, L.shape[0], generator=gen, dtype=torch.float64)
    return mu + z @ L.T
