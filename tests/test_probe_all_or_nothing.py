"""A probe step is all or nothing across points, also for rejections only the reduction sees.

A gradient can be finite everywhere and still make ``Σ|y|⁴`` overflow (|q| ~ 1e90); the
accumulator rejects such a batch. Before ``GradStats.prepare``/``commit`` existed the probe checked
finiteness itself, so the first point was committed before the second one failed. Here the first
point's gradient is ordinary and only the second one overflows: neither may change.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.accumulators import state_differences

F64 = torch.float64


class Scale(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def forward(self, x):
        return x * self.factor


class TwoPoints(nn.Module):
    """``first`` gets an ordinary gradient; ``second``'s gradient is ``blow_up`` times larger."""

    def __init__(self, blow_up: float):
        super().__init__()
        self.first = nn.Linear(5, 4).double()
        self.second = Scale(1.0 / blow_up)
        self.head = nn.Linear(4, 1).double()
        self.blow_up = blow_up

    def forward(self, x):
        return self.head(self.second(self.first(x)) * self.blow_up).squeeze(-1)


def per_sample_loss(model, batch):
    return model(batch) ** 2


def state(probe):
    return {name: (acc.n, acc.state_dict()) for name, acc in probe.stats.items()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name][0] == b[name][0], name
        assert not state_differences(a[name][1], b[name][1]), name


@pytest.mark.parametrize("nonfinite", ["raise", "skip"])
def test_overflow_at_a_later_point_leaves_every_point_unchanged(nonfinite, gen):
    torch.manual_seed(0)
    model = TwoPoints(blow_up=1e90)
    probe = fs.Probe(model, points=["first", "second"], second_moment="dense", nonfinite=nonfinite)
    ordinary = TwoPoints(blow_up=1.0)
    ordinary.load_state_dict(model.state_dict())
    # a first step with ordinary gradients at both points, through the same accumulators
    probe.model = ordinary
    probe.step(torch.randn(6, 5, generator=gen, dtype=F64), per_sample_loss)
    before = state(probe)
    assert all(n == 6 for n, _ in before.values())
    probe.model = model
    x = torch.randn(6, 5, generator=gen, dtype=F64)
    grads = {}
    # the gradients really are finite: only |q|^4 overflows at `second`
    handles = [
        getattr(model, n).register_full_backward_hook(
            lambda m, gi, go, n=n: grads.__setitem__(n, go[0].detach())
        )
        for n in ("first", "second")
    ]
    per_sample_loss(model, x.requires_grad_()).sum().backward()
    for h in handles:
        h.remove()
    model.zero_grad()
    assert torch.isfinite(grads["second"]).all() and grads["second"].abs().max() > 1e80
    assert grads["first"].abs().max() < 1e20
    if nonfinite == "raise":
        with pytest.raises(fs.FusedStatsError, match="second"):
            probe.step(x.detach(), per_sample_loss)
    else:
        probe.step(x.detach(), per_sample_loss)
        assert probe.skipped_steps["train"] == 1
    assert_same(state(probe), before)
