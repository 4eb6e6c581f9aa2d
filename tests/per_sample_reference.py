"""Independent per-sample references for the Probe tests (no code shared with fused_stats.api).

* :func:`point_grads_one_sample` — the activation gradients of ONE sample's loss at named modules:
  a plain forward with hooks that only *record* the modules' outputs (nothing detached, parameters
  left trainable), then ``torch.autograd.grad(loss, outputs)``. One backward per sample.
* :func:`lm_sample_loss` — a per-sequence causal-LM loss written token by token:
  ``ℓ = −(1/|V|) Σ_{t∈V} log softmax(logits[t])[labels[t+1]]``, ``V = {t : labels[t+1] ≠ −100}``,
  for a sequence already stripped of its padding.
* :func:`lm_reference` / :func:`conv_reference` — loops over the samples of a batch with the two
  functions above, turning each sample's gradient into per-sample vectors by explicit sums.
* :func:`u_targets` — ``tr Σ = avg |q_i − q_j|²/2`` and the four targets as averages over ordered tuples of DISTINCT indices, in fp64:
  ``|μ|² = avg q_iᵀq_j``, ``|μ|⁴ = avg (q_iᵀq_j)(q_kᵀq_l)``, and, written with difference vectors
  ``d_jl = q_j − q_l`` (E[d d̃ᵀ]/2 = Σ) so that the large mean cancels before any product instead of
  after it, ``μᵀΣμ = avg q_iᵀ d_jl d_jlᵀ q_k / 2`` and ``tr(Σ²) = avg (d_ijᵀ d_kl)² / 4`` (both
  expand to ``U3 − U4`` and ``U2 − 2U3 + U4`` of docs/design.md, section 2). For n ≤ 12
  :func:`reference.brute_force_targets` (exact rational arithmetic) is used instead; the fp64
  averages are held to that brute force at n = 8 and 12 in ``test_estimators_bruteforce.py``.

A point whose output the loss does not use, or whose gradient is identically zero, fails the
reference loudly: a zero reference would agree with a probe that captured nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import reference

F64 = torch.float64


def point_grads_one_sample(model, names, run_loss):
    """``{name: ∂ℓ/∂z_name}`` for the scalar loss ``run_loss(model)`` of one sample."""
    outputs = {}
    handles = []

    def make(name):
        def hook(module, args, out):
            outputs[name] = out[0] if isinstance(out, (tuple, list)) else out

        return hook

    for name in names:
        handles.append(model.get_submodule(name).register_forward_hook(make(name)))
    try:
        loss = run_loss(model)
    finally:
        for h in handles:
            h.remove()
    assert loss.dim() == 0
    missing = [n for n in names if n not in outputs]
    assert not missing, f"reference: modules {missing} never ran in the forward pass"
    # allow_unused only so that a point off the loss path is reported by name below, never
    # silently read as a zero gradient (which would agree with a probe that also drops it)
    grads = torch.autograd.grad(loss, [outputs[n] for n in names], allow_unused=True)
    result = {}
    for n, g in zip(names, grads):
        assert g is not None, f"reference: the loss does not depend on the output of {n!r}"
        assert bool(g.ne(0).any()), f"reference: the gradient at {n!r} is identically zero"
        result[n] = g.detach().to(F64)
    return result


def lm_sample_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token-by-token shifted cross-entropy of one unpadded sequence (1-d ``ids``, ``labels``)."""
    logits = model(input_ids=ids[None]).logits[0]
    terms = []
    for t in range(ids.shape[0] - 1):
        target = int(labels[t + 1])
        if target == -100:
            continue
        terms.append(-torch.log_softmax(logits[t], dim=-1)[target])
    return torch.stack(terms).mean()


def lm_reference(model, batch, points, unit, label_positions=False):
    """Per-point (n, d) per-sample vectors: one backward per sequence, its padding stripped.

    ``unit="sample"``: the sum over the sequence's positions (only those whose next-token target
    is not -100 if ``label_positions``); ``"position"``: each such position is a row.
    """
    model.eval()
    rows = {p: [] for p in points}
    for b in range(batch["input_ids"].shape[0]):
        length = int(batch["attention_mask"][b].sum())
        ids = batch["input_ids"][b, :length]
        labels = batch["labels"][b, :length] if "labels" in batch else ids
        grads = point_grads_one_sample(
            model, points, lambda m, ids=ids, labels=labels: lm_sample_loss(m, ids, labels)
        )
        for p in points:
            g = grads[p][0]  # (length, d)
            if label_positions:
                # position t predicts token t+1: it counts when that target is supervised
                emits = torch.zeros(length, dtype=torch.bool)
                emits[:-1] = labels[1:] != -100
                g = g[emits]
            if unit == "sample":
                rows[p].append(g.sum(0, keepdim=True))
            else:
                rows[p].append(g)
    return _checked_rows(rows)


def _checked_rows(rows: dict) -> dict[str, torch.Tensor]:
    """Concatenate each point's rows, refusing a point whose rows are all zero: such a reference
    cannot tell a correct probe from one that captured nothing."""
    out = {p: torch.cat(r) for p, r in rows.items()}
    for p, q in out.items():
        assert q.shape[0] > 0 and bool(q.ne(0).any()), (
            f"reference rows at {p!r} are all zero, {tuple(q.shape)}"
        )
    return out


def classification_sample_loss(model, x: torch.Tensor, y: int) -> torch.Tensor:
    return F.cross_entropy(model(x[None]), torch.tensor([y]))


def _fp64_u_targets(q: torch.Tensor) -> dict[str, float]:
    q = q.to(F64)
    n = q.shape[0]
    idx = torch.arange(n)
    G = q @ q.T
    off = idx[:, None] != idx[None, :]
    mu2 = float(G[off].mean())
    # 4-tuples (i, j, k, l) all distinct, as a mask over pair x pair
    pi, pj = torch.meshgrid(idx, idx, indexing="ij")
    pi, pj = pi.flatten(), pj.flatten()
    pair_ok = pi != pj
    pi, pj = pi[pair_ok], pj[pair_ok]
    disjoint = (
        (pi[:, None] != pi[None, :])
        & (pi[:, None] != pj[None, :])
        & (pj[:, None] != pi[None, :])
        & (pj[:, None] != pj[None, :])
    )
    g_pairs = G[pi, pj]
    mu4 = float((g_pairs[:, None] * g_pairs[None, :])[disjoint].mean())
    D = q[pi] - q[pj]  # d_ij for every ordered pair
    tr2 = float(((D @ D.T) ** 2)[disjoint].mean() / 4)
    # μᵀΣμ: pairs (j, l) index d_jl, the outer i, k distinct from each other and from j, l
    A = q @ D.T  # A[i, p] = q_iᵀ d_p
    outside = (idx[:, None] != pi[None, :]) & (idx[:, None] != pj[None, :])  # (n, pairs)
    A = torch.where(outside, A, torch.zeros((), dtype=F64))
    per_pair = A.sum(0) ** 2 - (A * A).sum(0)  # Σ_{i≠k, both outside} A_ip A_kp
    count = n * (n - 1) * (n - 2) * (n - 3)
    msm = float(per_pair.sum() / (2 * count))
    tr = float((D * D).sum(1).mean() / 2)  # E|q_i − q_j|²/2 = tr Σ
    return {"trace_sigma": tr, "mu_norm2": mu2, "mu_norm4": mu4, "mu_sigma_mu": msm, "trace_sigma2": tr2}


def u_targets(q: torch.Tensor) -> dict[str, float]:
    """The four unbiased targets of the rows of ``q`` (n >= 4), see the module docstring."""
    n = q.shape[0]
    assert n >= 4, n
    if n <= 12:
        return reference.brute_force_targets(q)
    return _fp64_u_targets(q)


def norms(q: torch.Tensor) -> dict[str, float]:
    """``ag_max = max |q_i|`` and ``ag_mean = mean |q_i|``."""
    r = q.to(F64).norm(dim=1)
    return {"ag_max": float(r.max()), "ag_mean": float(r.mean())}


def assert_estimate_matches(est, q: torch.Tensor, rel: float = 1e-6, context: str = "") -> None:
    """tr Σ, the four targets, ag_max/ag_mean and n of ``est`` against the references for ``q``.

    Relative to each reference value; a value that is itself a cancellation (|value| below 1e-6
    of its natural scale ``mean |q|²`` to the right power) is compared at that scale instead.
    """
    want = {**u_targets(q), **norms(q)}
    assert est.n == q.shape[0], f"{context}: n {est.n} vs {q.shape[0]}"
    assert est.dim == q.shape[1], f"{context}: dim {est.dim} vs {q.shape[1]}"
    scale2 = float((q.to(F64) ** 2).sum(1).mean())
    floor = {
        "trace_sigma": scale2,
        "mu_norm2": scale2,
        "mu_norm4": scale2**2,
        "mu_sigma_mu": scale2**2,
        "trace_sigma2": scale2**2,
        "ag_max": 0.0,
        "ag_mean": 0.0,
    }
    for key, value in want.items():
        got = getattr(est, key)
        tol = rel * max(abs(value), 1e-6 * floor[key])
        assert abs(got - value) <= tol, (
            f"{context}: {key} = {got!r}, reference {value!r} (|diff| {abs(got - value):.3e} > {tol:.3e})"
        )


def conv_reference(model, x, y, points, unit):
    """Per-point per-sample vectors of a conv net, one backward per image: ``sample`` sums the
    (C, H, W) gradient over pixels, ``position`` makes each pixel a row, ``flat`` flattens it."""
    model.eval()
    rows = {p: [] for p in points}
    for b in range(x.shape[0]):
        grads = point_grads_one_sample(
            model, points, lambda m, b=b: classification_sample_loss(m, x[b], int(y[b]))
        )
        for p in points:
            g = grads[p][0]  # (C, H, W)
            if unit == "sample":
                rows[p].append(g.sum(dim=(1, 2))[None])
            elif unit == "position":
                rows[p].append(g.permute(1, 2, 0).reshape(-1, g.shape[0]))
            else:
                rows[p].append(g.reshape(1, -1))
    return _checked_rows(rows)
