"""Each first-step rule of :mod:`fused_stats.api.growth.first_step` against torch's own step on
one fp64 tensor (to 1e-6: NAdam keeps mu_product in float32): a new parameter (no state) and the new slice of a tensor widened after ``s``
steps (zero moments, the tensor's step count and scalars), the realised ``−Δθ/lr`` compared with
``Rule.update(g)`` entry by entry. Settings chosen where a rule's terms are large enough to see:
NAdam with a large ``momentum_decay``, Adagrad with a non-zero ``initial_accumulator_value``
(per group and in the defaults), SGD momentum with dampening."""

from __future__ import annotations

import copy

import pytest
import torch

from fused_stats.api.growth.first_step import first_step_rule

OPT = torch.optim
LR = 1e-3
FACTORIES = {
    "sgd_momentum_dampening": lambda ps: OPT.SGD(ps, lr=LR, momentum=0.9, dampening=0.3),
    "sgd_nesterov": lambda ps: OPT.SGD(ps, lr=LR, momentum=0.9, nesterov=True),
    "adam": lambda ps: OPT.Adam(ps, lr=LR, betas=(0.8, 0.95), eps=1e-3),
    "adamax": lambda ps: OPT.Adamax(ps, lr=LR, betas=(0.8, 0.95), eps=1e-3),
    "adagrad": lambda ps: OPT.Adagrad(ps, lr=LR, lr_decay=0.2, initial_accumulator_value=0.7, eps=1e-3),
    "rmsprop_centered": lambda ps: OPT.RMSprop(ps, lr=LR, alpha=0.8, centered=True, momentum=0.5, eps=1e-3),
    "nadam": lambda ps: OPT.NAdam(ps, lr=LR, betas=(0.8, 0.95), momentum_decay=0.5, eps=1e-3),
    "radam": lambda ps: OPT.RAdam(ps, lr=LR, betas=(0.8, 0.9), eps=1e-3),
}


def _grad(seed, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _realised(opt, p, grad) -> torch.Tensor:
    before = p.detach().clone()
    p.grad = grad.clone()
    opt.step()
    return (before - p.detach()) / LR


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_new_parameter_steps_as_its_rule(name):
    p = torch.nn.Parameter(_grad(1, 7))
    opt = FACTORIES[name]([p])
    g = _grad(2, 7) * 0.05
    rule = first_step_rule(opt, opt.param_groups[0], None)
    torch.testing.assert_close(rule.update(g), _realised(opt, p, g), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("steps", [1, 6])
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_the_new_slice_of_a_widened_tensor_steps_as_its_rule(name, steps):
    p = torch.nn.Parameter(_grad(3, 5))
    opt = FACTORIES[name]([p])
    for s in range(steps):
        p.grad = _grad(10 + s, 5)
        opt.step()
    state = opt.state[p]
    # the widened tensor: its old entries and their state, then 3 new entries with zero state
    q = torch.nn.Parameter(torch.cat([p.detach(), torch.zeros(3, dtype=torch.float64)]))
    fresh = type(opt)([q], **{k: v for k, v in opt.defaults.items()})
    fresh.state[q] = {
        k: torch.cat([v, torch.zeros(3, dtype=v.dtype)])
        if torch.is_tensor(v) and v.shape == p.shape
        else copy.deepcopy(v)
        for k, v in state.items()
    }
    g_new = _grad(4, 3) * 0.05
    rule = first_step_rule(opt, opt.param_groups[0], state)
    realised = _realised(fresh, q, torch.cat([_grad(5, 5), g_new]))[5:]
    torch.testing.assert_close(rule.update(g_new), realised, rtol=1e-6, atol=1e-9)


def test_adagrad_new_parameter_takes_the_defaults_accumulator_not_its_groups():
    """torch's Adagrad sets a parameter's ``sum`` at construction; one added later (fs.grow appends
    to a group) starts from the optimizer's defaults, whatever its group says."""
    old = torch.nn.Parameter(_grad(6, 4))
    opt = OPT.Adagrad(
        [{"params": [old], "initial_accumulator_value": 2.0}], lr=LR, initial_accumulator_value=0.1
    )
    new = torch.nn.Parameter(_grad(7, 4))
    opt.param_groups[0]["params"].append(new)
    g = _grad(8, 4) * 0.05
    rule = first_step_rule(opt, opt.param_groups[0], None)
    old.grad = None
    torch.testing.assert_close(rule.update(g), _realised(opt, new, g), rtol=1e-6, atol=1e-9)
