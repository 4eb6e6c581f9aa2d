"""First-step predictions per optimizer, the signal fraction and the curvature gain, against real
optimizer steps on the grown model, per-sample gradients and an explicit Hessian (fp64)."""

from __future__ import annotations

import copy
import itertools
from types import SimpleNamespace

import pytest
import torch
import transformers

import fused_stats as fs
from fused_stats.api.growth.advise import advise
from fused_stats.api.growth.scores import candidate_scores

CANDIDATES = ["model.embed_tokens", "model.layers.0", "model.layers.1"]
ETAS = (1e-3, 1e-4, 1e-5)


def tiny_llama(seed=3):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=20,
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(cfg).double().eval()


def batches(seed: int, count: int, size: int = 6, T: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        start = torch.randint(0, 5, (size, 1), generator=g)
        noise = torch.randint(0, 20, (size, T), generator=g)
        keep = torch.rand(size, T, generator=g) < 0.8
        out.append({"input_ids": torch.where(keep, (start + torch.arange(T)) % 7, noise)})
    return out


def fp64_rms_norm(self, hidden):
    # LlamaRMSNorm computes in float32: its rounding, a non-smooth 1e-8 perturbation, would hide
    # the O(η²) remainder of a small step; the same formula in the input's dtype
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture(scope="module")
def setting():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", fp64_rms_norm)
        yield build_setting()


def build_setting():
    model = tiny_llama()
    protocol = fs.GrowthProtocol(CANDIDATES, seed=2)
    train, test = batches(0, 3), batches(1, 2)
    probe = fs.Probe(model, points=CANDIDATES, cross=protocol)
    probe.run(train, fs.causal_lm_loss, stream="train", mask="none", progress=False)
    probe.run(test, fs.causal_lm_loss, stream="test", mask="none", progress=False)
    return model, protocol, train, test, advise(probe, protocol)


def mean_loss(model, data) -> torch.Tensor:
    losses = torch.cat([fs.causal_lm_loss(model, b) for b in data])
    return losses.mean()


def grown_at(model, protocol, point):
    grown = copy.deepcopy(model)
    result = fs.grow(grown, protocol, at=[point])
    named = dict(grown.named_parameters())
    return grown.eval(), [named[n] for n in result.new_parameters]


def measured_change(model, protocol, point, train, test, optimizer, eta) -> float:
    """The mean test loss change of one step of a fresh ``optimizer`` over the new parameters only,
    on the gradient of the mean train loss."""
    grown, new = grown_at(model, protocol, point)
    with torch.no_grad():
        base = float(mean_loss(grown, test))
    opt = optimizer(new, lr=eta)
    grads = torch.autograd.grad(mean_loss(grown, train), new)
    for p, g in zip(new, grads):
        p.grad = g
    opt.step()
    with torch.no_grad():
        return float(mean_loss(grown, test)) - base


@pytest.mark.parametrize("point", ["model.embed_tokens", "model.layers.0"])
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW])
def test_one_real_step_changes_the_test_loss_by_the_prediction(setting, point, optimizer):
    model, protocol, train, test, advice = setting
    candidate = next(c for c in advice.ranked if c.point == point)
    per_unit = (
        candidate.predicted_change_sgd if optimizer is torch.optim.SGD else candidate.predicted_change_adam
    )
    assert per_unit is not None and per_unit < 0
    errors = []
    for eta in ETAS:
        ratio = measured_change(model, protocol, point, train, test, optimizer, eta) / (eta * per_unit)
        errors.append(abs(ratio - 1.0))
    assert errors[-1] < 1e-3, errors
    # the remainder is O(η²): the relative error falls about 10x per 10x smaller step
    for big, small in itertools.pairwise(errors):
        assert 4.0 < big / small < 25.0, errors


def per_sample_tangents(model, protocol, point, data) -> torch.Tensor:
    """One autograd.grad per sample: the flattened gradient of its loss on the new parameters."""
    grown, new = grown_at(model, protocol, point)
    rows = []
    for b in data:
        for i in range(b["input_ids"].shape[0]):
            loss = fs.causal_lm_loss(grown, {"input_ids": b["input_ids"][i : i + 1]})[0]
            rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, new)]))
    return torch.stack(rows)


@pytest.mark.parametrize("point", CANDIDATES)
def test_scores_against_per_sample_gradients_of_the_grown_model(setting, point):
    model, protocol, train, test, advice = setting
    candidate = next(c for c in advice.ranked if c.point == point)
    c_train = per_sample_tangents(model, protocol, point, train)
    c_test = per_sample_tangents(model, protocol, point, test)
    n = c_train.shape[0]
    total, squares = c_train.sum(0), (c_train * c_train).sum()
    unbiased = (total @ total - squares) / (n * (n - 1))
    assert candidate.signal_fraction == pytest.approx(float(unbiased / (squares / n)), rel=1e-9)
    mean_train, mean_test = c_train.mean(0), c_test.mean(0)
    assert candidate.predicted_change_sgd == pytest.approx(float(-(mean_train @ mean_test)), rel=1e-9)
    sign = mean_train / (mean_train.abs() + 1e-8)
    assert candidate.predicted_change_adam == pytest.approx(float(-(sign @ mean_test)), rel=1e-9)


def test_adam_eps_is_the_protocols_and_hashed(setting):
    model, protocol, train, test, _ = setting
    assert "adam_eps" not in protocol.to_dict() and "score" not in protocol.to_dict()
    wide = fs.GrowthProtocol(CANDIDATES, seed=2, adam_eps=1e-3)
    assert wide.digest != protocol.digest and fs.GrowthProtocol.from_dict(wide.to_dict()) == wide
    probe = fs.Probe(model, points=["model.layers.0"], cross=wide)
    probe.run(train, fs.causal_lm_loss, stream="train", mask="none", progress=False)
    probe.run(test, fs.causal_lm_loss, stream="test", mask="none", progress=False)
    c_train = per_sample_tangents(model, wide, "model.layers.0", train).mean(0)
    c_test = per_sample_tangents(model, wide, "model.layers.0", test).mean(0)
    sign = c_train / (c_train.abs() + 1e-3)
    report = probe.report(misalignment_trials=0).data
    adam = report["growth_protocol"]["scores"]["model.layers.0"]["adam_inner"]
    assert adam == pytest.approx(float(sign @ c_test), rel=1e-9)


def test_score_declares_the_ranking_and_every_score_is_reported(setting):
    model, protocol, train, test, advice = setting
    by_default = [c.point for c in advice.ranked]
    assert by_default == [c.point for c in sorted(advice.ranked, key=lambda c: -c.cross_frob2)]
    for score, key in (
        ("signal_fraction", lambda c: -c.signal_fraction),
        ("adam_first_step", lambda c: c.predicted_change_adam),
        ("split_adam", lambda c: -c.split_adam_score),
    ):
        declared = fs.GrowthProtocol(CANDIDATES, seed=2, score=score)
        assert declared.digest != protocol.digest and declared.to_dict()["score"] == score
        probe = fs.Probe(model, points=CANDIDATES, cross=declared)
        probe.run(train, fs.causal_lm_loss, stream="train", mask="none", progress=False)
        probe.run(test, fs.causal_lm_loss, stream="test", mask="none", progress=False)
        ranked = advise(probe, declared)
        assert [c.point for c in ranked.ranked] == [c.point for c in sorted(ranked.ranked, key=key)]
        assert ranked.score == score and ranked.to_dict()["score"] == score
        # the same numbers whatever ranks
        assert {c.point: c.signal_fraction for c in ranked.ranked} == pytest.approx(
            {c.point: c.signal_fraction for c in advice.ranked}, rel=1e-12
        )
    with pytest.raises(fs.FusedStatsError, match="score must be one of"):
        fs.GrowthProtocol(CANDIDATES, score="loss")


def test_adam_prediction_is_not_available_under_a_projection(setting):
    model, _, train, test, _ = setting
    projected = fs.GrowthProtocol(CANDIDATES, seed=2, projection=4)
    probe = fs.Probe(model, points=CANDIDATES, cross=projected)
    probe.run(train, fs.causal_lm_loss, stream="train", mask="none", progress=False)
    probe.run(test, fs.causal_lm_loss, stream="test", mask="none", progress=False)
    advice = advise(probe, projected)
    assert all(c.predicted_change_adam is None for c in advice.ranked)
    data = probe.report(misalignment_trials=0).data
    assert all(v["adam_inner"] is None for v in data["growth_protocol"]["scores"].values())
    assert all("split_a_on_b" not in v for v in data["growth_protocol"]["scores"].values())
    assert all(c.split_adam_score is None for c in advice.ranked)
    # a record claiming an Adam value under a projection is not believed either
    for v in data["growth_protocol"]["scores"].values():
        v["adam_inner"] = 1.0
    assert all(c.predicted_change_adam is None for c in advise(data, projected).ranked)
    for v in data["growth_protocol"]["scores"].values():
        v["split_a_on_b"] = v["split_b_on_a"] = 1.0
    assert all(c.split_adam_score is None for c in advise(data, projected).ranked)
    # SGD: (r/k) <C_M Pᵀ, C_K Pᵀ>, of mean <C_M, C_K> over P, from per-sample gradients of the
    # zero maps [o_proj | down_proj] (the tangent's column order)
    point = "model.layers.0"
    candidate = next(c for c in advice.ranked if c.point == point)
    p_matrix = probe.cross_stats[point].w_in.to(torch.float64)
    means = []
    for data_batches in (train, test):
        grown, _ = grown_at(model, projected, point)
        maps = [
            grown.get_submodule("model.layers.1.self_attn.o_proj").weight,
            grown.get_submodule("model.layers.1.mlp.down_proj").weight,
        ]
        total, count = 0, 0
        for b in data_batches:
            for i in range(b["input_ids"].shape[0]):
                loss = fs.causal_lm_loss(grown, {"input_ids": b["input_ids"][i : i + 1]})[0]
                total = total + torch.cat(torch.autograd.grad(loss, maps), dim=1)
                count += 1
        means.append(total / count @ p_matrix.T)
    r, k = p_matrix.shape[1], p_matrix.shape[0]
    assert (r, k) == (8 + 12, 4)
    want = -(r / k) * float((means[0] * means[1]).sum())
    assert candidate.predicted_change_sgd == pytest.approx(want, rel=1e-9)
    assert advice.to_dict()["adam_available"] is False
    assert "not available under a random projection" in advice.to_markdown()
    with pytest.raises(fs.FusedStatsError, match=r"adam_first_step.*projection"):
        fs.GrowthProtocol(CANDIDATES, projection=4, score="adam_first_step")
    with pytest.raises(fs.FusedStatsError, match=r"split_adam.*projection"):
        fs.GrowthProtocol(CANDIDATES, projection=4, score="split_adam")


class WithValues(torch.nn.Module):
    """``model`` called with some parameters replaced by ``values`` (torch.func.functional_call)."""

    def __init__(self, model, values):
        super().__init__()
        self.model, self.values = model, values

    def forward(self, **inputs):
        return torch.func.functional_call(self.model, self.values, (), inputs)


def test_curvature_gain_against_an_explicit_hessian(setting):
    model, protocol, train, _, _ = setting
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # a point where the new block's gᵀHg > 0 (else the gain is None)
    point = "model.layers.1"
    result = fs.curvature_gain(model, protocol, point, train, fs.causal_lm_loss)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    grown, new = grown_at(model, protocol, point)
    grown.set_attn_implementation("eager")  # CPU SDPA has no double backward
    names = [n for n, p in grown.named_parameters() if any(p is q for q in new)]
    shapes = [p.shape for p in new]
    sizes = [p.numel() for p in new]

    def batch_loss(flat, b):
        values = dict(zip(names, (v.reshape(s) for v, s in zip(flat.split(sizes), shapes))))
        return fs.causal_lm_loss(WithValues(grown, values), b).mean()

    flat = torch.cat([p.detach().reshape(-1) for p in new])
    # three batches of 6, each its own group: batch c's Hessian between the other two's mean
    # gradients, averaged over c
    grads = [torch.autograd.functional.jacobian(lambda f, b=b: batch_loss(f, b), flat) for b in train]
    hessians = [
        torch.autograd.functional.hessian(lambda f, b=b: batch_loss(f, b), flat, vectorize=True)
        for b in train
    ]
    ghg = sum(float(grads[(c + 2) % 3] @ hessians[c] @ grads[(c + 1) % 3]) for c in range(3)) / 3
    # |g|² from the halves (batches 0 and 2 against batch 1): the mean gradients of the halves
    grad_sq = float((grads[0] + grads[2]) / 2 @ grads[1])
    assert grad_sq > 0 and ghg > 0
    assert result.n == 18 and result.parameters == tuple(names)
    assert result.grad_sq == pytest.approx(grad_sq, rel=1e-10)
    assert result.ghg == pytest.approx(ghg, rel=1e-8)
    assert result.gain == pytest.approx(grad_sq**2 / (2 * ghg), rel=1e-8)
    assert result.reason is None


def test_split_adam_score_against_per_sample_gradients(setting):
    model, protocol, train, test, _ = setting
    data = train + test  # five batches: A = 0, 2, 4 (18 samples), B = 1, 3 (12)
    point = "model.layers.1"
    result = fs.split_adam_score(model, protocol, point, data, fs.causal_lm_loss)
    half_a = per_sample_tangents(model, protocol, point, data[0::2]).mean(0)
    half_b = per_sample_tangents(model, protocol, point, data[1::2]).mean(0)
    a_on_b = float((half_a / (half_a.abs() + 1e-8)) @ half_b)
    b_on_a = float((half_b / (half_b.abs() + 1e-8)) @ half_a)
    assert (result.n_a, result.n_b) == (18, 12)
    assert result.a_on_b == pytest.approx(a_on_b, rel=1e-9) and result.b_on_a == pytest.approx(
        b_on_a, rel=1e-9
    )
    assert result.score == pytest.approx((a_on_b + b_on_a) / 2, rel=1e-9)
    with pytest.raises(fs.FusedStatsError, match="at least 2 batches"):
        fs.split_adam_score(model, protocol, point, data[:1], fs.causal_lm_loss)


def brute_split(model, protocol, point, train, eps=1e-8) -> tuple[float, float]:
    """``⟨s_A, C_B⟩`` and ``⟨s_B, C_A⟩`` from per-sample gradients, A: train batches 0, 2, ..."""
    half_a = per_sample_tangents(model, protocol, point, train[0::2]).mean(0)
    half_b = per_sample_tangents(model, protocol, point, train[1::2]).mean(0)
    return float((half_a / (half_a.abs() + eps)) @ half_b), float((half_b / (half_b.abs() + eps)) @ half_a)


@pytest.mark.parametrize("point", CANDIDATES)
def test_advice_reports_the_split_adam_score_against_per_sample_gradients(setting, point, tmp_path):
    model, protocol, train, test, advice = setting
    a_on_b, b_on_a = brute_split(model, protocol, point, train)
    assert a_on_b != pytest.approx(b_on_a, rel=1e-3)  # the two terms are told apart below
    candidate = next(c for c in advice.ranked if c.point == point)
    assert candidate.split_adam_score == pytest.approx((a_on_b + b_on_a) / 2, rel=1e-9)
    # the probe's halves are fs.split_adam_score's (batch parity)
    direct = fs.split_adam_score(model, protocol, point, train, fs.causal_lm_loss)
    assert candidate.split_adam_score == pytest.approx(direct.score, rel=1e-9)
    # a saved and reloaded report gives the same advice, the split score included
    probe = fs.Probe(model, points=CANDIDATES, cross=protocol)
    probe.run(train, fs.causal_lm_loss, stream="train", mask="none", progress=False)
    probe.run(test, fs.causal_lm_loss, stream="test", mask="none", progress=False)
    report = probe.report(misalignment_trials=0)
    record = report.data["growth_protocol"]["scores"][point]
    assert record["split_n"] == [12, 6]
    assert record["split_a_on_b"] == pytest.approx(a_on_b, rel=1e-9)
    assert record["split_b_on_a"] == pytest.approx(b_on_a, rel=1e-9)
    reloaded = fs.Report.from_json(report.to_json(tmp_path / "report.json"))
    assert advise(reloaded.data, protocol).to_dict() == advise(probe, protocol).to_dict()
    # a report made without the halves: no split score, the rest unchanged
    for v in reloaded.data["growth_protocol"]["scores"].values():
        for key in ("split_a_on_b", "split_b_on_a", "split_n"):
            v.pop(key)
    old = advise(reloaded.data, protocol)
    assert all(c.split_adam_score is None for c in old.ranked)
    assert [c.predicted_change_adam for c in old.ranked] == [c.predicted_change_adam for c in advice.ranked]


def test_split_halves_follow_the_train_steps_only(setting):
    model, protocol, train, test, _ = setting
    point = "model.layers.0"
    probe = fs.Probe(model, points=[point], cross=protocol)
    # test steps in between do not shift the parity of the train steps
    for batch in train:
        probe.step(batch, fs.causal_lm_loss, stream="train", mask="none")
        probe.step(test[0], fs.causal_lm_loss, stream="test", mask="none")
    a_on_b, b_on_a = brute_split(model, protocol, point, train)
    record = probe.report(misalignment_trials=0).data["growth_protocol"]["scores"][point]
    assert record["split_a_on_b"] == pytest.approx(a_on_b, rel=1e-9)
    assert record["split_b_on_a"] == pytest.approx(b_on_a, rel=1e-9)
    # a failed step leaves the halves as they were
    with pytest.raises(RuntimeError, match="boom"):
        probe.step(train[0], lambda m, b: (_ for _ in ()).throw(RuntimeError("boom")), stream="train")
    again = probe.report(misalignment_trials=0).data["growth_protocol"]["scores"][point]
    assert again["split_a_on_b"] == pytest.approx(a_on_b, rel=1e-9)
    # one train batch: half B is empty, no split score
    single = fs.Probe(model, points=[point], cross=protocol)
    single.step(train[0], fs.causal_lm_loss, stream="train", mask="none")
    assert "split_a_on_b" not in single.report(misalignment_trials=0).data["growth_protocol"]["scores"][point]


def test_no_split_score_when_train_samples_came_another_way(setting, tmp_path):
    model, protocol, train, _, _ = setting
    point = "model.layers.0"
    saved = fs.Probe(model, points=[point], cross=protocol)
    saved.run(train, fs.causal_lm_loss, stream="train", mask="none", progress=False)
    saved.save_state(tmp_path / "state")
    # restored accumulators carry no halves, and steps after the restore cannot rebuild them
    restored = fs.Probe(model, points=[point], cross=fs.GrowthProtocol(CANDIDATES, seed=2))
    restored.load_state(tmp_path / "state")
    restored.step(train[0], fs.causal_lm_loss, stream="train", mask="none")
    restored.step(train[1], fs.causal_lm_loss, stream="train", mask="none")
    record = restored.report(misalignment_trials=0).data["growth_protocol"]["scores"][point]
    assert "split_a_on_b" not in record and record["mean_sq_norm"] is not None
    # accumulators replaced under a probe that kept halves: its halves no longer apply
    two = fs.Probe(model, points=[point], cross=fs.GrowthProtocol(CANDIDATES, seed=2))
    two.run(train[:2], fs.causal_lm_loss, stream="train", mask="none", progress=False)
    assert "split_a_on_b" in two.report(misalignment_trials=0).data["growth_protocol"]["scores"][point]
    two.load_state(tmp_path / "state")
    assert "split_a_on_b" not in two.report(misalignment_trials=0).data["growth_protocol"]["scores"][point]


def test_a_cleared_train_stream_starts_a_fresh_split(setting):
    model, protocol, train, _, _ = setting
    point = "model.layers.0"
    probe = fs.Probe(model, points=[point], cross=protocol)
    probe.run(train, fs.causal_lm_loss, stream="train", mask="none", progress=False)
    probe.clear_stream("train")
    probe.run(train, fs.causal_lm_loss, stream="train", mask="none", progress=False)
    # three steps before: the parity runs on, so half A is now train batch 1
    a_on_b, b_on_a = brute_split(model, protocol, point, train)
    record = probe.report(misalignment_trials=0).data["growth_protocol"]["scores"][point]
    assert record["split_n"] == [6, 12]
    assert record["split_a_on_b"] == pytest.approx(b_on_a, rel=1e-9)
    assert record["split_b_on_a"] == pytest.approx(a_on_b, rel=1e-9)


def test_candidate_scores_keep_no_split_under_a_projection():
    # what candidate_scores reads of a CrossStats: c_sum, n, sq_norm_sum
    g = torch.Generator().manual_seed(0)
    train = SimpleNamespace(c_sum=torch.randn(3, 2, generator=g, dtype=torch.float64), n=4, sq_norm_sum=2.0)
    half = (torch.randn(3, 2, generator=g, dtype=torch.float64), 2)
    assert "split_a_on_b" in candidate_scores(train, None, half=half)
    assert "split_a_on_b" not in candidate_scores(train, None, projected=True, half=half)
