"""The probe end to end on a LLaMA-shaped model (LLaMA-3-8B's widths, ``--stream-blocks`` blocks):
one probe step against one training step (``probe_overhead``: the ratio of medians of
interleaved rounds), and the weight-streamed probe step (``stream``): block host-to-device GB/s
against a pinned copy of the same bytes, and the streamed / in-memory step ratio (target <= 1.2).
"""

from __future__ import annotations

from .harness import wall


def llama_model(run, ctx, tokens, blocks):
    """``(model, batch, sizes)``: a LLaMA-shaped model (LLaMA-3-8B's widths, ``blocks`` blocks, bf16,
    on the host) and one batch of ``tokens`` random tokens on the device; a dry run: a tiny fp32 one."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    if run.args.dry_run:
        hidden, ff, heads, kv, blocks, seq, vocab, tokens = 64, 160, 4, 2, 3, 32, 128, 128
    else:
        hidden, ff, heads, kv, seq, vocab = 4096, 14336, 32, 8, 4096, 32000
    batch_size = max(tokens // seq, 1)
    dtype = torch.bfloat16 if ctx.cuda and not run.args.dry_run else torch.float32
    cfg = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ff,
        num_hidden_layers=blocks,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        max_position_embeddings=seq,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ids = torch.randint(0, vocab, (batch_size, seq), generator=torch.Generator().manual_seed(0))
    batch = {
        "input_ids": ids.to(ctx.device),
        "attention_mask": torch.ones_like(ids).to(ctx.device),
        "labels": ids.to(ctx.device),
    }
    sizes = {"tokens": batch_size * seq, "blocks": blocks, "hidden": hidden, "dtype": str(dtype)}
    return model, batch, sizes


def section_probe_overhead(run, ctx):
    """One probe step (``Probe.step``: forward, the activation-only backward, the accumulators) against
    one training step (forward and the full backward, weight gradients included) of the same
    LLaMA-shaped model on the device, a quarter of --tokens a batch; medians of interleaved rounds."""
    import statistics

    import fused_stats as fs

    model, batch, out = llama_model(run, ctx, max(1, ctx.tokens // 4), run.args.stream_blocks)
    model = model.to(ctx.device)
    probe = fs.Probe(model)

    def train_step():
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    def probe_step():
        probe.step(batch, fs.causal_lm_loss)

    rounds = 1 if run.args.dry_run else 5
    train_step(), probe_step()  # warm-up: kernels compiled, allocator primed
    times = {"train": [], "probe": []}
    for _ in range(rounds):
        times["train"].append(wall(train_step, 1, ctx.cuda))
        times["probe"].append(wall(probe_step, 1, ctx.cuda))
    train, step = statistics.median(times["train"]), statistics.median(times["probe"])
    model.zero_grad(set_to_none=True)
    out.update(train_step_s=train, probe_step_s=step, ratio=step / train, rounds=rounds)
    run.row(
        "probe overhead",
        "probe step / training step",
        step,
        "s",
        train,
        note=f"{out['tokens']} tokens, {out['blocks']} blocks, {out['dtype']}; train {train:.3f} s",
    )
    return out


def section_stream(run, ctx):
    """fs.stream_blocks on a LLaMA-shaped bf16 model with its weights in pinned host memory:
    achieved host-to-device GB/s of one block's materialisation against a measured pinned copy of
    the same bytes, and the streamed / in-memory probe step ratio at --tokens tokens a batch
    (target <= 1.2 with prefetch). Dry run: a tiny fp32 model on CPU, streamed from the module and
    from a sharded checkpoint folder (its statistics against the in-memory ones are a gpu test)."""
    import copy
    import tempfile

    import torch

    import fused_stats as fs

    dry, cuda = run.args.dry_run, ctx.cuda
    host_model, batch, out = llama_model(run, ctx, ctx.tokens, run.args.stream_blocks)
    batch_size, seq = batch["input_ids"].shape
    blocks = out["blocks"]
    reps = 1 if dry else 3

    device_model = copy.deepcopy(host_model).to(ctx.device)
    reference = fs.Probe(device_model)
    t_memory = wall(lambda: reference.step(batch, fs.causal_lm_loss), reps, cuda)
    del device_model
    if cuda:
        torch.cuda.empty_cache()
        for p in host_model.parameters():  # the weights sit in pinned host memory
            p.data = p.data.pin_memory()
    sources = {"host": host_model}
    tmp = None
    if dry:  # also a sharded folder (reading, the prefetch thread)
        tmp = tempfile.TemporaryDirectory()
        host_model.save_pretrained(tmp.name, max_shard_size="100KB")
        sources["folder"] = tmp.name
    try:
        for name, source in sources.items():
            with fs.stream_blocks(source, device=ctx.device, prefetch=1) as st:
                probe = fs.Probe(st.model)
                t_stream = wall(lambda probe=probe: probe.step(batch, fs.causal_lm_loss), reps, cuda)
                out[f"{name}_step_s"] = t_stream
                out[f"{name}_peak_over_block"] = st.peak_resident_bytes / st.block_bytes
                run.row(
                    "stream",
                    f"streamed/in-memory step ({name})",
                    t_stream,
                    "s",
                    t_memory,
                    note=f"target <= 1.2; {batch_size * seq} tokens, {blocks} blocks",
                )
                if cuda:
                    nbytes = st.block_bytes
                    t_block = wall(lambda: st._materialise(1), reps, cuda)
                    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    t_copy = wall(lambda pinned=pinned: pinned.to(ctx.device, non_blocking=True), reps, cuda)
                    out[f"{name}_h2d_GBps"] = nbytes / t_block / 1e9
                    out["pinned_copy_GBps"] = nbytes / t_copy / 1e9
                    run.row(
                        "stream",
                        f"block H2D GB/s ({name})",
                        nbytes / t_block / 1e9,
                        "GB/s",
                        nbytes / t_copy / 1e9,
                        note="vs a pinned copy of one block's bytes",
                    )
    finally:
        if tmp is not None:
            tmp.cleanup()
    out["in_memory_step_s"] = t_memory
    out["_status"] = "ok"
    return out
