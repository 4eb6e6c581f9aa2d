"""The feature axis of a point is inferred only where the module proves it; CrossSpec contradictions.

* ResNet points (blocks, a ``downsample`` conv + batch norm, a lone conv or batch norm) work without
  ``feature_dim``: their dims are the channel counts, and the statistics equal per-image gradients
  of one backward per image summed over the pixels (tests/per_sample_reference.py).
* A module emitting attention-head activations (B, T, H, d_head) (TransformerLens' ``hook_z``, an
  identity hook) is refused — by ``Probe.step``, ``probe.observe`` and ``insert_zero_block`` — with
  an error naming the point, the shape and ``feature_dim``, and nothing is accumulated; with
  ``feature_dim=-1`` the dim is ``d_head`` and the statistics equal the per-sample reference
  ``q_b = Σ_{t,h} ∂ℓ_b/∂z[b, t, h, :]`` from one backward per sample.
* ``CrossSpec(rank=R, w_in=W)`` with ``R`` different from W's row count is an error;
  ``CrossSpec(w_in=W)`` takes W's rank, ``CrossSpec()`` rank 64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.networks.resnet import cifar_resnet20

import per_sample_reference as R

F64 = torch.float64
B, T, H, DH, D = 6, 5, 2, 3, 4


class Heads(nn.Module):
    """Per-head activations (B, T, H, d_head) pass through an identity hook module ``hook_z``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, H * DH)
        self.hook_z = nn.Identity()
        self.out = nn.Linear(H * DH, 1)

    def forward(self, x):
        z = self.hook_z(torch.tanh(self.qkv(x)).view(x.shape[0], x.shape[1], H, DH))
        return self.out(torch.tanh(z).reshape(x.shape[0], x.shape[1], H * DH)).sum(dim=(1, 2))


def squared_error(model, batch):
    x, y = batch
    return (model(x) - y) ** 2


def heads_batch(gen):
    return torch.randn(B, T, D, generator=gen, dtype=F64), torch.randn(B, generator=gen, dtype=F64)


def test_resnet_points_need_no_feature_dim(gen):
    net = cifar_resnet20(width=2, seed=0).double()
    x = torch.randn(5, 3, 8, 8, generator=gen, dtype=F64)
    y = torch.randint(0, 10, (5,), generator=gen)
    points = ["layer1.1", "layer2.0", "layer2.0.downsample", "layer3.0.conv2", "layer3.1.bn1"]
    probe = fs.Probe(net, points=points, second_moment="dense")
    probe.step((x, y), fs.classification_loss)
    assert probe.feature_dims == dict.fromkeys(points, 1)
    assert probe.dims == {
        "layer1.1": 2,
        "layer2.0": 4,
        "layer2.0.downsample": 4,
        "layer3.0.conv2": 8,
        "layer3.1.bn1": 8,
    }
    net.eval()
    rows = {p: [] for p in points}
    for b in range(5):
        g = R.point_grads_one_sample(
            net, points, lambda m, b=b: R.classification_sample_loss(m, x[b], int(y[b]))
        )
        for p in points:
            rows[p].append(g[p][0].sum(dim=(1, 2))[None])  # channels, summed over the pixels
    for p in points:
        R.assert_estimate_matches(probe.stats[p].estimate(), torch.cat(rows[p]), context=p)


def test_head_activations_are_refused_without_feature_dim(gen):
    torch.manual_seed(0)
    model = Heads().double()
    x, y = heads_batch(gen)
    probe = fs.Probe(model, points=["hook_z"])
    with pytest.raises(fs.FusedStatsError) as info:
        probe.step((x, y), squared_error)
    msg = str(info.value)
    assert "'hook_z'" in msg and f"{(B, T, H, DH)}" in msg and "feature_dim=-1" in msg, msg
    assert probe.stats == {} and probe.steps["train"] == 0 and probe.feature_dims == {}
    with (
        pytest.raises(fs.FusedStatsError, match=r"'hook_z'.*\(6, 5, 2, 3\).*feature_dim"),
        probe.observe(loss_reduction="sum"),
    ):
        squared_error(model, (x, y)).sum().backward()
    assert probe.stats == {}
    block = fs.insert_zero_block(model, "hook_z", kind="bias", dim=DH)
    try:
        with pytest.raises(fs.FusedStatsError, match=r"'hook_z'.*\(6, 5, 2, 3\).*insert_zero_block"):
            model(x)
    finally:
        fs.remove_inserted_block(model, "hook_z")
    assert block is not None


def test_head_activations_with_feature_dim_match_per_sample_reference(gen):
    torch.manual_seed(1)
    model = Heads().double()
    x, y = heads_batch(gen)
    for fd in (-1, {"hook_z": 3}):
        probe = fs.Probe(model, points=["hook_z"], second_moment="dense", feature_dim=fd)
        probe.step((x, y), squared_error)
        assert probe.dims == {"hook_z": DH}
        rows = []
        for b in range(B):
            g = R.point_grads_one_sample(
                model, ["hook_z"], lambda m, b=b: (m(x[b : b + 1]) - y[b]).pow(2).sum()
            )
            rows.append(g["hook_z"][0].sum(dim=(0, 1))[None])  # Σ over positions and heads
        R.assert_estimate_matches(probe.stats["hook_z"].estimate(), torch.cat(rows))
    # the zero block at hook_z with the feature axis given leaves the model's output unchanged
    before = model(x)
    fs.insert_zero_block(model, "hook_z", kind="bias", feature_dim=-1, dim=DH)
    try:
        assert torch.equal(model(x), before)
    finally:
        fs.remove_inserted_block(model, "hook_z")


def test_cross_spec_rank_and_w_in_must_agree(gen):
    w = torch.randn(5, 7, generator=gen)
    with pytest.raises(fs.FusedStatsError, match=r"rank=64.*\(5, 7\).*5 rows"):
        fs.CrossSpec(rank=64, w_in=w)
    assert fs.CrossSpec(w_in=w).rank == 5
    assert fs.CrossSpec(rank=5, w_in=w).rank == 5
    assert fs.CrossSpec().rank == 64
    assert fs.CrossSpec(rank=3).projection(7).shape == (3, 7)
    assert torch.equal(fs.CrossSpec(w_in=w).projection(7), w)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(fs.FusedStatsError, match="rank must be a positive int"):
            fs.CrossSpec(rank=bad)
    with pytest.raises(fs.FusedStatsError, match=r"w_in must be a tensor of shape \(rank, d\)"):
        fs.CrossSpec(w_in=torch.randn(5, generator=gen))
