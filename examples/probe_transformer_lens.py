"""fused_stats with TransformerLens: residual points by hook name, and fused_stats as the
statistics backend inside TransformerLens' own backward hooks.

A ``HookedTransformer`` is built from a config (random weights, fp64: no download). Three ways to
the same statistics at ``blocks.{i}.hook_resid_post`` (the residual stream after block ``i``):

1. ``fs.Probe(model)``: ``fs.residual_points`` finds the hook names, ``fs.causal_lm_loss`` calls
   the positional-input model as ``model(tokens)``; one activation-only backward per batch.
2. TransformerLens' own hooks: ``model.hooks(bwd_hooks=[(name, fold)])`` around the user's
   forward/backward of the summed per-sequence losses (TransformerLens'
   ``return_type="loss", loss_per_token=True``); each hook folds ``∂L/∂resid_post`` (B, T, d) into a
   ``fs.GradStats``, which sums every sequence's positions (``unit="sample"``). Nothing
   per-sample is stored.
3. The check: one backward per sequence, its gradient summed over positions, rows stacked, the
   unbiased estimates from the stored rows (``GradStats`` with ``second_moment="pool"`` over the
   exact rows would be circular, so the rows' U-statistics are written out here in numpy).

The script exits non-zero when the three disagree by more than 1e-9 (relative).

    python examples/probe_transformer_lens.py          # d_model 64, 4 layers, 64 sequences
    python examples/probe_transformer_lens.py --tiny   # what the tests run
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

import fused_stats as fs


def require_peer(module: str):
    """Import a peer library this example compares with, or stop with the command that installs
    the project's pinned peers (a bare ModuleNotFoundError does not say where they come from)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module and not str(exc.name or "").startswith(module + "."):
            raise
        raise SystemExit(
            f"{Path(sys.argv[0]).name} needs the peer library {module!r}, which is not installed: run "
            "`bash .ci/install-peers` from the repository root (the pinned versions of pyproject.toml's "
            "peers list, installed with --no-deps)"
        ) from None


def build(layers, d_model, vocab, ctx, seed=0):
    lens = require_peer("transformer_lens")
    HookedTransformer, HookedTransformerConfig = lens.HookedTransformer, lens.HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=layers,
        d_model=d_model,
        n_ctx=ctx,
        d_head=d_model // 4,
        n_heads=4,
        d_vocab=vocab,
        act_fn="gelu",
        dtype=torch.float64,
        seed=seed,
        device="cpu",
        normalization_type="LN",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # HookedTransformer in TL 3.x
        return HookedTransformer(cfg)


def unbiased_from_rows(q: np.ndarray) -> dict:
    """|μ|², |μ|⁴, μᵀΣμ, tr(Σ²) as U-statistics of the rows (sums over distinct indices, written
    with the Gram matrix g = q qᵀ; O(n²) memory)."""
    n = q.shape[0]
    g = q @ q.T
    diag = np.diag(g).copy()
    off = g - np.diag(diag)
    r = off.sum(1)  # Σ_{j≠i} g_ij
    s1 = off.sum()  # Σ_{i≠j} g_ij
    s2 = (off**2).sum()  # Σ_{i≠j} g_ij²
    s3 = (r**2).sum() - s2  # Σ_{i,j,k distinct} g_ij g_jk
    s4 = s1**2 - 4 * s3 - 2 * s2  # Σ_{i,j,k,l distinct} g_ij g_kl
    n2, n3, n4 = n * (n - 1), n * (n - 1) * (n - 2), n * (n - 1) * (n - 2) * (n - 3)
    u1, u2, u3, u4 = s1 / n2, s2 / n2, s3 / n3, s4 / n4
    return {"mu_norm2": u1, "mu_norm4": u4, "mu_sigma_mu": u3 - u4, "trace_sigma2": u2 - 2 * u3 + u4}


def relative_difference(q: np.ndarray, estimates) -> float:
    """The largest relative difference of any of ``estimates`` from :func:`unbiased_from_rows`,
    each over max(|reference|, 1e-6 x the estimate's scale in powers of the mean |q|²)."""
    want = unbiased_from_rows(q)
    scale = float(np.mean(np.sum(q**2, axis=1)))
    floors = {"mu_norm2": scale, "mu_norm4": scale**2, "mu_sigma_mu": scale**2, "trace_sigma2": scale**2}
    diff = 0.0
    for est in estimates:
        for key, value in want.items():
            diff = max(diff, abs(getattr(est, key) - value) / max(abs(value), 1e-6 * floors[key]))
    return diff


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the tests)")
    args = parser.parse_args(argv)
    layers, d, vocab, ctx, n, B = (2, 12, 31, 8, 12, 4) if args.tiny else (4, 64, 500, 32, 64, 16)
    torch.manual_seed(0)
    model = build(layers, d, vocab, ctx)
    points = fs.residual_points(model)
    print(f"HookedTransformer, {layers} layers, d_model {d}: points {points}")
    tokens = torch.randint(0, vocab, (n, ctx))
    batches = tokens.split(B)

    # 1. the probe
    probe = fs.Probe(model, second_moment="dense")
    for batch in batches:
        probe.step(batch, fs.causal_lm_loss)

    # 2. fused_stats inside TransformerLens' own backward hooks
    own = {p: fs.GradStats(d, second_moment="dense", name=p) for p in points}

    def fold(grad, hook):
        own[hook.name].update(grad.detach())  # (B, T, d): q_b = Σ_t ∂L/∂resid_post[b, t]

    for batch in batches:
        with model.hooks(bwd_hooks=[(p, fold) for p in points]):
            per_token = model(batch, return_type="loss", loss_per_token=True)  # (B, T-1)
            # sum of the per-sequence mean losses: each sequence's rows are ∂ℓ_b/∂z_b
            per_token.mean(dim=1).sum().backward()
        model.zero_grad(set_to_none=True)

    # 3. the check: one backward per sequence
    rows = {p: [] for p in points}
    for b in range(n):
        grads = {}

        def keep(grad, hook, grads=grads):
            grads[hook.name] = grad.detach()[0].sum(0)

        with model.hooks(bwd_hooks=[(p, keep) for p in points]):
            model(tokens[b : b + 1], return_type="loss").backward()
        model.zero_grad(set_to_none=True)
        for p in points:
            rows[p].append(grads[p].numpy())

    worst = 0.0
    print(f"{'point':>22} {'d_align':>11} {'|mu|^2':>11} {'tr(S^2)':>11}  max rel. diff")
    for p in points:
        diff = relative_difference(np.stack(rows[p]), (probe.stats[p].estimate(), own[p].estimate()))
        worst = max(worst, diff)
        est = probe.stats[p].estimate()
        print(f"{p:>22} {est.d_align:11.4g} {est.mu_norm2:11.4g} {est.trace_sigma2:11.4g}  {diff:.2e}")
    if worst > 1e-9:
        print(f"DISAGREE: probe / TransformerLens hooks / per-sample loop differ by {worst:.2e}")
        return 1
    print(f"probe, TransformerLens' own hooks and the per-sample loop agree (max rel. diff {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
