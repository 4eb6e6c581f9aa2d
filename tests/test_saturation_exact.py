"""The saturation test's ``z`` and ``p_value`` at small n, exactly, against a reference written here.

Reference (no package code): the per-sample ``c_i = Σ_t q_t φ(W_in z_t)ᵀ`` by explicit loops over
samples and positions (φ from its formula), their inner products ``k_ij = <c_i, c_j>_F`` by a double
loop, and then the null distribution re-derived from the definition of the test. Under
``H0: C = E[c] = 0`` the unbiased ``Û = avg_{i≠j} k_ij`` satisfies

    (n − 1)·Û + avg_i |c_i|² = |Σ_i c_i|² / n  →  |Z|²,   Z ~ N(0, Σ_c),

a weighted sum of χ²₁ with mean ``tr Σ_c`` and variance ``2 tr Σ_c²``. Satterthwaite (1946) matches
it with ``a·χ²_ν``: ``a = tr Σ_c² / tr Σ_c``, ``ν = (tr Σ_c)² / tr Σ_c²``, estimated by
``tr Σ_c ≈ avg_i k_ii`` and ``tr Σ_c² = E[k_ij²] ≈ avg k_ij²`` over ordered pairs of distinct samples
of the SAME batch (pairs across batches are not formed by a streaming accumulator). The upper tail
of ``χ²_ν`` at ``x = ((n − 1)·Û + avg k_ii) / a`` is Wilson & Hilferty's (1931) cube-root normal
approximation: ``(χ²_ν/ν)^(1/3) ≈ N(1 − 2/(9ν), 2/(9ν))``, so ``z = ((x/ν)^(1/3) − 1 + 2/(9ν)) /
sqrt(2/(9ν))`` and ``p = 1 − Φ(z)``. The written-out tail is itself held to the exact χ² tail
(``torch.special.gammaincc``) so that it is a χ² tail and not merely the same formula twice.

n = 8 and 12, one batch or several, ``unit="sample"`` (with masked positions) and
``unit="position"``, from random ``q``/``z`` fed to ``CrossStats.update`` and, through the probe,
from one backward per sample of a small residual MLP. Agreement to 1e-9 relative.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.accumulators.cross_stats import CrossStats

from tiny_models import TanhBlock

F64 = torch.float64
PHI = {
    "tanh": math.tanh,
    "gelu": lambda x: 0.5 * x * (1 + math.erf(x / math.sqrt(2))),
    "relu": lambda x: max(x, 0.0),
}


def per_sample_c(q, z, mask, w_in, activation, unit):
    """Python loops: ``c`` (d × r) of every sample, in the accumulator's sample order."""
    phi = PHI[activation]
    B, T, d = q.shape
    r = w_in.shape[0]
    keep = torch.ones(B, T, dtype=torch.bool) if mask is None else mask.bool()
    out = []
    for b in range(B):
        c_b = torch.zeros(d, r, dtype=F64)
        counted = 0
        for t in range(T):
            if not keep[b, t]:
                continue
            f = torch.tensor([phi(float(w_in[k].double() @ z[b, t].double())) for k in range(r)], dtype=F64)
            c_t = torch.outer(q[b, t].double(), f)
            if unit == "position":
                out.append(c_t)
            else:
                c_b += c_t
                counted += 1
        if unit == "sample" and counted:
            out.append(c_b)
    return out


def wilson_hilferty(x: float, nu: float) -> tuple[float, float]:
    """``(z, P(χ²_ν > x))`` by the Wilson–Hilferty cube-root normal approximation."""
    v = 2.0 / (9.0 * nu)
    z = ((x / nu) ** (1.0 / 3.0) - (1.0 - v)) / math.sqrt(v)
    return z, 0.5 * math.erfc(z / math.sqrt(2.0))


def reference_null_tail(batches: list[list[torch.Tensor]]):
    """``(z, p, Û, ν)`` of the saturation test from the per-batch lists of ``c_i`` (docstring)."""
    cs = [c for batch in batches for c in batch]
    n = len(cs)
    k = [[float((a * b).sum()) for b in cs] for a in cs]
    u_hat = sum(k[i][j] for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    tr1 = sum(k[i][i] for i in range(n)) / n
    sq, pairs, start = 0.0, 0, 0
    for batch in batches:
        idx = range(start, start + len(batch))
        start += len(batch)
        for i in idx:
            for j in idx:
                if i != j:
                    sq += k[i][j] ** 2
                    pairs += 1
    tr2 = sq / pairs
    a, nu = tr2 / tr1, tr1 * tr1 / tr2
    x = ((n - 1) * u_hat + tr1) / a
    z, p = wilson_hilferty(x, nu)
    # the tail written out above is a chi-square tail: close to the exact one at this nu
    exact = float(torch.special.gammaincc(torch.tensor(nu / 2, dtype=F64), torch.tensor(x / 2, dtype=F64)))
    assert abs(p - exact) < 0.01, (p, exact, nu)
    return z, p, u_hat, nu


def assert_rel(got, want, rel, what):
    assert abs(got - want) <= rel * abs(want), f"{what}: {got!r} vs reference {want!r}"


CASES = {
    # name: (unit, [(B, T) per batch], masked?, activation)
    "n8_sample_one_batch": ("sample", [(8, 3)], False, "tanh"),
    "n12_sample_three_batches_masked": ("sample", [(5, 4), (4, 4), (3, 4)], True, "gelu"),
    "n12_position_two_batches": ("position", [(2, 3), (3, 2)], False, "relu"),
    "n8_position_masked": ("position", [(3, 4)], True, "tanh"),
}


@pytest.mark.parametrize("shift", [0.0, 0.6], ids=["null", "alternative"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_saturation_z_and_p_equal_the_written_out_satterthwaite_tail(case, shift, gen):
    unit, shapes, masked, activation = CASES[case]
    d, d_in, r = 3, 4, 2
    w_in = torch.randn(r, d_in, generator=gen, dtype=F64)
    acc = CrossStats(d, w_in, activation)
    batches = []
    for B, T in shapes:
        q = torch.randn(B, T, d, generator=gen, dtype=F64) + shift
        z = torch.randn(B, T, d_in, generator=gen, dtype=F64)
        mask = None
        if masked:
            mask = torch.rand(B, T, generator=gen) < 0.7
            mask[:, 0] = True  # every sample keeps a position: n is the intended size
            if unit == "position":  # 8 counted positions in all
                mask = torch.zeros(B, T, dtype=torch.bool)
                mask.view(-1)[torch.randperm(B * T, generator=gen)[:8]] = True
        acc.update(q, z, mask, unit=unit)
        batches.append(per_sample_c(q, z, mask, w_in, activation, unit))
    n = sum(len(b) for b in batches)
    assert n in (8, 12) and acc.n == n
    z_ref, p_ref, u_ref, _ = reference_null_tail(batches)
    assert 0.0 < p_ref < 1.0
    sat = acc.saturation()
    assert sat.n == n
    assert_rel(sat.cross_frob2, u_ref, 1e-9, f"{case}: cross_frob2")
    assert_rel(sat.z, z_ref, 1e-9, f"{case}: z")
    assert_rel(sat.p_value, p_ref, 1e-9, f"{case}: p_value")
    assert sat.saturated == (p_ref > 0.05)


class Net(nn.Module):
    """Two tanh residual blocks and a linear read-out: (B, d) streams at points ``0`` and ``1``."""

    def __init__(self, d):
        super().__init__()
        self.blocks = nn.Sequential(TanhBlock(d), TanhBlock(d))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.blocks(x)).squeeze(-1)


def squared_error(model, batch):
    x, y = batch
    return (model(x) - y) ** 2


@pytest.mark.parametrize("n", [8, 12])
def test_probe_saturation_z_and_p_from_one_backward_per_sample(n, gen):
    """Through the probe: c_i = q_i φ(W_in z_i)ᵀ with q_i from ONE backward of sample i's loss."""
    d, r = 4, 3
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = Net(d).double()
    x = torch.randn(n, d, generator=gen, dtype=F64)
    y = torch.randn(n, generator=gen, dtype=F64)
    w_in = torch.randn(r, d, generator=gen, dtype=F64)
    points = ["blocks.0", "blocks.1"]
    probe = fs.Probe(
        model, points=points, second_moment="dense", cross=fs.CrossSpec(w_in=w_in, activation="tanh")
    )
    sizes = [n] if n == 8 else [7, 5]
    start = 0
    for size in sizes:
        probe.step((x[start : start + size], y[start : start + size]), squared_error)
        start += size
    per_point = {p: [] for p in points}
    for size_start, size in zip([0, sizes[0]], sizes):
        batch_cs = {p: [] for p in points}
        for i in range(size_start, size_start + size):
            outs = {}
            handles = [
                model.get_submodule(p).register_forward_hook(
                    lambda m, a, o, p=p, outs=outs: outs.__setitem__(p, o)
                )
                for p in points
            ]
            try:
                loss = (model(x[i : i + 1]) - y[i]) ** 2
            finally:
                for h in handles:
                    h.remove()
            grads = torch.autograd.grad(loss.sum(), [outs[p] for p in points])
            for p, g in zip(points, grads):
                batch_cs[p].append(
                    per_sample_c(
                        g[:, None].detach(), outs[p][:, None].detach(), None, w_in, "tanh", "sample"
                    )[0]
                )
        for p in points:
            per_point[p].append(batch_cs[p])
    for p in points:
        z_ref, p_ref, u_ref, _ = reference_null_tail(per_point[p])
        sat = probe.saturation(p)
        assert sat.n == n
        assert_rel(sat.cross_frob2, u_ref, 1e-9, f"{p}: cross_frob2")
        assert_rel(sat.z, z_ref, 1e-9, f"{p}: z")
        assert_rel(sat.p_value, p_ref, 1e-9, f"{p}: p_value")
