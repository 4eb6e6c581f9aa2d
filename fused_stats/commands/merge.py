"""``fused-stats merge``: merge accumulator states written by separate jobs (offline shard merge).

``fused-stats merge OUT.safetensors IN1.safetensors IN2.safetensors ...`` loads every saved state,
merges them exactly and saves the result atomically: the merged state equals that of one
accumulator fed every shard's samples. :meth:`GradStats.save` files merge by shifting to a common
centre and adding (docs/design.md, section 2); :meth:`CrossStats.save` files (the depth probe's
cross-gradient sums) merge by adding every sum, and only if they describe the same zero-output
block (dim, rank, activation, ``w_in``) with the same unit; norm histogram files by adding their
counts, only with the same bins. Any accumulator kind merges the same way (its own ``merge``); the
kind is read from each file's metadata and all inputs must be of one kind. With directories, ``fused-stats merge OUT_DIR IN_DIR1
IN_DIR2 ...`` merges probe checkpoints (:func:`fused_stats.api.state.checkpoint.merge_checkpoints`) point
by point and stream by stream, cross statistics included. Everything is read and checked before
anything is written; an existing output that is not one of the inputs is replaced only with
``--force``.
"""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    cmd = sub.add_parser(
        "merge",
        help="merge saved accumulator states (GradStats, CrossStats, norm histogram files "
        "or probe checkpoint directories) from separate jobs",
        description="Merge saved accumulator states exactly: OUT = IN1 + IN2 + ... (state files "
        "of one kind, or probe checkpoint directories).",
    )
    cmd.add_argument(
        "out", help="output .safetensors file (or checkpoint directory); the folder it goes in must exist"
    )
    cmd.add_argument("inputs", nargs="+", help="input state files (or checkpoint directories)")
    cmd.add_argument("--force", action="store_true", help="replace an existing output (default: refuse)")
    cmd.set_defaults(func=cmd_merge)


def _state_class(inputs):
    """The accumulator class of the files, read from their metadata's ``format`` (every
    registered accumulator kind can be merged; all inputs must be of one kind)."""
    from ..accumulators.base import REGISTRY
    from ..accumulators.persistence import peek_format
    from ..errors import FusedStatsError

    classes = {cls.FORMAT: cls for cls in REGISTRY.values()}
    formats = [peek_format(path) for path in inputs]
    unknown = [f"{str(p)!r} ({f!r})" for p, f in zip(inputs, formats) if f not in classes]
    if unknown:
        raise FusedStatsError(
            f"merge: not fused_stats state files: {unknown}; expected one of the formats {sorted(classes)}"
        )
    if len(set(formats)) > 1:
        raise FusedStatsError(
            "merge: inputs hold different kinds of state: "
            f"{[f'{str(p)!r}: {f}' for p, f in zip(inputs, formats)]}"
        )
    return classes[formats[0]]


def merge_files(out, inputs):
    """Load, merge and save state files of one accumulator kind; returns the merged accumulator."""
    from ..errors import FusedStatsError

    cls = _state_class(inputs)
    accs = [cls.load(path) for path in inputs]  # all read and checked before any merge
    merged = accs[0]
    for path, acc in zip(inputs[1:], accs[1:]):
        try:
            merged.merge(acc)
        except FusedStatsError as exc:
            raise FusedStatsError(f"merging {str(path)!r} into {str(inputs[0])!r}: {exc}") from exc
    merged.save(out)
    return merged


def _describe(acc) -> str:
    """``kind: key=value, ...`` from the accumulator's own ``describe()``."""
    facts = ", ".join(f"{key}={value}" for key, value in acc.describe().items())
    return f"{acc.KIND}: {facts}" if facts else acc.KIND


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
            "merge: mix of files and directories; give either state files or probe "
            f"checkpoint directories, got {[str(p) for p in inputs]}"
        )
    parent = out.resolve().parent
    if not parent.is_dir():
        raise FusedStatsError(
            f"merge: the folder {str(out.parent)!r} for the output {str(out)!r} does not exist "
            "(create it first)"
        )
    same = any(out.resolve() == p.resolve() for p in inputs)
    if out.exists() and not same and not args.force:
        raise FusedStatsError(f"merge: {str(out)!r} exists; pass --force to replace it")
    if kinds == {True}:
        from ..api.state.checkpoint import merge_checkpoints, read_snapshot

        if out.exists() and not out.is_dir():
            raise FusedStatsError(f"merge: inputs are checkpoint directories but {str(out)!r} is a file")
        snap = merge_checkpoints(out, inputs)
        _, accs = read_snapshot(out)
        print(f"merged {len(inputs)} probe checkpoints into {snap}")
        print(f"{'stream':<8}{'point':<32}{'n':>10}  state")
        for (_, stream, name), acc in sorted(
            accs.items(), key=lambda item: (item[0][1], item[0][2], item[0][0] != "grad")
        ):
            print(f"{stream:<8}{name:<32}{acc.n:>10}  {_describe(acc)}")
        return 0
    if out.exists() and out.is_dir():
        raise FusedStatsError(f"merge: inputs are state files but {str(out)!r} is a directory")
    merged = merge_files(out, inputs)
    print(f"merged {len(inputs)} states into {out}: n={merged.n}, dim={merged.dim}, {_describe(merged)}")
    return 0
