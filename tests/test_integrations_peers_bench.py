"""bench/bench_peers.py at small size: fused_stats' Probe, the per-sequence loop a user would write
(one backward per sequence, rows stored) and Opacus' per-sample gradients of an inserted zero block
agree on every statistic (fp64 model, so the comparison is tight)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_peers
from _harness import build_llama

import fused_stats as fs


def close(got, want, scale, rel=1e-8):
    return abs(got - want) <= rel * max(abs(want), scale)


@pytest.mark.parametrize("with_opacus", [False, True])
def test_peers_agree(with_opacus):
    if with_opacus:
        pytest.importorskip("opacus")
    model, data = build_llama(hidden=32, layers=2, seq=12, batch=10, vocab=53, seed=3)
    model = model.double()
    points = fs.residual_points(model)
    w_in = torch.randn(4, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64) / 6
    probe = bench_peers.run_probe(model, data, points, w_in, B=4)
    other = (
        bench_peers.run_opacus(model, data, points, w_in, B=4)
        if with_opacus
        else bench_peers.run_loop(model, data, points)
    )
    for p in points:
        s2 = probe[p]["ag_max"] ** 2
        scales = {
            "mu_norm2": s2,
            "mu_norm4": s2**2,
            "mu_sigma_mu": s2**2,
            "trace_sigma2": s2**2,
            "ag_max": 0.0,
            "d_align": 0.0,
            "cross_frob2": s2 * 1e-2,
        }
        for key, want in probe[p].items():
            if key not in other[p]:
                continue
            got = other[p][key]
            if key == "d_align" and (want in (0.0, float("inf"))):
                assert got == want, (p, key, got, want)
                continue
            assert close(got, want, 1e-6 * scales[key]), (p, key, got, want)
    assert all(p.requires_grad for p in model.parameters())
