"""Decide where to add a residual block to a small CIFAR ResNet, then add it, mid-training.

1. train ``cifar_resnet20`` (width 8) on a synthetic 10-class image task with SGD + momentum;
2. fix a GrowthProtocol over every block boundary and probe the exact tangent of the block
   ``fs.grow`` would insert at each: the per-sample gradients of its zero last-BatchNorm scale and
   shift (docs/design.md, section 2.10), held-out images as the test stream;
3. ``fs.advise``: the candidates ranked by ``|C|_F²`` with Holm-corrected saturation tests and the
   width certificate at the same point (markdown and a plot in ``--out``);
4. ``fs.grow`` at ``advice.top`` (the Holm-significant candidate of largest ``|C|_F²``; None when
   saturated everywhere: the example then says "no growth" and stops) with the optimizer carried
   (new parameters start with zero momentum): the eval-mode logits are bit-identical, then
   training continues;
5. one SGD step on the new parameters against the first-order prediction ``-eta |grad|^2``: the
   relative error shrinks in proportion to eta (ratio ~10 per decade), down to where no ReLU
   further down changes sign. The new block is ``x + F(x)`` without a trailing ReLU
   (``out_relu=False``): the same function as ``relu(x + F(x))`` at its origin (``x`` is a ReLU
   output), but differentiable there, so autograd's gradient (which the probe measures) is the
   true derivative.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 python examples/grow_resnet.py`` (about 10 s on 2 CPU cores;
the thread count changes the BLAS reduction order, hence the trained model and its numbers). The
advice goes to ``--out``, by default a new temporary folder (printed at the end).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from monitor_resnet_training import synthetic_task

import fused_stats as fs
from fused_stats.networks.resnet import cifar_resnet20

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=60, help="SGD steps before and after growth")
parser.add_argument("--width", type=int, default=8, help="channels of the first stage")
parser.add_argument(
    "--at",
    default=None,
    help="grow at this candidate whatever the advice says (default: advice.top, no growth when None)",
)
parser.add_argument(
    "--out", default=None, help="output folder for advice.md, advice.png (default: a new temporary folder)"
)
args = parser.parse_args()
out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="grow_resnet_"))
torch.manual_seed(0)
sample = synthetic_task(16, seed=1)
model = cifar_resnet20(width=args.width, seed=0)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(steps: int) -> float:
    model.train()
    for _ in range(steps):
        x, y = sample(32)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


print(
    f"train loss after {args.steps} steps, {sum(1 for _ in fs.residual_points(model))} blocks: {train(args.steps):.4f}"
)

# fixed before any gradient is measured: where a block may go, what it is, its seed
blocks = [f"layer{s}.{i}" for s in (1, 2, 3) for i in range(3)]
protocol = fs.GrowthProtocol(candidates=blocks, family="layer", init="zero", seed=0)
print(f"protocol digest {protocol.digest[:16]}...")
probe = fs.Probe(model, points=protocol.candidates, cross=protocol)
for _ in range(4):
    probe.step(sample(64), fs.classification_loss)
for _ in range(2):
    probe.step(sample(64), fs.classification_loss, stream="test")
advice = fs.advise(probe, protocol)
out.mkdir(parents=True, exist_ok=True)
(out / "advice.md").write_text(advice.to_markdown())
advice.plot(out / "advice.png")
print("rank  point      n    |C|_F^2     p (Holm)  saturated")
for i, c in enumerate(advice.ranked, 1):
    print(f"{i:<5} {c.point:<10} {c.n:<4} {c.cross_frob2:<11.4e} {c.p_adjusted:<9.3g} {c.saturated}")
print(advice.verdict)

if args.at is None and advice.top is None:
    # saturated everywhere: no candidate's first-order gain is significant, so the advice is not
    # to grow; the example stops here (growing at the largest raw |C|^2 would ignore the test)
    print("no growth: saturated everywhere")
    print(f"wrote {out / 'advice.md'}, {out / 'advice.png'}")
    raise SystemExit(0)
# the Holm-significant candidate of largest |C|_F^2, unless --at names one
top = args.at if args.at is not None else advice.top.point
x_check, _ = sample(8)
with torch.no_grad():
    before = model(x_check)
# the new block with the BatchNorm statistics the probe calibrated and measured it with
result = fs.grow(model, protocol, at=[top], optimizer=opt, batchnorm_stats=probe)
with torch.no_grad():
    after = model(x_check)
print(f"grown at {top}: new block {result.positions[top]}, {len(result.new_parameters)} new tensors; "
      f"eval logits bit-identical: {torch.equal(before, after)}")  # fmt: skip
print(f"train loss after {args.steps} more steps, same optimizer: {train(args.steps):.4f}")

# the first SGD step on a fresh zero block (eval mode, fp64): the loss changes by -eta |g|^2 to
# first order, g the gradient of the new zero parameters (the depth paper's gain)
base = copy.deepcopy(model).double().eval()
fresh = fs.GrowthProtocol(candidates=[top], seed=1)
x, y = (t.double() if t.is_floating_point() else t for t in sample(64))
print("first SGD step on the new block (fp64, eval mode, summed loss over 64 images)")
print("eta     loss change       -eta|g|^2         relative error")
for eta in (0.1, 0.01, 0.001, 0.0001, 0.00001):
    m = copy.deepcopy(base)
    new = set(fs.grow(m, fresh).new_parameters)
    params = [p for n, p in m.named_parameters() if n in new]
    for p in m.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    # summed, not averaged: its rounding is 64x smaller relative to eta |g|^2
    loss0 = F.cross_entropy(m(x), y, reduction="sum")
    grads = torch.autograd.grad(loss0, params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= eta * g
        change = (F.cross_entropy(m(x), y, reduction="sum") - loss0).item()
    pred = -eta * sum((g**2).sum() for g in grads).item()
    print(f"{eta:<7} {change:<+17.6e} {pred:<+17.6e} {abs(change - pred) / abs(pred):.2e}")
print(f"wrote {out / 'advice.md'}, {out / 'advice.png'}")
