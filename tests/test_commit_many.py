"""``commit_many`` (the points of a probe committed together) against committing one by one.

Also ``prepare_many`` / ``commit_many`` given a stack (one stacked batch for several accumulators) against
one ``update`` each, what they decline, refuse and skip, and the probe's stacked fold against its
general path (the same bits).

Reference: the same prepared batches committed by ``commit`` into copies of the accumulators, in
order; every state tensor must be bit-identical (``state_differences`` empty) but a dense second
moment, which one batched product may round differently (checked to 1e-13). Covered: first
batches (no centre yet), batches past the first, pool and dense second moments, cross batches of
several samples and of one sample (the pairing of single-sample batches), mixes that ``commit``
would refuse or skip (stale, empty, non-finite), an accumulator listed twice, and a second-moment
update that fails in the middle (the accumulators before it complete, the rest untouched).
"""

from __future__ import annotations

import pytest
import torch

import fused_stats as fs
from fused_stats import FusedStatsError, ops
from fused_stats.accumulators.base import state_differences
from fused_stats.accumulators.cross_stats import CrossStats
from fused_stats.accumulators.grad_stats import GradStats
from fused_stats.ops import torch_twin

F64 = torch.float64


def grad_accs(gen, modes, d=6, warm=True):
    accs = [GradStats(d, second_moment=m, name=f"p{i}") for i, m in enumerate(modes)]
    if warm:
        for acc in accs:
            acc.update(torch.randn(5, d, generator=gen) + 0.7)
    return accs


def assert_same(accs, refs):
    """Every state tensor bit-identical, except a dense S: one batched product may sum the same
    products in another order (fp64 rounding)."""
    for acc, ref in zip(accs, refs):
        a, b = acc.state_dict(), ref.state_dict()
        if isinstance(a.get("S"), torch.Tensor):
            torch.testing.assert_close(a.pop("S"), b.pop("S"), rtol=1e-13, atol=1e-13)
        assert not state_differences(a, b), acc.name


def assert_close_states(acc, ref, tol):
    """Every counter equal and every state tensor equal to ``tol`` (relative and absolute)."""
    a, b = acc.state_dict(), ref.state_dict()
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, b[key], rtol=tol, atol=tol, msg=key)
        else:
            assert value == b[key], key


def commit_both(cls, accs, prepared):
    refs = [a.copy() for a in accs]
    for ref, p in zip(refs, prepared):
        ref.commit(p)
    cls.commit_many(accs, prepared)
    assert_same(accs, refs)


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("modes", [("dense",) * 3, ("pool", "dense", "auto")])
@pytest.mark.parametrize("stacked", [False, True])
def test_grad_commit_many_equals_sequential(modes, warm, stacked, gen):
    accs = grad_accs(gen, modes, warm=warm)
    for _ in range(3):
        grads = [torch.randn(8, 6, generator=gen) * 1.5 - 0.3 for _ in accs]
        if stacked:
            prepared = GradStats.prepare_many(accs, grads, [None] * 3, "sample", [-1] * 3)
        else:
            prepared = [a.prepare(g) for a, g in zip(accs, grads)]
        commit_both(GradStats, accs, prepared)
    assert all(a.n == (5 if warm else 0) + 24 for a in accs)


def test_grad_prepare_many_defaults_to_no_mask_and_the_last_axis(gen):
    """``prepare_many(accs, grads)`` without masks or feature dims: each batch as ``prepare``
    takes it by default (nothing masked, features on the last axis)."""
    accs = grad_accs(gen, ("dense", "pool"))
    refs = [a.copy() for a in accs]
    grads = [torch.randn(4, 3, 6, generator=gen) for _ in accs]
    GradStats.commit_many(accs, GradStats.prepare_many(accs, grads))
    for ref, g in zip(refs, grads):
        ref.update(g)
    assert_same(accs, refs)


@pytest.mark.parametrize("unit", ["sample", "position"])
@pytest.mark.parametrize("mode", ["dense", "pool"])
def test_grad_commit_many_masked_batches_equal_sequential(unit, mode, gen):
    """Masked batches carry rows that are not samples: n counts samples, not rows."""
    accs = grad_accs(gen, (mode,) * 3)
    for a in accs:
        a.unit = None  # the warm-up batch was unit="sample"; let both units through
    expected = [a.n for a in accs]
    for _ in range(2):
        grads = [torch.randn(5, 4, 6, generator=gen) + 0.3 for _ in accs]
        masks = [torch.rand(5, 4, generator=gen) > 0.4 for _ in accs]
        for i, m in enumerate(masks):
            m[0] = False  # a sample with no counted position
            m[1] = True
            expected[i] += int((m.any(dim=1) if unit == "sample" else m).sum())
        prepared = [a.prepare(g, m, unit) for a, g, m in zip(accs, grads, masks)]
        commit_both(GradStats, accs, prepared)
    assert [a.n for a in accs] == expected


def test_grad_commit_many_refused_mixes_behave_as_sequential(gen):
    accs = grad_accs(gen, ("dense",) * 3)
    for a in accs:
        a.nonfinite = "skip"
    bad = torch.randn(8, 6, generator=gen)
    bad[2, 1] = float("nan")
    prepared = [
        accs[0].prepare(torch.randn(8, 6, generator=gen)),
        accs[1].prepare(bad),
        accs[2].prepare(bad[:0]),
    ]
    assert not prepared[1].finite and prepared[2].n == 0
    commit_both(GradStats, accs, prepared)
    assert accs[1].skipped_batches == 1 and accs[0].n == 13 and accs[2].n == 5
    # a stale batch is refused, as by commit
    stale = [a.prepare(torch.randn(8, 6, generator=gen)) for a in accs]
    accs[1].update(torch.randn(3, 6, generator=gen))
    refs = [a.copy() for a in accs]
    with pytest.raises(FusedStatsError, match="stale prepared batch at point 'p1'"):
        refs[0].commit(stale[0])
        refs[1].commit(stale[1])
    with pytest.raises(FusedStatsError, match="stale prepared batch at point 'p1'"):
        GradStats.commit_many(accs, stale)
    assert_same(accs, refs)


def test_grad_commit_many_same_accumulator_twice_is_refused_as_stale(gen):
    (acc,) = grad_accs(gen, ("dense",))
    p = acc.prepare(torch.randn(4, 6, generator=gen))
    with pytest.raises(FusedStatsError, match="stale"):
        GradStats.commit_many([acc, acc], [p, p])
    assert acc.n == 9  # the first commit went in, the second was refused


def test_grad_commit_many_failing_second_moment_leaves_consistent_states(gen, monkeypatch):
    accs = grad_accs(gen, ("dense",) * 3)
    prepared = [a.prepare(torch.randn(8, 6, generator=gen)) for a in accs]
    refs = [a.copy() for a in accs]
    refs[0].commit(prepared[0])
    refs[1].commit(prepared[1])
    original = GradStats._add_second_moment

    def failing(self, count, rows):
        if self is accs[2]:
            raise RuntimeError("out of memory (simulated)")
        return original(self, count, rows)

    monkeypatch.setattr(GradStats, "_add_second_moment", failing)
    monkeypatch.setattr(ops, "second_moment_update_stacked", lambda *a: False)  # one at a time
    with pytest.raises(RuntimeError, match="simulated"):
        GradStats.commit_many(accs, prepared)
    assert_same(accs, refs)
    assert [a.n for a in accs] == [13, 13, 5]


def test_grad_commit_many_failing_batched_product_changes_nothing(gen, monkeypatch):
    accs = grad_accs(gen, ("dense",) * 3)
    prepared = [a.prepare(torch.randn(8, 6, generator=gen)) for a in accs]
    refs = [a.copy() for a in accs]

    def failing(Ss, rows):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(torch_twin, "second_moment_update_stacked", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        GradStats.commit_many(accs, prepared)
    assert_same(accs, refs)


def test_stacked_second_moment_matches_one_update_each(gen):
    Ss = [torch.randn(6, 6, generator=gen, dtype=F64) for _ in range(3)]
    rows = torch.randn(3, 9, 6, generator=gen)
    expected = [S + r.to(F64).T @ r.to(F64) for S, r in zip(Ss, rows)]
    assert ops.second_moment_update_stacked(Ss, rows, "torch")
    for S, e in zip(Ss, expected):
        torch.testing.assert_close(S, e, rtol=1e-14, atol=1e-14)
    with pytest.raises(FusedStatsError, match=r"rows must have shape \(3, R, d\)"):
        ops.second_moment_update_stacked(Ss, rows[:2], "torch")


def cross_accs(gen, count=3, d=5, din=4, r=6):
    return [
        CrossStats(d, torch.randn(r, din, generator=gen, dtype=F64) / 2, name=f"c{i}") for i in range(count)
    ]


@pytest.mark.parametrize("B", [1, 2, 7])
@pytest.mark.parametrize("stacked", [False, True])
def test_cross_commit_many_equals_sequential(B, stacked, gen):
    accs = cross_accs(gen)
    for _ in range(3):
        grads = [torch.randn(B, 3, 5, generator=gen) + 0.2 for _ in accs]
        acts = [torch.randn(B, 3, 4, generator=gen) for _ in accs]
        if stacked:
            prepared = CrossStats.prepare_many(accs, grads, acts, [None] * 3)
        else:
            prepared = [a.prepare(g, z) for a, g, z in zip(accs, grads, acts)]
        commit_both(CrossStats, accs, prepared)
    assert all(a.n == 3 * B and a.batches == 3 for a in accs)
    if B == 1:
        assert all(a.p[0] == 4 and a.carry is not None for a in accs)  # two pairings of single samples


def test_cross_commit_many_after_a_single_sample_batch_drops_the_carry(gen):
    accs = cross_accs(gen, 2)
    for a in accs:
        a.update(torch.randn(1, 2, 5, generator=gen), torch.randn(1, 2, 4, generator=gen))
    assert all(a.carry is not None for a in accs)
    prepared = [
        a.prepare(torch.randn(4, 2, 5, generator=gen), torch.randn(4, 2, 4, generator=gen)) for a in accs
    ]
    commit_both(CrossStats, accs, prepared)
    assert all(a.carry is None for a in accs)


# ---------------------------------------------------------------- prepare_many / commit_many of a stack
def test_grad_prepare_many_of_a_stack_declines_what_it_does_not_take(gen):
    accs = grad_accs(gen, ("dense",) * 2)
    g = torch.randn(2, 8, 6, generator=gen)
    assert GradStats.prepare_many(accs, g) is not None
    assert GradStats.prepare_many(accs, g, unit="position") is None
    assert GradStats.prepare_many(accs, g[:, :, :5]) is None  # dim 5 vs 6: prepare says why
    assert GradStats.prepare_many(accs, g[:1]) is None  # one stack row for two accumulators
    assert GradStats.prepare_many(accs, g[:, :0]) is None  # no sample
    fresh = grad_accs(gen, ("dense",), warm=False)
    assert GradStats.prepare_many([accs[0], fresh[0]], g) is None  # no centre yet
    assert GradStats.prepare_many(accs, g.double()) is not None
    with pytest.raises(FusedStatsError, match=r"stacked batch .* takes no masks"):
        GradStats.prepare_many(accs, g, [None, torch.ones(8)])


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_grad_commit_many_of_a_stack_refuses_or_skips_as_commit(policy, gen):
    accs = grad_accs(gen, ("dense",) * 3)
    for a in accs:
        a.nonfinite = policy
    g = torch.randn(3, 8, 6, generator=gen)
    g[1, 2, 3] = float("inf")
    stacked = GradStats.prepare_many(accs, g)
    assert stacked.finite == [True, False, True]
    refs = [a.copy() for a in accs]
    if policy == "raise":
        with pytest.raises(FusedStatsError, match=r"non-finite gradient .*'p1'"):
            GradStats.commit_many(accs, stacked)
        assert_same(accs[1:], refs[1:])  # the one refused and those after it are untouched
    else:
        GradStats.commit_many(accs, stacked)
        assert accs[1].skipped_batches == 1 and accs[1].n == 5
        assert accs[0].n == accs[2].n == 13
    # stale: prepared before another update
    stacked = GradStats.prepare_many(accs, torch.randn(3, 4, 6, generator=gen))
    accs[0].update(torch.randn(2, 6, generator=gen))
    with pytest.raises(FusedStatsError, match="stale prepared batch at point 'p0'"):
        GradStats.commit_many(accs, stacked)


def test_grad_commit_many_of_a_stack_equals_commit_of_each(gen):
    accs = grad_accs(gen, ("dense", "pool", "auto"))
    g = torch.randn(3, 8, 6, generator=gen) * 2 + 0.1
    refs = [a.copy() for a in accs]
    for ref, x in zip(refs, g):
        ref.update(x)
    GradStats.commit_many(accs, GradStats.prepare_many(accs, g))
    for acc, ref in zip(accs, refs):  # one prepare each vs one batched reduction: fp64 rounding
        assert_close_states(acc, ref, 1e-13)


@pytest.mark.parametrize("B", [1, 6])
def test_cross_commit_many_of_a_stack_equals_commit_of_each(B, gen):
    accs = cross_accs(gen)
    refs = [a.copy() for a in accs]
    for _ in range(2):
        g = torch.randn(3, B, 1, 5, generator=gen) + 0.2
        z = torch.randn(3, B, 1, 4, generator=gen)
        for ref, x, y in zip(refs, g, z):
            ref.update(x, y)
        stacked = CrossStats.prepare_many(accs, g, z)
        assert stacked is not None
        CrossStats.commit_many(accs, stacked)
    for acc, ref in zip(accs, refs):
        assert_close_states(acc, ref, 1e-12)


def test_cross_prepare_many_of_a_stack_declines_what_it_does_not_take(gen):
    accs = cross_accs(gen, 2)
    g, z = torch.randn(2, 6, 1, 5, generator=gen), torch.randn(2, 6, 1, 4, generator=gen)
    assert CrossStats.prepare_many(accs, g, z) is not None
    assert CrossStats.prepare_many(accs, g, z, unit="position") is None
    assert CrossStats.prepare_many(accs, g, z[..., :3]) is None  # in_dim 3 vs 4
    assert CrossStats.prepare_many(accs, g, z[:, :4]) is None  # batch sizes differ
    # many positions per sample: the ghost form does not pay, one call each (prepare) instead
    long_g, long_z = torch.randn(2, 6, 40, 5, generator=gen), torch.randn(2, 6, 40, 4, generator=gen)
    assert CrossStats.prepare_many(accs, long_g, long_z) is None
    other = CrossStats(5, torch.randn(6, 4, generator=gen, dtype=F64), activation="relu")
    assert CrossStats.prepare_many([accs[0], other], g, z) is None  # another block
    with pytest.raises(FusedStatsError, match=r"stacked batch .* takes no masks"):
        CrossStats.prepare_many(accs, g, z, [None, None])


# ---------------------------------------------------------------------------- the probe's stacked fold
def residual_probe(seed, **options):
    from torch import nn

    torch.manual_seed(seed)

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.up, self.down = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)

        def forward(self, z):
            return z + self.down(torch.tanh(self.up(z)))

    model = nn.Sequential(nn.Linear(4, 6), Block(6), Block(6), Block(6), nn.Linear(6, 3))
    return fs.Probe(model, points=["1", "2", "3"], unit="sample", **options)


@pytest.mark.parametrize("second_moment", ["dense", "auto"])
@pytest.mark.parametrize("cross", [False, True])
def test_probe_stacked_fold_equals_the_general_path_bit_for_bit(second_moment, cross, gen, monkeypatch):
    options = {"second_moment": second_moment, "cross": fs.CrossSpec(rank=5) if cross else None}
    fast, general = residual_probe(3, **options), residual_probe(3, **options)
    taken = []
    original = GradStats._commit_stacked
    monkeypatch.setattr(
        GradStats, "_commit_stacked", classmethod(lambda cls, *a: taken.append(1) or original(*a))
    )
    general_fold = fs.Probe._fold_stacked
    for step in range(4):
        x = torch.randn(9, 4, generator=gen)
        y = torch.randint(0, 3, (9,), generator=gen)
        fast.step((x, y), fs.classification_loss, stream="train" if step % 3 else "test")
        monkeypatch.setattr(fs.Probe, "_fold_stacked", lambda self, *a: False)
        general.step((x, y), fs.classification_loss, stream="train" if step % 3 else "test")
        monkeypatch.setattr(fs.Probe, "_fold_stacked", general_fold)
    assert (
        len(taken) == 2
    )  # steps 2 and 3 (train, accumulators made at step 1); the first of each stream is general
    assert set(fast.table) == set(general.table)
    for key, acc in fast.table.items():
        assert not state_differences(acc.state_dict(), general.table[key].state_dict()), key
    assert fast.steps == general.steps


def test_probe_stacked_fold_declines_mixed_batches(gen):
    probe = residual_probe(4, cross=fs.CrossSpec(rank=5), second_moment="dense")
    points = probe.points

    def batch(dtype=torch.float32):
        acts = {p: torch.randn(7, 6, generator=gen).to(dtype) for p in points}
        grads = {p: (torch.randn(7, 6, generator=gen) + 0.1).to(dtype) for p in points}
        return acts, grads

    assert probe.fold("train", *batch())  # makes the accumulators (general path)
    acts, grads = batch()
    assert probe._fold_stacked("train", acts, grads)
    acts, grads = batch()
    acts["2"] = acts["2"].double()  # one activation of another dtype
    assert not probe._fold_stacked("train", acts, grads)
    grads3 = {p: g.unsqueeze(1) for p, g in grads.items()}  # (B, 1, d) outputs: not this path
    assert not probe._fold_stacked("train", {p: a.unsqueeze(1) for p, a in acts.items()}, grads3)
    assert not probe._fold_stacked("test", *batch())  # that stream has no accumulators yet
    assert probe.fold("train", acts, grads)  # the general path takes the mixed batch
    assert probe.stats["2"].n == probe.cross_stats["2"].n == 21
