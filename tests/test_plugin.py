"""The plug-in ("comparable") values of ``Estimate.plugin`` against the formulas of per-sequence
scripts, evaluated independently in numpy fp64 from the stored rows:
``S = |q̄|²``, ``V = Σ_i (q̄ᵀ(q_i − q̄))²/(n − 1)``, ``T = |X Xᵀ|_F²/(n − 1)²`` (X: centred rows),
``d_par = S²/V``, ``d_2 = S²/T``, ``d_align = min``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fused_stats as fs


def rows_formulas(rows: np.ndarray) -> dict:
    n = rows.shape[0]
    mean = rows.mean(axis=0)
    X = rows - mean
    S = float(mean @ mean)
    V = float(np.sum((X @ mean) ** 2) / (n - 1))
    T = float(np.sum((X @ X.T) ** 2) / (n - 1) ** 2)
    return {
        "S": S,
        "V": V,
        "T": T,
        "d_par": S * S / V,
        "d_2": S * S / T,
        "d_align": min(S * S / V, S * S / T),
    }


@pytest.mark.parametrize("second_moment", ["dense", "pool"])
@pytest.mark.parametrize("mean_scale", [0.05, 3.0])
def test_plugin_equals_row_formulas(gen, second_moment, mean_scale):
    d = 7
    mu = mean_scale * torch.randn(d, generator=gen, dtype=torch.float64)
    batches = [mu + torch.randn(b, d, generator=gen, dtype=torch.float64) for b in (5, 9, 3)]
    acc = fs.GradStats(d, second_moment=second_moment, backend="torch")
    for batch in batches:
        acc.update(batch)
    plug = acc.estimate().plugin
    want = rows_formulas(torch.cat(batches).numpy())
    for key, value in want.items():
        assert getattr(plug, key) == pytest.approx(value, rel=1e-12, abs=0), key


def test_plugin_sequences_and_merge(gen):
    """unit="sample" over (B, T, d) gradients with a mask: the rows are the masked position sums;
    two accumulators merged give the plug-in values of all rows."""
    d, T = 5, 4
    grads = [torch.randn(b, T, d, generator=gen, dtype=torch.float64) + 0.7 for b in (6, 4)]
    masks = [torch.rand(b, T, generator=gen) > 0.3 for b in (6, 4)]
    for m in masks:
        m[:, 0] = True
    a = fs.GradStats(d, second_moment="dense", backend="torch")
    b = fs.GradStats(d, second_moment="dense", backend="torch")
    a.update(grads[0], mask=masks[0])
    b.update(grads[1], mask=masks[1])
    a.merge(b)
    rows = np.concatenate(
        [
            np.stack([sum(g[i, t].numpy() for t in range(T) if m[i, t]) for i in range(g.shape[0])])
            for g, m in zip(grads, masks)
        ]
    )
    plug = a.estimate().plugin
    for key, value in rows_formulas(rows).items():
        assert getattr(plug, key) == pytest.approx(value, rel=1e-12, abs=0), key


def test_plugin_in_dict_and_report(gen):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    probe = fs.Probe(model, points=["0", "1"], second_moment="dense")
    x, y = torch.randn(12, 4, generator=gen), torch.randint(0, 3, (12,), generator=gen)
    probe.step((x, y), fs.classification_loss)
    est = probe.stats["0"].estimate()
    assert est.to_dict()["plugin"]["d_align"] == est.plugin.d_align
    text = probe.report(misalignment_trials=0).to_markdown()
    assert "plug-in, biased" in text
    assert f"{est.plugin.T:.4g}" in text


def test_plugin_bias_directions_example():
    """The README's measured example (Gaussian rows, known population d_align): the plug-in value
    is inflated by a noise-dominated mean and deflated by a strong one (d_2 regime), while the
    unbiased one stays near the truth."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "plugin_vs_unbiased.py"
    out = subprocess.run(
        [sys.executable, str(script), "--repeats", "6"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    rows = {
        float(line.split()[0]): [float(x) for x in line.split()[1:]] for line in out.stdout.splitlines()[2:]
    }
    assert rows[0.3][3] > 3  # plug-in / true: inflated
    assert rows[3.0][3] < 0.95  # deflated
    assert 0.9 < rows[3.0][2] < 1.1  # unbiased / true
