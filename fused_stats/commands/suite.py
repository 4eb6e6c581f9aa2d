"""``fused-stats suite SUITE.toml --out DIR``: probe every checkpoint of a suite file on the same
windows, resumably, one shard per process (``--shard i/n``, torchrun, a SLURM array), and compare
them in ``DIR/suite.md``, ``DIR/suite.json`` and plots.

Everything the suite file names is checked first (keys, globs, data length, tokenizers, each
model's vocabulary and positions against the windows), before any model is loaded; an explicit
``[probe] points`` list on the first model this process probes, before ``--out`` is written. Models are
loaded as ``fused-stats probe`` loads them (:func:`fused_stats.commands.probe.load_model`,
:func:`~fused_stats.commands.probe.load_streamed` for ``stream_blocks``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..errors import FusedStatsError


def register(sub) -> None:
    p = sub.add_parser(
        "suite",
        help="probe a family of checkpoints on the same data (resumable, sharded) and compare them",
        description=__doc__.split("\n\n")[0].replace("``", "'"),
    )
    p.add_argument("suite_file", metavar="SUITE.toml", help="the suite file (TOML)")
    p.add_argument(
        "--out", required=True, help="suite folder: plan.json, runs/<name>.json, suite.json, suite.md, plots"
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda; under torchrun, cuda means cuda:LOCAL_RANK",
    )
    p.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="take runs I, I+N, I+2N, ... of the suite (default: from torchrun's RANK/WORLD_SIZE "
        "and a SLURM array's SLURM_ARRAY_TASK_*, else every run)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="probe every run again (also in a --out started with a different suite file or other data)",
    )
    p.add_argument("--no-plots", action="store_true", help="no PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (and no HF loading bar)")
    p.set_defaults(func=cmd_suite)


def _device(text: str, shard):
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, TypeError) as exc:
        raise FusedStatsError(f"--device {text!r} is not a torch device ({exc})") from None
    if device.type not in ("cpu", "cuda"):
        raise FusedStatsError(f"--device {text!r}: only cpu and cuda devices are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise FusedStatsError(f"--device {text!r}: CUDA is not available on this machine")
        if device.index is None and shard.local_rank is not None:
            device = torch.device("cuda", shard.local_rank)  # one rank per device on the node
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise FusedStatsError(
                f"device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def prepare(spec):
    """``(windows by tokenizer identity, tokenizer identity by run)``; refuses differing
    tokenizers unless the file says ``tokenizer = "per-model"``."""
    from ..api.suite.data import BYTES, build_windows, load_tokenizer, tokenizer_identity

    identity = {run.name: tokenizer_identity(run.model) for run in spec.runs}
    distinct = sorted(set(identity.values()))
    if len(distinct) > 1 and spec.data["tokenizer"] != "per-model":
        groups = {key: [n for n, k in identity.items() if k == key] for key in distinct}
        listing = "; ".join(
            f"{'no tokenizer (bytes)' if k == BYTES else 'tokenizer ' + k[:12]}: {', '.join(v)}"
            for k, v in groups.items()
        )
        raise FusedStatsError(
            f"suite file {str(spec.path)!r}: the runs' tokenizers differ ({listing}); the runs would not see the "
            'same sequences. Set tokenizer = "per-model" in [data] to tokenise once per tokenizer anyway'
        )
    token_ids = all(spec.data[s].suffix == ".npy" and spec.data[s].is_file() for s in ("train", "test"))
    windows = {}
    for key in distinct:
        tokenizer = None
        if key != BYTES and not token_ids:
            folder = next(r.model for r in spec.runs if identity[r.name] == key)
            tokenizer = load_tokenizer(folder)
        windows[key] = build_windows(spec.data, key, tokenizer)
    return windows, identity


def check_runs(spec, windows, identity) -> None:
    """Each run's config against its windows and the (M, K) budgets, before any model is loaded."""
    for run in spec.runs:
        w = windows[identity[run.name]]
        config = json.loads((run.model / "config.json").read_text())
        config = config.get("text_config", config) if "vocab_size" not in config else config
        vocab = config.get("vocab_size")
        top = int(max(w.train.max(), w.test.max()))
        low = int(min(w.train.min(), w.test.min()))
        if isinstance(vocab, int) and (top >= vocab or low < 0):
            raise FusedStatsError(
                f"run {run.name} ({str(run.model)!r}): token ids span [{low}, {top}] but its vocab_size is {vocab}"
            )
        limit = config.get("max_position_embeddings") or config.get("n_positions")
        if isinstance(limit, int) and spec.data["seq_len"] > limit:
            raise FusedStatsError(
                f"run {run.name} ({str(run.model)!r}): seq_len {spec.data['seq_len']} exceeds its {limit} positions"
            )
    if spec.probe["unit"] == "sample":
        n = spec.data["sequences"]
        for M, K in spec.splits:
            if 2 * n < M + K:
                raise FusedStatsError(
                    f"suite file {str(spec.path)!r}: [probe] splits [{M}, {K}]: the misalignment draws M + K = "
                    f"{M + K} disjoint samples from the pooled {n} train + {n} test sequences; lower M, K or "
                    "raise [data] sequences"
                )


def unreadable_shard(folder: Path) -> Path | None:
    """The first safetensors file of ``folder`` whose header does not cover the file (a torn
    copy or download), or None."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt") as handle:
                handle.keys()
        except Exception:  # safetensors raises its own error type for a bad header
            return file
    return None


def loader(seed: int = 0):
    def load(path: Path, dtype: str, device, stream: bool):
        from .probe import load_model, load_streamed

        try:
            if stream:
                return load_streamed(str(path), device, dtype)[0]
            return load_model(str(path), seed, dtype)[0].to(device)
        except Exception as exc:
            bad = unreadable_shard(path)
            if bad is None:
                raise
            raise FusedStatsError(
                f"checkpoint {str(path)!r}: shard {bad.name} is unreadable ({' '.join(str(exc).split())})"
            ) from None

    return load


def cmd_suite(args) -> int:
    from ..api.suite.runner import (
        check_points,
        collect,
        execute,
        finished,
        my_runs,
        open_dir,
        plan_document,
        plan_keys,
        reuse_loaded,
        shard_from_env,
        write_suite,
    )
    from ..api.suite.spec import read_suite
    from ..progress import quiet_hf_progress, stderr_is_terminal

    spec = read_suite(args.suite_file)
    shard = shard_from_env(args.shard)
    device = _device(args.device, shard)
    windows, identity = prepare(spec)
    check_runs(spec, windows, identity)
    out = Path(args.out)
    plan = plan_document(spec, windows, identity)
    for note in [n for w in windows.values() for n in w.notes] + plan["warnings"]:
        print(f"fused-stats: {'warning' if note in plan['warnings'] else 'note'}: {note}", file=sys.stderr)
    keys = plan_keys(plan)
    progress = not args.no_progress
    if not (progress and stderr_is_terminal()):
        quiet_hf_progress()
    mine = my_runs(spec.runs, shard)
    load = loader(spec.probe["seed"])
    todo = [
        r for r in mine if args.force or (finished(out, r.name, keys[r.name]) or {}).get("status") != "done"
    ]
    if todo:  # a misspelt point name is found on one model, before the folder is touched
        first = check_points(spec, todo[0], device, load)
        if first is not None:
            load = reuse_loaded(load, todo[0].model, first)
    open_dir(out, plan, args.force)
    print(
        f"suite {spec.path.name}: {len(spec.runs)} runs; shard {shard.index}/{shard.count} ({shard.how}) takes "
        f"{len(mine)} on {device}"
    )
    done, skipped, failed = execute(
        spec, out, windows, identity, shard, device, load, progress, keys, force=args.force
    )
    print(
        f"this shard: {len(done)} probed, {len(skipped)} finished earlier (skipped), {len(failed)} failed"
        + (f": {', '.join(failed)}" if failed else "")
    )
    suite, pending = collect(out)
    if suite is None:
        print(
            f"{len(pending)} run(s) not finished yet (other shards): {', '.join(pending)}; the last process "
            f"to finish writes {out / 'suite.json'} (or run: fused-stats report --suite {out})"
        )
        return 1 if failed else 0
    written = write_suite(out, suite, plots=not args.no_plots)
    print("wrote " + ", ".join(str(p) for p in written))
    if suite["failed"]:
        print(f"FAILED runs ({len(suite['failed'])} of {len(suite['runs'])}):")
        for name in suite["failed"]:
            print(f"  {name}: {suite['runs'][name]['error']}")
        return 1
    return 1 if failed else 0
