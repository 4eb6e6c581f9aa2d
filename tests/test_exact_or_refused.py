"""The curvature gain's numerator and its refusal of
non-finite losses, and refusals that came too late or said the wrong thing.

References: per-sample gradients of the grown model (one backward per sample) and the brute
force over pairs of distinct samples; realised optimizer steps; hand-written expectations of
what is refused and where.
"""

from __future__ import annotations

import pytest
import torch
from test_growth_scores import batches, fp64_rms_norm, grown_at, tiny_llama

import fused_stats as fs
from fused_stats.api.growth import scores

transformers = pytest.importorskip("transformers")
POINT = "model.layers.0"


@pytest.fixture(autouse=True)
def fp64_norms(monkeypatch):
    # LlamaRMSNorm computes in fp32; its rounding (1e-8 relative) would blur fp64 comparisons
    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", fp64_rms_norm)


def per_sample_rows(grown, new, data) -> torch.Tensor:
    """One backward per sample: the flattened gradient of its loss on the new parameters, under
    eager attention as curvature_gain's copy runs (its softmax is fp32: 1e-8 from sdpa's)."""
    grown.set_attn_implementation("eager")
    rows = []
    for b in data:
        for i in range(b["input_ids"].shape[0]):
            one = {k: v[i : i + 1] for k, v in b.items()}
            loss = fs.causal_lm_loss(grown, one)[0]
            rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, new)]))
    return torch.stack(rows)


def test_curvature_gain_numerator_is_the_mean_over_pairs_of_distinct_samples():
    """``grad_sq`` = mean of ``⟨c_i, c_j⟩`` over ``i`` in the even batches and ``j`` in the odd
    ones: every term pairs two distinct samples, so its mean is ``|E c|²``; the plug-in
    ``|mean c|²`` (the old numerator) adds ``Σ|c_i|²/n²`` and is not that."""
    model = tiny_llama()
    protocol = fs.GrowthProtocol(["model.embed_tokens", POINT], seed=2)
    data = batches(5, 3, size=4)  # A: batches 0, 2 (8 samples); B: batch 1 (4)
    result = fs.curvature_gain(model, protocol, POINT, data, fs.causal_lm_loss)
    grown, new = grown_at(model, protocol, POINT)
    rows_a = per_sample_rows(grown, new, data[0::2])
    rows_b = per_sample_rows(grown, new, data[1::2])
    pairs = [float(a @ b) for a in rows_a for b in rows_b]
    brute = sum(pairs) / len(pairs)
    assert result.n == 12 and len(pairs) == 8 * 4
    assert result.grad_sq == pytest.approx(brute, rel=1e-9, abs=1e-15)
    everything = torch.cat([rows_a, rows_b]).mean(0)
    plug_in = float(everything @ everything)
    assert abs(plug_in - brute) > 1e-3 * abs(plug_in)  # the test can tell the two apart
    if result.grad_sq > 0 and result.ghg > 0:
        assert result.gain == pytest.approx(result.grad_sq**2 / (2 * result.ghg), rel=1e-12)
    with pytest.raises(fs.FusedStatsError, match="at least 3 batches"):
        fs.curvature_gain(model, protocol, POINT, data[:2], fs.causal_lm_loss)


def test_curvature_gain_numerator_is_unbiased_where_the_plug_in_is_not():
    """Exact expectation over the split: with per-sample tangents ``c_i = μ + e_i`` the split
    estimate's terms are ``⟨c_i, c_j⟩``, ``i ≠ j``; its mean over every assignment of the samples
    to batches equals the U-statistic ``(|Σc|² − Σ|c|²)/(n(n−1))`` exactly, the plug-in's exceeds
    it by ``(Σ|c|²/n − U)/n``. Checked on per-sample gradients of the grown model, the split
    computed by curvature_gain on each of the 15 splits of 6 samples into batches of 2."""
    import itertools

    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=4)
    pool = batches(11, 1, size=6)[0]
    grown, new = grown_at(model, protocol, POINT)
    rows = per_sample_rows(grown, new, [pool])
    n = rows.shape[0]
    total, squares = rows.sum(0), float((rows * rows).sum())
    u_stat = (float(total @ total) - squares) / (n * (n - 1))
    # every split of the 6 samples into A (4: batches 0 and 2) and B (2: batch 1)
    values = []
    for b_pair in itertools.combinations(range(n), 2):
        a = [i for i in range(n) if i not in b_pair]
        data = [{"input_ids": pool["input_ids"][idx]} for idx in (a[:2], list(b_pair), a[2:])]
        values.append(fs.curvature_gain(model, protocol, POINT, data, fs.causal_lm_loss).grad_sq)
    assert len(values) == 15
    assert sum(values) / len(values) == pytest.approx(u_stat, rel=1e-9)
    plug_in = float(total @ total) / n**2
    assert plug_in - u_stat == pytest.approx((squares / n - u_stat) / n, rel=1e-9)
    assert plug_in - u_stat > 1e-3 * abs(u_stat)


def left_padded(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 20, (4, 8), generator=g)
    mask = torch.ones(4, 8, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, :5] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_curvature_gain_refuses_a_left_padded_batch_instead_of_reporting_no_minimum():
    """Eager attention (the copy's, for the double backward) turns a fully masked row into NaN:
    the old code reported ``gain=None`` ("no minimum") with NaN numbers; now it is refused,
    naming the point, the batch and its samples. The same samples under the model's sdpa are
    finite (so the NaN is the eager copy's, not the data's)."""
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2)
    data = [left_padded(0), left_padded(1), left_padded(2)]
    assert bool(torch.isfinite(fs.causal_lm_loss(model, data[0])).all())
    with pytest.raises(
        fs.FusedStatsError, match=r"'model.layers.0'.*non-finite for samples \[0, 2\] of batch 0"
    ):
        fs.curvature_gain(model, protocol, POINT, data, fs.causal_lm_loss)
    # right padding is fine: every row attends to something
    right = [{k: v.flip(1) for k, v in b.items()} for b in data]
    result = fs.curvature_gain(model, protocol, POINT, right, fs.causal_lm_loss)
    assert all(map(torch.isfinite, map(torch.tensor, (result.grad_sq, result.ghg))))


def test_split_adam_score_refuses_non_finite_losses():
    model = tiny_llama()
    protocol = fs.GrowthProtocol([POINT], seed=2)
    data = batches(2, 2)

    def loss(m, b):
        out = fs.causal_lm_loss(m, b)
        return out * torch.tensor([1.0, float("nan"), 1, 1, 1, 1], dtype=out.dtype)

    with pytest.raises(fs.FusedStatsError, match=r"non-finite for samples \[1\] of batch 0"):
        fs.split_adam_score(model, protocol, POINT, data, loss)


# ------------------------------------------------------------------------------- item 9


def test_schedule_with_split_adam_and_one_probe_batch_is_refused_at_construction():
    protocol = fs.GrowthProtocol([POINT], score="split_adam")
    one = batches(0, 1)
    with pytest.raises(fs.FusedStatsError, match=r"split_adam.*at least 2 probe batches; got 1"):
        fs.GrowthSchedule(protocol, at_steps=[1], probe_batches=one)
    fs.GrowthSchedule(protocol, at_steps=[1], probe_batches=batches(0, 2))  # two halves: accepted
    fs.GrowthSchedule(fs.GrowthProtocol([POINT]), at_steps=[1], probe_batches=one)  # other scores


@pytest.mark.parametrize("scorer", ["curvature_gain", "split_adam_score"])
def test_width_scores_say_why_they_are_refused(scorer):
    """Growing every block alike (no partial width growth) does not help: the refusal is about
    the new units being slices of widened tensors, and is raised before anything is copied."""
    model = tiny_llama()
    points = ["model.embed_tokens", POINT]
    protocol = fs.GrowthProtocol(points, family="mlp_width", width=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fs.FusedStatsError, match="slices of widened parameter tensors") as info:
        getattr(fs, scorer)(model, protocol, POINT, batches(0, 3), fs.causal_lm_loss)
    assert "partial" not in str(info.value) and "only some blocks" not in str(info.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_a_negative_seed_is_refused_in_code_and_in_a_protocol_file_alike(tmp_path):
    from fused_stats.api.growth.protocol_file import read_protocol_file

    with pytest.raises(fs.FusedStatsError, match=r"seed must be an integer >= 0, got -3") as code:
        fs.GrowthProtocol([POINT], seed=-3)
    path = tmp_path / "g.toml"
    path.write_text('candidates = ["model.layers.0"]\nseed = -3\n')
    with pytest.raises(fs.FusedStatsError, match=r"seed must be an integer >= 0, got -3") as file:
        read_protocol_file(path)
    assert str(file.value) == f"protocol file {str(path)!r}: {code.value}"
    assert fs.GrowthProtocol([POINT], seed=0).seed == 0


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_sgd_first_step_is_what_the_scores_docstring_says(nesterov, gen):
    """A fresh SGD(momentum=μ) on a zero parameter: its first step is ``−η g``, with
    ``nesterov=True`` ``−η (1 + μ) g`` (1.9× at μ = 0.9), as the module docstring now says."""
    mu, eta = 0.9, 0.1
    theta = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    g = torch.randn(5, generator=gen, dtype=torch.float64)
    opt = torch.optim.SGD([theta], lr=eta, momentum=mu, nesterov=nesterov)
    theta.grad = g.clone()
    opt.step()
    factor = 1 + mu if nesterov else 1.0
    torch.testing.assert_close(theta.detach(), -eta * factor * g, rtol=1e-15, atol=0)
    doc = " ".join(scores.__doc__.split())
    assert "nesterov=True" in doc and "``(1 + μ) g``" in doc and "1.9×" in doc
    assert "whose first step is SGD's" not in doc
