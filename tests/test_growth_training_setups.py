"""Growth during training, one process: the DDP wrapper rebuilt in place (a world-1 gloo group),
the set-ups refused before anything changes, and resume through FusedStatsTrainerMixin, which
grows the Trainer's original model as the checkpoint's growth record says before the weights load.

References: the gradients of the same model without DDP (world 1: DDP's all-reduce is the
identity); the parameter count of a hand-grown model; the uninterrupted run for the resumed one
(bit-equal parameters and optimizer state); fs.grow called by hand once per event of a
checkpoint's record; a copy of the model before each refused call; for nn.DataParallel (several
GPUs simulated through TrainingArguments' n_gpu), the Trainer's own wrapping of the model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_growth_training_ddp import (  # noqa: E402
    Rows,
    counting,
    probe_batches,
    protocol,
    tiny_llama,
    trainer_args,
)

import fused_stats as fs  # noqa: E402
from fused_stats.api.growth.distributed import check_rebuildable, rebuild_ddp  # noqa: E402
from fused_stats.integrations.transformers import (  # noqa: E402
    FusedStatsTrainerMixin,
    GrowthScheduleCallback,
)

transformers.logging.set_verbosity_error()


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def same_parameters(a, b):
    pa = a if isinstance(a, dict) else snapshot(a)
    pb = b if isinstance(b, dict) else snapshot(b)
    return list(pa) == list(pb) and all(torch.equal(pa[n], pb[n]) for n in pa)


def test_rebuilt_ddp_trains_every_grown_parameter_and_keeps_its_settings(world_of_one):
    model = tiny_llama()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=1, gradient_as_bucket_view=True)
    calls = []
    ddp.register_forward_pre_hook(lambda module, args: calls.append(1))
    fs.grow(model, protocol(), at=["model.layers.0"])
    rebuild_ddp(ddp)
    assert len(ddp._module_parameters) == len(list(model.parameters())) > 0
    assert ddp.module is model and ddp.find_unused_parameters and ddp.gradient_as_bucket_view
    assert ddp.bucket_bytes_cap == 1024 * 1024
    ids = counting(5, 4)
    ddp(input_ids=ids, labels=ids).loss.backward()
    assert calls == [1]  # a hook on the wrapper survives the rebuild
    reference = copy.deepcopy(model)
    reference.zero_grad()
    reference(input_ids=ids, labels=ids).loss.backward()
    grads = dict(reference.named_parameters())
    new = fs.growth_history(model)[0]["new_parameters"]
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, grads[name].grad), name
    assert any(dict(model.named_parameters())[n].grad.abs().max() > 0 for n in new)


def test_a_communication_hook_is_refused_before_the_model_changes(world_of_one):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = tiny_llama()
    ddp = DDP(model)
    ddp.register_comm_hook(None, allreduce_hook)
    schedule = fs.GrowthSchedule(protocol(), at_steps=[1], probe_batches=probe_batches(0))
    callback = GrowthScheduleCallback(schedule)
    args = trainer_args("/nonexistent")
    state = transformers.TrainerState(max_steps=3, global_step=0)
    control = transformers.TrainerControl()
    callback.on_train_begin(args, state, control, model=model)
    ids = counting(6, 3)
    ddp(input_ids=ids, labels=ids).loss.backward()  # the training forward shows the wrapper
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    before = snapshot(model)
    state.global_step = 1
    with pytest.raises(fs.FusedStatsError, match=r"communication hook.*supports one process"):
        callback.on_step_end(args, state, control, model=model, optimizer=optimizer)
    assert same_parameters(model, before) and fs.growth_history(model) == [] and schedule.events == []
    callback.close()


def test_wrappers_other_than_ddp_are_refused():
    model = tiny_llama()
    with pytest.raises(fs.FusedStatsError, match=r"DataParallel.*supports one process, or plain torch"):
        check_rebuildable(torch.nn.DataParallel(model), model, "here")
    with pytest.raises(fs.FusedStatsError, match="DataParallel"):
        check_rebuildable(None, torch.nn.DataParallel(model), "here")
    check_rebuildable(None, model, "here")  # one process, no wrapper: nothing to rebuild


@pytest.mark.parametrize(
    "setting, named",
    [("deepspeed", "DeepSpeed"), ("fsdp", "FSDP")],
)
def test_trainer_setups_that_cannot_be_rebuilt_are_refused_at_train_begin(setting, named):
    schedule = fs.GrowthSchedule(protocol(), at_steps=[1], probe_batches=probe_batches(0))
    callback = GrowthScheduleCallback(schedule)
    args = trainer_args("/nonexistent")
    setattr(args, setting, "ds_config.json" if setting == "deepspeed" else ["full_shard"])
    with pytest.raises(fs.FusedStatsError, match=rf"{named}.*supports one process, or plain torch"):
        callback.on_train_begin(args, transformers.TrainerState(max_steps=3), transformers.TrainerControl())
    assert callback._hook is None and schedule.events == []


# ---------------------------------------------------------------------------- resume
class Trainer(FusedStatsTrainerMixin, transformers.Trainer):
    pass


def schedule():
    return fs.GrowthSchedule(protocol(), at_steps=[2, 4], probe_batches=probe_batches(0))


def train(directory, callbacks, model=None, resume=None, trainer_class=Trainer):
    model = model or tiny_llama()
    trainer = trainer_class(
        model=model, args=trainer_args(directory), train_dataset=Rows(), callbacks=list(callbacks)
    )
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("whole")
    whole = schedule()
    model, trainer = train(directory, [GrowthScheduleCallback(whole)])
    return model, trainer, whole, directory / "checkpoint-3"


def test_the_mixin_resumes_the_original_model_as_the_uninterrupted_run(uninterrupted, tmp_path):
    model, trainer, whole, checkpoint = uninterrupted
    resumed = schedule()
    original = tiny_llama()
    assert original.config.num_hidden_layers == 2
    model_b, trainer_b = train(
        tmp_path, [GrowthScheduleCallback(resumed)], model=original, resume=str(checkpoint)
    )
    assert model_b.config.num_hidden_layers == 4 and resumed.events == whole.events
    assert fs.growth_history(model_b) == fs.growth_history(model)
    assert same_parameters(model_b, model)
    sa, sb = trainer.optimizer.optimizer.state_dict(), trainer_b.optimizer.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sorted(sa["state"]) == sorted(sb["state"])
    for i in sa["state"]:
        for key in sa["state"][i]:
            assert torch.equal(sa["state"][i][key], sb["state"][i][key]), (i, key)


def test_a_model_built_from_the_checkpoint_is_not_grown_again(uninterrupted, tmp_path):
    model, _, _, checkpoint = uninterrupted
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    resumed = schedule()
    model_b, _ = train(tmp_path, [GrowthScheduleCallback(resumed)], model=reloaded, resume=str(checkpoint))
    assert model_b.config.num_hidden_layers == 4 and same_parameters(model_b, model)


def test_a_checkpoint_of_another_protocol_is_refused_before_the_model_changes(uninterrupted, tmp_path):
    _, _, _, checkpoint = uninterrupted
    other = fs.GrowthSchedule(
        fs.GrowthProtocol(("model.layers.0", "model.layers.1"), family="layer", seed=3),
        at_steps=[2, 4],
        probe_batches=probe_batches(0),
    )
    original = tiny_llama()
    before = snapshot(original)
    with pytest.raises(fs.FusedStatsError, match="growth record holds events of protocol"):
        train(tmp_path, [GrowthScheduleCallback(other)], model=original, resume=str(checkpoint))
    assert same_parameters(original, before) and fs.growth_history(original) == []


def test_a_model_grown_elsewhere_is_refused_before_it_changes(uninterrupted, tmp_path):
    _, _, _, checkpoint = uninterrupted
    model = tiny_llama()
    fs.grow(model, protocol(), at=["model.layers.1"], step=2)  # not the checkpoint's first event
    before = snapshot(model)
    with pytest.raises(fs.FusedStatsError, match="is not the start of the checkpoint's"):
        train(tmp_path, [GrowthScheduleCallback(schedule())], model=model, resume=str(checkpoint))
    assert same_parameters(model, before) and len(fs.growth_history(model)) == 1


# ---------------------------------------------------------------------------- two events, resumed
def two_event_schedule():
    return fs.GrowthSchedule(protocol(), at_steps=[1, 3], probe_batches=probe_batches(0))


@pytest.fixture(scope="module")
def two_events(tmp_path_factory):
    """An uninterrupted run growing at steps 1 and 3; checkpoint-3 is written after both."""
    directory = tmp_path_factory.mktemp("two_events")
    whole = two_event_schedule()
    model, trainer = train(directory, [GrowthScheduleCallback(whole)])
    return model, trainer, whole, directory / "checkpoint-3"


def checkpoint_growth(checkpoint):
    import json

    return json.loads((checkpoint / "config.json").read_text())[fs.api.growth.record.RECORD_KEY]


def test_two_growth_events_at_different_steps_are_replayed_one_by_one(two_events):
    from fused_stats.api.growth.record import EVIDENCE_KEYS, FIRST_STEP_KEYS
    from fused_stats.integrations._trainer_growth import replay_checkpoint_growth

    _, _, whole, checkpoint = two_events
    record = checkpoint_growth(checkpoint)
    assert [(e["event"], e["step"]) for e in record] == [("grew", 1), ("grew", 3)]
    assert [e["step"] for e in whole.events] == [1, 3]
    # the hand reference: fs.grow called once per event, at the record's point, step and evidence
    hand = tiny_llama()
    for entry in record:
        kept = {k: entry[k] for k in EVIDENCE_KEYS + FIRST_STEP_KEYS if k in entry}
        fs.grow(hand, protocol(), at=[entry["point"]], step=entry["step"], evidence={entry["point"]: kept})
    assert fs.growth_history(hand) == record
    replayed = tiny_llama()
    assert replay_checkpoint_growth(replayed, str(checkpoint), protocol()) == 2
    assert replayed.config.num_hidden_layers == 4
    assert fs.growth_history(replayed) == record and same_parameters(replayed, hand)
    # a model holding the first event already gets the second alone
    first = tiny_llama()
    kept = {k: record[0][k] for k in EVIDENCE_KEYS + FIRST_STEP_KEYS if k in record[0]}
    fs.grow(first, protocol(), at=[record[0]["point"]], step=1, evidence={record[0]["point"]: kept})
    assert replay_checkpoint_growth(first, str(checkpoint), protocol()) == 1
    assert fs.growth_history(first) == record and same_parameters(first, hand)


def test_the_mixin_resumes_two_growth_events_as_the_uninterrupted_run(two_events, tmp_path):
    model, trainer, whole, checkpoint = two_events
    resumed = two_event_schedule()
    model_b, trainer_b = train(
        tmp_path, [GrowthScheduleCallback(resumed)], model=tiny_llama(), resume=str(checkpoint)
    )
    assert model_b.config.num_hidden_layers == 4 and resumed.events == whole.events
    assert fs.growth_history(model_b) == fs.growth_history(model) == checkpoint_growth(checkpoint)
    assert same_parameters(model_b, model)
    sa, sb = trainer.optimizer.optimizer.state_dict(), trainer_b.optimizer.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sorted(sa["state"]) == sorted(sb["state"])
    for i in sa["state"]:
        for key in sa["state"][i]:
            assert torch.equal(sa["state"][i][key], sb["state"][i][key]), (i, key)


# ---------------------------------------------------------------------------- nn.DataParallel
def several_gpus(monkeypatch, n_gpu, world_size=1):
    """TrainingArguments as the Trainer sees them with ``n_gpu`` GPUs in each of ``world_size``
    processes (the properties torch's device count sets; no GPU needed)."""
    monkeypatch.setattr(transformers.TrainingArguments, "n_gpu", property(lambda self: n_gpu))
    monkeypatch.setattr(transformers.TrainingArguments, "world_size", property(lambda self: world_size))


@pytest.mark.parametrize("n_gpu", [2, 3])
def test_data_parallel_is_refused_at_train_begin_before_anything_changes(n_gpu, tmp_path, monkeypatch):
    several_gpus(monkeypatch, n_gpu)
    whole = schedule()
    callback = GrowthScheduleCallback(whole)
    model = tiny_llama()
    before = snapshot(model)
    with pytest.raises(fs.FusedStatsError, match=rf"DataParallel over {n_gpu} GPUs in one process.*supports"):
        train(tmp_path, [callback], model=model)
    # refused before the first step: no parameter moved, nothing grown or saved, no hook left
    assert same_parameters(model, before) and fs.growth_history(model) == [] and whole.events == []
    assert callback._hook is None and not model._forward_pre_hooks
    assert not list(tmp_path.glob("checkpoint-*"))


def test_data_parallel_is_refused_before_a_resume_grows_the_model(uninterrupted, tmp_path, monkeypatch):
    _, _, _, checkpoint = uninterrupted
    several_gpus(monkeypatch, 2)
    original = tiny_llama()
    before = snapshot(original)
    with pytest.raises(fs.FusedStatsError, match="DataParallel over 2 GPUs in one process"):
        train(tmp_path, [GrowthScheduleCallback(schedule())], model=original, resume=str(checkpoint))
    assert same_parameters(original, before) and fs.growth_history(original) == []
    assert original.config.num_hidden_layers == 2


@pytest.mark.parametrize("n_gpu, world_size", [(0, 1), (1, 1), (2, 1), (1, 2), (2, 2)])
def test_refused_exactly_where_the_trainer_wraps_the_model_in_data_parallel(n_gpu, world_size, monkeypatch):
    from fused_stats.integrations._trainer_growth import check_trainer_setup

    several_gpus(monkeypatch, n_gpu, world_size)
    args = trainer_args("/nonexistent")
    model = tiny_llama()
    # the reference: the Trainer's own wrapping of the model it trains
    wrapped = transformers.Trainer(model=model, args=args)._wrap_model(model)
    if isinstance(wrapped, torch.nn.DataParallel):
        with pytest.raises(fs.FusedStatsError, match=f"DataParallel over {n_gpu} GPUs"):
            check_trainer_setup(args, model)
    else:
        check_trainer_setup(args, model)  # accepted: nothing raised
    assert (n_gpu, world_size) != (2, 1) or isinstance(wrapped, torch.nn.DataParallel)
