"""``fs.gradmax_directions`` from a probe: GradMax's ``C = E[Σ_t q_t u_tᵀ]`` at the MLP that
``mlp_width`` grows (``q`` at the MLP's output, ``u`` its input), against a per-sample loop on an
fp64 LLaMA (one ``torch.autograd.grad`` per sequence, ``u`` recorded by a hook), and the
refusal of a growth tangent probe, whose cross-gradient is over the new units' activations,
also when ``width == d`` gives it C's shape."""

from __future__ import annotations

import pytest
import torch

import fused_stats as fs
from fused_stats.api.growth.gradmax import ModuleInputs

from per_sample_reference import lm_sample_loss
from tiny_models import TINY_LLAMA_CONFIG, tiny_lm_config

transformers = pytest.importorskip("transformers")
F64 = torch.float64
MLP = "model.layers.1.mlp"
NEOX_MLP = "gpt_neox.layers.1.mlp"  # act(W_fc u): one input map, where GradMax's derivation holds


def llama(seed: int):
    config = transformers.LlamaConfig(**{k: v for k, v in TINY_LLAMA_CONFIG.items() if k != "model_type"})
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(F64).eval()


def neox(seed: int):
    torch.manual_seed(seed)
    return transformers.GPTNeoXForCausalLM(tiny_lm_config("neox", layers=2, d=8)).to(F64).eval()


def reference_c(model, ids: torch.Tensor, at: str = MLP) -> torch.Tensor:
    """mean over sequences of Σ_t q_t u_tᵀ, q = ∂ℓ_i/∂(MLP output), u the MLP's input."""
    mlp = model.get_submodule(at)
    total = torch.zeros(model.config.hidden_size, model.config.hidden_size, dtype=F64)
    seen = {}

    def hook(module, args, out):
        seen["u"], seen["y"] = args[0], out

    for row in ids:
        handle = mlp.register_forward_hook(hook)
        loss = lm_sample_loss(model, row, row)
        handle.remove()
        (q,) = torch.autograd.grad(loss, seen["y"])
        total += q[0].T @ seen["u"][0].detach()
    return total / ids.shape[0]


def test_directions_from_the_mlp_inputs_match_a_per_sample_loop(gen):
    model = neox(seed=1)
    d, k = model.config.hidden_size, 3
    ids = torch.randint(0, 40, (6, 9), generator=gen)
    probe = fs.Probe(model, points=[NEOX_MLP], cross=ModuleInputs(d))
    probe.step({"input_ids": ids, "labels": ids}, fs.causal_lm_loss, mask="attention")
    c_ref = reference_c(model, ids, NEOX_MLP)
    assert c_ref.abs().max() > 0
    torch.testing.assert_close(
        probe.cross_stats[NEOX_MLP].c_sum / probe.cross_stats[NEOX_MLP].n, c_ref, rtol=1e-9, atol=1e-12
    )
    rows = fs.gradmax_directions(probe, NEOX_MLP, k)
    assert rows.shape == (k, d)
    # the maximiser of Σ_j |C w_j|² over orthonormal rows: the top-k eigenvectors of CᵀC (eigh)
    evals, evecs = torch.linalg.eigh(c_ref.T @ c_ref)
    torch.testing.assert_close(
        (rows * evecs[:, -k:].flip(1).T).sum(1).abs(), torch.ones(k, dtype=F64), atol=1e-6, rtol=0
    )
    torch.testing.assert_close((c_ref @ rows.T).pow(2).sum(), evals[-k:].sum(), rtol=1e-9, atol=0)
    assert (rows.gather(1, rows.abs().argmax(1, keepdim=True)) > 0).all()
    # the directions are accepted by the growth they are for: mlp_width at the boundary before
    protocol = fs.GrowthProtocol(
        candidates=("gpt_neox.emb_dropout", "gpt_neox.layers.0"), family="mlp_width", width=2
    )
    fs.grow(model, protocol, init_directions={"gpt_neox.layers.0": rows, "gpt_neox.emb_dropout": rows})


def test_gated_mlp_directions_are_refused_where_the_first_order_term_vanishes(gen):
    """LLaMA's new unit ``silu(g·u)(v·u)`` with zero output column: its gradient has no term of
    first order in ``(g, v)`` (checked: at rows ``t (g, v)`` it scales as ``t²``), so GradMax's
    directions are refused, from a probe of the gated MLP and as ``init_directions``, with the
    model unchanged; ``C`` itself (the probe's measurement) is still right."""
    model = llama(seed=1)
    d = model.config.hidden_size
    ids = torch.randint(0, TINY_LLAMA_CONFIG["vocab_size"], (6, 9), generator=gen)
    probe = fs.Probe(model, points=[MLP], cross=ModuleInputs(d))
    probe.step({"input_ids": ids, "labels": ids}, fs.causal_lm_loss, mask="attention")
    c_ref = reference_c(model, ids)
    torch.testing.assert_close(
        probe.cross_stats[MLP].c_sum / probe.cross_stats[MLP].n, c_ref, rtol=1e-9, atol=1e-12
    )
    with pytest.raises(fs.FusedStatsError, match=r"model.layers.1.mlp.*'llama'.*gated"):
        fs.gradmax_directions(probe, MLP, 2)
    # the new unit's output-column gradient E[Σ_t q_t silu(t g·u) (t v·u)] is O(t²): halving t
    # quarters it (a first-order term would halve it)
    g_row, v_row = torch.randn(2, d, generator=gen, dtype=F64)
    u, q = torch.randn(9, d, generator=gen, dtype=F64), torch.randn(9, d, generator=gen, dtype=F64)
    grad = [q.T @ (torch.nn.functional.silu(t * u @ g_row) * (t * u @ v_row)) for t in (1e-6, 5e-7)]
    torch.testing.assert_close(grad[1] / grad[0], torch.full((d,), 0.25, dtype=F64), rtol=1e-4, atol=0)
    rows = fs.gradmax_directions(c_ref, None, 2)  # C given as a matrix: nothing says it is gated
    protocol = fs.GrowthProtocol(
        candidates=("model.embed_tokens", "model.layers.0"), family="mlp_width", width=2
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(fs.FusedStatsError, match=r"'model.embed_tokens' \(init_directions\).*gated"):
        fs.grow(model, protocol, init_directions={"model.layers.0": rows, "model.embed_tokens": rows})
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    fs.grow(model, protocol)  # random rows: accepted


def test_growth_tangent_probe_refused_even_with_c_shape(gen):
    model = llama(seed=2)
    d = model.config.hidden_size
    protocol = fs.GrowthProtocol(candidates=("model.layers.0",), family="mlp_width", width=d)
    probe = fs.Probe(model, cross=protocol)
    ids = torch.randint(0, TINY_LLAMA_CONFIG["vocab_size"], (4, 7), generator=gen)
    probe.step({"input_ids": ids, "labels": ids}, fs.causal_lm_loss)
    assert tuple(probe.cross_stats["model.layers.0"].c_sum.shape) == (d, d)  # C's shape, not its space
    with pytest.raises(fs.FusedStatsError, match="new units' activations"):
        fs.gradmax_directions(probe, "model.layers.0", 2)
    with pytest.raises(fs.FusedStatsError, match="features given"):
        fs.gradmax_directions(probe.cross_stats["model.layers.0"], None, 2)
    with pytest.raises(fs.FusedStatsError, match="not a point"):
        fs.gradmax_directions(probe, "model.layers.1", 2)
    with pytest.raises(fs.FusedStatsError, match="no cross-gradient"):
        fs.gradmax_directions(fs.Probe(model, points=[MLP]), MLP, 2)
    with pytest.raises(fs.FusedStatsError, match=r"expects a \(B, T, 5\) input"):
        bad = fs.Probe(model, points=[MLP], cross=ModuleInputs(5))
        bad.step({"input_ids": ids, "labels": ids}, fs.causal_lm_loss)
