"""How far the plug-in values of per-sequence scripts (``est.plugin``) move from the unbiased ones.

Gaussian rows ``q_i ~ N(μ, I_d)`` with known population values (``|μ|⁴ = a⁴``, ``μᵀΣμ = a²``,
``tr(Σ²) = d``, so ``d_align = min(a², a⁴/d)``), folded into ``fs.GradStats`` in batches; medians
over repeats of the unbiased ``est.d_align`` and the plug-in ``est.plugin.d_align``, as ratios to
the population value. Why they move (``E`` over draws of n rows):

* ``E[S] = |μ|² + tr(Σ)/n``: with a noise-dominated mean (``|μ|² ≪ tr(Σ)/n``) ``S²`` is mostly
  noise, so the plug-in ``d_align`` is inflated (the data look aligned when they are not);
* ``E[T] ≈ tr(Σ²) + tr(Σ)²/n``: with a strong mean ``S`` is accurate but ``T`` carries the extra
  ``tr(Σ)²/n = d²/n``, so ``d_2`` and the plug-in ``d_align`` are deflated.

    python examples/plugin_vs_unbiased.py
"""

from __future__ import annotations

import statistics
import sys

import torch

import fused_stats as fs


def run(d, n, a, repeats, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mu = torch.zeros(d, dtype=torch.float64)
    mu[0] = a
    truth = min(a**2, a**4 / d)
    unbiased, plugin = [], []
    for _ in range(repeats):
        acc = fs.GradStats(d, second_moment="dense", backend="torch")
        for batch in (mu + torch.randn(n, d, generator=gen, dtype=torch.float64)).split(64):
            acc.update(batch)
        est = acc.estimate()
        unbiased.append(est.d_align)
        plugin.append(est.plugin.d_align)
    return truth, statistics.median(unbiased), statistics.median(plugin)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    repeats = parser.parse_args(argv).repeats
    d, n = 64, 256
    print(f"rows q_i ~ N(mu, I_{d}), n = {n}, medians over {repeats} draws")
    print(
        f"{'|mu|':>6} {'|mu|^2 / (tr S / n)':>20} {'true d_align':>13} {'unbiased / true':>16} "
        f"{'plug-in / true':>15} {'plug-in / unbiased':>19}"
    )
    for a in (0.1, 0.3, 1.0, 3.0, 10.0):
        truth, unbiased, plugin = run(d, n, a, repeats)
        ratio = plugin / unbiased if unbiased > 0 else float("inf")
        print(
            f"{a:6.1f} {a * a / (d / n):20.3g} {truth:13.4g} {unbiased / truth:16.3f} "
            f"{plugin / truth:15.3f} {ratio:19.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
