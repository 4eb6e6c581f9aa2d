"""fs.GrowthSchedule under transformers.Trainer (tiny LLaMA from a config, fp32, CPU, gradient
accumulation 2). References: the same schedule written by hand (a plain TrainerCallback calling
fs.Probe, fs.advise and fs.grow at the same steps) for bit-equal parameters, optimizer state and
growth record; the scheduler's own lr for the grown groups; a run without any schedule for the
refusals (nothing changed)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import fused_stats as fs  # noqa: E402  (after the importorskip of the optional peers)
from fused_stats.api.growth.record import FIRST_STEP_KEYS  # noqa: E402
from fused_stats.errors import FusedStatsError  # noqa: E402
from fused_stats.integrations.transformers import (  # noqa: E402
    FusedStatsTrainerMixin,
    GrowthScheduleCallback,
)

transformers.logging.set_verbosity_error()

VOCAB, T = 29, 8
CANDIDATES = ("model.layers.0", "model.layers.1")


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(cfg)


def counting(gen, n):
    """Sequences counting up from a random start: a signal the random model has not learnt."""
    start = torch.randint(0, VOCAB, (n, 1), generator=gen)
    ids = (start + torch.arange(T)) % VOCAB
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class Rows(torch.utils.data.Dataset):
    def __init__(self, batch):
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def probe_batches(seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": counting(gen, 8)["input_ids"]} for _ in range(2)]


def train_data(seed=3, n=24):
    return Rows(counting(torch.Generator().manual_seed(seed), n))


def args(tmp_path, max_steps, **kw):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        learning_rate=3e-3,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


class HandWritten(transformers.TrainerCallback):
    """The schedule written out: probe, advise, grow (or stop) after the scheduled optimizer steps."""

    def __init__(self, protocol, at_steps, batches, alpha):
        self.protocol, self.at_steps, self.batches, self.alpha = protocol, at_steps, batches, alpha
        self.stopped = False

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.stopped or state.global_step not in self.at_steps:
            return
        probe = fs.Probe(model, points=list(self.protocol.candidates), cross=self.protocol)
        for batch in self.batches:
            probe.step(batch, fs.causal_lm_loss)
        advice = fs.advise(probe, self.protocol, alpha=self.alpha)
        if advice.top is None:
            self.stopped = True
            return
        fs.grow(
            model,
            self.protocol,
            at=[advice.top.point],
            optimizer=optimizer.optimizer,  # accelerate's wrapper holds the torch optimizer
            step=state.global_step,
            evidence=advice,
        )


def run(tmp_path, callback_factory, max_steps=5, trainer_class=transformers.Trainer, **kw):
    model = tiny_llama()
    trainer = trainer_class(
        model=model,
        args=args(tmp_path, max_steps, **kw),
        train_dataset=train_data(),
        callbacks=[callback_factory()],
    )
    trainer.train()
    return model, trainer


def optimizer_state(trainer):
    state = trainer.optimizer.optimizer.state_dict()
    return state["state"], state["param_groups"]


def assert_same_run(a, b):
    (model_a, trainer_a), (model_b, trainer_b) = a, b
    params_a, params_b = dict(model_a.named_parameters()), dict(model_b.named_parameters())
    assert list(params_a) == list(params_b)
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name
    state_a, groups_a = optimizer_state(trainer_a)
    state_b, groups_b = optimizer_state(trainer_b)
    assert groups_a == groups_b and sorted(state_a) == sorted(state_b)
    for i in state_a:
        for key in state_a[i]:
            assert torch.equal(state_a[i][key], state_b[i][key]), (i, key)
    history_a, history_b = fs.growth_history(model_a), fs.growth_history(model_b)
    if not any("first_step_change" in e for e in history_b):  # the hand-written schedule predicts nothing
        history_a = without_first_step(history_a)
    assert history_a == history_b


def without_first_step(history):
    """The record without the schedule's first-step prediction (tested in test_growth_schedule_first_step)."""
    return [{k: v for k, v in e.items() if k not in FIRST_STEP_KEYS} for e in history]


def test_trainer_callback_equals_the_hand_written_schedule(tmp_path):
    protocol = fs.GrowthProtocol(CANDIDATES, family="layer", seed=2)
    batches = probe_batches()
    schedule = fs.GrowthSchedule(protocol, at_steps=[2, 4], probe_batches=batches, max_growths=2)

    class Logged(FusedStatsTrainerMixin, transformers.Trainer):
        pass

    ours = run(tmp_path / "a", lambda: GrowthScheduleCallback(schedule), trainer_class=Logged)
    hand = run(tmp_path / "b", lambda: HandWritten(protocol, {2, 4}, batches, 0.05))
    assert_same_run(ours, hand)
    model, trainer = ours
    history = fs.growth_history(model)
    assert [e["step"] for e in history] == [2, 4] and model.config.num_hidden_layers == 4
    assert [e["step"] for e in schedule.events] == [2, 4] and schedule.stopped  # max_growths reached
    for entry, event in zip(history, schedule.events):
        assert entry["point"] == event["point"] and entry["protocol_digest"] == protocol.digest
        assert (
            entry["cross_frob2"] == event["cross_frob2"] > 0 and entry["p_value"] == event["p_value"] <= 0.05
        )
        # accelerate's wrapper is read through to its AdamW: a prediction, the same in both places
        assert entry["first_step_change"] == event["first_step_change"] < 0, event["first_step_note"]
    # the Trainer's own log carries each event at its step
    logged = {e["step"]: e for e in trainer.state.log_history if "fused_stats/growth/grew" in e}
    assert sorted(logged) == [2, 4]
    assert logged[2]["fused_stats/growth/cross_frob2"] == history[0]["cross_frob2"]
    # the Trainer's LambdaLR drives the new parameters: they sit in its groups, whose lr is the
    # scheduler's, and they trained (AdamW state with the steps since their growth)
    optimizer = trainer.optimizer.optimizer
    lrs = trainer.lr_scheduler.get_last_lr()
    index = {
        id(p): (g, i) for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])
    }
    params = dict(model.named_parameters())
    for entry in history:
        for name in entry["new_parameters"]:
            group, _ = index[id(params[name])]
            assert optimizer.param_groups[group]["lr"] == lrs[group]
    # names are the model's at growth time: the second block went in before the first, so the
    # last event's names are current; AdamW counted the steps since each growth (5 steps in all)
    steps = [optimizer.state[p]["step"].item() for p in model.parameters()]
    assert steps.count(5 - 2) == len(history[0]["new_parameters"])
    assert steps.count(5 - 4) == len(history[1]["new_parameters"])
    assert all(optimizer.state[params[n]]["step"].item() == 1 for n in history[1]["new_parameters"])
    out_proj = [n for n in history[1]["new_parameters"] if n.endswith("o_proj.weight")]
    assert out_proj and params[out_proj[0]].abs().max() > 0  # zero at insertion, moved by training


def test_all_saturated_stops_growing_and_says_so(tmp_path):
    protocol = fs.GrowthProtocol(CANDIDATES, family="layer")
    # alpha below every p-value this little probe can produce: saturated everywhere by construction
    schedule = fs.GrowthSchedule(protocol, every=2, probe_batches=probe_batches(), alpha=1e-30)
    callback = GrowthScheduleCallback(schedule)
    model, trainer = run(tmp_path, lambda: callback, max_steps=5)
    assert schedule.stopped and len(schedule.events) == 1  # decided at step 2, never again
    assert len(callback._step_batches) == 2  # only the last step's micro-batches are kept
    event = schedule.events[0]
    assert event["event"] == "saturated everywhere" and event["step"] == 2 and event["point"] is None
    assert "Saturated everywhere" in event["verdict"]
    assert model.config.num_hidden_layers == 2
    (entry,) = fs.growth_history(model)  # the decision is in the model's record, nothing grown
    assert entry["event"] == "saturated everywhere" and entry["step"] == 2 and entry["point"] is None
    assert entry["protocol_digest"] == protocol.digest and entry["new_parameters"] == []
    assert entry["verdict"] == event["verdict"]
    logged = [e for e in trainer.state.log_history if "fused_stats/growth/saturated" in e]
    assert [e["step"] for e in logged] == [2] and logged[0]["fused_stats/growth/saturated"] == 1.0


def test_a_schedule_step_beyond_the_training_is_refused_before_training(tmp_path):
    protocol = fs.GrowthProtocol(CANDIDATES)
    schedule = fs.GrowthSchedule(protocol, at_steps=[2, 9], probe_batches=probe_batches())
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = transformers.Trainer(
        model=model,
        args=args(tmp_path, 3),
        train_dataset=train_data(),
        callbacks=[GrowthScheduleCallback(schedule)],
    )
    with pytest.raises(FusedStatsError, match=r"at_steps \[9\] lie beyond the training length \(3"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_probe_batches_that_are_the_training_batches_are_refused(tmp_path):
    protocol = fs.GrowthProtocol(CANDIDATES)
    # every training row is the same sequence, so the probe batch equals each training micro-batch
    row = counting(torch.Generator().manual_seed(0), 1)
    data = Rows({k: v.repeat(6, 1) for k, v in row.items()})
    schedule = fs.GrowthSchedule(
        protocol, at_steps=[1], probe_batches=[{"input_ids": row["input_ids"].repeat(3, 1)}]
    )
    model = tiny_llama()
    trainer = transformers.Trainer(
        model=model, args=args(tmp_path, 2), train_dataset=data, callbacks=[GrowthScheduleCallback(schedule)]
    )
    n_params = len(trainer.create_optimizer().param_groups[0]["params"])
    with pytest.raises(FusedStatsError, match="probe batch 0 is a training batch"):
        trainer.train()
    assert model.config.num_hidden_layers == 2 and fs.growth_history(model) == [] and schedule.events == []
    assert len(trainer.optimizer.param_groups[0]["params"]) == n_params


def test_a_scheduled_step_without_an_optimizer_is_refused():
    model = tiny_llama()
    schedule = fs.GrowthSchedule(fs.GrowthProtocol(CANDIDATES), at_steps=[1], probe_batches=probe_batches())
    callback = GrowthScheduleCallback(schedule)
    state = transformers.TrainerState(global_step=1, max_steps=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FusedStatsError, match="optimizer is not created yet"):
        callback.on_step_end(None, state, transformers.TrainerControl(), model=model, optimizer=None)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and schedule.events == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "exactly one of at_steps"),
        (dict(at_steps=[2], every=2), "exactly one of at_steps"),
        (dict(at_steps=[0]), "positive int"),
        (dict(at_steps=[2, 2]), "distinct"),
        (dict(every=2, alpha=1.0), "alpha"),
        (dict(every=2, alpha=0.0), "alpha"),
        (dict(every=2, max_growths=0), "max_growths"),
        (dict(every=2, probe_batches=[]), "probe_batches is empty"),
        (dict(every=2, probe_batches={"input_ids": torch.zeros(2, 3)}), "list of held-out batches"),
        (dict(every=2, probe_batches=torch.zeros(2, 3, dtype=torch.long)), "list of held-out batches"),
    ],
)
def test_bad_schedules_are_refused(kwargs, message):
    kwargs.setdefault("probe_batches", probe_batches())
    with pytest.raises(FusedStatsError, match=message):
        fs.GrowthSchedule(fs.GrowthProtocol(CANDIDATES), **kwargs)


# ---------------------------------------------------------------------------- Lightning
LR, GA, STEPS = 3e-3, 2, 5


def linear_decay(step):
    return 1.0 - step / (STEPS + 1)


def lightning_module():
    L = pytest.importorskip("lightning")

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = tiny_llama()

        def training_step(self, batch, batch_idx):
            return self.lm(**batch).loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.lm.parameters(), lr=LR)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_decay)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return LM()


def loader():
    return torch.utils.data.DataLoader(train_data(), batch_size=3, shuffle=False)


def lightning_fit(callbacks, module=None, max_steps=STEPS, enable_checkpointing=False, ckpt_path=None):
    L = pytest.importorskip("lightning")
    module = module or lightning_module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        accumulate_grad_batches=GA,
        logger=False,
        enable_checkpointing=enable_checkpointing,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return module, trainer


def hand_written_loop(protocol, at_steps, batches, alpha=0.05, max_growths=None):
    """The Lightning run written as a plain loop, the schedule by hand."""
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_decay)
    step, grown = 0, 0
    epochs = (batch for _ in range(STEPS) for batch in loader())
    for i, batch in enumerate(epochs):
        (model(**batch).loss / GA).backward()
        if (i + 1) % GA:
            continue
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        step += 1
        if step in at_steps and (max_growths is None or grown < max_growths):
            probe = fs.Probe(model, points=list(protocol.candidates), cross=protocol)
            for b in batches:
                probe.step(b, fs.causal_lm_loss)
            advice = fs.advise(probe, protocol, alpha=alpha)
            fs.grow(model, protocol, at=[advice.top.point], optimizer=optimizer, step=step, evidence=advice)
            grown += 1
        if step == STEPS:
            break
    return model, optimizer


def test_lightning_callback_equals_the_hand_written_loop():
    from fused_stats.integrations.lightning import GrowthScheduleLightningCallback

    protocol = fs.GrowthProtocol(CANDIDATES, family="layer", seed=2)
    batches = probe_batches()
    schedule = fs.GrowthSchedule(protocol, at_steps=[2, 4], probe_batches=batches)
    module, trainer = lightning_fit([GrowthScheduleLightningCallback(schedule, model_of=lambda m: m.lm)])
    model, optimizer = hand_written_loop(protocol, {2, 4}, batches)
    ours = dict(module.lm.named_parameters())
    ref = dict(model.named_parameters())
    assert list(ours) == list(ref) and module.lm.config.num_hidden_layers == 4
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
    a, b = trainer.optimizers[0].state_dict(), optimizer.state_dict()
    assert a["param_groups"] == b["param_groups"] and sorted(a["state"]) == sorted(b["state"])
    for i in a["state"]:
        for key in a["state"][i]:
            assert torch.equal(a["state"][i][key], b["state"][i][key]), (i, key)
    assert without_first_step(fs.growth_history(module.lm)) == fs.growth_history(model)
    assert [e["step"] for e in fs.growth_history(model)] == [2, 4]
    assert [e["step"] for e in schedule.events] == [2, 4]
    # the LambdaLR of configure_optimizers drives the grown groups
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert [g["lr"] for g in trainer.optimizers[0].param_groups] == scheduler.get_last_lr()


def test_trainer_resumed_after_a_growth_event_matches_the_uninterrupted_run(tmp_path):
    protocol = fs.GrowthProtocol(CANDIDATES, family="layer", seed=2)
    batches = probe_batches()

    def schedule():
        # max_growths=2 over three scheduled steps: the resumed run must know it grew once already
        return fs.GrowthSchedule(protocol, at_steps=[2, 4, 5], probe_batches=batches, max_growths=2)

    save = dict(save_strategy="steps", save_steps=3)
    whole = schedule()
    model, trainer = run(tmp_path / "a", lambda: GrowthScheduleCallback(whole), **save)
    assert [e["step"] for e in whole.events] == [2, 4] and whole.stopped
    checkpoint = tmp_path / "a" / "checkpoint-3"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    assert reloaded.config.num_hidden_layers == 3 and [e["step"] for e in fs.growth_history(reloaded)] == [2]
    resumed_schedule = schedule()
    resumed = transformers.Trainer(
        model=reloaded,
        args=args(tmp_path / "b", 5, **save),
        train_dataset=train_data(),
        callbacks=[GrowthScheduleCallback(resumed_schedule)],
    )
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed_schedule.events == whole.events and resumed_schedule.stopped
    assert_same_run((model, trainer), (reloaded, resumed))
    assert resumed.lr_scheduler.get_last_lr() == trainer.lr_scheduler.get_last_lr()


def test_bf16_mixed_precision_keeps_working(tmp_path):
    # Trainer's CPU autocast (bf16) around forward and loss; the decision runs outside it, on the
    # fp32 parameters, so both schedules still agree bit for bit
    protocol = fs.GrowthProtocol(CANDIDATES, family="layer", seed=2)
    batches = probe_batches()
    schedule = fs.GrowthSchedule(protocol, at_steps=[2], probe_batches=batches)
    ours = run(tmp_path / "a", lambda: GrowthScheduleCallback(schedule), max_steps=3, bf16=True)
    hand = run(tmp_path / "b", lambda: HandWritten(protocol, {2}, batches, 0.05), max_steps=3, bf16=True)
    assert_same_run(ours, hand)
    assert [e["step"] for e in fs.growth_history(ours[0])] == [2]
    assert all(p.dtype == torch.float32 for p in ours[0].parameters())


def test_lightning_resumed_after_a_growth_event_matches_the_uninterrupted_run(tmp_path):
    L = pytest.importorskip("lightning")
    from fused_stats.integrations.lightning import GrowthScheduleLightningCallback

    protocol = fs.GrowthProtocol(CANDIDATES, family="layer", seed=2)
    batches = probe_batches()

    def callbacks(directory):
        schedule = fs.GrowthSchedule(protocol, at_steps=[2, 4, 5], probe_batches=batches, max_growths=2)
        keep = L.pytorch.callbacks.ModelCheckpoint(dirpath=directory, every_n_train_steps=4, save_top_k=-1)
        return schedule, [GrowthScheduleLightningCallback(schedule, model_of=lambda m: m.lm), keep]

    whole, cbs = callbacks(tmp_path / "a")
    module, trainer = lightning_fit(cbs, enable_checkpointing=True)
    assert [e["step"] for e in whole.events] == [2, 4] and whole.stopped
    checkpoint = next((tmp_path / "a").glob("*step=4*.ckpt"))  # an epoch's end: 4 steps an epoch
    # the grown architecture, from the growth record's count of layers, holds the checkpoint
    grown = lightning_module()
    config = grown.lm.config
    config.num_hidden_layers = 4
    torch.manual_seed(1)
    grown.lm = transformers.LlamaForCausalLM(config)
    resumed, cbs = callbacks(tmp_path / "b")
    module_b, trainer_b = lightning_fit(
        cbs, module=grown, enable_checkpointing=True, ckpt_path=str(checkpoint)
    )
    assert resumed.events == whole.events and resumed.stopped
    a, b = dict(module.lm.named_parameters()), dict(module_b.lm.named_parameters())
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    sa, sb = trainer.optimizers[0].state_dict(), trainer_b.optimizers[0].state_dict()
    for i in sa["state"]:
        for key in sa["state"][i]:
            assert torch.equal(sa["state"][i][key], sb["state"][i][key]), (i, key)
    assert fs.growth_history(module_b.lm) == fs.growth_history(module.lm)


def test_only_scheduled_optimizer_steps_are_decided():
    protocol = fs.GrowthProtocol(CANDIDATES)
    every = fs.GrowthSchedule(protocol, every=2, probe_batches=probe_batches())
    assert [s for s in range(7) if every.is_scheduled(s)] == [2, 4, 6]  # never step 0 (no step yet)
    at = fs.GrowthSchedule(protocol, at_steps=[5, 1], probe_batches=probe_batches())
    assert at.at_steps == (1, 5) and [s for s in range(7) if at.is_scheduled(s)] == [1, 5]


def test_probe_batches_follow_the_model_device():
    from collections import namedtuple

    from fused_stats.api.growth.schedule import _on_device

    Pair = namedtuple("Pair", "x y")
    batch = {"input_ids": torch.arange(4).view(1, 4), "extra": [Pair(torch.ones(2), 3)]}
    moved = _on_device(batch, torch.device("meta"))
    assert moved["input_ids"].device.type == "meta" and moved["extra"][0].x.device.type == "meta"
    assert isinstance(moved["extra"][0], Pair) and moved["extra"][0].y == 3
    assert batch["input_ids"].device.type == "cpu"  # the user's batch is left as it was


# ---------------------------------------------------------------------------- plumbing, direct
def test_a_probe_batch_sharing_a_tensor_with_a_training_batch_is_refused():
    schedule = fs.GrowthSchedule(fs.GrowthProtocol(CANDIDATES), every=1, probe_batches=probe_batches())
    gen = torch.Generator().manual_seed(5)
    shared, a, b = (torch.randint(0, VOCAB, (2, T), generator=gen) for _ in range(3))
    assert not torch.equal(a, b)
    # the shared tensor is not the first one, and sits inside a nested list (a Lightning-style batch)
    schedule.probe_batches = [(a, [shared])]
    with pytest.raises(FusedStatsError, match="probe batch 0 is a training batch"):
        schedule.check_not_training_batches([(b, shared)])
    schedule.check_not_training_batches([(b, shared.clone() + 1)])  # no shared tensor, other ids: held out


def test_a_refused_optimizer_or_ddp_wrapper_changes_nothing(tmp_path):
    import torch.distributed as dist

    model = tiny_llama()
    # alpha below every p-value: the decision would be "saturated", which must not be recorded either
    schedule = fs.GrowthSchedule(
        fs.GrowthProtocol(CANDIDATES), at_steps=[1], probe_batches=probe_batches(), alpha=1e-30
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FusedStatsError, match=r"must be a torch\.optim\.Optimizer"):
        schedule.maybe_grow(model, 1, optimizer={"lr": 1e-3})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        with pytest.raises(FusedStatsError, match="pass the module inside DistributedDataParallel"):
            schedule.maybe_grow(ddp, 1, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and schedule.events == []
    assert model.config.num_hidden_layers == 2 and fs.growth_history(model) == []


def test_the_logged_scalars_are_the_event_values():
    protocol = fs.GrowthProtocol(CANDIDATES)
    schedule = fs.GrowthSchedule(protocol, every=1, probe_batches=probe_batches())
    event = {"step": 3, "event": "grew", "point": "model.layers.1", "cross_frob2": 0.25}
    event.update(p_value=0.001, p_adjusted=0.002, verdict="")
    assert schedule.metrics(event) == {
        "fused_stats/growth/grew": 1.0,
        "fused_stats/growth/saturated": 0.0,
        "fused_stats/growth/cross_frob2": 0.25,
        "fused_stats/growth/p_value": 0.001,
        "fused_stats/growth/p_adjusted": 0.002,
        "fused_stats/growth/point_index": 1.0,  # the second of CANDIDATES
    }


def test_schedule_state_round_trips_and_a_foreign_state_is_refused():
    protocol = fs.GrowthProtocol(CANDIDATES, family="layer", seed=2)
    events = [{"step": 2, "event": "saturated everywhere", "point": None, "verdict": "v"}]
    state = {"protocol_digest": protocol.digest, "events": events, "stopped": True}
    schedule = fs.GrowthSchedule(protocol, every=2, probe_batches=probe_batches())
    schedule.load_state_dict(state)
    assert schedule.events == events and schedule.stopped and schedule.state_dict() == state
    assert not any(schedule.is_scheduled(s) for s in range(8))
    other = fs.GrowthSchedule(fs.GrowthProtocol(CANDIDATES, seed=3), every=2, probe_batches=probe_batches())
    with pytest.raises(FusedStatsError, match="written under protocol"):
        other.load_state_dict(state)
    with pytest.raises(FusedStatsError, match="not a GrowthSchedule state"):
        other.load_state_dict({"events": [], "stopped": False})
    assert other.events == [] and not other.stopped
