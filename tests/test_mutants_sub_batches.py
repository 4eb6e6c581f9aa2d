"""The B-sized sub-batches behind the Adam prediction and the split Adam score
(fused_stats/api/growth/sub_batches.py) against a hand reference on a tiny fp64 LLaMA.

Reference: the probe stepped one batch at a time; per step the change of the train CrossStats'
``c_sum`` (its tangent sum); per sub-batch ``c_b`` = the sum of its steps' changes / B and
``s_b = c_b/(|c_b| + ε)``; the Adam number ``−⟨mean_b s_b, C_K⟩`` and the split score
``(⟨s̄_even, C_odd⟩ + ⟨s̄_odd, C_even⟩)/2`` with ``C_even``/``C_odd`` the mean tangents of the
even/odd train steps' samples, all as the module docstring defines them. Samples that come in
between steps (load_state, all_reduce across two gloo ranks) end the sub-batch under way;
observe is refused on a growth probe and changes nothing.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from test_growth_scores import batches, fp64_rms_norm, tiny_llama

import fused_stats as fs

POINT = "model.layers.0"
B = 8
F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def fp64_norms():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", fp64_rms_norm)
        yield


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def protocol():
    return fs.GrowthProtocol([POINT], seed=2, train_batch_size=B)


def train_batches(sizes, seed=40):
    return [batches(seed + i, 1, size=n)[0] for i, n in enumerate(sizes)]


def c_sum(probe):
    acc = probe.cross_stats.get(POINT)
    return None if acc is None else acc.c_sum.detach().to(F64).clone()


def step_tangents(probe, data):
    """Each step's change of the train tangent sum (fp64)."""
    out = []
    for batch in data:
        before = c_sum(probe)
        probe.step(batch, fs.causal_lm_loss, mask="none")
        after = c_sum(probe)
        out.append(after if before is None else after - before)
    return out


def finish(probe):
    for batch in batches(1, 2, size=B):
        probe.step(batch, fs.causal_lm_loss, stream="test", mask="none")
    candidate = fs.advise(probe, protocol()).ranked[0]
    test = probe.test_cross_stats[POINT]
    return candidate, test.c_sum.detach().to(F64) / test.n


def s(c_b):
    eps = protocol().adam_eps
    return c_b / (c_b.abs() + eps)


def close(a, b):
    return a is not None and abs(a / b - 1) < 1e-9


def test_one_step_sub_batches_give_the_hand_adam_and_split_numbers(model):
    # five steps of B: three even (0, 2, 4), two odd; unequal halves tell n_even from n_odd
    probe = fs.Probe(model, points=[POINT], cross=protocol())
    deltas = step_tangents(probe, train_batches([B] * 5))
    candidate, c_k = finish(probe)
    directions = [s(d / B) for d in deltas]
    s_mean = sum(directions) / 5
    assert close(candidate.predicted_change_adam, -float((s_mean * c_k).sum()))
    s_even = (directions[0] + directions[2] + directions[4]) / 3
    s_odd = (directions[1] + directions[3]) / 2
    c_even = (deltas[0] + deltas[2] + deltas[4]) / (3 * B)
    c_odd = (deltas[1] + deltas[3]) / (2 * B)
    split = (float((s_even * c_odd).sum()) + float((s_odd * c_even).sum())) / 2
    assert close(candidate.split_adam_score, split)


def test_a_sub_batch_of_two_steps_counts_for_adam_but_gives_no_split(model):
    probe = fs.Probe(model, points=[POINT], cross=protocol())
    deltas = step_tangents(probe, train_batches([8, 8, 4, 4]))
    candidate, c_k = finish(probe)
    s_mean = (s(deltas[0] / B) + s(deltas[1] / B) + s((deltas[2] + deltas[3]) / B)) / 3
    assert close(candidate.predicted_change_adam, -float((s_mean * c_k).sum()))
    # not every sub-batch is one step: the halves are not sub-batch directions
    assert candidate.split_adam_score is None


def test_a_straddling_step_is_dropped_with_what_was_gathered(model):
    # 4 then 8 would make 12 > B: both are dropped; the steps of 8 around them are sub-batches
    probe = fs.Probe(model, points=[POINT], cross=protocol())
    deltas = step_tangents(probe, train_batches([8, 4, 8, 8]))
    candidate, c_k = finish(probe)
    s0, s3 = s(deltas[0] / B), s(deltas[3] / B)
    assert close(candidate.predicted_change_adam, -float(((s0 + s3) / 2 * c_k).sum()))
    sub = probe.cross.sub_batches[POINT]
    assert (sub.n_sub, sub.dropped) == (2, 12)
    # the split halves of the stream keep every step's samples (even: 0 and 2, odd: 1 and 3)
    c_even = (deltas[0] + deltas[2]) / 16
    c_odd = (deltas[1] + deltas[3]) / 12
    split = (float((s0 * c_odd).sum()) + float((s3 * c_even).sum())) / 2
    assert close(candidate.split_adam_score, split)


def test_samples_arriving_by_load_state_end_the_sub_batch_under_way(model, tmp_path):
    probe = fs.Probe(model, points=[POINT], cross=protocol())
    data = train_batches([4, 4, 4, 4, 4])
    first = step_tangents(probe, data[:1])
    probe.save_state(tmp_path / "ckpt")
    first += step_tangents(probe, data[1:3])  # a sub-batch of steps 0, 1; step 2 under way
    probe.load_state(tmp_path / "ckpt")  # back to step 0's samples: step 2's half sub-batch ends
    after = step_tangents(probe, data[3:])
    candidate, c_k = finish(probe)
    s_mean = (s((first[0] + first[1]) / B) + s((after[0] + after[1]) / B)) / 2
    assert close(candidate.predicted_change_adam, -float((s_mean * c_k).sum()))
    assert probe.cross.sub_batches[POINT].n_sub == 2


def observed(probe, model, batch):
    """Train samples folded in by ``observe`` (the user's own backward), not by ``Probe.step``."""
    with probe.observe(loss_reduction="mean"):
        fs.causal_lm_loss(model, batch).mean().backward()
    model.zero_grad(set_to_none=True)


def test_observe_on_a_growth_probe_is_refused_and_the_sub_batch_goes_on(model):
    """observe cannot fold samples into a growth probe (the new block needs the arguments its
    point was called with, which only Probe.step records): the refusal folds nothing, so the
    sub-batch under way goes on (steps 0 + 1 make one; steps 2 + 3, 12 > B, are dropped)."""
    probe = fs.Probe(model, points=[POINT], cross=protocol())
    data = train_batches([4, 4, 4, 8])
    first = step_tangents(probe, data[:1])
    with pytest.raises(fs.FusedStatsError, match=r"recorded by Probe\.step only"):
        observed(probe, model, batches(77, 1, size=4)[0])
    assert probe.cross_stats[POINT].n == 4 and probe.steps["train"] == 1
    after = step_tangents(probe, data[1:])
    candidate, c_k = finish(probe)
    s_mean = s((first[0] + after[0]) / B)
    assert close(candidate.predicted_change_adam, -float((s_mean * c_k).sum()))
    sub = probe.cross.sub_batches[POINT]
    assert (sub.n_sub, sub.dropped) == (1, 12)


def _all_reduce_worker(rank, world, out_dir):
    import json
    from pathlib import Path

    from gloo_harness import init_gloo

    torch.set_num_threads(1)
    transformers.models.llama.modeling_llama.LlamaRMSNorm.forward = fp64_rms_norm
    init_gloo(rank, world, out_dir)
    try:
        model = tiny_llama()
        probe = fs.Probe(model, points=[POINT], cross=protocol())
        data = train_batches([4, 4, 4, 8], seed=40 + 10 * rank)  # each rank its own samples
        step_tangents(probe, data[:1])  # a sub-batch under way: 4 of B = 8
        probe.all_reduce()  # the other rank's 4 samples come in: the count goes from 4 to 8
        n_reduced = probe.cross_stats[POINT].n
        after = step_tangents(probe, data[1:])
        candidate, c_k = finish(probe)
        s_mean = (s((after[0] + after[1]) / B) + s(after[2] / B)) / 2
        sub = probe.cross.sub_batches[POINT]
        result = {
            "n_reduced": n_reduced,
            "adam": candidate.predicted_change_adam,
            "hand": -float((s_mean * c_k).sum()),
            "n_sub": sub.n_sub,
            "dropped": sub.dropped,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def test_samples_arriving_by_all_reduce_end_the_sub_batch_under_way(tmp_path):
    """As with observe: two gloo ranks, step 0 then all_reduce (4 → 8 samples), then steps of
    4, 4, 8: each rank's sub-batches are its own steps 1 + 2 and 3."""
    from gloo_harness import run_two_ranks

    for result in run_two_ranks(_all_reduce_worker, tmp_path):
        assert result["n_reduced"] == 8
        assert close(result["adam"], result["hand"]), result
        assert (result["n_sub"], result["dropped"]) == (2, 0)
