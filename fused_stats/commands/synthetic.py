"""``fused-stats synthetic``: GradStats on a spiked Gaussian population with known μ and Σ."""

from __future__ import annotations

from .args import int_at_least, nonnegative_int, positive_int


def register(sub) -> None:
    syn = sub.add_parser(
        "synthetic",
        help="estimates on a synthetic population with known values",
        description="Feed a spiked Gaussian population (mean mu = MEAN * e_1, "
        "covariance I + 4 v v^T with a random unit v) through GradStats "
        "and print each unbiased estimate next to its population value.",
    )
    syn.add_argument("--dim", type=positive_int, default=64, help="feature dimension d")
    syn.add_argument("--mean", type=float, default=1.0, help="length of the population mean mu")
    syn.add_argument("--batches", type=positive_int, default=50, help="batches fed in")
    # the degree-4 estimates need n >= 4 samples
    syn.add_argument("--batch-size", type=int_at_least(4), default=200, help="samples per batch")
    syn.add_argument(
        "--second-moment",
        default="auto",
        choices=["auto", "dense", "pool"],
        help="second-moment mode of the accumulator",
    )
    syn.add_argument("--seed", type=nonnegative_int, default=0, help="random seed")
    syn.set_defaults(func=cmd_synthetic)


def cmd_synthetic(args) -> int:
    """Feed a spiked Gaussian population with known μ and Σ through GradStats; print both."""
    import torch

    from ..accumulators import GradStats

    gen = torch.Generator().manual_seed(args.seed)
    d = args.dim
    mu = torch.zeros(d, dtype=torch.float64)
    mu[0] = args.mean
    spike = torch.randn(d, generator=gen, dtype=torch.float64)
    spike /= spike.norm()
    # Σ = I + 4 v vᵀ: q = μ + z + 2 w v
    sigma = torch.eye(d, dtype=torch.float64) + 4 * torch.outer(spike, spike)
    acc = GradStats(d, second_moment=args.second_moment)
    for _ in range(args.batches):
        z = torch.randn(args.batch_size, d, generator=gen, dtype=torch.float64)
        w = torch.randn(args.batch_size, 1, generator=gen, dtype=torch.float64)
        acc.update(mu + z + 2 * w * spike)
    est = acc.estimate()
    truth = {
        "mu_norm2": float(mu @ mu),
        "mu_norm4": float(mu @ mu) ** 2,
        "mu_sigma_mu": float(mu @ sigma @ mu),
        "trace_sigma2": float((sigma @ sigma).trace()),
    }
    print(f"n={est.n} d={est.dim} second_moment={acc.mode}")
    print(f"{'target':<14}{'estimate':>14}{'population':>14}")
    for key, value in truth.items():
        print(f"{key:<14}{getattr(est, key):>14.6g}{value:>14.6g}")
    print(f"d_align={est.d_align:.4g}  certificate(M=K=100): {est.certificate(100, 100)}")
    return 0
