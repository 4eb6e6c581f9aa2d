"""fs.GrowthSchedule under DDP: a 2-process gloo run (tiny LLaMA, fp64, CPU). Each rank trains on
its own rows through DistributedDataParallel and probes its own held-out batches; at the
scheduled step the probe is all-reduced and rank 0's decision broadcast, every rank grows
``ddp.module`` and wraps it in a new DDP. References: the two ranks' final parameters and
optimizer states (bit-equal to each other), and one process's fs.Probe + fs.advise over both
ranks' probe batches at the parameters of the scheduled step (the point chosen, |C|_F²)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

import fused_stats as fs  # noqa: E402

from gloo_harness import init_gloo, run_two_ranks  # noqa: E402

VOCAB, T = 29, 8
CANDIDATES = ("model.layers.0", "model.layers.1")


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
    return transformers.LlamaForCausalLM(cfg).to(torch.float64)


def counting(seed, n):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (n, 1), generator=gen) + torch.arange(T)) % VOCAB


def probe_batches(rank):
    return [{"input_ids": counting(100 + rank, 6)}]


def _worker(rank, world, outdir):
    init_gloo(rank, world, outdir)
    from torch.nn.parallel import DistributedDataParallel as DDP

    transformers.logging.set_verbosity_error()
    model = tiny_llama()
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    protocol = fs.GrowthProtocol(CANDIDATES, family="layer", seed=2)
    schedule = fs.GrowthSchedule(protocol, at_steps=[2], probe_batches=probe_batches(rank))
    out = {}
    for step in range(1, 5):
        ids = counting(10 * step + rank, 4)
        ddp(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:
            torch.save(model.state_dict(), Path(outdir) / f"at_step2_rank{rank}.pt")
        event = schedule.maybe_grow(model, step, optimizer)
        if event is not None and event["event"] == "grew":
            ddp = DDP(model)  # the wrapper's buckets hold the old parameter list: rebuild it
    torch.save(
        {"params": dict(model.named_parameters()), "optimizer": optimizer.state_dict()},
        Path(outdir) / f"final_rank{rank}.pt",
    )
    out["events"] = schedule.events
    out["history"] = fs.growth_history(model)
    (Path(outdir) / f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_every_rank_takes_the_same_decision_and_grows_identically(tmp_path):
    ranks = run_two_ranks(_worker, tmp_path)
    assert ranks[0] == ranks[1]
    events = ranks[0]["events"]
    assert [(e["step"], e["event"]) for e in events] == [(2, "grew")]
    finals = [torch.load(tmp_path / f"final_rank{r}.pt") for r in range(2)]
    assert list(finals[0]["params"]) == list(finals[1]["params"])
    for name, value in finals[0]["params"].items():
        assert torch.equal(value, finals[1]["params"][name]), name
    assert len(finals[0]["params"]) > len(dict(tiny_llama().named_parameters()))
    for i, state in finals[0]["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, finals[1]["optimizer"]["state"][i][key]), (i, key)
    # one process over both ranks' probe batches at the step-2 parameters
    model = tiny_llama()
    model.load_state_dict(torch.load(tmp_path / "at_step2_rank0.pt"))
    protocol = fs.GrowthProtocol(CANDIDATES, family="layer", seed=2)
    probe = fs.Probe(model, points=list(CANDIDATES), cross=protocol)
    for rank in range(2):
        for batch in probe_batches(rank):
            probe.step(batch, fs.causal_lm_loss)
    advice = fs.advise(probe, protocol)
    assert events[0]["point"] == advice.top.point
    assert events[0]["cross_frob2"] == pytest.approx(advice.top.cross_frob2, rel=1e-10)
    assert ranks[0]["history"][0]["step"] == 2 and ranks[0]["history"][0]["point"] == advice.top.point
