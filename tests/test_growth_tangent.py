"""The probe of the block growth would insert, against per-sample gradients of that block.

Reference: the real layer (zero output maps) inserted into an fp64 copy of the model by hand, one
backward per sample, the gradients of every zero parameter flattened into ``c_i``; then the
unbiased ``|C|²``, its Hoeffding standard error and the Satterthwaite / Wilson–Hilferty ``z``, ``p``
of docs/design.md 2.8 by brute force over distinct index tuples. The probe sees none of this.
"""

from __future__ import annotations

import copy
import itertools
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F
import transformers

import fused_stats as fs
from fused_stats.api.growth.architecture import describe

ZEROED = {
    "llama": ["self_attn.o_proj", "mlp.down_proj"],
    "gpt2": ["attn.c_proj", "mlp.c_proj"],
    "neox": ["attention.dense", "mlp.dense_4h_to_h"],
}


def make_model(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=40,
            hidden_size=12,
            intermediate_size=20,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=32,
        )
        model, stack = transformers.LlamaForCausalLM(cfg), "model.layers"
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=40,
            n_embd=12,
            n_layer=2,
            n_head=2,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        model, stack = transformers.GPT2LMHeadModel(cfg), "transformer.h"
    else:
        cfg = transformers.GPTNeoXConfig(
            vocab_size=40,
            hidden_size=12,
            intermediate_size=20,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
        )
        model, stack = transformers.GPTNeoXForCausalLM(cfg), "gpt_neox.layers"
    return model.double().eval(), stack


def per_sample_loss(model, batch):
    """Mean shifted cross-entropy over each sequence's real targets, shape (B,)."""
    ids, am = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits
    valid = (am[:, 1:] * am[:, :-1]).to(logits.dtype)
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return (ce * valid).sum(1) / valid.sum(1)


def padded_batch(n, T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (n, T), generator=g)
    am = torch.ones(n, T, dtype=torch.long)
    for b in range(n):
        pad = int(torch.randint(0, 3, (1,), generator=g))
        if b % 2:
            am[b, :pad] = 0  # left padding: the new block's attention must get the mask
        else:
            am[b, T - pad :] = 0
    am[0, T - 2 :] = 0
    am[1, :2] = 0
    return {"input_ids": ids, "attention_mask": am}


def reference_grads(model, stack, point, block, batch, projection=None):
    """c_i: per-sample gradients of the zero parameters of ``block`` inserted after ``point``."""
    grown = copy.deepcopy(model)
    layers = grown.get_submodule(stack)
    index = int(point.rsplit(".", 1)[1]) + 1 if point.startswith(stack + ".") else 0
    layers.insert(index, copy.deepcopy(block))
    if hasattr(grown.config, "num_hidden_layers"):
        grown.config.num_hidden_layers += 1
    new = layers[index]
    zero_names = ZEROED[kind_of(model)]
    assert all(bool((p == 0).all()) for name in zero_names for p in new.get_submodule(name).parameters())
    params = [p for name in zero_names for p in new.get_submodule(name).parameters()]
    for p in grown.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    rows = []
    for b in range(batch["input_ids"].shape[0]):
        one = {k: v[b : b + 1] for k, v in batch.items()}
        loss = per_sample_loss(grown, one)[0]
        grads = torch.autograd.grad(loss, params)
        # each zero map's per-sample gradient as (d_out, d_in [+1 for the bias]), maps side by side
        blocks, pieces = [], list(grads)
        for name in zero_names:
            module = new.get_submodule(name)
            w = pieces.pop(0)
            w = w if isinstance(module, torch.nn.Linear) else w.T  # Conv1D stores (in, out)
            if module.bias is not None:
                w = torch.cat([w, pieces.pop(0)[:, None]], dim=1)
            blocks.append(w)
        c = torch.cat(blocks, dim=1)
        if projection is not None:
            c = c @ projection.T
        rows.append(c.flatten())
    return torch.stack(rows)


def kind_of(model):
    return {"LlamaForCausalLM": "llama", "GPT2LMHeadModel": "gpt2", "GPTNeoXForCausalLM": "neox"}[
        type(model).__name__
    ]


def brute_force(c):
    """|C|², se and (z, p) of docs/design.md 2.8 over distinct tuples of the rows of c."""
    n = c.shape[0]
    k = c @ c.T
    idx = range(n)
    pairs = [(i, j) for i, j in itertools.permutations(idx, 2)]
    cross2 = sum(float(k[i, j]) for i, j in pairs) / len(pairs)
    e2 = sum(float(k[i, j]) ** 2 for i, j in pairs) / len(pairs)
    trip = list(itertools.permutations(idx, 3))
    e3 = sum(float(k[i, j] * k[j, h]) for i, j, h in trip) / len(trip)
    quad = list(itertools.permutations(idx, 4))
    m4 = sum(float(k[i, j] * k[h, m]) for i, j, h, m in quad) / len(quad)
    var = (4 * (n - 2) * (e3 - m4) + 2 * (e2 - m4)) / (n * (n - 1))
    tr1 = float(torch.diagonal(k).sum()) / n
    scale, dof = e2 / tr1, tr1 * tr1 / e2
    x = ((n - 1) * cross2 + tr1) / scale
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    # a negative variance estimate: the standard error is not estimable (NaN), never a false 0
    return cross2, (math.sqrt(var) if var >= 0 else math.nan), z, 0.5 * math.erfc(z / math.sqrt(2))


def assert_matches(sat, c, floor):
    """``probe.saturation(point)`` against the brute force over the per-sample rows ``c``: |C|²,
    SE, z and p to 1e-10; ``floor``: |C|² must exceed it (not a comparison of two zeros)."""
    cross2, se, z, p = brute_force(c)
    assert abs(sat.cross_frob2 - cross2) <= 1e-10 * max(1.0, abs(cross2)), (sat.cross_frob2, cross2)
    # a negative variance estimate: not estimable, None (the brute force's NaN)
    assert (sat.cross_frob2_se is None and math.isnan(se)) or abs(sat.cross_frob2_se - se) <= 1e-10 * max(
        1.0, se
    )
    assert abs(sat.z - z) <= 1e-10 * max(1.0, abs(z))
    assert abs(sat.p_value - p) <= 1e-10
    assert abs(cross2) > floor


@pytest.mark.parametrize("kind", ["llama", "gpt2", "neox"])
@pytest.mark.parametrize("projection", [None, 7])
def test_tangent_probe_matches_per_sample_gradients(kind, projection):
    model, stack = make_model(kind)
    points = [describe(model).input_point, f"{stack}.0", f"{stack}.1"]
    protocol = fs.GrowthProtocol(points, family="layer", seed=3, projection=projection)
    probe = fs.Probe(model, points=points, cross=protocol, second_moment="dense")
    batch = padded_batch(6, 7, seed=11)
    before = [p.detach().clone() for p in model.parameters()]
    probe.step(batch, per_sample_loss)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for point in points:
        block = probe.cross.blocks[point]
        P = None if projection is None else probe.cross.feature_w_in(point, dtype=torch.float64)
        c = reference_grads(model, stack, point, block, batch, P)
        sat = probe.saturation(point)
        d, f = 12, (20 if kind != "gpt2" else 48)
        r = d + f + (2 if kind != "llama" else 0)  # GPT-2 and NeoX maps carry a zero bias each
        assert probe.cross_stats[point].rank == (r if projection is None else projection)
        assert sat.n == 6
        assert_matches(sat, c, 1e-8)


def test_a_protocol_probe_runs_the_self_checking_tangent_of_that_protocol_and_model():
    model, stack = make_model("llama")
    points = [f"{stack}.0", f"{stack}.1"]
    protocol = fs.GrowthProtocol(points, seed=3)
    probe = fs.Probe(model, points=points, cross=protocol)
    assert probe.cross.protocol is protocol and probe.cross.model is model
    probe.step(padded_batch(3, 5, seed=2), per_sample_loss)
    # each candidate's features were compared once with autograd through an fp64 copy
    assert probe.cross.checked == set(points) and set(probe.cross.check_errors) == set(points)
    assert all(e < 1e-6 for e in probe.cross.check_errors.values())


@pytest.mark.parametrize("unit", ["sample", "position"])
def test_padding_positions_enter_nothing(unit):
    """Changing the tokens under the padding leaves every statistic unchanged; with
    unit="position" only the real positions are samples."""
    model, stack = make_model("llama", seed=1)
    points = [f"{stack}.1"]
    batch = padded_batch(5, 8, seed=2)
    other = {k: v.clone() for k, v in batch.items()}
    pad = other["attention_mask"] == 0
    other["input_ids"][pad] = (other["input_ids"][pad] + 7) % 40
    sats = []
    for b in (batch, other):
        probe = fs.Probe(model, points=points, cross=fs.GrowthProtocol(points), unit=unit)
        probe.step(b, per_sample_loss)
        sats.append(probe.saturation(points[0]))
    assert abs(sats[0].cross_frob2 - sats[1].cross_frob2) <= 1e-12 * abs(sats[0].cross_frob2)
    assert sats[0].n == sats[1].n == (5 if unit == "sample" else int(batch["attention_mask"].sum()))


def test_cross_block_family_is_the_crossspec_probe():
    """family='cross_block' probes the protocol's W_out φ(W_in z) block: the same statistics as
    a CrossSpec probe given that block's W_in."""
    model, stack = make_model("llama", seed=4)
    points = [f"{stack}.0", f"{stack}.1"]
    protocol = fs.GrowthProtocol(points, family="cross_block", width=5, seed=2)
    probe = fs.Probe(model, points=points, cross=protocol)
    batch = padded_batch(6, 7, seed=5)
    probe.step(batch, per_sample_loss)
    for point in points:
        block = probe.cross.blocks[point]
        spec = fs.CrossSpec(w_in=block.w_in.clone(), activation=block.activation)
        ref = fs.Probe(model, points=[point], cross=spec)
        ref.step(batch, per_sample_loss)
        a, b = probe.saturation(point), ref.saturation(point)
        assert a.rank == 5
        assert abs(a.cross_frob2 - b.cross_frob2) <= 1e-12 * abs(
            b.cross_frob2
        ) and a.p_value == pytest.approx(b.p_value, abs=1e-12)


def reference_width_grads(model, protocol, point, batch, projection=None):
    """c_i: per-sample gradients of the zero new output columns of the MLP that fs.grow widens
    for ``point`` (all candidates grown at once, as a config with one intermediate size needs:
    every new column is zero, so the other candidates' units change nothing at first order)."""
    grown = copy.deepcopy(model)
    result = fs.grow(grown, protocol)
    kind = kind_of(model)
    stack = {"llama": "model.layers", "gpt2": "transformer.h", "neox": "gpt_neox.layers"}[kind]
    index = int(point.rsplit(".", 1)[1]) + 1 if point.startswith(stack + ".") else 0
    down = grown.get_submodule(stack)[index].get_submodule(
        {"llama": "mlp.down_proj", "gpt2": "mlp.c_proj", "neox": "mlp.dense_4h_to_h"}[kind]
    )
    assert result is not None
    k = protocol.width
    for p in grown.parameters():
        p.requires_grad_(False)
    down.weight.requires_grad_(True)
    rows = []
    for b in range(batch["input_ids"].shape[0]):
        one = {key: v[b : b + 1] for key, v in batch.items()}
        (g,) = torch.autograd.grad(per_sample_loss(grown, one)[0], [down.weight])
        c = g[-k:].T if kind == "gpt2" else g[:, -k:]  # Conv1D stores (in, out): new rows
        assert bool((down.weight[-k:] == 0).all() if kind == "gpt2" else (down.weight[:, -k:] == 0).all())
        if projection is not None:
            c = c @ projection.T
        rows.append(c.flatten())
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "neox"])
@pytest.mark.parametrize("projection", [None, 3])
def test_mlp_width_probe_matches_per_sample_gradients(kind, projection):
    model, stack = make_model(kind, seed=2)
    points = [describe(model).input_point, f"{stack}.0"]
    protocol = fs.GrowthProtocol(points, family="mlp_width", width=5, seed=3, projection=projection)
    probe = fs.Probe(model, points=points, cross=protocol, second_moment="dense")
    batch = padded_batch(6, 7, seed=13)
    probe.step(batch, per_sample_loss)
    for point in points:
        P = None if projection is None else probe.cross.feature_w_in(point, dtype=torch.float64)
        c = reference_width_grads(model, protocol, point, batch, P)
        sat = probe.saturation(point)
        assert sat.n == 6 and sat.rank == (5 if projection is None else projection)
        assert_matches(sat, c, 1e-12)


def test_unsupported_family_and_bad_candidate():
    model, stack = make_model("gpt2")
    with pytest.raises(fs.FusedStatsError, match="last block"):
        fs.Probe(
            model, points=[f"{stack}.1"], cross=fs.GrowthProtocol([f"{stack}.1"], family="mlp_width", width=4)
        )
    with pytest.raises(fs.FusedStatsError, match="not a residual point or block boundary"):
        fs.Probe(model, points=["lm_head"], cross=fs.GrowthProtocol(["lm_head"]))


def test_checkpoint_round_trip_and_observe(tmp_path):
    """A tangent probe's state saves and loads into a fresh probe of the same protocol (another
    projection is refused); observe() cannot give the new layer its call arguments: refused,
    nothing accumulated."""
    model, stack = make_model("gpt2", seed=6)
    points = [f"{stack}.0", f"{stack}.1"]
    protocol = fs.GrowthProtocol(points, seed=1, projection=9)
    probe = fs.Probe(model, points=points, cross=protocol)
    batch = padded_batch(5, 6, seed=7)
    probe.step(batch, per_sample_loss)
    probe.save_state(tmp_path / "ckpt")
    fresh = fs.Probe(model, points=points, cross=protocol)
    fresh.load_state(tmp_path / "ckpt")
    for point in points:
        assert fresh.saturation(point) == probe.saturation(point)
    other = fs.Probe(model, points=points, cross=fs.GrowthProtocol(points, seed=1, projection=8))
    with pytest.raises(fs.FusedStatsError, match="rank"):
        other.load_state(tmp_path / "ckpt")
    assert not other.table
    watcher = fs.Probe(model, points=points, cross=protocol)
    with pytest.raises(fs.FusedStatsError, match=r"Probe\.step only"), watcher.observe(loss_reduction="sum"):
        per_sample_loss(model, batch).sum().backward()
    assert not watcher.table
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_probed_block_is_the_block_fs_grow_inserts(kind):
    """Reference model grown by fs.grow itself: per-sample gradients of its zero parameters
    (those of ZEROED, found by name in the grown model) give the probe's |C|², z and p."""
    model, stack = make_model(kind, seed=8)
    point = f"{stack}.0"
    protocol = fs.GrowthProtocol([point], seed=5)
    probe = fs.Probe(model, points=[point], cross=protocol)
    batch = padded_batch(6, 7, seed=9)
    probe.step(batch, per_sample_loss)
    grown = copy.deepcopy(model)
    result = fs.grow(grown, protocol, at=[point])
    block = result.positions[point]
    names = [f"{block}.{m}.{p}" for m in ZEROED[kind] for p in ("weight", "bias")]
    params = dict(grown.named_parameters())
    zero = [params[n] for n in names if n in params]
    assert zero and all(bool((p == 0).all()) for p in zero)
    for p in grown.parameters():
        p.requires_grad_(False)
    for p in zero:
        p.requires_grad_(True)
    rows = []
    for b in range(6):
        loss = per_sample_loss(grown, {k: v[b : b + 1] for k, v in batch.items()})[0]
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, zero)]))
    assert_matches(probe.saturation(point), torch.stack(rows), 1e-8)


def test_exact_tangent_stores_no_identity_and_reads_identity_checkpoints(tmp_path):
    """Without a projection the features enter CrossStats as they are (no r × r w_in); a
    checkpoint written by the earlier identity-w_in form (tests/data, saved by that code after one
    train and one test batch) loads and resumes to the statistics of one uninterrupted run."""
    model, stack = make_model("llama", seed=6)
    points = [f"{stack}.0", f"{stack}.1"]
    protocol = fs.GrowthProtocol(points, seed=1)
    batches = [(padded_batch(5, 6, seed=7), "train"), (padded_batch(4, 6, seed=8), "test")]
    batches.append((padded_batch(6, 6, seed=9), "train"))
    whole = fs.Probe(model, points=points, cross=protocol)
    for batch, stream in batches:
        whole.step(batch, per_sample_loss, stream=stream)
    for point in points:
        acc = whole.cross_stats[point]
        assert acc.w_in is None and acc.rank == 12 + 20
        assert acc.state_nbytes() == (12 * 32 + 4) * 8
    old = pathlib.Path(__file__).parent / "data" / "tangent_identity_checkpoint"
    resumed = fs.Probe(model, points=points, cross=protocol)
    resumed.load_state(old)
    assert all(torch.equal(resumed.cross_stats[p].w_in, torch.eye(32)) for p in points)
    resumed.step(*batches[2][:1], per_sample_loss, stream="train")
    for point in points:
        for stream in ("train", "test"):
            a, b = resumed.saturation(point, stream=stream), whole.saturation(point, stream=stream)
            assert a.n == b.n and abs(a.cross_frob2 - b.cross_frob2) <= 1e-12 * abs(b.cross_frob2)
            assert abs(a.p_value - b.p_value) <= 1e-12
    # a new checkpoint is features-given and round-trips exactly
    whole.save_state(tmp_path / "ckpt")
    fresh = fs.Probe(model, points=points, cross=protocol)
    fresh.load_state(tmp_path / "ckpt")
    assert fresh.cross_stats[points[0]].w_in is None
    assert all(fresh.saturation(p) == whole.saturation(p) for p in points)
    for bad in [{}, {"rank": 0}, {"rank": True}]:
        with pytest.raises(fs.FusedStatsError, match="features given"):
            fs.CrossStats(4, None, "identity", **bad)
    with pytest.raises(fs.FusedStatsError, match="activation 'identity'"):
        fs.CrossStats(4, None, "gelu", rank=3)
    with pytest.raises(fs.FusedStatsError, match="w_in=None only"):
        fs.CrossStats(4, torch.eye(3), "identity", rank=3)


def resnet_model(kind):
    from fused_stats.networks.resnet import cifar_resnet20, tiny_resnet

    if kind == "basic":
        model = cifar_resnet20(width=4, seed=3, random_batchnorm=True)
        return model.double(), ["layer1.2", "layer2.0", "layer3.2"], (8, 8), "bn2"
    model = tiny_resnet(block="bottleneck", width=2, seed=3, random_batchnorm=True)
    return model.double(), ["layer1.0", "layer3.0"], (32, 32), "bn3"


def reference_bn_grads(model, protocol, point, x, y, last, projection=None, probe=None):
    """c_i: the per-sample gradient of every new parameter of the block fs.grow inserts after
    ``point`` (the grown fp64 model in eval mode, one backward per sample). At the origin only the
    zero last BatchNorm's ``[∂ℓ_i/∂γ ; ∂ℓ_i/∂β]`` is not zero (checked); with ``projection`` the
    rows are ``P [∂ℓ_i/∂γ ; ∂ℓ_i/∂β]``, the order of the probe's features; ``probe``: the block
    gets the BatchNorm statistics that probe calibrated (fused_stats/api/growth/batchnorm.py)."""
    grown = copy.deepcopy(model).eval()
    result = fs.grow(grown, protocol, at=[point], batchnorm_stats=probe)
    bn = grown.get_submodule(f"{result.positions[point]}.{last}")
    assert bool((bn.weight == 0).all()) and bool((bn.bias == 0).all())
    for p in grown.parameters():
        p.requires_grad_(False)
    named = dict(grown.named_parameters())
    params = [named[n] for n in result.new_parameters]
    for p in params:
        p.requires_grad_(True)
    rows = []
    for b in range(x.shape[0]):
        loss = F.cross_entropy(grown(x[b : b + 1]), y[b : b + 1])
        grads = dict(zip(result.new_parameters, torch.autograd.grad(loss, params)))
        zero_bn = [f"{result.positions[point]}.{last}.{n}" for n in ("weight", "bias")]
        assert all(not g.any() for n, g in grads.items() if n not in zero_bn)
        if projection is None:
            rows.append(torch.cat([g.flatten() for g in grads.values()]))
        else:
            rows.append(projection @ torch.cat([grads[n] for n in zero_bn]))
    return torch.stack(rows)


@pytest.mark.parametrize("kind", ["basic", "bottleneck"])
@pytest.mark.parametrize("projection", [None, 5])
def test_resnet_tangent_matches_per_sample_gradients_of_the_zero_batchnorm(kind, projection):
    """ResNet blocks (``x + F(x)``, no ReLU gate): the zero parameters are the last BatchNorm's
    scale and shift, whose per-sample gradients are per channel; the probe (model in train mode: it
    probes in eval mode) agrees with the per-sample gradients of all new parameters of an
    fs.grow-grown fp64 model to 1e-10, and leaves the model as it was."""
    model, points, side, last = resnet_model(kind)
    model.train()
    protocol = fs.GrowthProtocol(points, family="layer", seed=4, projection=projection)
    probe = fs.Probe(model, points=points, cross=protocol, second_moment="dense")
    g = torch.Generator().manual_seed(21)
    x = torch.randn(6, 3, *side, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (6,), generator=g)
    before = copy.deepcopy(model.state_dict())
    probe.step((x, y), fs.classification_loss)
    assert model.training and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    for point in points:
        channels = model.get_submodule(point).get_submodule(last).num_features
        P = None if projection is None else probe.cross.feature_w_in(point, dtype=torch.float64)
        c = reference_bn_grads(model, protocol, point, x, y, last, P, probe=probe)
        sat = probe.saturation(point)
        assert sat.n == 6 and sat.rank == (2 * channels if projection is None else projection)
        assert_matches(sat, c, 1e-12)


def test_resnet_tangent_advice_and_refusals():
    """The advisor ranks ResNet candidates from a tangent probe; a protocol whose block is not zero
    at its last BatchNorm ("random", "copy") is refused when the probe is built."""
    model, points, side, _ = resnet_model("basic")
    protocol = fs.GrowthProtocol(points, seed=1)
    probe = fs.Probe(model, points=points, cross=protocol)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        probe.step(
            (
                torch.randn(5, 3, *side, generator=g, dtype=torch.float64),
                torch.randint(0, 10, (5,), generator=g),
            ),
            fs.classification_loss,
        )
    advice = fs.advise(probe, protocol)
    assert sorted(e.point for e in advice.ranked) == sorted(points)
    assert all(e.cross_frob2 == probe.saturation(e.point).cross_frob2 for e in advice.ranked)
    for init in ("random", "copy"):
        with pytest.raises(fs.FusedStatsError, match=f"needs init='zero', the protocol has init='{init}'"):
            fs.Probe(model, points=points[:1], cross=fs.GrowthProtocol(points[:1], init=init))


def test_resnet_tangent_by_pixel_sums_to_the_per_sample_gradients():
    """unit="position": every pixel of every sample is a sample (n = B·H·W) and the pixels' terms
    sum to the per-sample gradients of the zero BatchNorm (Σ c of the reference)."""
    model, points, side, last = resnet_model("basic")
    protocol = fs.GrowthProtocol(points, seed=2)
    probe = fs.Probe(model, points=points, cross=protocol, unit="position")
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 3, *side, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (4,), generator=g)
    probe.step((x, y), fs.classification_loss)
    shapes = {}
    handles = [
        model.get_submodule(p).register_forward_hook(lambda m, a, out, p=p: shapes.__setitem__(p, out.shape))
        for p in points
    ]
    with torch.no_grad():
        model.eval()(x)
    for h in handles:
        h.remove()
    for point in points:
        channels = model.get_submodule(point).get_submodule(last).num_features
        # the identity "projection": the rows [∂ℓ_i/∂γ ; ∂ℓ_i/∂β] in the order of c_sum
        c = reference_bn_grads(
            model, protocol, point, x, y, last, torch.eye(2 * channels, dtype=torch.float64), probe=probe
        )
        acc = probe.cross_stats[point]
        assert acc.unit == "position" and acc.dim == 1 and acc.n == 4 * math.prod(shapes[point][2:])
        assert torch.allclose(acc.c_sum.flatten(), c.sum(0), rtol=1e-10, atol=1e-14)
        assert c.abs().max() > 1e-8


def test_resnet_tangent_with_calibrated_batchnorm_statistics():
    """A new block whose BatchNorms carry non-trivial running statistics (a caller's new_block):
    x̂ = (x − mean) / sqrt(var + eps) per channel, checked against per-sample gradients of the
    zero last BatchNorm with that very block inserted by hand into an fp64 copy."""
    from fused_stats.api.growth import blocks
    from fused_stats.api.growth.tangent import GrowthTangent

    model, points, side, _ = resnet_model("basic")
    point = points[1]
    protocol = fs.GrowthProtocol([point], seed=6)
    gen = torch.Generator().manual_seed(17)

    def calibrated(model, protocol, point):
        block = blocks.new_block(model, protocol, point)
        for bn in (block.bn1, block.bn2):
            bn.running_mean.copy_(0.3 * torch.randn(bn.num_features, generator=gen))
            bn.running_var.copy_(0.2 + torch.rand(bn.num_features, generator=gen))
        return block

    source = GrowthTangent(protocol, model, new_block=calibrated)
    probe = fs.Probe(model, points=[point], cross=source)
    x = torch.randn(6, 3, *side, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (6,), generator=gen)
    probe.step((x, y), fs.classification_loss)
    block = copy.deepcopy(source.blocks[point])
    grown = copy.deepcopy(model).eval()
    stage_name, index = point.split(".")
    stage = grown.get_submodule(stage_name)
    setattr(grown, stage_name, torch.nn.Sequential(*stage[: int(index) + 1], block, *stage[int(index) + 1 :]))
    with torch.no_grad():
        assert torch.equal(grown(x), model.eval()(x))  # still function preserving
    for p in grown.parameters():
        p.requires_grad_(False)
    params = [block.bn2.weight, block.bn2.bias]
    for p in params:
        p.requires_grad_(True)
    rows = []
    for b in range(6):
        loss = F.cross_entropy(grown(x[b : b + 1]), y[b : b + 1])
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    assert_matches(probe.saturation(point), torch.stack(rows), 1e-12)


def test_resnet_tangent_streams_checkpoint_and_feature_axis(tmp_path):
    """Train and test streams save and resume exactly; a probe reading another axis of the conv
    map as features is refused, naming the point, with nothing accumulated."""
    model, points, side, _ = resnet_model("basic")
    protocol = fs.GrowthProtocol(points, seed=3, projection=6)
    gen = torch.Generator().manual_seed(9)
    batches = [
        (
            torch.randn(4, 3, *side, generator=gen, dtype=torch.float64),
            torch.randint(0, 10, (4,), generator=gen),
        )
        for _ in range(3)
    ]
    whole, part = (
        fs.Probe(model, points=points, cross=protocol),
        fs.Probe(model, points=points, cross=protocol),
    )
    for probe in (whole, part):
        probe.step(batches[0], fs.classification_loss)
        probe.step(batches[1], fs.classification_loss, stream="test")
    part.save_state(tmp_path / "ckpt")
    resumed = fs.Probe(model, points=points, cross=protocol)
    resumed.load_state(tmp_path / "ckpt")
    for probe in (whole, resumed):
        probe.step(batches[2], fs.classification_loss)
    for point in points:
        for stream in ("train", "test"):
            a, b = resumed.saturation(point, stream=stream), whole.saturation(point, stream=stream)
            assert a == b and a.n > 0 and a.rank == 6
    sideways = fs.Probe(model, points=points[:1], cross=protocol, feature_dim=-1)
    with pytest.raises(fs.FusedStatsError, match=r"'layer1\.2'.*per channel"):
        sideways.step(batches[0], fs.classification_loss)
    assert not sideways.table
