"""Growth surgery a run can resume from: optimizer order, the config copy, cross_block saving,
refused optimizers and the zero-state rule of widened tensors.

* Resume (the HF Trainer way): an AdamW with a decay and a no-decay group built by iterating
  ``named_parameters()`` trains, the model grows at a middle and a last boundary (or widens), a
  step follows; model and optimizer state are saved, the model reloaded with ``from_pretrained``,
  a fresh AdamW built the same way loads the state, and one step gives parameters bit-identical to
  one more step of the in-process pair (the reference: the run that never left the process).
* Config: a second model built from the same config object keeps its depth, saves and reloads
  with it; a refused call leaves the config object in place.
* cross_block: ``save_pretrained`` refuses (from_pretrained would drop the block); the state-dict
  route (rebuild, grow with the same protocol, ``load_state_dict``) gives the same logits after
  training the block.
* Refused optimizers change nothing; ``optimizer_groups`` names the group each parameter joined.
* Width growth under Adam: the first update of the new slice after growth at step count ``t``
  equals the explicit Adam formula with the shared ``t``, and relative to a zero-state start the
  closed form ``(1-β₁)/(1-β₁ᵗ)·√((1-β₂ᵗ)/(1-β₂))``.
* Protocol: widths and projections below 1 refused, ``width`` for family ``"layer"`` refused,
  digests recorded by the code before these changes kept for ``layer`` and ``cross_block``.
"""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
import torch

import fused_stats as fs
from fused_stats.api.growth.blocks import new_block, new_units
from fused_stats.api.growth.protocol import WIDTH_STATE_RULE, ZERO_STATE_RULE

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

F64 = torch.float64
VOCAB = 40


def llama(layers=3, seed=11):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=12,
        intermediate_size=20,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        vocab_size=VOCAB,
        initializer_range=0.3,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).to(F64)


def batch(gen):
    ids = torch.randint(3, VOCAB, (3, 7), generator=gen)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def trainer_groups(model):
    """Two groups as HF Trainer builds them: parameters of norm layers (found by module type) and
    biases without weight decay, the rest with it, each in named_parameters() order."""
    norm_params = {
        id(p) for m in model.modules() if "Norm" in type(m).__name__ for p in m.parameters(recurse=False)
    }
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if id(p) in norm_params or n.endswith("bias")]
    decay = [p for n, p in named if not (id(p) in norm_params or n.endswith("bias"))]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def step(model, opt, b):
    opt.zero_grad()
    model(**b).loss.backward()
    opt.step()


def aligned(model):
    for t in [*model.parameters(), *model.buffers()]:
        t.data = t.data.clone()  # fresh allocations: BLAS may round differently on file-offset views
    return model


@pytest.mark.parametrize("family", ["layer", "mlp_width"])
def test_resume_from_saved_model_and_optimizer_is_bit_identical(family, gen, tmp_path):
    model = llama().train()
    opt = torch.optim.AdamW(trainer_groups(model), lr=1e-2)
    for _ in range(3):
        step(model, opt, batch(gen))
    if family == "layer":
        protocol = fs.GrowthProtocol(["model.layers.0", "model.layers.2"], init="random", seed=2)
    else:
        protocol = fs.GrowthProtocol(
            ["model.embed_tokens", "model.layers.0", "model.layers.1"], family="mlp_width", width=3
        )
    result = fs.grow(model, protocol, optimizer=opt)
    # index for index the groups a fresh optimizer builds over the grown model
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [
        [id(p) for p in g["params"]] for g in trainer_groups(model)
    ]
    named = dict(model.named_parameters())
    for name, g in result.optimizer_groups.items():
        assert any(p is named[name] for p in opt.param_groups[g]["params"])
    if family == "layer":
        assert set(result.optimizer_groups) == set(result.new_parameters)
        assert result.optimizer_groups["model.layers.1.input_layernorm.weight"] == 1
        assert result.optimizer_groups["model.layers.1.mlp.down_proj.weight"] == 0
    else:
        assert set(result.optimizer_groups) == set(result.widened)
    step(model, opt, batch(gen))  # the new parameters have state now
    model.save_pretrained(tmp_path / "model")
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    last = batch(gen)
    step(model, opt, last)

    loaded = aligned(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=F64)).train()
    fresh = torch.optim.AdamW(trainer_groups(loaded), lr=1e-2)
    fresh.load_state_dict(torch.load(tmp_path / "opt.pt"))
    step(loaded, fresh, last)
    reloaded = dict(loaded.named_parameters())
    assert sorted(reloaded) == sorted(model.state_dict())
    for name, p in model.named_parameters():
        assert torch.equal(p, reloaded[name]), name


def test_other_models_sharing_the_config_keep_it(gen, tmp_path):
    model = llama(layers=2)
    other = transformers.LlamaForCausalLM(model.config).to(F64)
    shared = model.config
    fs.grow(model, fs.GrowthProtocol(["model.layers.0"]))
    assert model.config.num_hidden_layers == 3 and model.config is not shared
    assert all(m.config is model.config for m in model.modules() if "config" in vars(m))
    assert shared.num_hidden_layers == 2 and other.config is shared
    other.save_pretrained(tmp_path)
    assert len(transformers.AutoModelForCausalLM.from_pretrained(tmp_path).model.layers) == 2
    wide = fs.GrowthProtocol(["model.embed_tokens", "model.layers.0"], family="mlp_width", width=2)
    fs.grow(other, wide)
    assert other.config.intermediate_size == 22 and shared.intermediate_size == 20
    # a refused call leaves the model holding the config object it had
    third = transformers.LlamaForCausalLM(shared).to(F64)
    with pytest.raises(fs.FusedStatsError, match="would keep"):
        fs.grow(third, fs.GrowthProtocol(["model.layers.0"], family="mlp_width", width=2))
    assert third.config is shared and all(m.config is shared for m in third.modules() if "config" in vars(m))


def test_cross_block_save_is_refused_and_the_state_dict_resumes(gen, tmp_path):
    base = llama(layers=2).train()
    model = copy.deepcopy(base)
    protocol = fs.GrowthProtocol(["model.layers.0"], family="cross_block", width=4, seed=3)
    opt = torch.optim.AdamW(trainer_groups(model), lr=1e-2)
    result = fs.grow(model, protocol, optimizer=opt)
    assert result.optimizer_groups == {"model.layers.0.fused_stats_inserted.w_out": 0}
    assert [id(p) for p in opt.param_groups[0]["params"]] == [
        id(p) for p in trainer_groups(model)[0]["params"]
    ]
    for _ in range(2):
        step(model, opt, batch(gen))
    assert model.model.layers[0].fused_stats_inserted.w_out.abs().sum() > 0
    with pytest.raises(fs.FusedStatsError, match=r"inserted blocks at \['model.layers.0'\].*state_dict"):
        model.save_pretrained(tmp_path / "grown")
    assert not (tmp_path / "grown").exists()
    torch.save(model.state_dict(), tmp_path / "grown.pt")
    rebuilt = copy.deepcopy(base)
    fs.grow(rebuilt, protocol)
    rebuilt.load_state_dict(torch.load(tmp_path / "grown.pt"))
    b = batch(gen)
    with torch.no_grad():
        assert torch.equal(rebuilt(**b).logits, model(**b).logits)
    copied = copy.deepcopy(model)  # the refusal follows the copy, and removal lifts it
    fs.remove_inserted_block(copied, "model.layers.0")
    copied.save_pretrained(tmp_path / "plain")
    plain = aligned(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=F64))
    with torch.no_grad():
        assert torch.equal(plain(**b).logits, copied(**b).logits)
    with pytest.raises(fs.FusedStatsError, match="inserted blocks"):
        model.save_pretrained(tmp_path / "grown")


def _untouched(model, opt):
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config, config_dict = model.config, model.config.to_dict()
    groups = [[id(p) for p in g["params"]] for g in opt.param_groups]
    opt_state = copy.deepcopy(opt.state_dict())

    def check():
        after = model.state_dict()
        assert list(after) == list(state) and all(torch.equal(after[k], v) for k, v in state.items())
        assert model.config is config and config.to_dict() == config_dict
        assert [[id(p) for p in g["params"]] for g in opt.param_groups] == groups
        now = opt.state_dict()
        assert now["param_groups"] == opt_state["param_groups"]
        for k, s in opt_state["state"].items():
            assert all(torch.equal(now["state"][k][n], v) for n, v in s.items())

    return check


def test_optimizers_that_cannot_take_the_growth_are_refused(gen):
    model = llama(layers=2).train()
    layer1 = torch.optim.Adam(model.model.layers[1].parameters(), lr=1e-3)
    factored = torch.optim.Adafactor(model.parameters(), lr=1e-3)
    step(model, factored, batch(gen))
    step(model, layer1, batch(gen))
    wide = fs.GrowthProtocol(["model.embed_tokens", "model.layers.0"], family="mlp_width", width=2)
    cases = [
        (layer1, fs.GrowthProtocol(["model.layers.0"]), "none of the parameters of 'model.layers.0'"),
        (layer1, fs.GrowthProtocol(["model.layers.0"], family="cross_block"), "'model.layers.0'"),
        (layer1, wide, "none of the parameters of 'model.layers.0.mlp'"),
        (factored, wide, r"'row_var' of model.layers.0.mlp.gate_proj.weight has shape \(20, 1\)"),
    ]
    for opt, protocol, message in cases:
        check = _untouched(model, opt)
        with pytest.raises(fs.FusedStatsError, match=message):
            fs.grow(model, protocol, optimizer=opt)
        check()
    # the optimizer holds the neighbour: every new parameter joins, and says where
    result = fs.grow(model, fs.GrowthProtocol(["model.layers.1"]), optimizer=layer1)
    assert result.optimizer_extended and set(result.optimizer_groups) == set(result.new_parameters)
    assert fs.grow(model, fs.GrowthProtocol(["model.layers.0"])).optimizer_extended is False


def test_named_optimizer_keeps_names_in_step_with_its_slots():
    model = llama(layers=2)
    opt = torch.optim.SGD(model.named_parameters(), lr=0.1)
    fs.grow(model, fs.GrowthProtocol(["model.layers.0"]), optimizer=opt)
    names = [n for n, _ in model.named_parameters()]
    assert opt.param_groups[0]["param_names"] == names
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]


def _adam_update(g, t, lr, b1, b2, eps):
    """Adam's first update of a zero-moment element at step count t (torch's formula)."""
    m_hat = (1 - b1) * g / (1 - b1**t)
    v_hat = (1 - b2) * g * g / (1 - b2**t)
    return -lr * m_hat / (v_hat.sqrt() + eps)


@pytest.mark.parametrize("steps_before", [0, 1, 10, 50])
def test_width_growth_first_adam_update_of_the_new_slice(steps_before, gen):
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    model = llama(layers=1).train()
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(b1, b2), eps=eps)
    for _ in range(steps_before):
        step(model, opt, batch(gen))
    fs.grow(model, fs.GrowthProtocol(["model.embed_tokens"], family="mlp_width", width=3), optimizer=opt)
    down = model.model.layers[0].mlp.down_proj.weight
    before = down.detach().clone()
    step(model, opt, batch(gen))
    g = down.grad[:, 20:]
    moved = (down - before)[:, 20:]
    t = steps_before + 1
    assert g.abs().min() > 1e-6
    torch.testing.assert_close(moved, _adam_update(g, t, lr, b1, b2, eps), rtol=1e-9, atol=0)
    factor = (1 - b1) / (1 - b1**t) * ((1 - b2**t) / (1 - b2)) ** 0.5
    ratio = moved / _adam_update(g, 1, lr, b1, b2, eps)  # a zero-state start's first update
    big = g.abs() > 1e-3  # where eps is negligible the ratio is the closed form
    torch.testing.assert_close(ratio[big], torch.full_like(ratio[big], factor), rtol=1e-3, atol=0)
    assert {0: 1.0, 1: 0.7441, 10: 0.4821, 50: 0.7086}[steps_before] == pytest.approx(factor, abs=1e-4)


def test_protocol_validation_and_stored_digests():
    for name in ("width", "projection"):
        with pytest.raises(fs.FusedStatsError, match=f"{name} must be a positive int"):
            fs.GrowthProtocol(["a"], family="mlp_width", **{"width": 2, name: 0})
    with pytest.raises(fs.FusedStatsError, match="no meaning for family 'layer'"):
        fs.GrowthProtocol(["a"], family="layer", width=8)
    with pytest.raises(fs.FusedStatsError, match="needs family 'layer'"):
        fs.GrowthProtocol(["a"], family="mlp_width", width=2, init="copy")
    model = llama(layers=2)
    wide = fs.GrowthProtocol(["model.embed_tokens"], family="mlp_width", width=2)
    for init, message in (("random", "needs family 'layer'"), ("ones", "init must be one of")):
        with pytest.raises(fs.FusedStatsError, match=message):  # the prober's block, as fs.grow
            new_block(model, wide, "model.embed_tokens", init=init)
    # stored digests of protocol version 2 (blocks seeded by name; version 1 had d1da391f… and
    # dcd25362…): layer and cross_block records hold no width rule
    cross = fs.GrowthProtocol(["model.layers.0", "model.layers.1"], family="cross_block", width=5, seed=9)
    assert cross.digest == "739eecfd337ee3207d5b866d441cdd68f960ac725521b83fa4c5694da2b5c437"
    assert fs.GrowthProtocol(["model.layers.0"], seed=2).digest == (
        "e0072f1eb601011df5bf7e3e97c8323b6e677821316c4472918dad34c5f3e8ce"
    )
    wide = fs.GrowthProtocol(["model.layers.0", "model.layers.1"], family="mlp_width", width=3, seed=4)
    record = wide.to_dict()
    assert record["zero_state_rule"] == WIDTH_STATE_RULE != ZERO_STATE_RULE
    canonical = json.dumps(record, sort_keys=True, separators=(",", ":"))
    assert wide.digest == hashlib.sha256(canonical.encode()).hexdigest()
    assert (
        wide.digest != "03620429508309c0053237e276fe839cdfa9bcf741bfe7a1d88d75ed33e8e135"
    )  # the old, false rule
    assert fs.GrowthProtocol.from_dict(record) == wide


def test_gradmax_rows_have_the_norm_of_a_random_row(gen):
    """Directions are rescaled to σ√d, the expected norm of an N(0, σ²) row of length d (GPT-NeoX:
    a gated MLP's directions are refused, test_gradmax.py)."""
    torch.manual_seed(11)
    config = transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=12, intermediate_size=20, num_hidden_layers=2, num_attention_heads=2
    )
    config.initializer_range = 0.3
    model = transformers.GPTNeoXForCausalLM(config).to(F64)
    sigma, d = model.config.initializer_range, model.config.hidden_size
    protocol = fs.GrowthProtocol(["gpt_neox.emb_dropout"], family="mlp_width", width=3)
    directions = torch.randn(4, d, generator=gen, dtype=F64) * 5
    rows = new_units(model, protocol, "gpt_neox.emb_dropout", directions).pieces["mlp.dense_h_to_4h.weight"][
        1
    ]
    torch.testing.assert_close(
        rows.norm(dim=1), torch.full((3,), sigma * d**0.5, dtype=F64), rtol=1e-12, atol=0
    )
    cos = torch.nn.functional.cosine_similarity(rows, directions[:3], dim=1)
    torch.testing.assert_close(cos, torch.ones(3, dtype=F64), rtol=1e-12, atol=1e-12)


def test_groups_of_gpt2_cross_block_and_widened_biases():
    """GPT-2 blocks start with a norm (no-decay group): the cross block's w_out still joins the
    decay group; widened biases keep their no-decay slot."""
    torch.manual_seed(3)
    config = transformers.GPT2Config(n_embd=12, n_layer=2, n_head=2, n_positions=32, vocab_size=VOCAB)
    model = transformers.GPT2LMHeadModel(config).to(F64)
    opt = torch.optim.AdamW(trainer_groups(model), lr=1e-3)
    cross = fs.grow(model, fs.GrowthProtocol(["transformer.h.0"], family="cross_block"), optimizer=opt)
    assert cross.optimizer_groups == {"transformer.h.0.fused_stats_inserted.w_out": 0}
    wide = fs.GrowthProtocol(["transformer.drop", "transformer.h.0"], family="mlp_width", width=2)
    result = fs.grow(model, wide, optimizer=opt)
    assert result.optimizer_groups["transformer.h.0.mlp.c_fc.bias"] == 1
    assert result.optimizer_groups["transformer.h.1.mlp.c_proj.weight"] == 0
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [
        [id(p) for p in g["params"]] for g in trainer_groups(model)
    ]


@pytest.mark.parametrize("dampening", [0.0, 0.5])
def test_width_growth_first_sgd_momentum_update_of_the_new_slice(dampening, gen):
    """The carried zero momentum buffer gives the new slice (1 - dampening)·g, where a fresh
    SGD's first buffer is g itself (the rule WIDTH_STATE_RULE states)."""
    lr = 0.1
    model = llama(layers=1).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, dampening=dampening)
    for _ in range(2):
        step(model, opt, batch(gen))
    fs.grow(model, fs.GrowthProtocol(["model.embed_tokens"], family="mlp_width", width=3), optimizer=opt)
    down = model.model.layers[0].mlp.down_proj.weight
    before = down.detach().clone()
    step(model, opt, batch(gen))
    g = down.grad[:, 20:]
    assert g.abs().min() > 0
    torch.testing.assert_close((down - before)[:, 20:], -lr * (1 - dampening) * g, rtol=1e-12, atol=0)


def test_new_parameters_of_frozen_counterparts_stay_out(gen):
    model = llama(layers=2).train()
    opt = torch.optim.AdamW(trainer_groups(model)[:1], lr=1e-3)  # norms frozen: not in the optimizer
    result = fs.grow(model, fs.GrowthProtocol(["model.layers.0"]), optimizer=opt)
    norms = {n for n in result.new_parameters if "norm" in n}
    assert norms and set(result.optimizer_groups) == set(result.new_parameters) - norms
    assert [id(p) for p in opt.param_groups[0]["params"]] == [
        id(p) for p in trainer_groups(model)[0]["params"]
    ]
    step(model, opt, batch(gen))
