"""Peak memory of one probe step, measured from outside the library: the peak RSS (``VmHWM``
after resetting it through ``/proc/self/clear_refs``) of a fresh process per case.

* Streamed from a checkpoint folder (``fs.stream_blocks``), a 4- and a 16-block LLaMA (d = 256)
  at N = B·T tokens where ``L N d`` dominates: each added point may raise the peak by at most
  1.25 N·d values (fp32). On CPU the streamer's saved block input (one N·d per block) is host
  memory and counts; the in-backward fold adds only each point's (B, d) rows.
* In memory: the probe step's peak over a plain forward + backward to the same leaf (the first
  point's output, parameters frozen) is below one N·d plus the reduced rows.

``MALLOC_MMAP_THRESHOLD_`` is fixed for the measured processes: glibc otherwise raises its mmap
threshold after the first large free, so later transient buffers come from the heap, stay mapped
after they are freed, and the peak then reflects the allocator's history, not the live tensors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fused_stats as fs

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

D, B, T = 256, 8, 384
ND_BYTES = B * T * D * 4

SCRIPT = textwrap.dedent("""
    import json, sys, torch, fused_stats as fs
    import transformers; transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    folder, mode, B, T = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    def rss(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    def peak_growth(run):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) reset to the current RSS
        start = rss("VmRSS:")
        run()
        return rss("VmHWM:") - start
    gen = torch.Generator().manual_seed(0)
    def batch():
        ids = torch.randint(0, 64, (B, T), generator=gen)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    cfg = transformers.AutoConfig.from_pretrained(folder)
    small = transformers.AutoModelForCausalLM.from_config(type(cfg)(**{**cfg.to_dict(), "num_hidden_layers": 2}))
    with fs.stream_blocks(small) as st:  # imports and first-use allocations are not the step's
        fs.Probe(st.model).step(batch(), fs.causal_lm_loss)
    b = batch()
    if mode == "stream":
        def run():
            with fs.stream_blocks(folder) as st:
                fs.Probe(st.model).step(b, fs.causal_lm_loss)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
        first = fs.residual_points(model)[0]
        def plain():  # the same activation-only backward, written with plain autograd
            for p in model.parameters():
                p.requires_grad_(False)
            leaf = {}
            def hook(m, a, out):
                t = out[0] if isinstance(out, tuple) else out
                leaf["z"] = t.detach().requires_grad_()
                return (leaf["z"], *out[1:]) if isinstance(out, tuple) else leaf["z"]
            h = model.get_submodule(first).register_forward_hook(hook)
            try:
                torch.autograd.grad(fs.causal_lm_loss(model, b).sum(), [leaf["z"]])
            finally:
                h.remove()
        def probe():
            fs.Probe(model).step(b, fs.causal_lm_loss)
        run = plain if mode == "plain" else probe
        run()  # the first full-size step of this process: buffers any later step reuses
    print(json.dumps({"growth": peak_growth(run)}))
""")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for layers in (4, 16):
        cfg = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=D,
            intermediate_size=688,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=T,
        )
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(f"llama{layers}")
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path, max_shard_size="8MB")
        out[layers] = path
    return out


def peak(folder, mode) -> int:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the peak RSS")
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_="65536",
        PYTHONPATH=os.pathsep.join([str(Path(fs.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder), mode, str(B), str(T)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["growth"]


def test_streamed_step_peak_per_added_point(folders):
    small, large = peak(folders[4], "stream"), peak(folders[16], "stream")
    per_point = (large - small) / 12 / ND_BYTES
    print(
        f"streamed: peak growth {small / 2**20:.1f} MiB (4 blocks), {large / 2**20:.1f} MiB (16 blocks): "
        f"{per_point:.2f} N·d per added point"
    )
    assert per_point <= 1.25, (small, large, per_point)


def test_in_memory_step_peak_over_a_plain_backward(folders):
    plain, probe = peak(folders[16], "plain"), peak(folders[16], "probe")
    rows = 16 * B * D * 8  # each point's (B, d) fp64 rows until the commit
    print(
        f"in memory: plain {plain / 2**20:.1f} MiB, probe {probe / 2**20:.1f} MiB, N·d {ND_BYTES / 2**20:.1f} MiB"
    )
    assert probe - plain < ND_BYTES + rows, (plain, probe)


def test_stream_plan_counts_what_a_step_holds(monkeypatch):
    """``plan_streaming``'s per-step terms, from the shapes: the gradient in and out of the
    recomputed block (2 N d), every point's (B, d) fp64 rows (and N r fp64 features with a cross
    rank); and the rows a real step hands to the commit are that many bytes."""
    from fused_stats.api.streaming.plan import plan_streaming

    N, d, L, Bs, b = 65536, 8192, 80, 8, 2
    plan = plan_streaming("llama-70b", tokens=N, samples=Bs, prefetch=1)
    assert plan.gradient_bytes == 2 * N * d * b
    assert plan.reduced_bytes == L * Bs * d * 8
    with_cross = plan_streaming("llama-70b", tokens=N, samples=Bs, cross_rank=64)
    assert with_cross.reduced_bytes - plan.reduced_bytes == L * N * 64 * 8
    parts = ("resident_bytes", "streamed_blocks_bytes", "block_activation_bytes", "gradient_bytes")
    assert (
        plan.device_bytes
        == sum(getattr(plan, k) for k in parts) + plan.reduced_bytes + plan.accumulator_bytes
    )
    # the README's worked example: 107.67 GiB on one H200 at 64K tokens
    assert round(plan.device_bytes / 2**30, 2) == 107.67

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=2
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    held = []
    original = fs.GradStats.commit_many.__func__
    monkeypatch.setattr(
        fs.GradStats,
        "commit_many",
        classmethod(
            lambda cls, accs, prepared: (
                held.append(sum(p.batch.rows.nbytes for p in prepared)) or original(cls, accs, prepared)
            )
        ),
    )
    ids = torch.randint(0, 64, (5, 7))
    with fs.stream_blocks(model) as st:
        fs.Probe(st.model).step({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, fs.causal_lm_loss)
    assert held == [3 * 5 * 16 * 8]
