"""The DDP rebuild around a grown model (fused_stats/api/growth/distributed.py), one process in a
gloo group: the settings and flags the first wrap had, the wrapper's own hooks, one autograd hook
per parameter, and the refusals made before anything changes.

References: the arguments the wrapper was built with; the gradients of a deep copy of the grown
model without DDP (world 1: DDP's all-reduce is the identity); the hooks a fresh wrap registers;
a snapshot of the parameters before each refused call.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_growth_training_ddp import counting, protocol, tiny_llama  # noqa: E402

import fused_stats as fs  # noqa: E402
from fused_stats.api.growth import distributed  # noqa: E402
from fused_stats.api.growth.distributed import check_rebuildable, rebuild_ddp  # noqa: E402


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def unchanged(model, before):
    now = snapshot(model)
    return list(now) == list(before) and all(torch.equal(now[n], before[n]) for n in now)


def plain_gradients(model, ids):
    reference = copy.deepcopy(model)
    reference.zero_grad()
    reference(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad for name, p in reference.named_parameters()}


def test_rebuild_keeps_static_graph_broadcast_buffers_and_the_training_flag(world_of_one):
    model = tiny_llama()
    ddp = DDP(model, static_graph=True, broadcast_buffers=False)
    ddp.eval()
    fs.grow(model, protocol(), at=["model.layers.0"])
    rebuild_ddp(ddp)
    assert ddp.static_graph is True
    assert ddp.broadcast_buffers is False
    assert ddp.training is False
    # the other way round: a wrapper in training mode with buffers broadcast stays so
    model_b = tiny_llama()
    ddp_b = DDP(model_b)
    fs.grow(model_b, protocol(), at=["model.layers.1"])
    rebuild_ddp(ddp_b)
    assert ddp_b.static_graph is False and ddp_b.broadcast_buffers is True and ddp_b.training is True


@pytest.mark.parametrize("static_graph", [False, True])
def test_after_rebuild_one_backward_gives_the_plain_models_gradients_once(world_of_one, static_graph):
    model = tiny_llama()
    ddp = DDP(model, static_graph=static_graph)
    ids = counting(1, 4)
    ddp(input_ids=ids, labels=ids).loss.backward()  # the old reducer has run once
    model.zero_grad(set_to_none=True)
    fs.grow(model, protocol(), at=["model.layers.0"])
    rebuild_ddp(ddp)
    ids = counting(7, 5)
    reference = plain_gradients(model, ids)
    ddp(input_ids=ids, labels=ids).loss.backward()
    new = fs.growth_history(model)[0]["new_parameters"]
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, reference[name]), name
    assert any(reference[n].abs().max() > 0 for n in new)


def test_hooks_on_the_wrapper_survive_the_rebuild(world_of_one):
    model = tiny_llama()
    ddp = DDP(model)
    calls = []
    ddp.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    ddp.register_forward_hook(lambda module, args, out: calls.append("post"))
    fs.grow(model, protocol(), at=["model.layers.0"])
    rebuild_ddp(ddp)
    ids = counting(2, 3)
    ddp(input_ids=ids, labels=ids)
    assert calls == ["pre", "post"]


def test_the_old_reducers_accumulate_grad_hooks_are_removed(world_of_one):
    # DDP registers one post-accumulate-grad hook per parameter under the python reducer
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        accumulate_grad_hooks_after_rebuild()


def accumulate_grad_hooks_after_rebuild():
    model = tiny_llama()
    ddp = DDP(model)
    first = list(model.parameters())
    assert all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in first)
    fs.grow(model, protocol(), at=["model.layers.0"])
    rebuild_ddp(ddp)
    assert len(ddp._accum_grad_hooks) == len(list(model.parameters()))
    for name, p in model.named_parameters():
        assert len(p._post_accumulate_grad_hooks or {}) == 1, name


def test_a_ddp_around_another_model_is_refused_and_nothing_changes(world_of_one):
    model, other = tiny_llama(), tiny_llama()
    ddp = DDP(other)
    before, before_other = snapshot(model), snapshot(other)
    with pytest.raises(fs.FusedStatsError, match="does not wrap the model being grown"):
        check_rebuildable(ddp, model, "here")
    assert unchanged(model, before) and unchanged(other, before_other) and ddp.module is other
    check_rebuildable(ddp, other, "here")  # its own model passes
    check_rebuildable(ddp, other.model.layers[0], "here")  # and a module inside it


def test_ddp_native_mixed_precision_is_refused_and_nothing_changes(world_of_one):
    from torch.nn.parallel.distributed import _MixedPrecision

    model = tiny_llama()
    ddp = DDP(model)
    # the refusal reads the attribute DDP's constructor sets from mixed_precision=
    ddp.mixed_precision = _MixedPrecision(param_dtype=torch.float64)
    before = snapshot(model)
    with pytest.raises(fs.FusedStatsError, match="native mixed precision"):
        check_rebuildable(ddp, model, "here")
    assert unchanged(model, before) and ddp.module is model


def test_several_processes_with_no_wrapper_seen_are_refused(monkeypatch):
    model = tiny_llama()
    before = snapshot(model)
    check_rebuildable(None, model, "here")  # one process: nothing to rebuild
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    with pytest.raises(fs.FusedStatsError, match=r"2 processes, but no DistributedDataParallel"):
        check_rebuildable(None, model, "here")
    assert unchanged(model, before)
