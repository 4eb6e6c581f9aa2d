"""Training-time monitoring: ``Probe.observe`` around the user's own training step.

References:

* ``Probe.step`` on the same batch and the same model state (taken just before the observed
  step; an AdamW step follows, so later batches see a changed model), for the batch-mean, sum and
  token-mean losses, with HF gradient checkpointing off, non-reentrant and reentrant: estimates
  and raw sums to <= 1e-6 relative. The model is a tiny HF LLaMA in fp64 with right-
  padded batches and unsupervised prompt tokens. HF's ``LlamaRMSNorm`` computes in fp32 (a
  *downcast* for an fp64 model) and ``ForCausalLMLoss`` casts logits to fp32, which would put
  ~1e-7 rounding into the comparison; the fixture ``fp64_llama`` therefore runs the RMSNorm formula
  in the input dtype and gives the model an fp64 token-mean loss with HF's signature and formula
  (shifted labels, sum over targets != -100, divided by their count or ``num_items_in_batch``).
  HF's own unpatched loss is checked too, at the level of the per-sample vectors.
* Per-sample loops (``tests/per_sample_reference.py``: one backward per sequence, padding
  stripped) and the brute-force U-statistics over ordered distinct tuples, independently of the
  package.
* Bit-identical parameters and gradients after N AdamW steps with and without ``observe``,
  also under bf16 autocast and with checkpointing.
* Under real bf16 autocast (fp32 model): the gradients ``observe`` sees equal those of
  ``Probe.step`` bit for bit (a bf16 MLP output and fp32 residual points), the statistics to <= 1e-6
  relative; on a model cast to bf16 too.
* Monitor logs against estimates of reference probes fed by ``Probe.step`` at the logged steps.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fused_stats as fs
from fused_stats.api.training.monitor_log import plot_monitor_log, read_monitor_log

import per_sample_reference as R
from gloo_harness import init_gloo
from tiny_models import padded_lm_batch


def _transformers():
    # imported on first use, not with the module: the DDP test's spawned ranks import this file
    module = pytest.importorskip("transformers")
    module.logging.set_verbosity_error()
    return module


VOCAB = 64
F64 = torch.float64
FIELDS = ("mu_norm2", "mu_norm4", "mu_sigma_mu", "trace_sigma2", "trace_sigma", "ag_max", "ag_mean")
ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- models and data
def _rmsnorm_same_dtype(self, hidden_states):
    # the RMSNorm formula of LlamaRMSNorm, evaluated in the input's dtype (fp64 stays fp64)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def fp64_token_mean_loss(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """HF's causal-LM loss (mean over all valid shifted targets of the batch), kept in fp64."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    total = F.cross_entropy(
        logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    count = (shift_labels != ignore_index).sum() if num_items_in_batch is None else num_items_in_batch
    return total / count


@pytest.fixture
def fp64_llama(monkeypatch):
    _transformers()
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rmsnorm_same_dtype)

    def build(seed=0, fp64_loss=True):
        model = llama(seed).double()
        if fp64_loss:
            model.loss_function = fp64_token_mean_loss
        return model

    return build


def llama(seed=0, hidden=16, layers=2):
    torch.manual_seed(seed)
    transformers = _transformers()
    cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    return transformers.LlamaForCausalLM(cfg).train()


def checkpointing(model, mode):
    if mode == "off":
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"}
        )


def lm_batch(gen, lengths, T, prompts):
    return padded_lm_batch(gen, lengths, T, VOCAB, prompts)


def batches(gen):
    # very unequal valid-target counts, so "mean" and "token_mean" scale differently
    return [
        lm_batch(gen, [10, 4, 7, 9, 3], 10, [0, 1, 3, 0, 0]),
        lm_batch(gen, [6, 8, 2, 8], 8, [2, 0, 0, 1]),
    ]


def training_loss(model, batch, reduction):
    """The user's loss for a declared reduction (mean/sum of per-sample losses, HF token mean)."""
    if reduction == "token_mean":
        return model(**batch).loss
    per_sample = fs.causal_lm_loss(model, batch)
    return per_sample.mean() if reduction == "mean" else per_sample.sum()


def assert_same_stats(ref: fs.Probe, obs: fs.Probe, rel=1e-6, stream="train"):
    ref_accs, obs_accs = ref.accumulators("grad", stream), obs.accumulators("grad", stream)
    assert list(ref_accs) == list(obs_accs) == ref.points
    for point in ref.points:
        a, b = ref_accs[point], obs_accs[point]
        assert a.n == b.n > 0, (point, a.n, b.n)
        ea, eb = a.estimate(), b.estimate()
        for key in FIELDS:
            x, y = getattr(ea, key), getattr(eb, key)
            assert abs(x - y) <= rel * abs(x), (point, key, x, y)
        sa, sb = a.raw_sum(), b.raw_sum()
        assert torch.allclose(sb, sa, rtol=rel, atol=rel * float(sa.abs().max())), point


def n_valid(batch):
    """Valid shifted targets per sample, counted here independently (HF's rule)."""
    return [
        int(sum(1 for t in range(1, batch["labels"].shape[1]) if batch["labels"][b, t] != -100))
        for b in range(batch["labels"].shape[0])
    ]


# --------------------------------------------------------------------- statistics equal Probe.step
@pytest.mark.parametrize("gc", ["off", "non-reentrant", "reentrant"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "token_mean"])
def test_observe_equals_probe_step(fp64_llama, gen, gc, reduction):
    model = fp64_llama()
    checkpointing(model, gc)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = fs.Probe(model, second_moment="dense")
    obs = fs.Probe(model, second_moment="dense")
    for batch in batches(gen):
        ref.step(batch, fs.causal_lm_loss)  # same model state, before the update
        assert model.training  # Probe.step restored train mode (checkpointing needs it)
        opt.zero_grad(set_to_none=True)
        with obs.observe(loss_reduction=reduction) as ob:
            training_loss(model, batch, reduction).backward()
        opt.step()
        assert ob.folded
        counts = n_valid(batch)
        B = len(counts)
        want = {"sum": [1.0] * B, "mean": [float(B)] * B, "token_mean": [sum(counts) / c for c in counts]}[
            reduction
        ]
        assert torch.allclose(ob.scale, torch.tensor(want, dtype=F64), rtol=1e-15)
        assert ob.loss_weight == (1.0 if reduction == "token_mean" else None)
    assert obs.steps["train"] == 2
    assert_same_stats(ref, obs, rel=1e-6)


def test_observe_position_unit_label_mask_matches(fp64_llama, gen):
    # unit="position" with the label mask: every supervised position is a sample
    model = fp64_llama()
    checkpointing(model, "non-reentrant")
    ref = fs.Probe(model, unit="position", second_moment="dense")
    obs = fs.Probe(model, unit="position", second_moment="dense")
    for batch in batches(gen):
        ref.step(batch, fs.causal_lm_loss, mask="labels")
        with obs.observe(loss_reduction="token_mean", mask="labels"):
            model(**batch).loss.backward()
    assert_same_stats(ref, obs)


def test_observe_own_token_mean_with_batch_argument(fp64_llama, gen):
    # a token-mean loss computed by the user from logits: counts come from batch=
    model = fp64_llama()
    ref = fs.Probe(model, second_moment="pool")
    obs = fs.Probe(model, second_moment="pool")
    for batch in batches(gen):
        ref.step(batch, fs.causal_lm_loss)
        logits = None
        with obs.observe(loss_reduction="token_mean", batch=batch):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = fp64_token_mean_loss(
                logits[:, :-1], batch["labels"][:, 1:], VOCAB, shift_labels=batch["labels"][:, 1:]
            )
            loss.backward()
    assert_same_stats(ref, obs)


def test_observe_against_per_sample_loops(fp64_llama, gen):
    """Independent reference: one backward per sequence, then exact U-statistics."""
    model = fp64_llama()
    checkpointing(model, "reentrant")
    points = ["model.layers.0", "model.layers.1"]
    probe = fs.Probe(model, points=points, second_moment="pool")
    rows = {p: [] for p in points}
    for batch in batches(gen):
        snapshot = copy.deepcopy(model)
        with probe.observe(loss_reduction="token_mean"):
            model(**batch).loss.backward()
        for p, q in R.lm_reference(snapshot, batch, points, "sample").items():
            rows[p].append(q)
        with torch.no_grad():  # move the model between batches
            for param in model.parameters():
                param -= 0.05 * param.grad
                param.grad = None
    for p in points:
        q = torch.cat(rows[p])
        assert torch.allclose(probe.stats[p].pool_rows(), q, rtol=1e-9, atol=1e-12), p
        R.assert_estimate_matches(probe.stats[p].estimate(), q, rel=1e-6, context=p)


def test_hf_own_fp32_loss(gen):
    """HF's unpatched loss (fp32 cross-entropy): per-sample vectors agree to fp32 rounding."""
    model = llama(1).double()
    probe = fs.Probe(model, second_moment="pool")
    ref = fs.Probe(model, second_moment="pool")
    batch = batches(gen)[0]
    ref.step(batch, fs.causal_lm_loss)
    with probe.observe(loss_reduction="token_mean"):
        model(**batch).loss.backward()
    for p in probe.points:
        a, b = ref.stats[p].pool_rows(), probe.stats[p].pool_rows()
        err = ((a - b).norm(dim=1) / a.norm(dim=1)).max()
        assert err < 1e-6, (p, float(err))


def test_callbacks_see_whole_scaled_gradients(fp64_llama, gen):
    # a callback (e.g. cross statistics) needs the whole gradient and the activation: both paths
    # must hand it the same per-sample-loss gradient as Probe.step
    model = fp64_llama()
    seen = {"ref": [], "obs": []}
    ref = fs.Probe(model, second_moment="dense")
    obs = fs.Probe(model, second_moment="dense")
    ref.add_callback(lambda c: seen["ref"].append((c.point, c.grad.clone(), c.activation.clone())))
    obs.add_callback(lambda c: seen["obs"].append((c.point, c.grad.clone(), c.activation.clone())))
    batch = batches(gen)[0]
    ref.step(batch, fs.causal_lm_loss)
    with obs.observe(loss_reduction="token_mean"):
        model(**batch).loss.backward()
    assert [p for p, _, _ in seen["ref"]] == [p for p, _, _ in seen["obs"]] == ref.points
    for (p, g_ref, z_ref), (_, g_obs, z_obs) in zip(seen["ref"], seen["obs"]):
        assert g_obs.shape == batch["input_ids"].shape + (16,)
        assert torch.allclose(g_obs, g_ref, rtol=1e-9, atol=1e-12 * float(g_ref.abs().max())), p
        assert torch.equal(z_obs, z_ref), p
    assert_same_stats(ref, obs)


@pytest.mark.parametrize("window", [False, True])
def test_cross_statistics_observed_and_logged(fp64_llama, gen, tmp_path, window):
    # the depth probe's |C|^2 from observed steps equals Probe.step's, and the log carries it
    model = fp64_llama()
    spec = fs.CrossSpec(rank=8, activation="gelu", seed=1)
    ref = fs.Probe(model, second_moment="dense", cross=spec)
    obs = fs.Probe(model, second_moment="dense", cross=spec)
    log = fs.MonitorLog(tmp_path / "c.jsonl", every=2, window=window)
    for batch in batches(gen):
        ref.step(batch, fs.causal_lm_loss)
        with obs.observe(loss_reduction="token_mean", log=log):
            model(**batch).loss.backward()
    (record,) = read_monitor_log(tmp_path / "c.jsonl")
    for p in ref.points:
        want = ref.saturation(p)
        assert record["points"][p]["n"] == want.n == 9
        for key in ("cross_frob2", "cross_frob2_se", "cross_frob", "p_value"):
            w = getattr(want, key)
            if w is None:  # an SE that is not estimable at this n is logged as null
                assert record["points"][p][key] is None, (p, key)
                continue
            assert abs(record["points"][p][key] - w) <= 1e-6 * abs(w), (p, key)
        assert record["points"][p]["saturated"] == want.saturated
    if window:  # the window emptied the cross statistics with the GradStats
        assert obs.cross_stats == {} and obs.stats == {}
    else:
        assert_same_stats(ref, obs)


def test_nan_at_padding_is_ignored(fp64_llama, gen):
    """A NaN gradient at uncounted (padding) positions of one point: that point's masked sum is
    non-finite, so its whole gradient is kept and masked exactly (Probe's rule: what is not
    counted cannot matter), while the other point takes the per-sample-sum path."""
    model = fp64_llama()
    batch = batches(gen)[0]
    pad = batch["attention_mask"] == 0
    assert bool(pad.any())
    ref = fs.Probe(model, second_moment="dense")
    ref.step(batch, fs.causal_lm_loss)

    def poison(module, args, out):
        # registered before observe's hook, so observe receives the poisoned gradient
        out.register_hook(lambda g: g.masked_fill(pad.unsqueeze(-1), math.nan))

    handle = model.model.layers[0].register_forward_hook(poison)  # the lowest point: the NaN
    obs = fs.Probe(model, second_moment="dense")  # reaches no other point
    try:
        with obs.observe(loss_reduction="token_mean"):
            model(**batch).loss.backward()
    finally:
        handle.remove()
    assert_same_stats(ref, obs)


def test_checkpoint_inside_module_call_counts_once(gen):
    """Hooks INSIDE the checkpointed call (older HF versions checkpoint ``__call__``): the
    forward runs twice, the statistics must count every sample once."""

    class Net(nn.Module):
        def __init__(self, reentrant):
            super().__init__()
            self.reentrant = reentrant
            self.inp = nn.Linear(6, 8)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
            self.out = nn.Linear(8, 4)

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                if self.training:
                    h = h + torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
                else:
                    h = h + block(h)
            return self.out(h)

    for reentrant in (False, True):
        torch.manual_seed(3)
        model = Net(reentrant).double().train()
        points = ["blocks.0", "blocks.1", "blocks.2"]
        ref = fs.Probe(model, points=points, second_moment="dense")
        obs = fs.Probe(model, points=points, second_moment="dense")
        calls = []
        model.blocks[0].register_forward_hook(lambda *a, calls=calls: calls.append(torch.is_grad_enabled()))
        for B in (7, 5):
            x = torch.randn(B, 6, generator=gen, dtype=F64)
            y = torch.randint(0, 4, (B,), generator=gen)
            ref.step((x, y), fs.classification_loss)
            calls.clear()
            # without early stop, the non-reentrant replay runs the whole block, hooks included
            with torch.utils.checkpoint.set_checkpoint_early_stop(False), obs.observe(loss_reduction="mean"):
                F.cross_entropy(model(x), y).backward()
            # the block ran twice (forward, then its replay in the backward): no-grad then grad
            # for reentrant, grad twice for non-reentrant
            assert calls == ([False, True] if reentrant else [True, True]), calls
        assert obs.stats["blocks.0"].n == 12
        assert_same_stats(ref, obs, rel=1e-9)


def test_explicit_scale_and_loss_scale(fp64_llama, gen):
    model = fp64_llama()
    ref = fs.Probe(model, second_moment="dense")
    obs = fs.Probe(model, second_moment="dense")
    b1, b2 = batches(gen)
    # weighted loss sum_b w_b l_b: the per-sample factors are 1/w_b
    ref.step(b1, fs.causal_lm_loss)
    w = torch.rand(5, generator=gen, dtype=F64) + 0.5
    with obs.observe(scale=1.0 / w):
        (w * fs.causal_lm_loss(model, b1)).sum().backward()
    # gradient accumulation: the HF loss divided by 4, declared with loss_scale
    ref.step(b2, fs.causal_lm_loss)
    with obs.observe(loss_reduction="token_mean", loss_scale=0.25) as ob:
        (model(**b2).loss / 4).backward()
    assert ob.loss_weight == 0.25
    # a GradScaler's current scale is divided out
    ref.step(b1, fs.causal_lm_loss)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with obs.observe(loss_reduction="mean", loss_scale=scaler):
        scaler.scale(fs.causal_lm_loss(model, b1).mean()).backward()
    assert_same_stats(ref, obs)


def test_num_items_in_batch(fp64_llama, gen):
    # HF's gradient-accumulation normaliser N replaces the batch's own token count
    model = fp64_llama()
    ref = fs.Probe(model, second_moment="dense")
    obs = fs.Probe(model, second_moment="dense")
    batch = batches(gen)[0]
    ref.step(batch, fs.causal_lm_loss)
    with obs.observe(loss_reduction="token_mean") as ob:
        model(**batch, num_items_in_batch=torch.tensor(100)).loss.backward()
    counts = n_valid(batch)
    assert torch.allclose(ob.scale, torch.tensor([100.0 / c for c in counts], dtype=F64))
    assert_same_stats(ref, obs)


def test_test_stream_and_callable_mask(fp64_llama, gen):
    # held-out batches observed into the test stream (e.g. an eval backward without an update),
    # with a callable mask: the same as Probe.step with that stream and mask
    model = fp64_llama()
    ref = fs.Probe(model, second_moment="dense")
    obs = fs.Probe(model, second_moment="dense")
    b1, b2 = batches(gen)

    def supervised(batch):
        return batch["labels"] != -100

    for batch, stream in ((b1, "train"), (b2, "test")):
        ref.step(batch, fs.causal_lm_loss, stream=stream, mask=supervised)
        with obs.observe(loss_reduction="token_mean", stream=stream, mask=supervised):
            model(**batch).loss.backward()
    assert_same_stats(ref, obs, stream="train")
    assert_same_stats(ref, obs, stream="test")
    for p in ref.points:
        a, b = ref.realized_alignment(p), obs.realized_alignment(p)
        assert abs(a - b) <= 1e-6 * abs(a)


def test_sample_without_targets_is_no_sample(fp64_llama, gen):
    model = fp64_llama()
    batch = batches(gen)[0]
    batch["labels"][2] = -100  # sample 2 has no loss term at all
    keep = [0, 1, 3, 4]
    ref = fs.Probe(model, second_moment="dense")
    ref.step({k: v[keep] for k, v in batch.items()}, fs.causal_lm_loss)
    obs = fs.Probe(model, second_moment="dense")
    with obs.observe(loss_reduction="token_mean"):
        model(**batch).loss.backward()
    assert obs.stats["model.layers.0"].n == 4
    assert_same_stats(ref, obs)


def test_resnet_conv_points_eval_mode(gen):
    from fused_stats.networks.resnet import tiny_resnet

    model = tiny_resnet(width=4, seed=0, random_batchnorm=True).double().eval()
    ref = fs.Probe(model, second_moment="dense")
    obs = fs.Probe(model, second_moment="dense")
    x = torch.randn(6, 3, 8, 8, generator=gen, dtype=F64)
    y = torch.randint(0, 10, (6,), generator=gen)
    ref.step((x, y), fs.classification_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # BN in eval mode: no coupling warning
        with obs.observe(loss_reduction="mean"):
            F.cross_entropy(model(x), y).backward()
    assert_same_stats(ref, obs, rel=1e-9)
    model.train()
    with pytest.warns(UserWarning, match="BatchNorm"), obs.observe(loss_reduction="mean"):
        F.cross_entropy(model(x), y).backward()


# ----------------------------------------------------------------------------- training untouched
def _train(model, data, probe_points, observe, autocast=False, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    probe = fs.Probe(model, points=probe_points, second_moment="dense") if observe else None
    for batch in data[:steps]:
        opt.zero_grad(set_to_none=True)
        ctx = probe.observe(loss_reduction="token_mean") if observe else _Null()
        with ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(**batch).loss
            loss.backward()
        opt.step()
    return probe


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize(
    "gc,autocast", [("off", False), ("non-reentrant", False), ("reentrant", False), ("off", True)]
)
def test_training_bit_identical(gen, gc, autocast):
    base = llama(5, hidden=32)
    data = [lm_batch(gen, [12, 7, 12, 9], 12, [0, 2, 0, 1]) for _ in range(3)]
    plain, watched = copy.deepcopy(base), copy.deepcopy(base)
    checkpointing(plain, gc)
    checkpointing(watched, gc)
    _train(plain, data, None, observe=False, autocast=autocast)
    probe = _train(watched, data, "residual", observe=True, autocast=autocast)
    assert probe.stats["model.layers.1"].n == 12 and probe.steps["train"] == 3
    for (name, p), q in zip(plain.named_parameters(), watched.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(p.grad, q.grad), name
    # observe's hooks are gone (checkpointing adds its own, alike in both models)
    hooks = [
        [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
        for model in (plain, watched)
    ]
    assert hooks[0] == hooks[1]


def test_bf16_autocast_observe_equals_probe_step(gen):
    # real autocast on an fp32 model: matmuls run in bf16. The residual points stay fp32 (fp32
    # embedding + bf16 branch outputs); the MLP output is a bf16 Linear output, so its gradient
    # arrives in bf16 and observe lifts it to fp32. Both paths run the same forward under the
    # same autocast on the same model state, so the gradients they see must be bit-identical.
    model = llama(2)
    points = ["model.layers.0.mlp", "model.layers.0", "model.layers.1"]
    seen = {"ref": [], "whole": []}

    def recorder(key):
        return lambda cap: seen[key].append((cap.point, cap.grad.detach().clone()))

    ref = fs.Probe(model, points=points, second_moment="dense")
    ref.add_callback(recorder("ref"))
    # a callback makes observe fold the whole gradients (Probe.step's own reduction);
    # without one it takes the lean path (positions summed at the hook)
    whole = fs.Probe(model, points=points, second_moment="dense")
    whole.add_callback(recorder("whole"))
    lean = fs.Probe(model, points=points, second_moment="dense")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in batches(gen):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref.step(batch, fs.causal_lm_loss)  # same model state, before the update
        for probe in (whole, lean):
            opt.zero_grad(set_to_none=True)
            with probe.observe(loss_reduction="sum"):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = fs.causal_lm_loss(model, batch).sum()
                loss.backward()
        opt.step()
    assert [p for p, _ in seen["ref"]] == [p for p, _ in seen["whole"]] == ref.points * 2
    dtypes = {p: g.dtype for p, g in seen["ref"]}
    assert dtypes == {
        "model.layers.0.mlp": torch.bfloat16,
        "model.layers.0": torch.float32,
        "model.layers.1": torch.float32,
    }
    for (point, a), (_, b) in zip(seen["ref"], seen["whole"]):
        assert b.dtype == torch.float32 and torch.equal(a.float(), b), point
    assert_same_stats(ref, whole, rel=0.0)
    # The lean path (no callback) sums each sample's positions at the hook in fp32, Probe.step's
    # reduction sums the same fp32 values in another order: each q_b moves by fp32 rounding (a few
    # 1e-8 relative; the raw sums below agree to 7e-8 over 8 seeds). Relative to its own value a
    # degree-4 estimate near zero amplifies that (mu_norm4 up to 7e-6 over 8 seeds), so each
    # field is held to 1e-6 of its own size or of its natural scale S^(k/2), S = tr(Sigma) +
    # |mu|^2 = E|q|^2 and k its degree in q, whichever is larger (worst measured: 9e-8 of that)
    assert [lean.stats[p].n for p in ref.points] == [ref.stats[p].n for p in ref.points] == [9] * 3
    degree = {
        "mu_norm2": 2,
        "mu_norm4": 4,
        "mu_sigma_mu": 4,
        "trace_sigma2": 4,
        "trace_sigma": 2,
        "ag_max": 1,
        "ag_mean": 1,
    }
    assert set(degree) == set(FIELDS)
    for point in ref.points:
        a, b = ref.stats[point].estimate(), lean.stats[point].estimate()
        S = a.trace_sigma + a.mu_norm2
        for key, k in degree.items():
            x, y = getattr(a, key), getattr(b, key)
            assert abs(x - y) <= 1e-6 * max(abs(x), S ** (k / 2)), (point, key, x, y)
        sa, sb = ref.stats[point].raw_sum(), lean.stats[point].raw_sum()
        assert torch.allclose(sb, sa, rtol=1e-6, atol=1e-6 * float(sa.abs().max())), point


def test_bf16_model_gradients_folded_in_fp32(gen):
    # a model cast to bf16: point outputs and their gradients are bf16; observe lifts them to
    # fp32 before scaling, Probe.step folds them as they are; both sum the same bf16 values
    model = llama(2).to(torch.bfloat16)
    batch = batches(gen)[0]
    ref = fs.Probe(model, second_moment="dense")
    obs = fs.Probe(model, second_moment="dense")
    ref.step(batch, fs.causal_lm_loss)
    with obs.observe(loss_reduction="sum"):
        fs.causal_lm_loss(model, batch).sum().backward()
    assert [obs.stats[p].n for p in obs.points] == [5] * len(obs.points)
    assert_same_stats(ref, obs, rel=1e-6)


# ----------------------------------------------------------------------------- declarations
def _state(probe):
    return {p: (acc.n, acc.raw_sum().clone()) for p, acc in probe.stats.items()}


def _same_state(before, probe):
    after = _state(probe)
    return before.keys() == after.keys() and all(
        before[p][0] == after[p][0] and torch.equal(before[p][1], after[p][1]) for p in before
    )


@pytest.fixture
def primed(fp64_llama, gen):
    model = fp64_llama()
    probe = fs.Probe(model, second_moment="dense")
    b1, b2 = batches(gen)
    with probe.observe(loss_reduction="token_mean"):
        model(**b1).loss.backward()
    model.zero_grad(set_to_none=True)
    return model, probe, b2


def test_missing_or_invalid_declaration(primed):
    _, probe, _ = primed
    with pytest.raises(fs.FusedStatsError, match="loss_reduction"):
        probe.observe()
    with pytest.raises(fs.FusedStatsError, match="one of"):
        probe.observe(loss_reduction="batchmean")
    with pytest.raises(fs.FusedStatsError, match="positive"):
        probe.observe(scale=torch.tensor([1.0, 0.0, 1.0, 1.0]))
    with pytest.raises(fs.FusedStatsError, match="1-d"):
        probe.observe(scale=torch.ones(4, 1))
    with pytest.raises(fs.FusedStatsError, match="loss_scale"):
        probe.observe(loss_reduction="sum", loss_scale=0.0)
    with pytest.raises(fs.FusedStatsError, match="stream"):
        probe.observe(loss_reduction="sum", stream="valid")


def test_wrong_scale_shape_rejected_state_unchanged(primed):
    model, probe, batch = primed
    before = _state(probe)
    with (
        pytest.raises(fs.FusedStatsError, match=r"scale has shape \(3,\); expected \(4,\)"),
        probe.observe(scale=torch.ones(3)),
    ):
        model(**batch).loss.backward()
    assert _same_state(before, probe)


def test_mean_declared_for_hf_token_mean_loss_raises(primed):
    model, probe, batch = primed
    before = _state(probe)
    with pytest.raises(fs.FusedStatsError, match="token_mean"), probe.observe(loss_reduction="mean"):
        model(**batch).loss.backward()
    assert _same_state(before, probe)
    # the HF loss divided by 4 without loss_scale: the weight is named in the message
    with (
        pytest.raises(fs.FusedStatsError, match=r"loss_scale=0.25"),
        probe.observe(loss_reduction="token_mean"),
    ):
        (model(**batch).loss / 4).backward()
    assert _same_state(before, probe)


def test_mean_with_unequal_label_counts_warns(primed):
    model, probe, batch = primed
    with pytest.warns(UserWarning, match="token_mean"), probe.observe(loss_reduction="mean"):
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        ).logits
        # the user's own loss (the model's .loss is not used): a batch mean of token losses
        F.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
        ).backward()


def test_usage_errors_leave_state_unchanged(primed):
    model, probe, batch = primed
    before = _state(probe)
    with (
        pytest.raises(fs.FusedStatsError, match="no gradient reached"),
        probe.observe(loss_reduction="token_mean"),
    ):
        model(**batch)
    with (
        pytest.raises(fs.FusedStatsError, match="more than one gradient"),
        probe.observe(loss_reduction="token_mean"),
    ):
        model(**batch).loss.backward()
        model(**batch).loss.backward()
    with (
        pytest.raises(fs.FusedStatsError, match="no gradient reached"),
        probe.observe(loss_reduction="token_mean"),
    ):
        pass
    with (
        pytest.raises(fs.FusedStatsError, match="inside the with-block"),
        probe.observe(loss_reduction="token_mean"),
    ):
        loss = model(**batch).loss
    loss.backward()  # after the block: its tensor hooks are gone, nothing is captured
    with (
        pytest.raises(fs.FusedStatsError, match="token_mean"),
        probe.observe(loss_reduction="token_mean"),
    ):  # no labels nor attention mask
        model(input_ids=batch["input_ids"]).logits.sum().backward()
    with (
        pytest.raises(fs.FusedStatsError, match="nested"),
        probe.observe(loss_reduction="sum"),
        probe.observe(loss_reduction="sum"),
    ):
        pass
    with (
        pytest.raises(ZeroDivisionError),
        probe.observe(loss_reduction="token_mean"),
    ):  # the user's own error passes through untouched
        model(**batch).loss.backward()
        1 / 0  # noqa: B018  (raises: the user's own error inside the block)
    assert _same_state(before, probe)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with probe.observe(loss_reduction="token_mean") as ob:  # still usable afterwards
        model(**batch).loss.backward()
    assert ob.folded and probe.stats["model.layers.0"].n == 9


def test_point_that_never_ran(gen):
    net = Residual().double()
    probe = fs.Probe(net, points=["blocks.0", "blocks.2"], second_moment="dense")
    x = torch.randn(5, 5, generator=gen, dtype=F64)
    with (
        pytest.raises(fs.FusedStatsError, match=r"points \['blocks.2'\] did not run"),
        probe.observe(loss_reduction="sum"),
    ):
        h = net.inp(x)
        net.out(h + net.blocks[0](h)).sum().backward()
    assert probe.stats == {}


def test_nonfinite_gradient_policy(primed):
    model, probe, batch = primed
    before = _state(probe)
    with pytest.raises(fs.FusedStatsError, match="non-finite"), probe.observe(loss_reduction="token_mean"):
        (model(**batch).loss * math.inf).backward()
    assert _same_state(before, probe)
    with probe.observe(loss_reduction="token_mean", nonfinite="skip") as ob:
        (model(**batch).loss * math.inf).backward()
    assert not ob.folded and probe.skipped_steps["train"] == 1 and probe.nonfinite == "raise"
    assert _same_state(before, probe)


# ----------------------------------------------------------------------------- monitor log
@pytest.mark.parametrize("window", [False, True])
def test_monitor_log_against_reference_probes(fp64_llama, gen, tmp_path, window):
    model = fp64_llama()
    data = [lm_batch(gen, [8, 5, 8], 8, [0, 1, 2]) for _ in range(6)]
    log = fs.MonitorLog(tmp_path / "run.jsonl", every=2, window=window, meta={"run": "t"})
    obs = fs.Probe(model, second_moment="dense")
    cumulative = fs.Probe(model, second_moment="dense")
    expected = []
    windowed = None
    for step, batch in enumerate(data, 1):
        if windowed is None:
            windowed = fs.Probe(model, second_moment="dense")
        cumulative.step(batch, fs.causal_lm_loss)
        windowed.step(batch, fs.causal_lm_loss)
        with obs.observe(loss_reduction="token_mean", log=log, step=10 * step):
            model(**batch).loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
                p.grad = None
        if step % 2 == 0:
            ref = windowed if window else cumulative
            expected.append((10 * step, {p: ref.stats[p].estimate() for p in ref.points}))
            windowed = None
    records = read_monitor_log(tmp_path / "run.jsonl")
    assert [r["step"] for r in records] == [s for s, _ in expected] == [20, 40, 60]
    for record, (_, want) in zip(records, expected):
        assert record["mode"] == ("window" if window else "cumulative")
        assert record["meta"] == {"run": "t"} and record["stream"] == "train"
        for p, est in want.items():
            got = record["points"][p]
            assert got["n"] == est.n == (6 if window else 3 * record["step"] // 10)
            for key in (
                "mu_norm2",
                "mu_norm4",
                "mu_sigma_mu",
                "trace_sigma2",
                "ag_max",
                "ag_mean",
                "d_par",
                "d_2",
                "d_align",
            ):
                w = getattr(est, key)
                if w is None:  # not estimable at this n: logged as null
                    assert got[key] is None, (p, key)
                else:
                    assert abs(got[key] - w) <= 1e-6 * abs(w) + 1e-300, (p, key, got[key], w)
    png = plot_monitor_log(tmp_path / "run.jsonl", tmp_path / "traj.png")
    assert png.stat().st_size > 5000
    # the CLI: `fused-stats report LOG.jsonl` plots the same trajectories
    from fused_stats.cli import main

    assert main(["report", str(tmp_path / "run.jsonl"), "--out", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "run.png").stat().st_size > 5000


def test_monitor_log_small_windows_and_bad_files(tmp_path, gen):
    model = llama(0)
    probe = fs.Probe(model, second_moment="dense")
    log = fs.MonitorLog(tmp_path / "w.jsonl", every=1, window=True)
    batch = lm_batch(gen, [5, 6, 4], 6, [0, 0, 0])  # 3 samples < 4: estimates are null
    with probe.observe(loss_reduction="token_mean", log=log):
        model(**batch).loss.backward()
    (record,) = read_monitor_log(tmp_path / "w.jsonl")
    point = record["points"]["model.layers.0"]
    assert point["n"] == 3 and point["d_align"] is None
    assert probe.stats == {}  # window mode emptied the stream
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"format": "something else"}) + "\n")
    with pytest.raises(fs.FusedStatsError, match="not a fused_stats monitor record"):
        read_monitor_log(bad)
    with pytest.raises(fs.FusedStatsError, match="every"):
        fs.MonitorLog(tmp_path / "x.jsonl", every=0)
    from fused_stats.cli import main

    assert main(["report", str(bad), "--out", str(tmp_path / "cli")]) == 2  # named error, no crash
    assert not (tmp_path / "cli").exists()


# ----------------------------------------------------------------------------- DDP
class Residual(nn.Module):
    def __init__(self, d=6, depth=3):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(depth))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def ddp_data(steps=2, per_rank=6, world=2):
    g = torch.Generator().manual_seed(11)
    return [
        (
            torch.randn(world * per_rank, 5, generator=g, dtype=F64),
            torch.randint(0, 3, (world * per_rank,), generator=g),
        )
        for _ in range(steps)
    ]


def _ddp_worker(rank, world, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fused_stats.api.state.distributed import all_reduce_probe

    torch.set_num_threads(1)
    init_gloo(rank, world, out_dir)
    try:
        torch.manual_seed(0)
        model = Residual().double()
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        probe = fs.Probe(
            model,
            points=["blocks.0", "blocks.1", "blocks.2"],
            second_moment="dense",
            cross=fs.CrossSpec(rank=3, seed=5),
        )
        log = fs.MonitorLog(Path(out_dir) / "ddp.jsonl" if rank == 0 else None, every=2, all_reduce=True)
        for x, y in ddp_data():
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
            opt.zero_grad()
            with probe.observe(loss_reduction="mean", log=log):
                F.cross_entropy(ddp(xs), ys).backward()
            opt.step()
        local_n = probe.stats["blocks.0"].n
        all_reduce_probe(probe)
        result = {"local_n": local_n, "est": {p: probe.stats[p].estimate().to_dict() for p in probe.points}}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        # both ranks done before DDP's reducer and the group are torn down: a rank that exits
        # while the other still talks to it was seen to abort ("terminate called ...")
        dist.barrier()
        del ddp, opt
    finally:
        dist.destroy_process_group()
    # skip the interpreter's shutdown: DDP's gloo threads were seen to abort the process in their
    # C++ destructors there ("terminate called without an active exception") after all the work
    # above was done and written; errors above still propagate and fail the test
    os._exit(0)


def test_ddp_local_stats_all_reduced(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_ddp_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    # reference: one process, the full batch, the same SGD updates (the mean over the full batch
    # has the gradient DDP averages from the two equal halves), Probe.step at every state
    torch.manual_seed(0)
    model = Residual().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = fs.Probe(
        model,
        points=["blocks.0", "blocks.1", "blocks.2"],
        second_moment="dense",
        cross=fs.CrossSpec(rank=3, seed=5),
    )
    for x, y in ddp_data():
        # each rank's half as its own step: the cross statistics' standard error uses pairs within
        # a batch, so the reference must see the same batches as the ranks did
        for half in zip(x.chunk(2), y.chunk(2)):
            ref.step(half, fs.classification_loss)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    (logged,) = read_monitor_log(tmp_path / "ddp.jsonl")
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["local_n"] == 12
        for p in ref.points:
            want = ref.stats[p].estimate()
            for key in FIELDS:
                w = getattr(want, key)
                assert abs(got["est"][p][key] - w) <= 1e-9 * abs(w), (rank, p, key)
                if key != "trace_sigma":  # not a logged field
                    assert abs(logged["points"][p][key] - w) <= 1e-9 * abs(w), (p, key)
            assert got["est"][p]["n"] == 24 == logged["points"][p]["n"]
            # the merged line carries the merged cross-gradient statistics too
            sat = ref.saturation(p)
            assert abs(logged["points"][p]["cross_frob2"] - sat.cross_frob2) <= 1e-9 * abs(sat.cross_frob2)
            assert logged["points"][p]["cross_frob2_se"] == pytest.approx(
                sat.cross_frob2_se, rel=1e-9, nan_ok=True
            )


# ----------------------------------------------------------------------------- examples
def _example(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_examples_run_tiny(tmp_path):
    lm = _example("monitor_llama_training")
    result = lm.run(
        steps=4, hidden=16, layers=2, seq=32, batch=4, every=2, out=tmp_path / "lm", progress=False
    )
    records = read_monitor_log(result["log"])
    assert [r["step"] for r in records] == [2, 4]
    assert records[-1]["points"]["model.layers.1"]["n"] == 8  # window: 2 steps x 4 sequences
    assert records[-1]["points"]["model.layers.1"]["cross_frob2"] is not None  # cross= tracked
    assert Path(result["plot"]).exists()
    rn = _example("monitor_resnet_training")
    result = rn.run(steps=4, width=4, batch=8, image=8, every=2, out=tmp_path / "rn", progress=False)
    records = read_monitor_log(result["log"])
    assert [r["step"] for r in records] == [2, 4]
    assert all(point["n"] == 16 for point in records[-1]["points"].values())  # 2 steps x 8
    assert Path(result["plot"]).exists()


# ----------------------------------------------------------------------------- explicit feature axis
def test_observe_with_an_explicit_last_feature_axis():
    """``feature_dim=2`` on (B, T, d) outputs (the last axis, named positively): the lean path's
    (B, d) sums keep the output's rank, so a fresh probe and one after a step both fold them; the
    per-sample rows equal one backward per sample, summed over the counted positions."""
    from tiny_models import MaskedPoolNet, masked_pool_loss, masked_seq_batches

    model = MaskedPoolNet(6, seed=3).double()
    points = ["blocks.0", "blocks.1"]
    probe = fs.Probe(model, points=points, feature_dim=2, second_moment="pool")
    batches = [
        {k: (v.double() if v.is_floating_point() else v) for k, v in b.items()}
        for b in masked_seq_batches(5, 2, 5, 4)
    ]
    for batch in batches:
        with probe.observe(loss_reduction="sum", mask="none"):
            masked_pool_loss(model, batch).sum().backward()
        model.zero_grad(set_to_none=True)
    rows = {p: [] for p in points}
    for batch in batches:
        for b in range(batch["x"].shape[0]):
            one = {k: v[b : b + 1] for k, v in batch.items()}
            g = R.point_grads_one_sample(model, points, lambda m, one=one: masked_pool_loss(m, one)[0])
            for p in points:
                rows[p].append(g[p].reshape(-1, g[p].shape[-1]).sum(0))
    for p in points:
        assert probe.stats[p].n == 10
        assert torch.allclose(probe.stats[p].pool_rows(), torch.stack(rows[p]), rtol=1e-10, atol=1e-13), p


def test_scale_factors_are_pure_functions_of_the_batch():
    """``per_sample_scales`` / ``check_declaration`` without an Observation: the factors against
    counts made by hand (targets t+1 with label != -100, as HF's shifted loss)."""
    from fused_stats.api.training.observe import check_declaration, per_sample_scales

    labels = torch.tensor([[5, 6, 7, -100], [1, -100, -100, -100], [2, 3, -100, 4]])
    n = [sum(1 for t in range(1, 4) if int(row[t]) != -100) for row in labels]  # 2, 0, 2
    total = sum(n)
    batch = {"labels": labels}
    s, keep, counts, tot = per_sample_scales(batch, 3, "token_mean", None, "p")
    assert keep.tolist() == [c > 0 for c in n] and tot == total
    assert s.tolist() == [total / c if c else 0.0 for c in n]
    assert per_sample_scales(batch, 3, "mean", None, "p")[0].tolist() == [3.0, 3.0, 3.0]
    assert per_sample_scales(batch, 3, "sum", None, "p")[0].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(fs.FusedStatsError, match=r"scale has shape \(2,\)"):
        per_sample_scales(batch, 3, None, torch.ones(2, dtype=torch.float64), "p")
    # the model's own token-mean loss reached with weight 1: "mean" disagrees, "token_mean" agrees
    s_mean, keep_m, counts_m, tot_m = per_sample_scales(batch, 3, "mean", None, "p")
    with pytest.raises(fs.FusedStatsError, match="token_mean"):
        check_declaration(s_mean, keep_m, counts_m, tot_m, 1.0, [1.0], "mean", None)
    assert check_declaration(s, keep, counts, tot, 1.0, [1.0], "token_mean", None) == 1.0
