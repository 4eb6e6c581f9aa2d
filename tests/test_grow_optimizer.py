"""Growing with an optimizer: ``fs.grow(..., optimizer=...)``.

Old state is kept bit for bit and new parameters start without state; the first step on the new
parameters equals a freshly built optimizer's step on copies of them (the reference), and old
parameters move exactly as in the ungrown model. One SGD step after zero growth matches
``-η |∇_new L|²`` with a relative error shrinking like η (second-order term); Adam's first step
matches ``-η Σ g²/(|g| + ε)``; with a zero gradient (saturated) neither moves the loss.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_grow import F64, STACK, VOCAB, _train_steps, build, lm_batch

import fused_stats as fs


def _state_copy(opt):
    return {
        id(p): {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
        for p, s in opt.state.items()
    }


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    ],
)
def test_optimizer_state_across_depth_growth(make, gen):
    model = build("llama", F64)
    model.train()
    opt = make(model.parameters())
    _train_steps(model, opt, gen)
    ref_model, ref_opt = copy.deepcopy((model, opt))
    saved = _state_copy(opt)
    old = list(model.parameters())
    protocol = fs.GrowthProtocol(candidates=["model.layers.0"], seed=1)
    result = fs.grow(model, protocol, optimizer=opt)
    for p in old:  # old state, bit for bit
        assert set(opt.state[p]) == set(saved[id(p)])
        for k, v in saved[id(p)].items():
            assert torch.equal(opt.state[p][k], v) if torch.is_tensor(v) else opt.state[p][k] == v
    named = dict(model.named_parameters())
    new = [named[n] for n in result.new_parameters]
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) in in_opt for p in new) and all(len(opt.state[p]) == 0 for p in new)
    # one more step: old parameters move exactly as in the ungrown model, new ones as a fresh optimizer's
    batch = lm_batch(gen)
    opt.zero_grad()
    model(**batch).loss.backward()
    grads = [p.grad.clone() for p in new]
    fresh_params = [p.detach().clone().requires_grad_(True) for p in new]
    fresh = make(fresh_params)
    for fp, g in zip(fresh_params, grads):
        fp.grad = g
    opt.step()
    fresh.step()
    ref_opt.zero_grad()
    ref_model(**batch).loss.backward()
    ref_opt.step()
    for p, q in zip(old, ref_model.parameters()):
        assert torch.equal(p, q)
    for p, fp in zip(new, fresh_params):
        assert torch.equal(p, fp)
    moved = [n for n, p, g in zip(result.new_parameters, new, grads) if g.abs().sum() > 0]
    assert any("o_proj" in n for n in moved) and any("down_proj" in n for n in moved)


@pytest.mark.parametrize(
    "kind, make, keys",
    [
        ("gpt2", lambda ps: torch.optim.AdamW(ps, lr=1e-3), ("exp_avg", "exp_avg_sq")),
        ("llama", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), ("momentum_buffer",)),
    ],
)
def test_optimizer_state_across_width_growth(kind, make, keys, gen):
    model = build(kind, F64, layers=2)
    model.train()
    opt = make(model.parameters())
    _train_steps(model, opt, gen)
    saved = {
        n: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
        for n, p in model.named_parameters()
    }
    shapes = {n: p.shape for n, p in model.named_parameters()}
    inp, stack = STACK[kind]
    protocol = fs.GrowthProtocol(candidates=[inp, f"{stack}.0"], family="mlp_width", width=3)
    result = fs.grow(model, protocol, optimizer=opt)
    named = dict(model.named_parameters())
    assert (
        len(result.widened) == 6
    )  # three tensors per MLP (LLaMA gate, up, down; GPT-2 c_fc weight and bias, c_proj)
    for n in result.widened:
        p = named[n]
        (axis,) = [a for a in range(p.dim()) if p.shape[a] != shapes[n][a]]
        assert p.shape[axis] == shapes[n][axis] + 3
        st = opt.state[p]
        assert set(st) == set(saved[n])
        if "step" in st:
            assert torch.equal(st["step"], saved[n]["step"])
        for k in keys:
            old_len = saved[n][k].shape[axis]
            assert torch.equal(st[k].narrow(axis, 0, old_len), saved[n][k])
            assert not st[k].narrow(axis, old_len, 3).any()
    for n, p in named.items():
        if n not in result.widened:
            assert torch.equal(opt.state[p][keys[0]], saved[n][keys[0]])
    assert [id(p) for g in opt.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
    _train_steps(model, opt, gen, steps=1)  # training continues with the same optimizer


def _first_step_change(kind_opt, eta, gen_seed, saturate=False):
    """Loss change of one step on the new parameters only, and the first-order prediction."""
    g = torch.Generator().manual_seed(gen_seed)
    model = build("llama", F64)
    batch = lm_batch(g)
    opt = (
        torch.optim.SGD(model.parameters(), lr=eta, momentum=0.9)
        if kind_opt == "sgd"
        else torch.optim.Adam(model.parameters(), lr=eta)
    )
    result = fs.grow(model, fs.GrowthProtocol(candidates=["model.layers.0"], seed=3), optimizer=opt)
    named = dict(model.named_parameters())
    new = {id(named[n]) for n in result.new_parameters}

    def loss_fn():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        if saturate:  # loss at its minimum in the logits: q = 0 everywhere
            return ((out - target) ** 2).sum()
        return torch.nn.functional.cross_entropy(
            out[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1)
        )

    with torch.no_grad():
        target = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.clone()
    opt.zero_grad()
    loss0 = loss_fn()
    loss0.backward()
    gnew = []
    for p in model.parameters():
        if id(p) in new:
            gnew.append(p.grad.clone())
        else:
            p.grad = None  # only the new parameters step
    opt.step()
    with torch.no_grad():
        loss1 = loss_fn()
    gn = torch.cat([x.flatten() for x in gnew])
    if kind_opt == "sgd":
        pred = -eta * (gn**2).sum()
    else:
        pred = -eta * (gn**2 / (gn.abs() + 1e-8)).sum()
    return (loss1 - loss0).item(), pred.item(), gn


@pytest.mark.parametrize("opt_kind, etas", [("sgd", (1.0, 0.1, 0.01)), ("adam", (1e-2, 1e-3, 1e-4))])
def test_first_step_after_zero_growth_matches_first_order(opt_kind, etas):
    errs = []
    for eta in etas:
        change, pred, gn = _first_step_change(opt_kind, eta, 123)
        assert gn.abs().sum() > 0 and pred < 0
        errs.append(abs(change - pred) / abs(pred))
    # the remainder is second order: the relative error shrinks about tenfold per tenfold smaller step
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[2] < 0.02, errs
    assert errs[1] / errs[2] > 5, errs


@pytest.mark.parametrize("opt_kind", ["sgd", "adam"])
def test_saturated_boundary_is_the_same_for_sgd_and_adam(opt_kind):
    change, pred, gn = _first_step_change(opt_kind, 1e-2, 7, saturate=True)
    assert not gn.any() and pred == 0 and change == 0
