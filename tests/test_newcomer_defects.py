"""What a new user meets first: a misspelled batch key, a view read before any step, token ids of
another integer dtype. Each fails loudly (or works) instead of silently doing something else.

References are independent of the code under test: the loss of int32 ids is compared with a
per-sequence loop over the model's logits (one log-softmax per target token, written out here),
and the misspelled key is checked against what the model does with the right key.
"""

from __future__ import annotations

import pytest
import torch

import fused_stats as fs

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from test_labels_mask import VOCAB, tiny_llama  # noqa: E402  (after the skip)


def padded(gen, B=4, T=7):
    ids = torch.randint(0, VOCAB, (B, T), generator=gen)
    attn = torch.ones(B, T, dtype=torch.long)
    attn[0, 4:] = 0
    attn[1, :2] = 0  # left padding: the first real token's prediction from a pad must not count
    attn[2, 5:] = 0
    return ids, attn


# ------------------------------------------------------------------------ misspelled batch keys
def test_misspelled_batch_key_of_an_hf_model_names_the_close_match(gen):
    model = tiny_llama()
    ids, attn = padded(gen)
    probe = fs.Probe(model, second_moment="dense")
    with pytest.raises(fs.FusedStatsError, match=r"'attention_masks'.*did you mean 'attention_mask'"):
        probe.step({"input_ids": ids, "attention_masks": attn}, fs.causal_lm_loss)
    assert probe.steps["train"] == 0 and len(probe.table) == 0  # nothing folded
    with pytest.raises(fs.FusedStatsError, match="'attention_masks'"):
        fs.causal_lm_loss(model, {"input_ids": ids, "attention_masks": attn})


def test_named_and_typed_kwargs_of_an_hf_forward_are_accepted(gen):
    """``position_ids`` (named) and ``output_hidden_states`` (a TransformersKwargs key) pass; the
    loss with the right mask key equals the loss of the unpadded sequences computed one by one."""
    model = tiny_llama()
    ids, attn = padded(gen)
    B = ids.shape[0]
    pos = (attn.cumsum(1) - 1).clamp(min=0)  # the real tokens at positions 0, 1, ... as unpadded
    got = fs.causal_lm_loss(
        model, {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "output_hidden_states": True}
    )
    for b in range(B):
        real = ids[b][attn[b] == 1]
        n = real.numel()
        logits = model(input_ids=real[None]).logits[0]
        lp = torch.log_softmax(logits[:-1], dim=-1)
        ref = -sum(lp[t, real[t + 1]] for t in range(n - 1)) / (n - 1)
        torch.testing.assert_close(got[b], ref, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------ integer dtypes
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_causal_lm_loss_takes_token_ids_of_any_integer_dtype(dtype, gen):
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (3, 6), generator=gen)
    got = fs.causal_lm_loss(model, {"input_ids": ids.to(dtype), "labels": ids.to(dtype)})
    logits = model(input_ids=ids).logits
    for b in range(3):
        lp = torch.log_softmax(logits[b, :-1], dim=-1)
        ref = -sum(lp[t, ids[b, t + 1]] for t in range(5)) / 5
        torch.testing.assert_close(got[b], ref, rtol=1e-10, atol=1e-12)


def test_float_token_ids_are_rejected_by_name(gen):
    model = tiny_llama()
    ids = torch.randint(0, VOCAB, (2, 5), generator=gen)
    with pytest.raises(fs.FusedStatsError, match=r"labels must hold integer ids.*float32"):
        fs.causal_lm_loss(model, {"input_ids": ids, "labels": ids.float()})


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8])
def test_classification_loss_takes_targets_of_any_integer_dtype(dtype, gen):
    model = torch.nn.Linear(5, 4).double()
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (6,), generator=gen)
    got = fs.classification_loss(model, (x, y.to(dtype)))
    logits = model(x)
    ref = torch.stack([-torch.log_softmax(logits[i], dim=-1)[y[i]] for i in range(6)])
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    with pytest.raises(fs.FusedStatsError, match="targets must hold integer ids"):
        fs.classification_loss(model, (x, y.double()))


# ------------------------------------------------------------------------ views before a step
def test_stats_before_any_step_and_for_an_unknown_point_name_the_point(gen):
    model = tiny_llama()
    probe = fs.Probe(model, second_moment="dense")
    point = probe.points[-1]
    with pytest.raises(fs.FusedStatsError, match=rf"'{point}'.*no step has folded a batch"):
        probe.stats[point]
    assert point not in probe.stats and probe.stats.get(point) is None  # the mapping protocol holds
    ids, attn = padded(gen)
    probe.step({"input_ids": ids, "attention_mask": attn}, fs.causal_lm_loss)
    assert probe.stats[point].n == ids.shape[0]  # unit="sample": one per sequence
    with pytest.raises(fs.FusedStatsError, match=r"'model\.nope'.*not a point of this probe.*model\.layers"):
        probe.stats["model.nope"]
    with pytest.raises(fs.FusedStatsError, match=rf"'{point}' in the test stream.*no step"):
        probe.test_stats[point]


# ------------------------------------------------------------------------ no pool, said plainly
def test_no_pool_message_names_the_mode_and_never_a_none_switch_point(gen):
    dense = fs.GradStats(6, second_moment="dense")
    dense.update(torch.randn(5, 6, generator=gen))
    with pytest.raises(fs.FusedStatsError) as info:
        dense.pool_rows()
    assert "None" not in str(info.value) and "second_moment='dense' keeps none" in str(info.value)
    auto = fs.GradStats(6, second_moment="auto")
    limit = auto.pool_limit
    auto.update(torch.randn(limit + 3, 6, generator=gen))
    with pytest.raises(
        fs.FusedStatsError, match=rf"folded its pool into the dense moment past {limit} samples"
    ):
        auto.pool_rows()
