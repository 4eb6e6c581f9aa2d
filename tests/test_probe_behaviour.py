"""Probe behaviour: the model is left untouched, errors are clear and atomic, streams and reports.

References: snapshots of the model taken before probing (outputs, parameters, buffers, flags,
hooks) compared with ``torch.equal``; per-sample loops (tests/per_sample_reference.py) for the
values; the width paper's Theorem 1 written out here for the certificate; exhaustive enumeration
of all train/test partitions for the misalignment Monte Carlo.
"""

from __future__ import annotations

import collections
import itertools
import math
import weakref
from typing import ClassVar

import pytest
import torch
from torch import nn

import fused_stats as fs
from fused_stats.networks.resnet import cifar_resnet20, tiny_resnet

import per_sample_reference as R

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=32,
        initializer_range=0.3,
    )
    return transformers.LlamaForCausalLM(cfg).double()


def lm_batch(gen, B=6, T=6):
    ids = torch.randint(0, 50, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :2] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def hooks_of(model):
    """Every hook dict of every module, as (module name, attribute, number of hooks)."""
    found = []
    for name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            if "hook" in attr and isinstance(value, dict) and value:
                found.append((name, attr, len(value)))
    return found


def snapshot(model):
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "flags": {n: p.requires_grad for n, p in model.named_parameters()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "hooks": hooks_of(model),
    }


def assert_model_as_before(model, before):
    after = snapshot(model)
    for n, p in before["params"].items():
        assert torch.equal(p, after["params"][n]), n
    for n, b in before["buffers"].items():
        assert torch.equal(b, after["buffers"][n]), n
    assert after["flags"] == before["flags"]
    assert after["modes"] == before["modes"]
    assert all(g is None for g in after["grads"].values()), "the probe created parameter gradients"
    assert after["hooks"] == before["hooks"] == []


def acc_state(probe):
    return {
        (s, p): (a.n, None if a.n == 0 else a.estimate() if a.n >= 4 else a.raw_sum().clone())
        for s, table in (("train", probe.stats), ("test", probe.test_stats))
        for p, a in table.items()
    }


def assert_state_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        assert x[0] == y[0], k
        if isinstance(x[1], torch.Tensor):
            assert torch.equal(x[1], y[1]), k
        else:
            assert x[1] == y[1], k


# ---------------------------------------------------------------------------- the model is untouched
def test_llama_outputs_params_flags_modes_unchanged(gen):
    model = tiny_llama()
    model.train()
    model.model.layers[1].eval()  # a mixed mode must come back exactly
    model.model.embed_tokens.weight.requires_grad_(False)  # mixed flags too
    batch = lm_batch(gen)
    with torch.no_grad():
        out_before = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    before = snapshot(model)
    probe = fs.Probe(model, second_moment="dense")
    probe.step(batch, fs.causal_lm_loss)
    probe.step(batch, fs.causal_lm_loss, stream="test")
    with torch.no_grad():
        out_after = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert torch.equal(out_before, out_after)
    assert_model_as_before(model, before)
    assert probe.stats["model.layers.0"].n == 6 and probe.test_stats["model.layers.1"].n == 6


def test_resnet_batchnorm_statistics_untouched(gen):
    model = tiny_resnet("bottleneck", (1, 1, 1, 1), width=2, seed=1, random_batchnorm=True).double()
    model.train()
    before = snapshot(model)
    x = torch.randn(4, 3, 32, 32, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (4,), generator=gen)
    probe = fs.Probe(model)
    probe.step((x, y), fs.classification_loss)
    assert_model_as_before(model, before)  # running means/vars: eval() during the step


class CountingTrain(nn.Module):
    """A module that overrides ``train`` (as some libraries do): the step must call it."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 5)
        self.calls = []

    def train(self, mode=True):
        self.calls.append(mode)
        return super().train(mode)

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("override", [False, True])
def test_step_sees_eval_and_frozen_model_and_restores_mixed_flags(override, gen):
    tied = nn.Linear(5, 5)
    body = CountingTrain() if override else nn.Linear(5, 5)
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), body, tied, nn.Dropout(0.5), tied, nn.Linear(5, 3))
    model.train()
    model[1].eval()
    model[6].bias.requires_grad_(False)
    before = snapshot(model)
    if override:
        body.calls.clear()
    seen = []

    def loss_fn(m, batch):
        seen.append(([mod.training for mod in m.modules()], [p.requires_grad for p in m.parameters()]))
        x, y = batch
        return nn.functional.cross_entropy(m(x), y, reduction="none")

    probe = fs.Probe(model, points=["0", "2"])
    x = torch.randn(7, 5, generator=gen)
    y = torch.randint(0, 3, (7,), generator=gen)
    probe.step((x, y), loss_fn)
    modes, flags = seen[0]
    assert not any(modes) and not any(flags)
    assert_model_as_before(model, before)
    if override:
        assert body.calls == [False]  # switched through model.eval(), so the override ran
    # the tied parameter, listed once by parameters(), is trainable again (not frozen twice)
    assert tied.weight.requires_grad and tied.bias.requires_grad
    # the dropout was off: the statistics are those of the deterministic model (a second run equal)
    again = fs.Probe(model, points=["0", "2"])
    again.step((x, y), loss_fn)
    assert torch.equal(probe.stats["2"].raw_sum(), again.stats["2"].raw_sum())


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["after_forward", "before_forward", "in_forward_hook"])
def test_exception_in_loss_fn_restores_everything(where, gen):
    model = tiny_llama(1)
    model.train()
    model.lm_head.weight.requires_grad_(False)
    batch = lm_batch(gen)
    probe = fs.Probe(model, second_moment="pool")
    probe.step(batch, fs.causal_lm_loss)
    state = acc_state(probe)
    before = snapshot(model)

    def loss_fn(m, b):
        if where == "before_forward":
            raise Boom("before")
        if where == "in_forward_hook":  # a second forward runs the points twice: the hook raises
            fs.causal_lm_loss(m, b)
        fs.causal_lm_loss(m, b)
        raise Boom("after")

    expected = fs.FusedStatsError if where == "in_forward_hook" else Boom
    with pytest.raises(expected) as info:
        probe.step(batch, loss_fn)
    if where == "in_forward_hook":
        assert "more than once" in str(info.value)
    assert_model_as_before(model, before)
    assert_state_equal(acc_state(probe), state)
    probe.step(batch, fs.causal_lm_loss)  # and the probe still works afterwards
    assert probe.stats["model.layers.0"].n == 12


# ---------------------------------------------------------------------------- loss checks
@pytest.mark.parametrize(
    "bad,needle",
    [
        (lambda loss: loss.mean(), "shape ()"),
        (lambda loss: loss[:, None], "shape (6, 1)"),
        (lambda loss: loss[:5], "shape (5,)"),
        (lambda loss: loss.detach(), "do not depend"),
        (lambda loss: loss * torch.tensor([1, 1, float("nan"), 1, 1, 1], dtype=loss.dtype), "samples [2]"),
        (lambda loss: (loss > 0).long(), "dtype"),
    ],
)
def test_bad_loss_output_rejected_state_unchanged(bad, needle, gen):
    model = tiny_llama(2)
    batch = lm_batch(gen)
    probe = fs.Probe(model, second_moment="pool")
    probe.step(batch, fs.causal_lm_loss)
    state, before = acc_state(probe), snapshot(model)
    with pytest.raises(fs.FusedStatsError) as info:
        probe.step(batch, lambda m, b: bad(fs.causal_lm_loss(m, b)))
    assert needle in str(info.value)
    assert_state_equal(acc_state(probe), state)
    assert_model_as_before(model, before)


def test_loss_helpers_reject_bad_batches(gen):
    model = tiny_llama(0)
    batch = lm_batch(gen)
    batch["labels"][2] = -100
    with pytest.raises(fs.FusedStatsError, match=r"sequences \[2\]"):
        fs.causal_lm_loss(model, batch)
    with pytest.raises(fs.FusedStatsError, match="input_ids"):
        fs.causal_lm_loss(model, {"ids": batch["input_ids"]})
    with pytest.raises(fs.FusedStatsError, match=r"\(6, 6\)"):
        fs.causal_lm_loss(model, {"input_ids": batch["input_ids"], "attention_mask": torch.ones(6, 5)})
    net = cifar_resnet20(width=2)
    with pytest.raises(fs.FusedStatsError, match="targets"):
        fs.classification_loss(net, (torch.randn(3, 3, 8, 8), torch.zeros(4, dtype=torch.long)))


def test_causal_lm_loss_against_token_loop(gen):
    model = tiny_llama(3).eval()
    batch = lm_batch(gen)
    got = fs.causal_lm_loss(model, batch)
    for b in range(6):
        length = int(batch["attention_mask"][b].sum())
        want = R.lm_sample_loss(model, batch["input_ids"][b, :length], batch["labels"][b, :length])
        assert torch.allclose(got[b], want, rtol=1e-12, atol=0), b


# ---------------------------------------------------------------------------- output structures
Out = collections.namedtuple("Out", "hidden aux")


class Block(nn.Module):
    def __init__(self, d, kind):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.kind = kind

    def forward(self, h):
        out = h + torch.tanh(self.lin(h))
        aux = h.pow(2).mean(-1)  # from the input, as HF layers' extra outputs never derive from out
        if self.kind == "tuple":
            return out, aux
        if self.kind == "named":
            return Out(out, aux)
        if self.kind == "list":
            return [out, aux]
        return out


class StructNet(nn.Module):
    """Blocks returning a tuple, a namedtuple, a list and a tensor; extra outputs are used."""

    def __init__(self, d=5, inplace_after=None):
        super().__init__()
        self.embed = nn.Linear(3, d)
        self.blocks = nn.ModuleList([Block(d, k) for k in ("tuple", "named", "list", "tensor")])
        self.head = nn.Linear(d, 4)
        self.inplace_after = inplace_after

    def forward(self, x):
        h = self.embed(x)
        extra = 0
        self.seen = []
        for i, blk in enumerate(self.blocks):
            out = blk(h)
            self.seen.append(type(out))
            if isinstance(out, torch.Tensor):
                h = out
            else:
                h, aux = out[0], out[1]
                extra = extra + aux
            if i == self.inplace_after:
                h.mul_(2.0)
        return self.head(h) + extra[..., None]


def test_tuple_namedtuple_list_outputs_match_reference(gen):
    torch.manual_seed(0)
    model = StructNet().double()
    points = [f"blocks.{i}" for i in range(4)]
    assert fs.residual_points(model) == points  # the single homogeneous ModuleList
    x = torch.randn(9, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (9,), generator=gen)
    with torch.no_grad():
        before = model(x)
    probe = fs.Probe(model, second_moment="pool")
    probe.step((x, y), fs.classification_loss)
    assert model.seen == [tuple, Out, list, torch.Tensor]  # structures re-emitted as they were
    with torch.no_grad():
        assert torch.equal(model(x), before)
    rows = {p: [] for p in points}
    for b in range(9):
        g = R.point_grads_one_sample(
            model, points, lambda m, b=b: R.classification_sample_loss(m, x[b], int(y[b]))
        )
        for p in points:
            rows[p].append(g[p])
    for p in points:
        R.assert_estimate_matches(probe.stats[p].estimate(), torch.cat(rows[p]), context=p)


def test_in_place_change_of_a_captured_output_is_detected(gen):
    torch.manual_seed(0)
    model = StructNet(inplace_after=2).double()
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (4,), generator=gen)
    probe = fs.Probe(model, points=["blocks.0", "blocks.2"])
    with pytest.raises(fs.FusedStatsError, match=r"blocks\.2.*in place"):
        probe.step((x, y), fs.classification_loss)
    assert hooks_of(model) == []
    assert probe.stats == {}


# ---------------------------------------------------------------------------- points
def test_residual_points_of_supported_families():
    torch.manual_seed(0)
    neox = transformers.GPTNeoXModel(
        transformers.GPTNeoXConfig(
            hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2, vocab_size=20
        )
    )
    gpt2 = transformers.GPT2Model(transformers.GPT2Config(n_embd=8, n_layer=3, n_head=2, vocab_size=20))
    assert fs.residual_points(neox) == ["layers.0", "layers.1", "layers.2"]
    assert fs.residual_points(gpt2) == ["h.0", "h.1", "h.2"]
    assert fs.residual_points(tiny_llama().model) == ["layers.0", "layers.1"]
    assert fs.residual_points(tiny_resnet("bottleneck", (2, 1, 1, 2), width=2)) == [
        "layer1.0",
        "layer1.1",
        "layer2.0",
        "layer3.0",
        "layer4.0",
        "layer4.1",
    ]
    r20 = fs.residual_points(cifar_resnet20(width=2))
    assert r20 == [f"layer{s}.{i}" for s in (1, 2, 3) for i in range(3)]


def test_unknown_point_lists_candidates_and_no_residual_model_errors():
    model = tiny_llama()
    with pytest.raises(fs.FusedStatsError) as info:
        fs.Probe(model, points=["model.layers.0", "model.layer.1"])
    msg = str(info.value)
    assert "'model.layer.1'" in msg and "model.layers.1" in msg
    with pytest.raises(fs.FusedStatsError, match="twice"):
        fs.Probe(model, points=["model.layers.0", "model.layers.0"])
    mlp = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(fs.FusedStatsError, match="no residual stream"):
        fs.residual_points(mlp)
    with pytest.raises(fs.FusedStatsError, match="residual points"):
        fs.Probe(cifar_resnet20(width=2), points="layer1.5")


def test_any_module_is_a_point_with_its_own_feature_axis(gen):
    """An MLP inside a decoder layer and a ResNet conv: explicit names, auto feature axes."""
    model = tiny_llama(4)
    batch = lm_batch(gen)
    probe = fs.Probe(model, points=["model.layers.1.mlp", "model.layers.0"], second_moment="pool")
    probe.step(batch, fs.causal_lm_loss)
    ref = R.lm_reference(model, batch, ["model.layers.1.mlp", "model.layers.0"], "sample")
    for p in probe.points:
        R.assert_estimate_matches(probe.stats[p].estimate(), ref[p], context=p)
    net = cifar_resnet20(width=2, seed=0).double()
    x = torch.randn(5, 3, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (5,), generator=gen)
    p2 = fs.Probe(net, points=["layer2.1.conv1", "layer3.0"], feature_dim={"layer3.0": 1})
    p2.step((x, y), fs.classification_loss)
    assert p2.feature_dims == {"layer2.1.conv1": 1, "layer3.0": 1}
    assert (p2.dims["layer2.1.conv1"], p2.dims["layer3.0"]) == (4, 8)


class ConvSeq(nn.Module):
    """(B, C, L) feature maps from Conv1d blocks with a skip: the channel axis is 1."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv1d(2, 3, 3, padding=1)
        self.blocks = nn.ModuleList([nn.Conv1d(3, 3, 3, padding=1) for _ in range(2)])
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h = self.stem(x)
        for blk in self.blocks:
            h = h + torch.tanh(blk(h))
        return self.head(h.mean(-1))


def test_conv1d_points_use_channel_axis(gen):
    torch.manual_seed(0)
    model = ConvSeq().double()
    x = torch.randn(6, 2, 7, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 2, (6,), generator=gen)
    probe = fs.Probe(model, points=["blocks.0", "blocks.1"], second_moment="pool")
    probe.step((x, y), fs.classification_loss)
    assert probe.dims == {"blocks.0": 3, "blocks.1": 3}
    rows = {p: [] for p in probe.points}
    for b in range(6):
        g = R.point_grads_one_sample(
            model, probe.points, lambda m, b=b: R.classification_sample_loss(m, x[b], int(y[b]))
        )
        for p in probe.points:
            rows[p].append(g[p][0].sum(-1, keepdim=True).T)  # the gradient of this block's conv
    # blocks.i's output is tanh(conv) (its skip is outside), so compare the same tensors
    for p in probe.points:
        R.assert_estimate_matches(probe.stats[p].estimate(), torch.cat(rows[p]), context=p)


def emitting_positions(batch):
    """Positions that predict a supervised token: labels[t+1] != -100, both t and t+1 real."""
    labels, attn = batch["labels"], batch["attention_mask"] != 0
    keep = torch.zeros(labels.shape, dtype=torch.bool)
    keep[:, :-1] = (labels[:, 1:] != -100) & attn[:, :-1] & attn[:, 1:]
    return keep


# ---------------------------------------------------------------------------- masks
def test_mask_forms_agree(gen):
    model = tiny_llama(5)
    batch = lm_batch(gen)
    keep = emitting_positions(batch)
    results = []
    for mask in ("labels", keep, keep.double(), emitting_positions):
        probe = fs.Probe(model, unit="position", second_moment="dense")
        probe.step(batch, fs.causal_lm_loss, mask=mask)
        results.append(probe.stats["model.layers.1"].estimate())
    assert results[0].n == int(keep.sum())
    assert all(r == results[0] for r in results[1:])
    none = fs.Probe(model, unit="position")
    none.step(batch, fs.causal_lm_loss, mask="none")
    assert none.stats["model.layers.0"].n == 36
    with pytest.raises(fs.FusedStatsError, match=r"mask of shape \(6, 5\)"):
        none.step(batch, fs.causal_lm_loss, mask=torch.ones(6, 5))
    with pytest.raises(fs.FusedStatsError, match="labels"):
        none.step({"input_ids": batch["input_ids"]}, fs.causal_lm_loss, mask="labels")
    assert none.stats["model.layers.0"].n == 36


def test_flat_unit_on_sequences_zeroes_padding(gen):
    model = tiny_llama(6)
    batch = lm_batch(gen)
    probe = fs.Probe(model, unit="flat", second_moment="pool")
    probe.step(batch, fs.causal_lm_loss, mask="labels")
    keep = emitting_positions(batch)
    rows = []
    for b in range(6):
        length = int(batch["attention_mask"][b].sum())
        g = R.point_grads_one_sample(
            model,
            ["model.layers.0"],
            lambda m, b=b, length=length: R.lm_sample_loss(
                m, batch["input_ids"][b, :length], batch["labels"][b, :length]
            ),
        )["model.layers.0"][0]
        full = torch.zeros(6, 16, dtype=torch.float64)
        full[:length] = g
        full[~keep[b]] = 0
        rows.append(full.reshape(1, -1))
    R.assert_estimate_matches(probe.stats["model.layers.0"].estimate(), torch.cat(rows))


# ---------------------------------------------------------------------------- non-finite, misc
def test_nonfinite_gradient_raise_or_skip(gen):
    net = cifar_resnet20(width=2, seed=0).double()
    x = torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (4,), generator=gen)

    def bad_loss(m, b):
        # finite losses whose gradient is not: d sqrt(u)/du at u = 0 is inf, times 0 is nan
        out = m(b[0])
        ce = torch.nn.functional.cross_entropy(out, b[1], reduction="none")
        return ce + (out - out.detach()).abs().sum(1).sqrt()

    for policy in ("raise", "skip"):
        probe = fs.Probe(net, nonfinite=policy)
        probe.step((x, y), fs.classification_loss)
        state = acc_state(probe)
        if policy == "raise":
            with pytest.raises(fs.FusedStatsError, match="non-finite"):
                probe.step((x, y), bad_loss)
        else:
            probe.step((x, y), bad_loss)
            assert probe.skipped_steps["train"] == 1
        assert_state_equal(acc_state(probe), state)
        assert probe.steps["train"] == 1


def test_argument_checks():
    model = cifar_resnet20(width=2)
    for kwargs, needle in [
        ({"unit": "token"}, "unit"),
        ({"second_moment": "full"}, "second_moment"),
        ({"cross": object()}, "cross"),
        ({"feature_dim": {"nope": 1}}, "feature_dim"),
        ({"backend": "cuda"}, "backend"),
    ]:
        with pytest.raises(fs.FusedStatsError, match=needle):
            fs.Probe(model, **kwargs)
    probe = fs.Probe(model)
    with pytest.raises(fs.FusedStatsError, match="stream"):
        probe.step(
            (torch.randn(2, 3, 8, 8), torch.zeros(2, dtype=torch.long)), fs.classification_loss, stream="val"
        )
    with torch.inference_mode(), pytest.raises(fs.FusedStatsError, match="inference_mode"):
        probe.step((torch.randn(2, 3, 8, 8), torch.zeros(2, dtype=torch.long)), fs.classification_loss)
    with pytest.raises(fs.FusedStatsError, match="nothing probed"):
        probe.report()


def test_run_with_progress_and_max_batches(gen, capsys):
    net = cifar_resnet20(width=2, seed=0).double()
    data = [
        (
            torch.randn(3, 3, 8, 8, generator=gen, dtype=torch.float64),
            torch.randint(0, 10, (3,), generator=gen),
        )
        for _ in range(5)
    ]
    probe = fs.Probe(net, second_moment="dense")
    assert probe.run(data, fs.classification_loss, max_batches=3) == 3
    assert probe.stats["layer1.0"].n == 9 and probe.steps["train"] == 3
    assert probe.run(iter(data), fs.classification_loss, stream="test", progress=False) == 5
    assert probe.test_stats["layer3.2"].n == 15


def test_callbacks_receive_activation_and_gradient(gen):
    net = cifar_resnet20(width=2, seed=0).double()
    x = torch.randn(5, 3, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (5,), generator=gen)
    got = []
    probe = fs.Probe(net, points=["layer2.0"])
    probe.add_callback(got.append)
    probe.step((x, y), fs.classification_loss)
    (cap,) = got
    assert cap.point == "layer2.0" and cap.stream == "train" and cap.feature_dim == 1
    net.eval()
    with torch.no_grad():
        z = net.layer2[0](net.layer1(net.relu(net.bn1(net.conv1(x)))))
    assert torch.equal(cap.activation, z)
    for b in range(5):
        g = R.point_grads_one_sample(
            net, ["layer2.0"], lambda m, b=b: R.classification_sample_loss(m, x[b], int(y[b]))
        )
        assert torch.allclose(cap.grad[b], g["layer2.0"][0], rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------------------- streams and report
def two_streams(gen, n_train=5, n_test=5, second_moment="pool", seed=0):
    net = cifar_resnet20(width=2, seed=seed, random_batchnorm=True).double()
    xs = torch.randn(n_train + n_test, 3, 8, 8, generator=gen, dtype=torch.float64)
    ys = torch.randint(0, 10, (n_train + n_test,), generator=gen)
    probe = fs.Probe(net, second_moment=second_moment)
    probe.step((xs[:n_train], ys[:n_train]), fs.classification_loss)
    if n_test:
        probe.step((xs[n_train:], ys[n_train:]), fs.classification_loss, stream="test")
    ref = R.conv_reference(net, xs, ys, probe.points, "sample")
    return probe, {p: (q[:n_train], q[n_train:]) for p, q in ref.items()}


def theorem1(q_pool, M, K):
    """Width paper, Theorem 1, from brute-force U-statistics of the pooled vectors."""
    t = R.u_targets(q_pool)
    mu4, msm, tr2 = t["mu_norm4"], t["mu_sigma_mu"], t["trace_sigma2"]
    n_eff = M * K / (M + K + 1)
    if mu4 <= 0:
        return n_eff, 1.0, 1.0
    d_par = mu4 / msm if msm > 0 else math.inf
    d_2 = mu4 / tr2 if tr2 > 0 else math.inf
    var = (1 / M + 1 / K) * max(msm, 0) + max(tr2, 0) / (M * K)
    return n_eff, 1 / (1 + n_eff * min(d_par, d_2)), var / (var + mu4)


def test_realized_alignment_and_certificates(gen):
    probe, ref = two_streams(gen, 6, 5)
    certified = 0
    for p, (qa, qb) in ref.items():
        want = float(qa.mean(0) @ qb.mean(0))
        assert probe.realized_alignment(p) == pytest.approx(want, rel=1e-9, abs=1e-15)
        for pooled, q in ((True, torch.cat([qa, qb])), (False, qa)):
            cert = probe.certificate(p, pooled=pooled)
            n_eff, b_align, b_exact = theorem1(q, 6, 5)
            assert (cert.M, cert.K) == (6, 5)
            assert cert.n_eff == pytest.approx(n_eff, rel=1e-12)
            assert cert.b_align == pytest.approx(b_align, rel=1e-6)
            assert cert.b_exact == pytest.approx(b_exact, rel=1e-6)
            certified += cert.estimable
    assert certified > 0  # at least some points carry a signal, so the bounds were exercised


def test_misalignment_against_all_partitions(gen):
    probe, ref = two_streams(gen, 5, 5, seed=1)
    checked = 0
    for p, (qa, qb) in ref.items():
        q = torch.cat([qa, qb])
        values = []
        for A in itertools.combinations(range(10), 5):
            B = [i for i in range(10) if i not in A]
            values.append(float(q[list(A)].mean(0) @ q[B].mean(0)))
        exact = sum(v <= 0 for v in values) / len(values)
        mis = probe.misalignment(p, trials=20_000, seed=3)
        se = math.sqrt(max(exact * (1 - exact), 1e-4) / 20_000)
        assert abs(mis.probability - exact) <= 4 * se, (p, mis.probability, exact)
        assert (mis.M, mis.K, mis.pool_size) == (5, 5, 10)
        checked += 0 < exact < 1
    assert checked > 0  # a point where the probability is neither 0 nor 1


def test_report_structure_and_weak_points(gen, tmp_path):
    probe, ref = two_streams(gen, 6, 3)
    report = probe.report(meta={"width": 2, "seed": 0}, misalignment_trials=200)
    assert isinstance(report, fs.Report)
    data = probe._report_data(meta={"width": 2}, misalignment_trials=200)
    assert data["format"] == "fused_stats.report" and data["version"] == 1
    assert data["model"]["class"] == "CifarResNet" and data["model"]["config"]["depth"] == 9
    assert data["model"]["num_parameters"] == sum(p.numel() for p in probe.model.parameters())
    assert [pt["name"] for pt in data["points"]] == probe.points
    assert [pt["index"] for pt in data["points"]] == list(range(9))
    for pt in data["points"]:
        qa, qb = ref[pt["name"]]
        assert pt["dim"] == qa.shape[1]
        assert pt["train"]["n"] == 6 and pt["test"] is None  # test n = 3 < 4: None, no crash
        assert pt["certificate"]["M"] == 6 and pt["certificate"]["K"] == 3
        assert pt["misalignment"]["trials"] == 200
        assert pt["realized_alignment"] == pytest.approx(float(qa.mean(0) @ qb.mean(0)), rel=1e-9, abs=1e-15)
        assert pt["saturation"] is None
    path = report.to_json(tmp_path / "r.json")
    assert fs.Report.from_json(path).points[0]["name"] == "layer1.0"
    dense, _ = two_streams(gen, 5, 0, second_moment="dense")
    d2 = dense._report_data(misalignment_trials=100)
    assert all(
        pt["misalignment"] is None
        and pt["certificate"] is None
        and pt["test"] is None
        and pt["realized_alignment"] is None
        and pt["train"]["n"] == 5
        for pt in d2["points"]
    )
    with pytest.raises(fs.FusedStatsError, match=r"needs a pool|no sample pool"):
        dense.misalignment("layer1.0", M=2, K=2)


class _Spy(torch.autograd.Function):
    """Identity whose autograd node can be watched: is the graph below a point kept alive?"""

    nodes: ClassVar[list] = []

    @staticmethod
    def forward(ctx, x):
        _Spy.nodes.append(weakref.ref(ctx))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


class SpyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(3, 4)
        self.blocks = nn.ModuleList([Block(4, "tensor") for _ in range(2)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = _Spy.apply(self.stem(x))
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def test_graph_below_the_lowest_point_is_cut(gen):
    """Even with an input that requires grad, the losses' graph stops at the first point."""
    torch.manual_seed(0)
    model = SpyNet().double()
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 2, (5,), generator=gen)
    alive = []

    def loss_fn(m, b):
        losses = fs.classification_loss(m, b)
        alive.append(_Spy.nodes[-1]() is not None)  # the forward's locals are gone by now
        return losses

    losses = loss_fn(model, (x, y))  # without a probe the graph reaches the spy
    assert alive == [True]
    del losses
    probe = fs.Probe(model, points=["blocks.0", "blocks.1"])
    probe.step((x, y), loss_fn)
    assert alive == [True, False]
    assert x.grad is None and all(p.grad is None for p in model.parameters())


def test_fp32_model_and_no_grad_context(gen):
    """An fp32 model under the caller's torch.no_grad(): the step still differentiates, and the
    fp32 gradients match fp32 per-sample loops upcast to fp64 (quantities without cancellation)."""
    net = cifar_resnet20(width=4, seed=2, random_batchnorm=True)  # float32
    x = torch.randn(8, 3, 8, 8, generator=gen)
    y = torch.randint(0, 10, (8,), generator=gen)
    probe = fs.Probe(net, points=["layer1.2", "layer3.0"], second_moment="pool")
    with torch.no_grad():
        probe.step((x, y), fs.classification_loss)
    ref = R.conv_reference(net, x, y, probe.points, "sample")
    for p in probe.points:
        est, q = probe.stats[p].estimate(), ref[p]
        r = q.norm(dim=1)
        assert est.n == 8
        assert est.ag_max == pytest.approx(float(r.max()), rel=1e-4)
        assert est.ag_mean == pytest.approx(float(r.mean()), rel=1e-4)
        assert est.trace_sigma == pytest.approx(R.u_targets(q)["trace_sigma"], rel=1e-4)


def test_flat_unit_drops_a_sample_with_no_counted_position(gen):
    model = tiny_llama(7)
    batch = lm_batch(gen)
    mask = batch["attention_mask"].clone()
    mask[2] = 0  # sample 2 has no counted position: not a sample (as for unit="sample")
    flat = fs.Probe(model, unit="flat", second_moment="pool")
    flat.step(batch, fs.causal_lm_loss, mask=mask)
    per_sample = fs.Probe(model, unit="sample", second_moment="pool")
    per_sample.step(batch, fs.causal_lm_loss, mask=mask)
    assert flat.stats["model.layers.0"].n == per_sample.stats["model.layers.0"].n == 5
    # the kept rows, in order, against one backward per sequence (padding stripped), each flattened
    # with its uncounted positions zeroed; sample 2 must be absent, not a zero row
    want = []
    for b in range(6):
        if b == 2:
            continue
        length = int(batch["attention_mask"][b].sum())
        g = R.point_grads_one_sample(
            model,
            ["model.layers.0"],
            lambda m, b=b, length=length: R.lm_sample_loss(
                m, batch["input_ids"][b, :length], batch["labels"][b, :length]
            ),
        )["model.layers.0"][0]
        full = torch.zeros(6, 16, dtype=torch.float64)
        full[:length] = g
        full[mask[b] == 0] = 0
        want.append(full.reshape(1, -1))
    want = torch.cat(want)
    got = flat.stats["model.layers.0"].pool_rows()
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12 * float(want.abs().max()))
