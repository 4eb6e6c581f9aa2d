"""Memory: the plan against what is really allocated, and a flat footprint over a stream.

* The bytes :func:`plan_memory` predicts per accumulator (dense, pool with N samples, auto below and
  above its switch point) match, within 10 %, the bytes of the distinct storages behind the live
  accumulator's state tensors (counted from ``untyped_storage()``, so a small view keeping a large
  buffer alive would show) and ``state_nbytes()``; for a whole Probe on a tiny LLaMA built from a
  transformers config, the plan's total from the config matches the sum over all accumulators.
* A stream of 20 000 samples (100 batches) keeps the process RSS (``VmRSS`` from
  ``/proc/self/status``) flat after warm-up: the median RSS of the last 20 batches exceeds that of
  the 20 after warm-up by less than 1 MiB, where leaking one d x d matrix or one batch of rows per
  batch would add about 9 MiB. The 1e5-sample version is bench/bench_memory.py.
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

import fused_stats as fs
from fused_stats.accumulators import auto_pool_limit
from fused_stats.api.streaming.plan import model_shape, plan_memory
from fused_stats.cli import main


def allocated_bytes(acc) -> int:
    """Bytes of the distinct storages the state tensors keep alive."""
    seen = {}
    for field in acc.FIELDS:
        value = getattr(acc, field.name)
        if value is not None:
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def feed(acc, n: int, batch: int, gen) -> None:
    done = 0
    while done < n:
        b = min(batch, n - done)
        acc.update(torch.randn(b, acc.dim, generator=gen, dtype=torch.float64) + 2.0)
        done += b


@pytest.mark.parametrize(
    "second_moment,dim,n",
    [
        ("dense", 48, 30),
        ("dense", 7, 500),
        ("pool", 48, 30),
        ("pool", 8, 200),
        ("auto", 48, auto_pool_limit(48)),  # the largest pool auto keeps
        ("auto", 48, auto_pool_limit(48) + 1),  # one more: dense
    ],
)
def test_plan_matches_allocated_state(second_moment, dim, n, gen):
    acc = fs.GradStats(dim, second_moment=second_moment)
    feed(acc, n, 7, gen)
    plan = plan_memory(dim=dim, points=1, pool_size=n, streams=1)
    predicted = getattr(plan, second_moment)
    assert abs(allocated_bytes(acc) - predicted) <= 0.10 * predicted
    assert abs(acc.state_nbytes() - predicted) <= 0.10 * predicted
    if second_moment == "auto":
        assert plan.auto_mode == acc.mode


def test_auto_plan_never_exceeds_dense():
    for dim in (1, 2, 3, 17, 64, 4096):
        for n in (0, 1, dim // 2, auto_pool_limit(dim), auto_pool_limit(dim) + 1, 3 * dim):
            plan = plan_memory(dim=dim, points=1, pool_size=n)
            assert plan.auto <= plan.dense
            assert plan.auto == min(plan.pool, plan.dense) or n > plan.auto_switch


def test_plan_of_a_probe_on_a_tiny_llama(gen):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    probe = fs.Probe(model, second_moment="auto")

    def loss_fn(m, batch):
        logits = m(input_ids=batch).logits[:, :-1]
        return (
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none"
            )
            .reshape(batch.shape[0], -1)
            .mean(1)
        )

    probe.step(torch.randint(0, 50, (6, 5), generator=gen), loss_fn)
    probe.step(torch.randint(0, 50, (4, 5), generator=gen), loss_fn, stream="test")
    assert model_shape(config.to_dict()) == (16, 3)
    for _stream, accs, n in (("train", probe.stats, 6), ("test", probe.test_stats, 4)):
        plan = plan_memory(model=config.to_dict(), pool_size=n, streams=1)
        assert plan.points == len(accs) == 3
        live = sum(acc.state_nbytes() for acc in accs.values())
        storages = sum(allocated_bytes(acc) for acc in accs.values())
        assert abs(live - plan.total("auto")) <= 0.10 * plan.total("auto")
        assert abs(storages - plan.total("auto")) <= 0.10 * plan.total("auto")


def test_plan_command_llama_shapes(capsys, tmp_path):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    # fp64 state: centre, s, t (3d) + four scalars + S (d^2); 2 streams per point
    for label, d, points in (("llama-7b", 4096, 32), ("llama-70b", 8192, 80)):
        per_acc = (3 * d + 4 + d * d) * 8
        line = next(row for row in out.splitlines() if row.startswith(label))
        assert f"{per_acc / 2**20:.2f} MiB" in line
        assert f"{per_acc * points * 2 / 2**30:.2f} GiB" in line
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 2048, "num_hidden_layers": 16, "model_type": "gpt_neox"}))
    assert main(["plan", "--model", str(config), "--pool", "1000", "--streams", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["dim"], row["points"], row["auto_mode"]) == (2048, 16, "pool")
    assert row["pool"] == (3 * 2048 + 4 + 1000 * 2048 + 1000**2) * 8
    assert row["total_auto"] == row["pool"] * 16
    assert main(["plan", "--dim", "0", "--points", "3"]) == 2
    assert "--dim: must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["plan", "--model", str(tmp_path / "missing.json")]) == 2
    assert "cannot read a model config" in capsys.readouterr().err


@pytest.mark.parametrize("second_moment", ["dense", "auto"])
def test_rss_flat_over_a_stream(second_moment, gen):
    dim, batch, batches, warm = 128, 200, 100, 10
    acc = fs.GradStats(dim, second_moment=second_moment)
    x = torch.empty(batch, dim, dtype=torch.float32)
    samples = []
    for _ in range(batches):
        torch.randn(batch, dim, generator=gen, out=x)
        acc.update(x + 1.0)
        samples.append(rss_bytes())
    # the trend (median of the last 20 batches minus that of the 20 after warm-up), not single
    # samples, which move by the per-batch workspace when freed buffers go back to the OS late
    growth = statistics.median(samples[-20:]) - statistics.median(samples[warm : warm + 20])
    assert acc.n == batch * batches and acc.mode == "dense"
    # leaking one d x d fp64 matrix per batch would add 70 * 128 KiB = 8.75 MiB here
    assert growth < 2**20, f"RSS grew by {growth / 2**20:.2f} MiB after warm-up"
