"""FusedStatsCallback under transformers.Trainer: a tiny LLaMA (from a config, fp64, CPU) trained
with gradient_accumulation_steps=2. References: a hand-written observe loop and Probe.step
(one activation backward of the per-sample losses) over the same micro-batches at the same
parameters, recorded from the run; a run without the callback for bit-identity. A model whose
forward takes no ``num_items_in_batch`` on 9 rows: a partial last accumulation step, whose loss
the Trainer divides by its own micro-batch count."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import fused_stats as fs  # noqa: E402  (after the importorskip of the optional peers)
from fused_stats.integrations.transformers import (  # noqa: E402  (after the importorskip)
    FusedStatsCallback,
    FusedStatsTrainerMixin,
)

from tiny_models import padded_lm_batch  # noqa: E402  (after the importorskip)

VOCAB, T = 29, 8
KEYS = ("n", "d_align", "d_par", "d_2", "mu_norm2", "ag_max")


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(cfg).to(torch.float64)


class NoItemsLM(torch.nn.Module):
    """The tiny LLaMA behind a forward that takes neither ``num_items_in_batch`` nor ``**kwargs``:
    the Trainer passes no ``num_items_in_batch`` and divides each micro-batch's loss by ``k``, the
    micro-batches of its optimizer step (fewer in an epoch's last step). The loss is the fp64
    token mean over the micro-batch; ``output="dict"`` returns it where the observation sees it
    (and checks the weight it arrives with), ``"tuple"`` where it does not (only the callback's
    factor decides)."""

    def __init__(self, output="dict"):
        super().__init__()
        self.lm = tiny_llama()
        self.output = output

    def forward(self, input_ids, attention_mask, labels):
        logits = self.lm(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
        )
        return {"loss": loss, "logits": logits} if self.output == "dict" else (loss, logits)


class Rows(torch.utils.data.Dataset):
    def __init__(self, gen, n):
        lengths = torch.randint(3, T + 1, (n,), generator=gen).tolist()
        batch = padded_lm_batch(gen, lengths, T, VOCAB)
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def training_args(tmp_path, max_steps):
    """CPU, 3 sequences a micro-batch, 2 micro-batches a step, a log entry every step."""
    from transformers import TrainingArguments

    return TrainingArguments(
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


def train(tmp_path, data, callbacks=(), trainer_class=None, max_steps=3, record=None, make_model=tiny_llama):
    from transformers import Trainer

    model = make_model()
    if record is not None:

        def see(module, args, kwargs):
            record.append(
                (
                    {k: v.detach().clone() for k, v in module.state_dict().items()},
                    {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()},
                )
            )

        model.register_forward_pre_hook(see, with_kwargs=True)
    callbacks = [
        cb(model) if callable(cb) and not isinstance(cb, transformers.TrainerCallback) else cb
        for cb in callbacks
    ]
    args = training_args(tmp_path, max_steps)
    trainer = (trainer_class or Trainer)(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    return model, trainer


def reference_records(recorded, ga, steps, use_probe_step):
    """Cumulative estimates after each optimizer step from the recorded micro-batches."""
    model = tiny_llama()
    probe = fs.Probe(model, second_moment="dense")
    out = []
    for i, (state, kwargs) in enumerate(recorded):
        model.load_state_dict(state)
        if use_probe_step:
            batch = {k: kwargs[k] for k in ("input_ids", "attention_mask", "labels")}
            probe.step(batch, fs.causal_lm_loss)
        else:
            with probe.observe(loss_reduction="token_mean"):
                model(**kwargs).loss.backward()
            model.zero_grad()
        if (i + 1) % ga == 0:
            out.append({p: probe.stats[p].estimate() for p in probe.points})
    assert len(out) == steps
    return out


def check(records, refs, fp32_loss=False):
    """``fp32_loss``: against Probe.step, whose fp64 loss differs from HF's causal-LM loss, which
    upcasts the logits to fp32 only (so fp64 logits are rounded to fp32 there): agreement to
    fp32 rounding of the gradients, on the estimates that do not divide by a near-zero |μ|⁴."""
    assert len(records) == len(refs)
    for step, (record, ref) in enumerate(zip(records, refs), 1):
        assert record["step"] == step
        for point, est in ref.items():
            got = record["points"][point]
            for key in ("n", "mu_norm2", "trace_sigma2", "ag_max") if fp32_loss else KEYS:
                want = getattr(est, key)
                if want is None:  # not estimable at this n (a variance estimate <= 0): None in the log too
                    assert got[key] is None, (step, point, key, got[key])
                    continue
                tol = dict(rel=1e-5, abs=1e-5 * est.ag_mean**2) if fp32_loss else dict(rel=1e-6, abs=1e-12)
                assert got[key] == pytest.approx(want, **tol), (step, point, key)


def test_trainer_callback_gradient_accumulation(tmp_path, gen):
    data = Rows(gen, 18)
    plain, _ = train(tmp_path / "plain", data)

    made = {}

    def make(model):
        made["probe"] = fs.Probe(model, second_moment="dense")
        made["log"] = fs.MonitorLog(tmp_path / "monitor.jsonl")
        made["cb"] = FusedStatsCallback(made["probe"], loss_reduction="token_mean", log=made["log"])
        return made["cb"]

    recorded = []
    observed, trainer = train(
        tmp_path / "obs",
        data,
        callbacks=[make],
        trainer_class=type("T", (FusedStatsTrainerMixin, transformers.Trainer), {}),
        record=recorded,
    )
    # training bit-identical with and without the callback
    for (name, a), (_, b) in zip(plain.state_dict().items(), observed.state_dict().items()):
        assert torch.equal(a, b), name
    assert len(recorded) == 6 and made["cb"].micro_batches == 6
    # one MonitorLog line per optimizer step, equal to both references
    lines = fs.api.training.monitor_log.read_monitor_log(tmp_path / "monitor.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3]
    check(lines, reference_records(recorded, 2, 3, use_probe_step=False))
    check(lines, reference_records(recorded, 2, 3, use_probe_step=True), fp32_loss=True)
    # one set of Trainer log metrics per optimizer step, in log_history
    logged = [h for h in trainer.state.log_history if "fused_stats/model.layers.1/d_align" in h]
    assert [h["step"] for h in logged] == [1, 2, 3]
    for h, line in zip(logged, lines):
        assert h["fused_stats/model.layers.1/d_align"] == line["points"]["model.layers.1"]["d_align"]
        assert h["fused_stats/model.layers.0/n"] == line["points"]["model.layers.0"]["n"]


@pytest.mark.parametrize("output", ["dict", "tuple"])
def test_trainer_callback_partial_step_without_num_items_in_batch(tmp_path, gen, output):
    """9 rows in micro-batches of 3, 2 per optimizer step: steps of 2 and 1 micro-batches, whose
    losses the Trainer divides by 2 and by 1; the logged statistics are Probe.step's over the
    same micro-batches at the same parameters."""
    data = Rows(gen, 9)
    made = {}

    def make(model):
        made["probe"] = fs.Probe(model, second_moment="dense")
        made["cb"] = FusedStatsCallback(
            made["probe"], loss_reduction="token_mean", log=fs.MonitorLog(tmp_path / "monitor.jsonl")
        )
        return made["cb"]

    recorded = []
    train(
        tmp_path / "obs",
        data,
        callbacks=[make],
        max_steps=2,
        record=recorded,
        make_model=lambda: NoItemsLM(output),
    )
    assert len(recorded) == 3 and made["cb"].micro_batches == 3
    assert all(set(kwargs) == {"input_ids", "attention_mask", "labels"} for _, kwargs in recorded)
    lines = fs.api.training.monitor_log.read_monitor_log(tmp_path / "monitor.jsonl")
    assert [r["step"] for r in lines] == [1, 2]
    # reference: Probe.step (fp64 per-sample losses) of the plain LLaMA, micro-batch by micro-batch
    ref_model = tiny_llama()
    ref = fs.Probe(ref_model, second_moment="dense")
    refs = []
    for i, (state, kwargs) in enumerate(recorded):
        ref_model.load_state_dict({k.removeprefix("lm."): v for k, v in state.items()})
        ref.step({k: kwargs[k] for k in ("input_ids", "attention_mask", "labels")}, fs.causal_lm_loss)
        if i in (1, 2):  # the ends of the two optimizer steps
            refs.append({f"lm.{p}": ref.stats[p].estimate() for p in ref.points})
    assert set(made["probe"].points) == set(refs[0])
    check(lines, refs)


def test_trainer_callback_wrong_declaration_raises(tmp_path, gen):
    data = Rows(gen, 6)
    with pytest.raises(fs.FusedStatsError, match="token_mean"):
        train(
            tmp_path,
            data,
            max_steps=1,
            callbacks=[lambda m: FusedStatsCallback(fs.Probe(m), loss_reduction="mean")],
        )


def test_callback_arguments():
    probe = fs.Probe(tiny_llama())
    with pytest.raises(fs.FusedStatsError, match="loss_reduction"):
        FusedStatsCallback(probe, loss_reduction="tokens")
    with pytest.raises(fs.FusedStatsError, match="every"):
        FusedStatsCallback(probe, every=0)


def _ddp_worker(rank, world, out_dir):
    """One rank of a 2-process accelerate/DDP Trainer run (gloo, CPU): a run without the
    callback, then one with it; parameters, recorded micro-batches and callback records saved."""
    import os
    from pathlib import Path

    import torch.distributed as dist

    from gloo_harness import init_gloo

    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1",
        }
    )  # the group below exists already: no port is used
    torch.set_num_threads(1)
    init_gloo(rank, world, out_dir)
    try:
        data = Rows(torch.Generator().manual_seed(5), 24)
        plain, _ = train(Path(out_dir) / f"plain{rank}", data)
        made, recorded = {}, []

        def make(model):
            made["probe"] = fs.Probe(model, second_moment="dense")
            log = fs.MonitorLog(Path(out_dir) / "ddp.jsonl" if rank == 0 else None, all_reduce=True)
            made["cb"] = FusedStatsCallback(made["probe"], loss_reduction="token_mean", log=log)
            return made["cb"]

        observed, _ = train(Path(out_dir) / f"obs{rank}", data, callbacks=[make], record=recorded)
        same = all(
            torch.equal(a, b) for a, b in zip(plain.state_dict().values(), observed.state_dict().values())
        )
        torch.save(
            {
                "same": same,
                "recorded": recorded,
                "records": made["cb"].records,
                "local_n": made["probe"].stats["model.layers.0"].n,
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


def test_trainer_callback_ddp_two_ranks(tmp_path):
    import torch.multiprocessing as mp

    from fused_stats.api.training.monitor_log import read_monitor_log

    mp.spawn(_ddp_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert all(r["same"] for r in ranks)
    assert [len(r["recorded"]) for r in ranks] == [6, 6]
    # the micro-batches of each step, both ranks' in turn, at that step's parameters; the
    # model's loss with the global num_items_in_batch has weight 1 here, c = world on the ranks
    merged = []
    for step in range(3):
        for r in ranks:
            merged += r["recorded"][2 * step : 2 * step + 2]
    refs = reference_records(merged, 4, 3, use_probe_step=False)
    refs_step = reference_records(merged, 4, 3, use_probe_step=True)
    assert sum(r["local_n"] for r in ranks) == refs[-1]["model.layers.0"].n
    lines = read_monitor_log(tmp_path / "ddp.jsonl")
    check(lines, refs)
    check(lines, refs_step, fp32_loss=True)
    check(ranks[1]["records"], refs)
