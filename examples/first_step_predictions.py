"""The advisor's first-step predictions against real optimizer steps on the grown model.

1. an fp64 LLaMA (built from a config) is probed at every candidate of a GrowthProtocol, and
   fs.advise gives per candidate ``predicted_change_sgd = −⟨C_M, C_K⟩`` and
   ``predicted_change_adam = −⟨s_M, C_K⟩`` (per unit step, on the mean test loss);
2. for the top two candidates: a copy is grown by fs.grow, and one step of a fresh SGD or Adam
   over the new parameters only (on the gradient of the mean train loss) changes the mean test
   loss; measured / (η × predicted) is printed per η;
3. fs.curvature_gain at the top candidate, with its wall time against one training step.

LlamaRMSNorm computes in float32 whatever the model's dtype; its rounding (~1e-8 of the loss)
would hide the O(η²) remainder at small η, so this script runs the norms in fp64.
Run: ``PYTHONPATH=. python examples/first_step_predictions.py`` (about 20 s on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import transformers
from transformers.models.llama import modeling_llama

import fused_stats as fs

transformers.logging.set_verbosity_error()


def fp64_rms_norm(self, hidden):
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


modeling_llama.LlamaRMSNorm.forward = fp64_rms_norm

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--width", type=int, default=32)
parser.add_argument("--depth", type=int, default=3)
parser.add_argument("--batches", type=int, default=4, help="train batches (test: half of it)")
args = parser.parse_args()

torch.manual_seed(0)
VOCAB, T, B = 32, 16, 8
config = transformers.LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=args.width,
    intermediate_size=2 * args.width,
    num_hidden_layers=args.depth,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
model = transformers.LlamaForCausalLM(config).double().eval()
gen = torch.Generator().manual_seed(1)


def batch():
    motif = torch.randint(0, VOCAB, (B, 4), generator=gen)
    return {"input_ids": motif.repeat(1, T // 4)}


train = [batch() for _ in range(args.batches)]
test = [batch() for _ in range(max(1, args.batches // 2))]
protocol = fs.GrowthProtocol(fs.growth_points(model), seed=0)
probe = fs.Probe(model, points=list(protocol.candidates), cross=protocol)
probe.run(train, fs.causal_lm_loss, stream="train", mask="none", progress=False)
probe.run(test, fs.causal_lm_loss, stream="test", mask="none", progress=False)
advice = fs.advise(probe, protocol)
print("| point | |C|_F² | signal fraction | ΔL SGD per unit step | ΔL Adam per unit step |")
print("|---|---:|---:|---:|---:|")
for c in advice.ranked:
    print(
        f"| {c.point} | {c.cross_frob2:.4g} | {c.signal_fraction:.3g} | {c.predicted_change_sgd:.4g} "
        f"| {c.predicted_change_adam:.4g} |"
    )


def mean_loss(m, data):
    return torch.cat([fs.causal_lm_loss(m, b) for b in data]).mean()


def one_step(point, optimizer, eta):
    grown = copy.deepcopy(model)
    result = fs.grow(grown, protocol, at=[point])
    named = dict(grown.named_parameters())
    new = [named[n] for n in result.new_parameters]
    grown.eval()
    with torch.no_grad():
        base = float(mean_loss(grown, test))
    opt = optimizer(new, lr=eta)
    for p, g in zip(new, torch.autograd.grad(mean_loss(grown, train), new)):
        p.grad = g
    opt.step()
    with torch.no_grad():
        return float(mean_loss(grown, test)) - base


print()
print("| point | optimizer | eta | predicted ΔL | measured ΔL | measured / predicted |")
print("|---|---|---:|---:|---:|---:|")
for c in advice.ranked[:2]:
    for name, optimizer, per_unit in (
        ("SGD", torch.optim.SGD, c.predicted_change_sgd),
        ("Adam", torch.optim.Adam, c.predicted_change_adam),
    ):
        for eta in (1e-2, 1e-3, 1e-4):
            measured = one_step(c.point, optimizer, eta)
            print(
                f"| {c.point} | {name} | {eta:g} | {eta * per_unit:.4g} | {measured:.4g} "
                f"| {measured / (eta * per_unit):.5f} |"
            )

top = advice.ranked[0].point
start = time.perf_counter()
gain = fs.curvature_gain(model, protocol, top, train, fs.causal_lm_loss)
hvp = time.perf_counter() - start
start = time.perf_counter()
mean_loss(model, train).backward()
step = time.perf_counter() - start
model.zero_grad(set_to_none=True)
print()
value = f"{gain.gain:.4g}" if gain.gain is not None else f"not estimable ({gain.reason})"
print(
    f"curvature gain at {top}: |g|^2 = {gain.grad_sq:.4g}, g^T H g = {gain.ghg:.4g}, "
    f"|g|^4/(2 g^T H g) = {value} over {gain.n} samples; {hvp:.2f} s "
    f"({hvp / step:.1f}x one forward-backward of the {args.batches} train batches, {step:.2f} s)"
)
