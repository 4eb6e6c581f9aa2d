"""Watch the block-output statistics of a small CIFAR ResNet while it trains (random data).

What it does: trains ``cifar_resnet20`` (``fused_stats.networks.resnet``) with SGD + momentum on a
synthetic 10-class image task (class-dependent mean images plus noise, so there is something to
learn and nothing to download) and wraps every step in ``probe.observe(loss_reduction="mean")``:
``F.cross_entropy`` averages over the batch, so each image's gradient at each residual block is
rescaled by ``B``. A point's per-sample vector sums the (C, H, W) gradient over pixels (``unit=
"sample"``): the gradient of a per-channel bias at that block. Every ``--every`` steps the
estimates per block go to ``OUT/monitor.jsonl``; the trajectories to ``OUT/monitor.png``.

The network trains with BatchNorm in training mode, whose batch statistics couple the images of a
batch; the observed gradients then include that coupling (``observe`` warns once). That is the
training signal the optimizer sees; ``Probe.step`` (eval mode) gives the uncoupled one.

    python examples/monitor_resnet_training.py             # about 20 s on 2 busy CPU cores
    python examples/monitor_resnet_training.py --cumulative
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import fused_stats as fs
from fused_stats.api.training.monitor_log import plot_monitor_log, read_monitor_log, summary_markdown
from fused_stats.networks.resnet import cifar_resnet20


def synthetic_task(image: int, classes: int = 10, seed: int = 0):
    """A sampler of (images, labels): class mean image (fixed, seeded) + unit Gaussian noise."""
    gen = torch.Generator().manual_seed(seed)
    means = 0.5 * torch.randn(classes, 3, image, image, generator=gen)

    def sample(batch: int):
        y = torch.randint(0, classes, (batch,), generator=gen)
        return means[y] + torch.randn(batch, 3, image, image, generator=gen), y

    return sample


def run(
    steps: int = 100,
    width: int = 8,
    batch: int = 32,
    image: int = 16,
    every: int = 5,
    lr: float = 0.05,
    window: bool = True,
    out="monitor_resnet",
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Train and monitor; returns ``{"log", "plot", "losses", "probe"}``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = cifar_resnet20(width=width, seed=seed).train()
    probe = fs.Probe(model, points="residual", unit="sample", second_moment="dense")
    log_path = out / "monitor.jsonl"
    log_path.unlink(missing_ok=True)
    log = fs.MonitorLog(
        log_path, every=every, window=window, meta={"model": "cifar_resnet20", "width": width, "lr": lr}
    )
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sample = synthetic_task(image, seed=seed)
    losses = []
    start = time.perf_counter()
    with warnings.catch_warnings():
        # the BatchNorm coupling is explained in the module docstring
        warnings.filterwarnings("ignore", message=".*BatchNorm.*", category=UserWarning)
        for step in range(1, steps + 1):
            x, y = sample(batch)
            opt.zero_grad(set_to_none=True)
            with probe.observe(loss_reduction="mean", log=log, step=step):
                loss = F.cross_entropy(model(x), y)
                loss.backward()
            opt.step()
            losses.append(loss.item())
            if progress and step % every == 0:
                ag = [p["ag_max"] for p in log.last["points"].values()]
                print(
                    f"step {step:4d}  loss {loss.item():.3f}  AG_max first/last block: "
                    f"{ag[0] or float('nan'):.3g} / {ag[-1] or float('nan'):.3g}  "
                    f"({time.perf_counter() - start:.1f} s)"
                )
    plot = plot_monitor_log(log_path, out / "monitor.png")
    if progress:
        print(summary_markdown(read_monitor_log(log_path)))
        print(f"wrote {log_path} and {plot}")
    return {"log": log_path, "plot": plot, "losses": losses, "probe": probe}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image", type=int, default=16)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--cumulative",
        action="store_true",
        help="log estimates since the start instead of per window of --every steps",
    )
    parser.add_argument("--out", default="monitor_resnet")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default); 1 is steadier on a busy machine",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run(
        steps=args.steps,
        width=args.width,
        batch=args.batch,
        image=args.image,
        every=args.every,
        lr=args.lr,
        window=not args.cumulative,
        out=args.out,
        seed=args.seed,
    )


if __name__ == "__main__":
    main()
