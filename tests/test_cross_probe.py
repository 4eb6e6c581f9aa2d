"""The depth probe's |C|_F^2 on real models against per-sample loops.

Reference (written here, no package code): for every sample its own forward with plain hooks that
only record the point outputs ``z``, and ONE backward of its own loss (fp64, padding stripped from
the sequence) giving ``q_t = ∂ℓ/∂z_t``; then, explicitly, ``c_i = Σ_t q_t φ(W_in z_t)ᵀ`` with
``W_in`` the spec's projection and φ written from its formula (gelu via erf), and the
U-statistic ``|C|_F² = avg_{i≠j} <c_i, c_j>_F`` as the mean of the off-diagonal entries of the
Gram matrix of the flattened ``c_i`` (every ordered pair of distinct samples). ``unit="position"``:
every counted position is a sample with ``c = q φᵀ``. The probe sees padded batches in several
steps; the comparison is to 1e-6 relative.

Also: with ``activation="constant"`` (φ ≡ 1, rank 1) ``C = μ``, so ``|C|²`` equals the GradStats
``mu_norm2`` at the same point; ``probe.saturation``'s ``ag_max``/``ag_mean`` against max/mean
``|q_i|`` of the reference gradients, its SE against the plug-in Hoeffding variance and its null SE
written out from the reference ``c_i`` (tuple sums by brute-force loops within each probed batch);
the report data holds the saturation dicts; the Triton path (interpreter) gives the
torch path's result inside the probe.
"""

from __future__ import annotations

import math

import pytest
import torch

import fused_stats as fs
from fused_stats.networks.resnet import cifar_resnet20

from tiny_models import padded_lm_batch, split

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

F64 = torch.float64
VOCAB = 40


PHI = {
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))),
    "tanh": torch.tanh,
    "constant": torch.ones_like,
}


def build_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=12,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        initializer_range=0.3,
    )
    return transformers.LlamaForCausalLM(cfg).double().train()


def lm_batch(gen, lengths, T):
    return padded_lm_batch(gen, lengths, T, VOCAB)


def record_one(model, names, run_loss):
    """``{name: (z, q)}`` of one sample: outputs recorded by hooks, ONE backward of its loss."""
    outs, handles = {}, []
    for name in names:

        def hook(module, args, out, name=name):
            outs[name] = out[0] if isinstance(out, (tuple, list)) else out

        handles.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        loss = run_loss(model)
    finally:
        for h in handles:
            h.remove()
    grads = torch.autograd.grad(loss, [outs[n] for n in names])
    return {n: (outs[n].detach()[0], g.detach()[0]) for n, g in zip(names, grads)}


def lm_loss_one(model, ids, labels):
    logits = model(input_ids=ids[None]).logits[0]
    terms = [
        -torch.log_softmax(logits[t], -1)[labels[t + 1]] for t in range(len(ids) - 1) if labels[t + 1] != -100
    ]
    return torch.stack(terms).mean()


def lm_rows(model, batch, names):
    """Per sample and point: (z, q), each (length, d), padding stripped."""
    model.eval()
    rows = {n: [] for n in names}
    for b in range(batch["input_ids"].shape[0]):
        length = int(batch["attention_mask"][b].sum())
        ids, labels = batch["input_ids"][b, :length], batch["labels"][b, :length]
        got = record_one(model, names, lambda m, ids=ids, labels=labels: lm_loss_one(m, ids, labels))
        for n in names:
            rows[n].append(got[n])
    return rows


def conv_rows(model, x, y, names):
    """Per image and point: (z, q) as (pixels, channels)."""
    model.eval()
    rows = {n: [] for n in names}
    for b in range(x.shape[0]):
        got = record_one(
            model, names, lambda m, b=b: torch.nn.functional.cross_entropy(m(x[b : b + 1]), y[b : b + 1])
        )
        for n in names:
            z, q = got[n]
            rows[n].append((z.reshape(z.shape[0], -1).T, q.reshape(q.shape[0], -1).T))
    return rows


def reference_cs(samples, w_in, activation, unit):
    """The flattened ``c_i`` (rows, in sample order) and, alongside, the probe's ``q_i``:
    ``Σ_t q_t`` per sample (``unit="sample"``) or one row per position."""
    cs, qs = [], []
    for z, q in samples:
        phi = PHI[activation](z @ w_in.T)
        if unit == "sample":
            cs.append(sum(torch.outer(q[t], phi[t]) for t in range(q.shape[0])))
            qs.append(q.sum(0))
        else:
            cs.extend(torch.outer(q[t], phi[t]) for t in range(q.shape[0]))
            qs.extend(q[t] for t in range(q.shape[0]))
    return torch.stack([c.reshape(-1) for c in cs]), torch.stack(qs)


def reference_cross(samples, w_in, activation, unit):
    """``(|C|_F² as the mean over distinct ordered pairs, n)`` from per-sample (z, q)."""
    flat, _ = reference_cs(samples, w_in, activation, unit)
    n = flat.shape[0]
    gram = flat @ flat.T
    off = ~torch.eye(n, dtype=torch.bool)
    return float(gram[off].mean()), n


def reference_se(flat, batch_sizes):
    """Plug-in Hoeffding SE of the U-statistic (cross_stats docstring; Hoeffding 1948):
    ``Var = (4(n−2) ζ1 + 2 ζ2)/(n(n−1))``, ``ζ1 = E[k_ij k_jk] − m4``, ``ζ2 = E[k_ij²] − m4``,
    ``m4 = E[k_ij k_kl]``, each expectation the average over ordered tuples of distinct indices
    taken INSIDE each batch (brute-force loops), pooled over batches; also the null SE
    ``sqrt(2 E[k_ij²]/(n(n−1)))``. Returns ``(Var, null SE, tuple sums, tuple counts)``."""
    from itertools import permutations

    sums, counts, start = [0.0, 0.0, 0.0], [0, 0, 0], 0
    for size in batch_sizes:
        k = (flat[start : start + size] @ flat[start : start + size].T).tolist()
        start += size
        for i, j in permutations(range(size), 2):
            sums[0] += k[i][j] ** 2
            counts[0] += 1
        for i, j, h in permutations(range(size), 3):
            sums[1] += k[i][j] * k[j][h]
            counts[1] += 1
        for i, j, h, m in permutations(range(size), 4):
            sums[2] += k[i][j] * k[h][m]
            counts[2] += 1
    assert start == flat.shape[0] and min(counts) > 0
    e2, e3, m4 = (s / c for s, c in zip(sums, counts))
    n = flat.shape[0]
    var = (4 * (n - 2) * (e3 - m4) + 2 * (e2 - m4)) / (n * (n - 1))
    return var, math.sqrt(2 * e2 / (n * (n - 1))), sums, counts


def assert_rel(got, want, rel, what):
    assert abs(got - want) <= rel * abs(want), f"{what}: {got!r} vs reference {want!r}"


@pytest.mark.parametrize("unit", ["sample", "position"])
def test_llama_cross_matches_per_sample_loop(unit, gen):
    model = build_llama()
    points = fs.residual_points(model)
    spec = fs.CrossSpec(rank=5, activation="gelu", seed=2)
    lengths = [7, 4, 7, 3, 6, 7, 5, 6, 2, 7, 4, 5] if unit == "sample" else [5, 3, 5, 4]
    batch = lm_batch(gen, lengths, max(lengths))
    test_batch = lm_batch(gen, [6, 2, 6, 5], 6)
    probe = fs.Probe(model, unit=unit, second_moment="dense", cross=spec)
    parts = split(batch, [3, len(lengths) - 3] if unit == "position" else [6, 6])
    for part in parts:
        probe.step(part, fs.causal_lm_loss)
    # the samples each step contributed: sequences, or counted positions (targets not -100)
    batch_sizes = [
        part["input_ids"].shape[0] if unit == "sample" else int(part["attention_mask"].sum())
        for part in parts
    ]
    probe.step(test_batch, fs.causal_lm_loss, stream="test")
    assert model.training
    ref_train = lm_rows(model, batch, points)
    ref_test = lm_rows(model, test_batch, points)
    positive = 0
    for p in points:
        w_in = spec.projection(12, dtype=F64)
        assert torch.equal(probe.cross_stats[p].w_in, w_in)
        want, n = reference_cross(ref_train[p], w_in, "gelu", unit)
        assert probe.cross_stats[p].n == n
        assert_rel(probe.cross_stats[p].cross_frob2(), want, 1e-6, f"llama {unit} {p} train")
        want_t, n_t = reference_cross(ref_test[p], w_in, "gelu", unit)
        assert probe.test_cross_stats[p].n == n_t
        assert_rel(probe.test_cross_stats[p].cross_frob2(), want_t, 1e-6, f"llama {unit} {p} test")
        sat = probe.saturation(p)
        assert_rel(sat.cross_frob2, want, 1e-6, "saturation().cross_frob2")
        flat, qs = reference_cs(ref_train[p], w_in, "gelu", unit)
        norms = qs.norm(dim=1)  # AG = |q_i| of the per-sample (or per-position) gradients
        assert_rel(sat.ag_max, float(norms.max()), 1e-9, f"ag_max {unit} {p}")
        assert_rel(sat.ag_mean, float(norms.mean()), 1e-9, f"ag_mean {unit} {p}")
        assert sat.n == n and sat.rank == 5
        var, se_null, sums, counts = reference_se(flat, batch_sizes)
        acc = probe.cross_stats[p]
        assert list(acc.p) == counts, (acc.p, counts)
        for got, want, what in zip(acc.u.tolist(), sums, ("k_ij^2", "k_ij k_jk", "k_ij k_kl")):
            assert_rel(got, want, 1e-6, f"sum of {what} {unit} {p}")
        assert_rel(sat.cross_frob2_se_null, se_null, 1e-6, f"cross_frob2_se_null {unit} {p}")
        # with 3-6 samples per batch the plug-in variance can be negative; the SE is then None
        if var > 0:
            assert_rel(sat.cross_frob2_se, math.sqrt(var), 1e-6, f"cross_frob2_se {unit} {p}")
            positive += 1
        else:
            assert sat.cross_frob2_se is None and "cross_frob2_se" in sat.not_estimable, (sat, var)
    if unit == "position":  # this data gives a positive plug-in variance at layers.0
        assert positive >= 1


@pytest.mark.parametrize("unit", ["sample", "position"])
def test_resnet_cross_matches_per_sample_loop(unit, gen):
    """Conv maps: channels are the features, pixels the positions."""
    model = cifar_resnet20(width=4, seed=1, random_batchnorm=True).double()
    points = ["layer1.1", "layer2.0", "layer3.2"]
    B, side = (7, 8) if unit == "sample" else (3, 4)
    x = torch.randn(B, 3, side, side, generator=gen, dtype=F64)
    y = torch.randint(0, 10, (B,), generator=gen)
    spec = fs.CrossSpec(rank=3, activation="tanh", seed=4)
    probe = fs.Probe(model, points=points, unit=unit, second_moment="dense", cross=spec)
    half = B // 2
    probe.step((x[:half], y[:half]), fs.classification_loss)
    probe.step((x[half:], y[half:]), fs.classification_loss)
    ref = conv_rows(model, x, y, points)
    for p in points:
        d = probe.dims[p]
        want, n = reference_cross(ref[p], spec.projection(d, dtype=F64), "tanh", unit)
        assert probe.cross_stats[p].n == n
        assert_rel(probe.cross_stats[p].cross_frob2(), want, 1e-6, f"resnet {unit} {p}")


def test_constant_rank_one_equals_mu_norm2(gen):
    """φ ≡ 1 with rank 1: c_i = q_i, so |C|² is the GradStats' unbiased |μ|² at the same point."""
    model = build_llama(seed=3)
    probe = fs.Probe(model, second_moment="dense", cross=fs.CrossSpec(rank=1, activation="constant"))
    batch = lm_batch(gen, [6, 3, 6, 5, 2, 6], 6)
    probe.step(batch, fs.causal_lm_loss)
    probe.step(lm_batch(gen, [4, 4, 2], 4), fs.causal_lm_loss)
    for p in probe.points:
        mu2 = probe.stats[p].estimate().mu_norm2
        assert_rel(probe.saturation(p).cross_frob2, mu2, 1e-9, f"constant block at {p}")
        assert abs(mu2) > 1e-6  # a real signal, not two zeros


def test_report_and_argument_checks(gen):
    model = cifar_resnet20(width=2, seed=0)
    with pytest.raises(fs.FusedStatsError, match="CrossSpec"):
        fs.Probe(model, cross={"rank": 4})
    with pytest.raises(fs.FusedStatsError, match="flat"):
        fs.Probe(model, unit="flat", cross=fs.CrossSpec(rank=2))
    plain = fs.Probe(model)
    x, y = torch.randn(6, 3, 8, 8, generator=gen), torch.randint(0, 10, (6,), generator=gen)
    plain.step((x, y), fs.classification_loss)
    with pytest.raises(fs.FusedStatsError, match="cross="):
        plain.saturation("layer1.0")
    probe = fs.Probe(model, cross=fs.CrossSpec(rank=2, activation="relu"))
    probe.step((x, y), fs.classification_loss)
    with pytest.raises(fs.FusedStatsError, match="test stream"):
        probe.saturation("layer1.0", stream="test")
    data = probe._report_data(misalignment_trials=0)
    for pt in data["points"]:
        sat = pt["saturation"]
        assert sat["n"] == 6 and sat["rank"] == 2
        assert sat["cross_frob2"] == pytest.approx(probe.cross_stats[pt["name"]].cross_frob2(), rel=1e-12)
        assert isinstance(sat["saturated"], bool) and 0 <= sat["p_value"] <= 1
    text = probe.report(misalignment_trials=0).to_markdown()
    assert "saturation" in text


def test_triton_backend_in_probe_matches_torch(monkeypatch, gen):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = build_llama(seed=5)
    batch = lm_batch(gen, [6, 3, 6, 5, 4], 6)
    spec = fs.CrossSpec(rank=4, activation="silu", seed=7)
    out = {}
    for backend in ("torch", "triton"):
        probe = fs.Probe(model, second_moment="dense", cross=spec, backend=backend)
        probe.step(batch, fs.causal_lm_loss)
        out[backend] = probe
    for p in out["torch"].points:
        a, b = out["torch"].cross_stats[p], out["triton"].cross_stats[p]
        assert a.n == b.n
        torch.testing.assert_close(b.c_sum, a.c_sum, rtol=1e-12, atol=1e-14)
        assert b.cross_frob2() == pytest.approx(a.cross_frob2(), rel=1e-10)
        sa, sb = out["torch"].saturation(p), out["triton"].saturation(p)
        assert (sb.cross_frob2_se is None) == (sa.cross_frob2_se is None)
        if sa.cross_frob2_se is not None:
            assert sb.cross_frob2_se == pytest.approx(sa.cross_frob2_se, rel=1e-8)
