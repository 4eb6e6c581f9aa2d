"""Grow a tiny LLaMA while the HF Trainer trains it, where the saturation test says growth helps.

1. a GrowthProtocol (two layer candidates, zero init) and a GrowthSchedule: decide after every
   2nd optimizer step on held-out batches, at most 2 growths;
2. Trainer.train() with GrowthScheduleCallback (gradient accumulation 2): at each decision the
   candidates are probed, advised (Holm-adjusted, alpha=0.05) and the model grows at the top
   significant candidate, the Trainer's AdamW and LambdaLR carrying on with the new layer;
3. the schedule's events, the model's growth record and the Trainer's log lines that carry them.

Run: ``PYTHONPATH=. python examples/grow_during_training.py [--steps N]`` (a few seconds on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

import fused_stats as fs
from fused_stats.integrations.transformers import FusedStatsTrainerMixin, GrowthScheduleCallback

transformers.logging.set_verbosity_error()
VOCAB, T = 29, 8


def counting(gen, n):
    """Sequences counting up from a random start (mod VOCAB): a task the random model has not learnt."""
    ids = (torch.randint(0, VOCAB, (n, 1), generator=gen) + torch.arange(T)) % VOCAB
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class Rows(torch.utils.data.Dataset):
    def __init__(self, batch):
        self.rows = [{k: v[i] for k, v in batch.items()} for i in range(len(batch["input_ids"]))]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Trainer(FusedStatsTrainerMixin, transformers.Trainer):
    """The mixin puts the growth events into Trainer.log before TensorBoard / W&B see it."""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    opts = parser.parse_args()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
        )
    )  # fmt: skip
    train = Rows(counting(torch.Generator().manual_seed(3), 48))
    held_out = torch.Generator().manual_seed(7)  # a separate generator: never the training rows
    probe_batches = [{"input_ids": counting(held_out, 8)["input_ids"]} for _ in range(2)]

    protocol = fs.GrowthProtocol(["model.layers.0", "model.layers.1"], family="layer", init="zero", seed=2)
    schedule = fs.GrowthSchedule(protocol, every=2, probe_batches=probe_batches, alpha=0.05, max_growths=2)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=3, gradient_accumulation_steps=2,
            max_steps=opts.steps, learning_rate=3e-3, logging_steps=1, report_to="none",
            use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        )  # fmt: skip
        trainer = Trainer(
            model=model, args=args, train_dataset=train, callbacks=[GrowthScheduleCallback(schedule)]
        )
        trainer.train()

    for event in schedule.events:
        print(f"step {event['step']}: {event['event']} {event['point'] or ''}")
        print(f"  {event['verdict']}")
    print("stopped:", schedule.stopped, "| layers now:", model.config.num_hidden_layers)
    for entry in fs.growth_history(model):
        if entry["event"] != "grew":
            print(f"growth record: step={entry['step']} {entry['event']}")
            continue
        print(
            f"growth record: step={entry['step']} point={entry['point']} position={entry['position']} "
            f"cross_frob2={entry['cross_frob2']:.3g} p_value={entry['p_value']:.3g} "
            f"new parameters={len(entry['new_parameters'])}"
        )
    for line in trainer.state.log_history:
        if "fused_stats/growth/grew" in line:
            print("log:", {k: v for k, v in line.items() if k.startswith("fused_stats/") or k == "step"})


if __name__ == "__main__":
    main()
