"""``fused-stats merge``: merge accumulator states written by separate jobs (offline shard merge).

``fused-stats merge OUT.safetensors IN1.safetensors IN2.safetensors ...`` loads every
:meth:`GradStats.save` file, merges them exactly (shift to a common centre and add; DESIGN
section 2) and saves the result atomically: the merged state equals that of one accumulator fed
every shard's samples. With directories, ``fused-stats merge OUT_DIR IN_DIR1 IN_DIR2 ...`` merges
probe checkpoints (:func:`fused_stats.api.checkpoint.merge_checkpoints`) point by point and stream
by stream. Everything is read and checked before anything is written; an existing output that is
not one of the inputs is replaced only with ``--force``.
"""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    cmd = sub.add_parser(
        "merge", help="merge GradStats state files (or probe checkpoint directories) from separate jobs",
        description="Merge saved accumulator states exactly: OUT = IN1 + IN2 + ... (all files, or "
                    "all probe checkpoint directories).")
    cmd.add_argument("out", help="output .safetensors file (or checkpoint directory)")
    cmd.add_argument("inputs", nargs="+", help="input state files (or checkpoint directories)")
    cmd.add_argument("--force", action="store_true", help="replace an existing output")
    cmd.set_defaults(func=cmd_merge)


def merge_files(out, inputs):
    """Load, merge and save ``GradStats`` files; returns the merged accumulator."""
    from ..accumulators import GradStats
    from ..errors import FusedStatsError

    accs = [GradStats.load(path) for path in inputs]  # all read and checked before any merge
    merged = accs[0]
    for path, acc in zip(inputs[1:], accs[1:]):
        try:
            merged.merge(acc)
        except FusedStatsError as exc:
            raise FusedStatsError(f"merging {str(path)!r} into {str(inputs[0])!r}: {exc}") from exc
    merged.save(out)
    return merged


def cmd_merge(args) -> int:
    from ..errors import FusedStatsError

    out = Path(args.out)
    inputs = [Path(p) for p in args.inputs]
    missing = [str(p) for p in inputs if not p.exists()]
    if missing:
        raise FusedStatsError(f"merge: inputs not found: {missing}")
    kinds = {p.is_dir() for p in inputs}
    if len(kinds) > 1:
        raise FusedStatsError(
            "merge: mix of files and directories; give either GradStats state files or probe "
            f"checkpoint directories, got {[str(p) for p in inputs]}")
    same = any(out.resolve() == p.resolve() for p in inputs)
    if out.exists() and not same and not args.force:
        raise FusedStatsError(f"merge: {str(out)!r} exists; pass --force to replace it")
    if kinds == {True}:
        from ..api.checkpoint import merge_checkpoints, read_snapshot

        if out.exists() and not out.is_dir():
            raise FusedStatsError(f"merge: inputs are checkpoint directories but {str(out)!r} is a file")
        snap = merge_checkpoints(out, inputs)
        _, accs = read_snapshot(out)
        print(f"merged {len(inputs)} probe checkpoints into {snap}")
        print(f"{'stream':<8}{'point':<32}{'n':>10}  mode")
        for (stream, name), acc in sorted(accs.items()):
            print(f"{stream:<8}{name:<32}{acc.n:>10}  {acc.mode}")
        return 0
    if out.exists() and out.is_dir():
        raise FusedStatsError(f"merge: inputs are state files but {str(out)!r} is a directory")
    merged = merge_files(out, inputs)
    print(f"merged {len(inputs)} states into {out}: n={merged.n}, dim={merged.dim}, mode={merged.mode}")
    return 0
