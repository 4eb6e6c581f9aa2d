"""Growth during training under 2-process DDP (gloo, CPU): the HF Trainer (accelerate's DDP) and
Lightning's strategy "ddp", tiny LLaMA from a config.

Each rank trains on its own share of the rows and probes its own held-out batches; at the
scheduled steps the probe is all-reduced, rank 0's decision broadcast, every rank grows and the
DDP wrapper is rebuilt around the grown model. References: the other rank (bit-equal parameters:
the ranks see different data, so only gradients all-reduced over the grown parameter list keep
them equal); one process's fs.Probe + fs.advise over both ranks' probe batches at the scheduled
step's parameters (the point grown, |C|_F²); the block count and parameter count of a
hand-grown model; the uninterrupted 2-process run for the resumed one (bit-equal parameters
and optimizer state).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import fused_stats as fs  # noqa: E402

from gloo_harness import init_gloo, run_two_ranks  # noqa: E402

VOCAB, T = 29, 8
CANDIDATES = ("model.layers.0", "model.layers.1")
STEPS = 5


def tiny_llama():
    torch.manual_seed(0)
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


def counting(seed, n):
    """Sequences counting up from a random start: a signal the random model has not learnt."""
    start = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
    return (start + torch.arange(T)) % VOCAB


class Rows(torch.utils.data.Dataset):
    def __init__(self, n=40, seed=3):
        self.ids = counting(seed, n)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def probe_batches(rank):
    return [{"input_ids": counting(100 + rank, 6)}]


def protocol():
    return fs.GrowthProtocol(CANDIDATES, family="layer", seed=2)


def parameter_hashes(model):
    return {
        name: hashlib.sha256(p.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
        for name, p in model.named_parameters()
    }


def torchrun_env(rank, world):
    os.environ.update(
        {
            "RANK": str(rank),
            "GROUP_RANK": "0",
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",
        }
    )  # as torchrun sets them; the gloo group exists already (file rendezvous): no port is used


# ---------------------------------------------------------------------------- HF Trainer
class SaveBeforeGrowth(transformers.TrainerCallback):
    """Rank 0's parameters after the optimizer step of ``step``, before the growth callback acts."""

    def __init__(self, step, path):
        self.step, self.path = step, path

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step and args.process_index == 0:
            torch.save(model.state_dict(), self.path)


def trainer_args(directory, **kw):
    base = dict(
        output_dir=str(directory),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=3e-3,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="steps",
        save_steps=3,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _trainer_worker(rank, world, outdir):
    torchrun_env(rank, world)
    torch.set_num_threads(1)
    init_gloo(rank, world, outdir)
    import torch.distributed as dist

    from fused_stats.integrations.transformers import FusedStatsTrainerMixin, GrowthScheduleCallback

    transformers.logging.set_verbosity_error()

    class Trainer(FusedStatsTrainerMixin, transformers.Trainer):
        pass

    def schedule():
        return fs.GrowthSchedule(protocol(), at_steps=[2, 4], probe_batches=probe_batches(rank))

    out = {}
    try:
        # the uninterrupted run, a checkpoint after its first growth event (step 3)
        whole = schedule()
        model = tiny_llama()
        trainer = Trainer(
            model=model,
            args=trainer_args(Path(outdir) / "a"),
            train_dataset=Rows(),
            callbacks=[SaveBeforeGrowth(2, Path(outdir) / "step2.pt"), GrowthScheduleCallback(whole)],
        )
        trainer.train()
        wrapped = trainer.model_wrapped
        optimizer = trainer.optimizer.optimizer
        out["whole"] = {
            "events": whole.events,
            "history": fs.growth_history(model),
            "hashes": parameter_hashes(model),
            "n_params": sum(p.numel() for p in model.parameters()),
            "layers": model.config.num_hidden_layers,
            "losses": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e},
            "global_step": trainer.state.global_step,
            # the wrapper the loop trained is DDP over every parameter of the grown model,
            # accelerate holds that model (or its wrapper), the optimizer holds every parameter
            "wrapper": type(wrapped).__name__,
            "accelerate_holds": [m is model or m is wrapped for m in trainer.accelerator._models],
            "wrapper_params": len(wrapped._module_parameters),
            "model_params": len(list(model.parameters())),
            "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups),
            "reducer_buckets_params": sum(
                len(b.parameters()) for b in wrapped.reducer._get_zeros_like_grad_buckets()
            ),
            "new_moved": [
                float(dict(model.named_parameters())[n].detach().abs().max())
                for e in fs.growth_history(model)
                for n in e["new_parameters"]
                if n.endswith("o_proj.weight")
            ],
        }
        state = {k: v for k, v in optimizer.state_dict()["state"].items()}
        torch.save({"state": state}, Path(outdir) / f"optimizer_whole{rank}.pt")
        dist.barrier()
        # resumed from checkpoint-3: the Trainer is given the original (2-layer) model, the mixin
        # grows it as the checkpoint's record says before the weights are loaded
        resumed = schedule()
        model_b = tiny_llama()
        trainer_b = Trainer(
            model=model_b,
            args=trainer_args(Path(outdir) / "b"),
            train_dataset=Rows(),
            callbacks=[GrowthScheduleCallback(resumed)],
        )
        trainer_b.train(resume_from_checkpoint=str(Path(outdir) / "a" / "checkpoint-3"))
        out["resumed"] = {
            "events": resumed.events,
            "history": fs.growth_history(model_b),
            "hashes": parameter_hashes(model_b),
        }
        state_b = trainer_b.optimizer.optimizer.state_dict()["state"]
        torch.save({"state": state_b}, Path(outdir) / f"optimizer_resumed{rank}.pt")
        (Path(outdir) / f"rank{rank}.json").write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def trainer_ranks(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("trainer_ddp")
    return run_two_ranks(_trainer_worker, outdir), outdir


def test_trainer_two_ranks_grow_identically_and_keep_training(trainer_ranks):
    ranks, outdir = trainer_ranks
    a, b = ranks[0]["whole"], ranks[1]["whole"]
    assert a["hashes"] == b["hashes"]  # every parameter bit-equal on both ranks
    assert a["events"] == b["events"] and a["history"] == b["history"]
    assert [(e["step"], e["event"]) for e in a["events"]] == [(2, "grew"), (4, "grew")]
    # the grown architecture: two inserted blocks, the parameter count of a hand-grown model
    hand = tiny_llama()
    fs.grow(hand, protocol(), at=["model.layers.0"])
    fs.grow(hand, protocol(), at=["model.layers.0"])
    assert a["layers"] == 4 == hand.config.num_hidden_layers
    assert a["n_params"] == sum(p.numel() for p in hand.parameters())
    # training went on after both growths, on the rebuilt wrapper
    assert a["global_step"] == STEPS and sorted(map(int, a["losses"])) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for v in a["losses"].values())
    assert a["wrapper"] == "DistributedDataParallel" and a["accelerate_holds"] == [True]
    assert a["wrapper_params"] == a["model_params"] == a["optimizer_params"] == a["reducer_buckets_params"]
    assert len(a["new_moved"]) == 2 and min(a["new_moved"]) > 0  # zero at insertion, trained since
    # the decision at step 2: one process probing both ranks' batches at the step-2 parameters
    model = tiny_llama()
    model.load_state_dict(torch.load(outdir / "step2.pt"))
    probe = fs.Probe(model, points=list(CANDIDATES), cross=protocol())
    for rank in range(2):
        for batch in probe_batches(rank):
            probe.step(batch, fs.causal_lm_loss)
    advice = fs.advise(probe, protocol())
    assert a["events"][0]["point"] == advice.top.point
    assert a["events"][0]["cross_frob2"] == pytest.approx(advice.top.cross_frob2, rel=1e-6)


def test_trainer_resume_after_growth_under_ddp_equals_the_uninterrupted_run(trainer_ranks):
    ranks, outdir = trainer_ranks
    for rank in range(2):
        whole, resumed = ranks[rank]["whole"], ranks[rank]["resumed"]
        assert resumed["events"] == whole["events"] and resumed["history"] == whole["history"]
        assert resumed["hashes"] == whole["hashes"]  # bit-equal, every parameter
        sa = torch.load(outdir / f"optimizer_whole{rank}.pt")["state"]
        sb = torch.load(outdir / f"optimizer_resumed{rank}.pt")["state"]
        assert sorted(sa) == sorted(sb)
        for i in sa:
            for key in sa[i]:
                assert torch.equal(sa[i][key], sb[i][key]), (rank, i, key)


# ---------------------------------------------------------------------------- Lightning
def _lightning_worker(rank, world, outdir):
    torchrun_env(rank, world)
    torch.set_num_threads(1)
    init_gloo(rank, world, outdir)
    import lightning as L
    import torch.distributed as dist

    from fused_stats.integrations.lightning import GrowthScheduleLightningCallback

    transformers.logging.set_verbosity_error()

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = tiny_llama()
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = self.lm(**batch).loss
            self.losses.append((self.trainer.global_step, float(loss.detach())))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.lm.parameters(), lr=3e-3)

    class Wrapper(L.Callback):
        """The strategy's wrapper at the end of training (Lightning unwraps it at teardown)."""

        def on_train_end(self, trainer, pl_module):
            wrapper = trainer.strategy.model
            seen["wrapper"] = type(wrapper).__name__
            seen["wrapper_params"] = len(wrapper._module_parameters)

    seen = {}
    try:
        schedule = fs.GrowthSchedule(protocol(), at_steps=[2, 4], probe_batches=probe_batches(rank))
        module = LM()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            num_nodes=1,
            strategy="ddp",
            max_steps=STEPS,
            accumulate_grad_batches=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[GrowthScheduleLightningCallback(schedule, model_of=lambda m: m.lm), Wrapper()],
        )
        loader = torch.utils.data.DataLoader(Rows(), batch_size=2, shuffle=False)
        trainer.fit(module, loader)
        out = {
            **seen,
            "strategy": type(trainer.strategy).__name__,
            "world": trainer.world_size,
            "events": schedule.events,
            "history": fs.growth_history(module.lm),
            "hashes": parameter_hashes(module.lm),
            "n_params": sum(p.numel() for p in module.lm.parameters()),
            "layers": module.lm.config.num_hidden_layers,
            "losses": module.losses,
            "global_step": trainer.global_step,
            "model_params": len(list(module.parameters())),
            "optimizer_params": sum(len(g["params"]) for g in trainer.optimizers[0].param_groups),
        }
        (Path(outdir) / f"rank{rank}.json").write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_lightning_ddp_two_ranks_grow_identically_and_keep_training(tmp_path):
    pytest.importorskip("lightning")
    a, b = run_two_ranks(_lightning_worker, tmp_path)
    assert a["strategy"] == "DDPStrategy" and a["world"] == 2
    assert a["hashes"] == b["hashes"]  # every parameter bit-equal on both ranks
    assert a["events"] == b["events"] and a["history"] == b["history"]
    assert [(e["step"], e["event"]) for e in a["events"]] == [(2, "grew"), (4, "grew")]
    hand = tiny_llama()
    fs.grow(hand, protocol(), at=["model.layers.0"])
    fs.grow(hand, protocol(), at=["model.layers.0"])
    assert a["layers"] == 4 and a["n_params"] == sum(p.numel() for p in hand.parameters())
    assert a["global_step"] == STEPS
    # micro-batches at every optimizer step, also after both growths, with finite losses
    assert sorted({step for step, _ in a["losses"]}) == list(range(STEPS))
    assert all(math.isfinite(loss) for _, loss in a["losses"] + b["losses"])
    assert a["wrapper"] == "DistributedDataParallel"
    assert a["wrapper_params"] == a["model_params"] == a["optimizer_params"]


# ---------------------------------------------------------------------------- FSDP refused
def _fsdp_worker(rank, world, outdir):
    torchrun_env(rank, world)
    torch.set_num_threads(1)
    init_gloo(rank, world, outdir)
    import torch.distributed as dist

    from fused_stats.integrations.transformers import GrowthScheduleCallback

    transformers.logging.set_verbosity_error()
    schedule = fs.GrowthSchedule(protocol(), at_steps=[1], probe_batches=probe_batches(rank))
    model = tiny_llama()
    args = trainer_args(
        Path(outdir) / "fsdp",
        fsdp=True,
        fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        save_strategy="no",
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Rows(), callbacks=[GrowthScheduleCallback(schedule)]
    )
    out = {}
    try:
        trainer.train()
    except fs.FusedStatsError as error:
        out["error"] = str(error)
    out.update(
        global_step=trainer.state.global_step,
        events=schedule.events,
        history=fs.growth_history(model),
        layers=model.config.num_hidden_layers,
    )
    (Path(outdir) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_trainer_under_fsdp_is_refused_before_any_step(tmp_path):
    for rank in run_two_ranks(_fsdp_worker, tmp_path):
        assert "FSDP" in rank["error"] and "DistributedDataParallel" in rank["error"]
        assert "Lightning's strategy 'ddp'" in rank["error"]  # the supported set-ups are named
        assert rank["global_step"] == 0 and rank["events"] == [] and rank["history"] == []
        assert rank["layers"] == 2
