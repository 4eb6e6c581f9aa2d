"""Probe a ResNet's residual stream: per-block statistics of the activation gradient on conv maps.

What it does: a CIFAR ResNet-20 (3 stages x 3 basic blocks, channels w/2w/4w) from
:mod:`fused_stats.networks.resnet`, trained briefly on a synthetic 10-class image task (class-dependent
colour and stripe pattern plus noise: no download), then probed after every block. For a conv map
(B, C, H, W) the feature axis is C: with ``unit="sample"`` each ``q_b ∈ R^C`` is the gradient of
image b's loss with respect to a per-channel bias added to the block's output at every pixel;
``unit="position"`` would make every pixel a sample and ``unit="flat"`` the whole C·H·W map.

The synthetic task is easy and the short training nearly fits it; a classifier trained to
convergence drives the train-mean gradient towards zero (docs/design.md, section 9), so expect small
``|μ|²`` and ``d_align`` here — the example shows the mechanics, not a width trend.

At the end it checks itself: a few images' per-sample vectors at the last block, as the probe
stores them, against one plain backward per image (it exits with an error if they disagree).

    python examples/probe_resnet.py                  # under a minute on 2 CPU cores
    python examples/probe_resnet.py --unit flat --width 4
"""

from __future__ import annotations

import argparse

import torch

import fused_stats as fs
from fused_stats.networks.resnet import cifar_resnet20


def synthetic_images(n: int, side: int, seed: int):
    """Images whose class sets a mean colour and a stripe frequency; noise of the same size."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=gen)
    colours = torch.linspace(-1, 1, 10)
    grid = torch.arange(side, dtype=torch.float32)
    stripes = torch.sin(grid[None, :] * (1 + y[:, None]) * 0.5)  # (n, side)
    x = colours[y][:, None, None, None] + stripes[:, None, None, :]
    x = x.expand(n, 3, side, side) + torch.randn(n, 3, side, side, generator=gen)
    return x.contiguous(), y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--side", type=int, default=16)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--probe-batches", type=int, default=4)
    parser.add_argument("--unit", default="sample", choices=["sample", "position", "flat"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = cifar_resnet20(width=args.width, seed=args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(args.train_steps):
        x, y = synthetic_images(args.batch, args.side, seed=1000 + step)
        loss = fs.classification_loss(model, (x, y)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if args.train_steps:
        print(f"trained {args.train_steps} steps, last batch loss {loss.item():.3f}")

    print("residual points:", fs.residual_points(model))
    # "auto": a pool of per-sample vectors while it is smaller than a d x d matrix, then dense
    probe = fs.Probe(model, unit=args.unit, second_moment="auto")
    train = [synthetic_images(args.batch, args.side, seed=10 + i) for i in range(args.probe_batches)]
    test = [synthetic_images(args.batch, args.side, seed=20 + i) for i in range(args.probe_batches)]
    probe.run(train, fs.classification_loss, stream="train")
    probe.run(test, fs.classification_loss, stream="test")

    print(
        f"\n{'point':10s} {'dim':>5s} {'n':>5s} {'|mu|^2':>10s} {'d_align':>9s} "
        f"{'B_align':>8s} {'AG_max':>9s} {'AG_mean':>9s} {'mu_M.g_K':>10s}"
    )
    for name in probe.points:
        est = probe.pooled(name).estimate()
        cert = probe.certificate(name)
        print(
            f"{name:10s} {est.dim:5d} {est.n:5d} {est.mu_norm2:10.3e} {est.d_align:9.4f} "
            f"{cert.b_align:8.4f} {est.ag_max:9.3e} {est.ag_mean:9.3e} "
            f"{probe.realized_alignment(name):10.3e}"
        )
    print("\n(estimates from the pooled train + test samples; B_align at M = train n, K = test n)")
    self_check(model, probe.points[-1], args.unit, train[0][0][:4], train[0][1][:4])


def self_check(model, point: str, unit: str, x, y) -> None:
    """The probe's per-sample vectors at one point against one plain backward per image.

    A separate pool-mode Probe on a few images stores its ``q_b``; here each image's loss is
    differentiated alone with respect to the block's output (a forward hook that only records it),
    and reduced as ``unit`` says: summed over pixels, one row per pixel, or flattened.
    """
    check = fs.Probe(model, points=[point], unit=unit, second_moment="pool")
    check.step((x, y), fs.classification_loss)
    got = check.stats[point].pool_rows()
    was_training = model.training
    model.eval()  # the probe differentiates in eval mode (BatchNorm running statistics)
    rows = []
    try:
        for b in range(x.shape[0]):
            seen = {}
            handle = model.get_submodule(point).register_forward_hook(
                lambda module, args, out, seen=seen: seen.setdefault("z", out)
            )
            try:
                loss = torch.nn.functional.cross_entropy(model(x[b : b + 1]), y[b : b + 1])
            finally:
                handle.remove()
            (g,) = torch.autograd.grad(loss, seen["z"])
            g = g[0].double()  # (C, H, W)
            if unit == "sample":
                rows.append(g.sum(dim=(1, 2))[None])
            elif unit == "position":
                rows.append(g.permute(1, 2, 0).reshape(-1, g.shape[0]))
            else:
                rows.append(g.reshape(1, -1))
    finally:
        model.train(was_training)
    want = torch.cat(rows)
    if got.shape != want.shape:
        raise SystemExit(f"self-check failed: probe rows {tuple(got.shape)} vs loop {tuple(want.shape)}")
    diff = float((got - want).abs().max() / want.abs().max())
    print(
        f"self-check at {point}: probe q_b vs one backward per image ({x.shape[0]} images, "
        f"unit={unit}): max |diff| / max |q| = {diff:.1e}"
    )
    if not diff < 1e-4:  # fp32 model: the two paths differ only by rounding
        raise SystemExit(f"self-check failed: relative difference {diff:.3e} >= 1e-4")


if __name__ == "__main__":
    main()
