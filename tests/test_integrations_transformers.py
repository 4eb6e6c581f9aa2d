"""FusedStatsCallback under transformers.Trainer: a tiny LLaMA (from a config, fp64, CPU) trained
with gradient_accumulation_steps=2. References: a hand-written observe loop and Probe.step
(one activation backward of the per-sample losses) over the same micro-batches at the same
parameters, recorded from the run; a run without the callback for bit-identity."""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import fused_stats as fs  # noqa: E402
from fused_stats.integrations.transformers import (FusedStatsCallback,  # noqa: E402
                                                   FusedStatsTrainerMixin)
from tiny_models import padded_lm_batch  # noqa: E402

VOCAB, T = 29, 8
KEYS = ("n", "d_align", "d_par", "d_2", "mu_norm2", "ag_max")


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    return LlamaForCausalLM(cfg).to(torch.float64)


class Rows(torch.utils.data.Dataset):
    def __init__(self, gen, n):
        lengths = torch.randint(3, T + 1, (n,), generator=gen).tolist()
        batch = padded_lm_batch(gen, lengths, T, VOCAB)
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def train(tmp_path, data, callbacks=(), trainer_class=None, max_steps=3, record=None):
    from transformers import Trainer, TrainingArguments

    model = tiny_llama()
    if record is not None:
        def see(module, args, kwargs):
            record.append(({k: v.detach().clone() for k, v in module.state_dict().items()},
                           {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in kwargs.items()}))
        model.register_forward_pre_hook(see, with_kwargs=True)
    callbacks = [cb(model) if callable(cb) and not isinstance(cb, transformers.TrainerCallback)
                 else cb for cb in callbacks]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3,
                             gradient_accumulation_steps=2, max_steps=max_steps, learning_rate=3e-3,
                             logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
                             disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = (trainer_class or Trainer)(model=model, args=args, train_dataset=data,
                                         callbacks=callbacks)
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


def check(records, refs):
    assert len(records) == len(refs)
    for step, (record, ref) in enumerate(zip(records, refs), 1):
        assert record["step"] == step
        for point, est in ref.items():
            got = record["points"][point]
            for key in KEYS:
                want = getattr(est, key)
                assert got[key] == pytest.approx(want, rel=1e-6, abs=1e-12), (step, point, key)


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
    observed, trainer = train(tmp_path / "obs", data, callbacks=[make],
                              trainer_class=type("T", (FusedStatsTrainerMixin, transformers.Trainer), {}),
                              record=recorded)
    # training bit-identical with and without the callback
    for (name, a), (_, b) in zip(plain.state_dict().items(), observed.state_dict().items()):
        assert torch.equal(a, b), name
    assert len(recorded) == 6 and made["cb"].micro_batches == 6
    # one MonitorLog line per optimizer step, equal to both references
    lines = fs.api.monitor_log.read_monitor_log(tmp_path / "monitor.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3]
    check(lines, reference_records(recorded, 2, 3, use_probe_step=False))
    check(lines, reference_records(recorded, 2, 3, use_probe_step=True))
    # one set of Trainer log metrics per optimizer step, in log_history
    logged = [h for h in trainer.state.log_history if "fused_stats/model.layers.1/d_align" in h]
    assert [h["step"] for h in logged] == [1, 2, 3]
    for h, line in zip(logged, lines):
        assert h["fused_stats/model.layers.1/d_align"] == line["points"]["model.layers.1"]["d_align"]
        assert h["fused_stats/model.layers.0/n"] == line["points"]["model.layers.0"]["n"]


def test_trainer_callback_wrong_declaration_raises(tmp_path, gen):
    data = Rows(gen, 6)
    with pytest.raises(fs.FusedStatsError, match="token_mean"):
        train(tmp_path, data, max_steps=1,
              callbacks=[lambda m: FusedStatsCallback(fs.Probe(m), loss_reduction="mean")])


def test_callback_arguments():
    probe = fs.Probe(tiny_llama())
    with pytest.raises(fs.FusedStatsError, match="loss_reduction"):
        FusedStatsCallback(probe, loss_reduction="tokens")
    with pytest.raises(fs.FusedStatsError, match="every"):
        FusedStatsCallback(probe, every=0)
