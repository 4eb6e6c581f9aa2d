"""Peer benchmark: fused_stats' Probe against what a user would otherwise write, on one model.

Same LLaMA-style model (``bench/_harness.py``), same sequences, CPU, fp32, statistics at every
residual point (``model.layers.{i}``):

* **fused_stats**: ``Probe(model, second_moment="dense", cross=CrossSpec(w_in=W))`` and
  ``probe.step(batch, fs.causal_lm_loss)`` per batch: one activation-only backward per batch,
  streaming accumulators, nothing per-sample stored.
* **per-sequence loop** (what per-sequence scripts do): one forward/backward per sequence
  (``loss.backward()``, weight gradients included, as a training-style script runs it) with a
  tensor hook on each block's output, the row ``q_i = Σ_t ∂ℓ_i/∂z_t`` stored, the statistics
  computed at the end from the stacked rows (U-statistics through the Gram matrix).
* **Opacus** per-sample gradients (``GradSampleModule``, ``loss_reduction="sum"``) of a zero
  block inserted after every block, ``z + W_out φ(W z) + b`` with ``W_out = 0``, ``b = 0``
  (function-preserving): its ``b.grad_sample`` is ``q_i``, its ``W_out.grad_sample`` is
  ``c_i = Σ_t q_t φ(W z_t)ᵀ``, from which ``|C|_F² = (|Σc_i|² − Σ|c_i|²)/(n(n−1))``. Only the
  inserted blocks are trainable.

Printed: time per 1,000 sequences, peak memory (each case runs in a fresh process, which builds
the same model and sequences; the peak resident set above what the process held when the case
started), and the agreement of every statistic with fused_stats' (``|μ|², |μ|⁴, μᵀΣμ,
tr(Σ²), d_align, AG_max`` and ``|C|_F²``) as ratios. The cases run one after the other (each
timed alone: on this shared machine that adds noise of maybe 20 %, far below the differences
measured). Results: ``bench/results/peers_cpu.json``.

    python bench/bench_peers.py                         # hidden 256, 4 layers, seq 128, 64 seqs
    python bench/bench_peers.py --sequences 16 --hidden 64 --layers 2 --seq 32   # quick
"""

from __future__ import annotations

import gc
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import RESULTS, build_llama

import fused_stats as fs

RANK = 16


def u_stats(q: np.ndarray) -> dict:
    """The unbiased targets from stored rows (sums over distinct indices via the Gram matrix)."""
    q = q.astype(np.float64)
    n = q.shape[0]
    g = q @ q.T
    off = g - np.diag(np.diag(g))
    r = off.sum(1)
    s1, s2 = off.sum(), (off**2).sum()
    s3 = (r**2).sum() - s2
    s4 = s1**2 - 4 * s3 - 2 * s2
    n2, n3, n4 = n * (n - 1), n * (n - 1) * (n - 2), n * (n - 1) * (n - 2) * (n - 3)
    u1, u2, u3, u4 = s1 / n2, s2 / n2, s3 / n3, s4 / n4
    out = {"mu_norm2": u1, "mu_norm4": u4, "mu_sigma_mu": u3 - u4, "trace_sigma2": u2 - 2 * u3 + u4}
    # as fused_stats reports it: no signal (|μ|⁴ <= 0) gives 0; a variance estimate <= 0 makes
    # that bound vacuous (inf)
    d_par = u4 / out["mu_sigma_mu"] if out["mu_sigma_mu"] > 0 else float("inf")
    d_2 = u4 / out["trace_sigma2"] if out["trace_sigma2"] > 0 else float("inf")
    out["d_align"] = min(d_par, d_2) if u4 > 0 else 0.0
    out["ag_max"] = float(np.sqrt((q**2).sum(1)).max())
    return out


def cross_frob2(c: np.ndarray) -> float:
    """Unbiased ``|C|_F²`` from per-sample ``c_i`` (n, d, r)."""
    n = c.shape[0]
    c = c.reshape(n, -1).astype(np.float64)
    return float(((c.sum(0) ** 2).sum() - (c**2).sum()) / (n * (n - 1)))


def rss_mib() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(fn):
    """``(result, seconds, peak MiB)``: the peak resident set of this process (a fresh one per
    case, see ``main``) above what it held when the case started."""
    gc.collect()
    before = rss_mib()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return result, seconds, max(peak - before, 0.0)


def batches_of(data, B):
    n = data["input_ids"].shape[0]
    return [{k: v[i : i + B] for k, v in data.items()} for i in range(0, n, B)]


def run_probe(model, data, points, w_in, B):
    probe = fs.Probe(
        model, points=points, second_moment="dense", cross=fs.CrossSpec(w_in=w_in, activation="gelu")
    )
    for batch in batches_of(data, B):
        probe.step(batch, fs.causal_lm_loss)
    return {
        p: {
            **{
                k: getattr(probe.stats[p].estimate(), k)
                for k in ("mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2", "d_align", "ag_max")
            },
            "cross_frob2": probe.saturation(p).cross_frob2,
        }
        for p in points
    }


def sequence_loss(model, ids, labels):
    logits = model(input_ids=ids[None]).logits[0, :-1]
    target = labels[1:]
    keep = target != -100
    return nn.functional.cross_entropy(logits[keep], target[keep])


def run_loop(model, data, points):
    rows = {p: [] for p in points}
    for b in range(data["input_ids"].shape[0]):
        length = int(data["attention_mask"][b].sum())
        ids, labels = data["input_ids"][b, :length], data["labels"][b, :length]
        grads = {}
        handles = []
        for p in points:

            def hook(module, args, out, p=p, grads=grads):
                z = out[0] if isinstance(out, tuple) else out
                z.register_hook(lambda g, p=p, grads=grads: grads.__setitem__(p, g.detach()))

            handles.append(model.get_submodule(p).register_forward_hook(hook))
        try:
            sequence_loss(model, ids, labels).backward()
        finally:
            for h in handles:
                h.remove()
        model.zero_grad(set_to_none=True)
        for p in points:
            rows[p].append(grads[p][0].sum(0).double().numpy())
    return {p: u_stats(np.stack(r)) for p, r in rows.items()}


class ZeroBlockAfter(nn.Module):
    """``layer`` followed by a function-preserving block ``z + W_out gelu(W_in z) + b``."""

    def __init__(self, layer, w_in):
        super().__init__()
        self.layer = layer
        self.register_buffer("w_in", w_in.clone())
        self.out = nn.Linear(w_in.shape[0], w_in.shape[1], dtype=w_in.dtype)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, *args, **kwargs):
        res = self.layer(*args, **kwargs)
        z = res[0] if isinstance(res, tuple) else res
        z = z + self.out(nn.functional.gelu(z @ self.w_in.T))
        return (z, *res[1:]) if isinstance(res, tuple) else z


def run_opacus(model, data, points, w_in, B):
    from opacus import GradSampleModule

    layers = model.model.layers
    for p in model.parameters():
        p.requires_grad_(False)
    originals = list(layers)
    blocks = [ZeroBlockAfter(layer, w_in) for layer in originals]
    for i, block in enumerate(blocks):
        layers[i] = block
    try:
        gsm = GradSampleModule(model, loss_reduction="sum", batch_first=True, strict=False)
        q = {i: [] for i in range(len(blocks))}
        c = {i: [] for i in range(len(blocks))}
        for batch in batches_of(data, B):
            losses = fs.causal_lm_loss(gsm, batch)
            losses.sum().backward()
            for i, block in enumerate(blocks):
                q[i].append(block.out.bias.grad_sample.detach().double().numpy())
                c[i].append(block.out.weight.grad_sample.detach().double().numpy())
                block.out.bias.grad_sample = None
                block.out.weight.grad_sample = None
            gsm.zero_grad(set_to_none=True)
        gsm._close()
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
        for p in model.parameters():
            p.requires_grad_(True)
    out = {}
    for i, p in enumerate(points):
        stats = u_stats(np.concatenate(q[i]))
        stats["cross_frob2"] = cross_frob2(np.concatenate(c[i]))
        out[p] = stats
    return out


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "peers_cpu.json"))
    parser.add_argument("--no-opacus", action="store_true")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, data = build_llama(
        hidden=args.hidden, layers=args.layers, seq=args.seq, batch=args.sequences, vocab=args.vocab
    )
    points = fs.residual_points(model)
    w_in = torch.randn(RANK, args.hidden, generator=torch.Generator().manual_seed(1)) / args.hidden**0.5
    # the zero block's activation and W_in as fused_stats' CrossSpec uses them (exact-erf gelu)
    n = args.sequences
    runners = {
        "fused_stats Probe": lambda: run_probe(model, data, points, w_in, args.batch),
        "per-sequence loop": lambda: run_loop(model, data, points),
        "Opacus grad_sample": lambda: run_opacus(model, data, points, w_in, args.batch),
    }
    if args.case:
        # one case in this (fresh) process: its peak memory is its own; imports are not timed
        if args.case.startswith("Opacus"):
            import opacus
        stats, seconds, peak = measure(runners[args.case])
        print("RESULT " + json.dumps({"stats": stats, "seconds": seconds, "peak": peak}, default=float))
        return 0
    names = list(runners)
    if args.no_opacus:
        names.remove("Opacus grad_sample")
    else:
        try:
            import opacus  # noqa: F401
        except ImportError:
            print("opacus is not installed: its row is left out")
            names.remove("Opacus grad_sample")
    cases = {}
    for name in names:
        argv_case = [a for a in (argv if argv is not None else sys.argv[1:])] + ["--case", name]
        out = subprocess.run(
            [sys.executable, __file__, *argv_case], capture_output=True, text=True, check=True
        )
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
        got = json.loads(line[len("RESULT ") :])
        cases[name] = (got["stats"], got["seconds"], got["peak"])
    ref = cases["fused_stats Probe"][0]
    print(
        f"LlamaForCausalLM hidden {args.hidden}, {args.layers} layers, seq {args.seq}, "
        f"{n} sequences (batches of {args.batch}), {len(points)} points, fp32, "
        f"{torch.get_num_threads()} thread(s)"
    )
    print(
        f"{'case':>20} {'s / 1k seq':>11} {'x Probe':>8} {'peak MiB':>9}  statistic ratio to Probe "
        "(min .. max over points and statistics)"
    )
    base = cases["fused_stats Probe"][1]
    results = {"args": vars(args), "cases": {}}
    for name, (stats, seconds, peak) in cases.items():
        ratios = {
            p: {k: (v / ref[p][k] if ref[p][k] else float("nan")) for k, v in stats[p].items() if k in ref[p]}
            for p in points
        }
        flat = [r for point in ratios.values() for r in point.values() if np.isfinite(r)]
        print(
            f"{name:>20} {1000 * seconds / n:11.2f} {seconds / base:8.2f} {peak:9.1f}  "
            f"{min(flat):.6f} .. {max(flat):.6f}"
        )
        results["cases"][name] = {
            "seconds_per_1000": 1000 * seconds / n,
            "ratio_time": seconds / base,
            "peak_mib": peak,
            "stats": stats,
            "ratios_to_probe": ratios,
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
