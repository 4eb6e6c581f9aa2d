"""Wall time of ``fused-stats suite`` against the two ways a researcher would otherwise run it.

Six LLaMA-style checkpoints (hidden 64/128/192 × 2/4 blocks, sharded safetensors, one locally
trained BPE tokenizer) are probed on the same text, each the same work: ``sequences`` train and
``sequences`` test windows of ``seq_len`` tokens, the cross-gradient at rank 16, the certificate and
misalignment at one (M, K). Three ways, each a fresh Python process timed from start to exit:

* ``suite``: one ``fused-stats suite --no-plots`` process (text tokenised once, libraries imported
  once; the same outputs as the other two: a JSON report per run, plus suite.json and suite.md);
* ``suite_plots``: the same with its five comparison plots (matplotlib import and rendering);
* ``probes``: one ``fused-stats probe --text`` process per checkpoint, summed (the loop by hand);
* ``loop``: one Python process that tokenises once and calls ``fs.Probe`` per checkpoint.

Targets: suite / probes ≤ 0.8, suite / loop ≤ 1.05. The best of ``--rounds`` rounds is kept
(the machine is shared; rounds alternate the three ways). Results: bench/results/suite_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WIDTHS, DEPTHS = (64, 128, 192), (2, 4)

LOOP = r"""
import json, sys, time
from pathlib import Path
import numpy as np, torch, transformers
import fused_stats as fs
root, seq_len, sequences, batch, M, K, trials = sys.argv[1], *map(int, sys.argv[2:8])
root = Path(root)
torch.set_num_threads(1)
folders = sorted((root / "ckpts").iterdir())
tok = transformers.AutoTokenizer.from_pretrained(folders[0])
rows = {}
for stream in ("train", "test"):
    ids = tok((root / f"{stream}.txt").read_text(), add_special_tokens=False)["input_ids"]
    rows[stream] = torch.tensor(ids[: seq_len * sequences]).view(sequences, seq_len)
for folder in folders:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    probe = fs.Probe(model, points="residual", unit="sample", second_moment="pool", cross=fs.CrossSpec(rank=16))
    for stream, r in rows.items():
        for i in range(0, sequences, batch):
            b = r[i : i + batch]
            probe.step({"input_ids": b, "labels": b}, fs.causal_lm_loss, stream=stream, mask="attention")
    data = probe.report(misalignment_trials=0).data
    for point in probe.points:
        probe.certificate(point, M=M, K=K), probe.misalignment(point, M, K, trials=trials)
    fs.Report(data).to_json(root / "loop" / f"{folder.name}.json")
"""


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    vocab = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
        for _ in range(400)
    ]
    return "\n".join(" ".join(rng.choice(vocab) for _ in range(12)) for _ in range(words // 12)) + "\n"


def build(root: Path, seq_len: int) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    transformers.logging.set_verbosity_error()
    train, test = text(0, 60_000), text(1, 60_000)
    (root / "train.txt").write_text(train)
    (root / "test.txt").write_text(test)
    (root / "all.txt").write_text(train + test)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([train], trainers.BpeTrainer(vocab_size=1024, special_tokens=["<unk>", "<eos>"]))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>"
    )
    for w in WIDTHS:
        for d in DEPTHS:
            cfg = transformers.LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=w,
                intermediate_size=2 * w,
                num_hidden_layers=d,
                num_attention_heads=max(w // 32, 1),
                num_key_value_heads=max(w // 32, 1),
                max_position_embeddings=seq_len,
            )
            torch.manual_seed(w + d)
            folder = root / "ckpts" / f"llama-w{w}-d{d}"
            transformers.LlamaForCausalLM(cfg).save_pretrained(folder, max_shard_size="200KB")
            tokenizer.save_pretrained(folder)


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed:\n{done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument("--out", default=str(RESULTS / "suite_cpu.json"))
    args = parser.parse_args()
    T, N, B, M = args.seq_len, args.sequences, args.batch_size, args.sequences
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    with tempfile.TemporaryDirectory(prefix="bench_suite_") as tmp:
        root = Path(tmp)
        build(root, T)
        (root / "suite.toml").write_text(
            f'[data]\ntrain = "train.txt"\ntest = "test.txt"\nseq_len = {T}\nsequences = {N}\nbatch_size = {B}\n'
            f'[probe]\nsecond_moment = "pool"\ncross = 16\nsplits = [[{M}, {M}]]\ntrials = {args.trials}\n'
            '[[runs]]\nglob = "ckpts/llama-*"\n'
        )
        folders = sorted((root / "ckpts").iterdir())
        # the probe command splits one text 90/10: enough text that both streams hold N windows
        probe_args = ["--batches", str(N // B), "--batch-size", str(B), "--seq-len", str(T), "--cross", "16"]
        probe_args += ["--second-moment", "pool", "--split", str(M), str(M), "--trials", str(args.trials)]
        times = {"suite": [], "suite_plots": [], "probes": [], "loop": []}
        cli = [sys.executable, "-m", "fused_stats.cli"]
        for r in range(args.rounds):
            suite = [*cli, "suite", str(root / "suite.toml"), "--no-progress"]
            times["suite"].append(timed([*suite, "--out", str(root / f"suite{r}"), "--no-plots"], env))
            times["suite_plots"].append(timed([*suite, "--out", str(root / f"suite-plots{r}")], env))
            times["probes"].append(
                sum(
                    timed(
                        [
                            *cli,
                            "probe",
                            "--model",
                            str(f),
                            "--text",
                            str(root / "all.txt"),
                            "--out",
                            str(root / f"p{r}" / f.name),
                            "--no-progress",
                            *probe_args,
                        ],
                        env,
                    )
                    for f in folders
                )
            )
            times["loop"].append(
                timed(
                    [
                        sys.executable,
                        "-c",
                        LOOP,
                        str(root),
                        str(T),
                        str(N),
                        str(B),
                        str(M),
                        str(M),
                        str(args.trials),
                    ],
                    env,
                )
            )
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in times.items()), flush=True)
        best = {k: min(v) for k, v in times.items()}
        result = {
            "checkpoints": len(folders),
            "seq_len": T,
            "sequences_per_stream": N,
            "batch_size": B,
            "trials": args.trials,
            "rounds": args.rounds,
            "seconds": times,
            "best_seconds": best,
            "suite_over_probes": best["suite"] / best["probes"],
            "suite_over_loop": best["suite"] / best["loop"],
            "suite_plots_over_loop": best["suite_plots"] / best["loop"],
        }
        print(
            json.dumps(
                {
                    k: result[k]
                    for k in ("best_seconds", "suite_over_probes", "suite_over_loop", "suite_plots_over_loop")
                },
                indent=1,
            )
        )
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
            print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
