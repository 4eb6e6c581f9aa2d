"""Watch the residual-stream statistics of a small LLaMA-style model while it trains.

What it does: builds a byte-level LLaMA from a ``transformers`` config, trains it with AdamW on
the Python standard library's own source (no download), and wraps every training step in
``probe.observe(loss_reduction="token_mean")``: the activation gradients at each block's output
are taken from the training step's own backward (HF's loss is a mean over all valid tokens of
the batch, so each sequence's gradient is rescaled by ``N_tok / n_b`` to the gradient of that
sequence's mean loss). Every ``--every`` steps a line with d_align, AG_max, ... per block is
appended to ``OUT/monitor.jsonl``; at the end the trajectories are plotted to ``OUT/monitor.png``
(the same plot as ``fused-stats report OUT/monitor.jsonl``). With ``--cross-rank R`` (default 16)
the probe also tracks the depth paper's cross-gradient ``|C|_F`` of a zero-output GELU block of
rank R at each point (``fs.CrossSpec``), logged and plotted next to d_align and AG_max.

Sequences are cut file by file, so the last window of each file is shorter and right-padded
(labels -100 on the padding): the per-sequence token counts differ, which is exactly the case
where a batch-mean declaration would be wrong.

    python examples/monitor_llama_training.py                  # 40 s on 2 busy CPU cores
    python examples/monitor_llama_training.py --cumulative     # estimates since step 0
    python examples/monitor_llama_training.py --checkpointing  # HF gradient checkpointing on
"""

from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch

import fused_stats as fs
from fused_stats.api.training.monitor_log import plot_monitor_log, read_monitor_log, summary_markdown


def stdlib_windows(seq: int, count: int, seed: int = 0, min_len: int = 16) -> list[bytes]:
    """``count`` windows of at most ``seq`` bytes, cut file by file from the stdlib's top-level
    modules (a file's last window is shorter), in a seeded random order."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    windows: list[bytes] = []
    for path in files:
        data = path.read_bytes()
        windows += [data[i : i + seq] for i in range(0, len(data), seq) if len(data) - i >= min_len]
        if len(windows) >= 4 * count:
            break
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [windows[i] for i in order[:count]]


def collate(windows: list[bytes], seq: int) -> dict:
    """Right-padded byte batch with HF labels (-100 on padding)."""
    B = len(windows)
    ids = torch.zeros(B, seq, dtype=torch.long)
    mask = torch.zeros(B, seq, dtype=torch.long)
    for b, w in enumerate(windows):
        ids[b, : len(w)] = torch.tensor(list(w))
        mask[b, : len(w)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def build(hidden: int, layers: int, seq: int, seed: int):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 32, 1),
        num_key_value_heads=max(hidden // 32, 1),
        max_position_embeddings=seq,
    )
    return transformers.LlamaForCausalLM(cfg).train()


def run(
    steps: int = 100,
    hidden: int = 64,
    layers: int = 4,
    seq: int = 128,
    batch: int = 16,
    every: int = 10,
    lr: float = 3e-3,
    window: bool = True,
    checkpointing: bool = False,
    cross_rank: int = 16,
    out="monitor_llama",
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Train and monitor; returns ``{"log", "plot", "losses", "probe"}``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = build(hidden, layers, seq, seed)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    cross = fs.CrossSpec(rank=cross_rank, activation="gelu", seed=seed) if cross_rank else None
    probe = fs.Probe(model, points="residual", unit="sample", second_moment="dense", cross=cross)
    log_path = out / "monitor.jsonl"
    log_path.unlink(missing_ok=True)
    log = fs.MonitorLog(
        log_path,
        every=every,
        window=window,
        meta={"model": "llama", "hidden": hidden, "layers": layers, "lr": lr},
    )
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    windows = stdlib_windows(seq, steps * batch, seed)
    losses = []
    start = time.perf_counter()
    for step in range(1, steps + 1):
        data = collate(windows[(step - 1) * batch : step * batch], seq)
        opt.zero_grad(set_to_none=True)
        with probe.observe(loss_reduction="token_mean", log=log, step=step):
            loss = model(**data).loss
            loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress and step % every == 0:
            d = [p["d_align"] for p in log.last["points"].values()]
            shown = " ".join("-" if v is None else f"{v:.3g}" for v in d)
            print(
                f"step {step:4d}  loss {loss.item():.3f}  d_align per block: {shown}  "
                f"({time.perf_counter() - start:.1f} s)"
            )
    plot = plot_monitor_log(log_path, out / "monitor.png")
    if progress:
        print(summary_markdown(read_monitor_log(log_path)))
        print(f"wrote {log_path} and {plot}")
    return {"log": log_path, "plot": plot, "losses": losses, "probe": probe}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--cumulative",
        action="store_true",
        help="log estimates since the start instead of per window of --every steps",
    )
    parser.add_argument("--checkpointing", action="store_true", help="HF gradient checkpointing")
    parser.add_argument(
        "--cross-rank",
        type=int,
        default=16,
        help="rank of the zero-output block whose cross-gradient |C| is tracked (0: off)",
    )
    parser.add_argument("--out", default="monitor_llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default); on a busy 2-core machine more "
        "threads stall each other (2.8 s instead of 0.35 s per step here)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run(
        steps=args.steps,
        hidden=args.hidden,
        layers=args.layers,
        seq=args.seq,
        batch=args.batch,
        every=args.every,
        lr=args.lr,
        window=not args.cumulative,
        checkpointing=args.checkpointing,
        cross_rank=args.cross_rank,
        out=args.out,
        seed=args.seed,
    )


if __name__ == "__main__":
    main()
