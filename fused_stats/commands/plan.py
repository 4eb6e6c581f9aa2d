"""``fused-stats plan``: accumulator memory per insertion point before a probe run.

``fused-stats plan --dim D --points P [--pool N] [--streams 2]`` or ``--model CONFIG_JSON`` (HF
config with ``hidden_size`` and ``num_hidden_layers``) or ``--preset llama-70b``; with no shape at
all it prints the LLaMA-7B and LLaMA-70B shapes. Bytes are exact counts of the fp64 state
(:func:`fused_stats.api.streaming.plan.plan_memory`). ``--tangent`` adds the new-layer tangent
probe of ``cross=GrowthProtocol``: ``L + 1`` candidates (the input boundary too), the MLP width
from the config or preset.
"""

from __future__ import annotations

from ..networks.pretrained import resolve_model
from .args import int_at_least, nonnegative_int, positive_int

# `--tangent` without a value: the MLP width of the model's config or preset
TANGENT_WIDTH_FROM_CONFIG = 0


def register(sub) -> None:
    from ..api.streaming.plan import PRESETS

    cmd = sub.add_parser(
        "plan",
        help="accumulator memory per point (dense / pool / auto) for a model shape",
        description="Bytes of accumulator state per point and for the whole probe, per second-moment "
        "mode, before a run starts.",
    )
    cmd.add_argument(
        "--dim",
        type=positive_int,
        help="feature dimension d (hidden size); with --points (default: from --model)",
    )
    cmd.add_argument(
        "--points", type=positive_int, help="number of insertion points; with --dim (default: from --model)"
    )
    cmd.add_argument(
        "--pool",
        type=nonnegative_int,
        default=None,
        help="samples per accumulator (pool size N) for the pool and auto modes "
        "(default: unknown; auto is shown at its dense bound)",
    )
    cmd.add_argument(
        "--model",
        help="model config JSON, a model directory holding config.json, a .gguf file or 'smollm2-135m' "
        "(default: none)",
    )
    cmd.add_argument(
        "--preset",
        action="append",
        choices=sorted(PRESETS),
        help="a named shape, repeatable (default: llama-7b and llama-70b when no shape is given)",
    )
    cmd.add_argument(
        "--streams",
        type=int_at_least(1),
        default=2,
        choices=[1, 2],
        help="accumulators per point: 2 = train + test streams, 1 = one",
    )
    cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cmd.add_argument(
        "--stream-blocks",
        action="store_true",
        help="also plan device and host memory of a weight-streamed probe step",
    )
    cmd.add_argument("--tokens", type=int, default=8192, help="tokens a batch (--stream-blocks)")
    cmd.add_argument(
        "--samples", type=positive_int, default=8, help="sequences a batch (--stream-blocks; default 8)"
    )
    cmd.add_argument(
        "--cross-rank",
        type=positive_int,
        default=None,
        help="rank of a cross= block, whose features a step keeps (--stream-blocks; default: none)",
    )
    cmd.add_argument(
        "--tangent",
        type=positive_int,
        metavar="F",
        nargs="?",
        const=TANGENT_WIDTH_FROM_CONFIG,
        default=None,
        help="also count the probe of a new layer's exact tangent (cross=GrowthProtocol) with MLP "
        "width F: r = d + F features per candidate; F is read from --model's config or the preset "
        "(a different F is refused) and needed only with --dim (default: not counted)",
    )
    cmd.add_argument(
        "--projection",
        type=positive_int,
        default=None,
        help="with --tangent: rank k of the fixed projection (default: none, the exact tangent)",
    )
    cmd.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    import json

    from ..api.streaming.plan import format_table, plan_memory
    from ..errors import FusedStatsError

    if args.model is None and (args.dim is None) != (args.points is None):
        given, missing = ("--dim", "--points") if args.points is None else ("--points", "--dim")
        raise FusedStatsError(f"{given} needs {missing} too (or --model CONFIG for the shape)")
    if args.tangent is not None and args.stream_blocks:
        # the probe refuses it: the streamed model's blocks hold meta-device weights
        raise FusedStatsError(
            "--tangent with --stream-blocks: the tangent probe (cross=GrowthProtocol) does not run on a "
            "weight-streamed model (the probe refuses it: 'the tangent probe runs the new block on the "
            "model's own stream and builds it from the model's weights', which fs.stream_blocks keeps on "
            "the meta device); plan the tangent without --stream-blocks"
        )
    plans = []  # (plan, the config or preset it was read from, or None for --dim/--points)
    if args.model is not None:
        args.model = resolve_model(args.model)  # a known pretrained name or a .gguf: its folder
        plans.append(
            (
                plan_memory(
                    dim=args.dim,
                    points=args.points,
                    pool_size=args.pool,
                    model=args.model,
                    streams=args.streams,
                ),
                args.model,
            )
        )
    elif args.dim is not None or args.points is not None:
        plans.append(
            (plan_memory(dim=args.dim, points=args.points, pool_size=args.pool, streams=args.streams), None)
        )
    for preset in args.preset or ([] if plans else ["llama-7b", "llama-70b"]):
        plans.append((plan_memory(model=preset, pool_size=args.pool, streams=args.streams), preset))
    widths = [] if args.tangent is None else [_tangent_width(args, source) for _, source in plans]
    plans = [plan for plan, _ in plans]
    if args.json:
        print(json.dumps([p.to_dict() for p in plans], indent=1))
        return 0
    print(format_table(plans))
    if args.stream_blocks:
        from ..api.streaming.plan import format_stream_plan, plan_streaming

        for spec in ([args.model] if args.model else []) + (args.preset or ["llama-7b", "llama-70b"]):
            print(
                format_stream_plan(
                    plan_streaming(
                        spec,
                        args.tokens,
                        pool_size=args.pool,
                        streams=args.streams,
                        samples=args.samples,
                        cross_rank=args.cross_rank,
                    )
                )
            )
    if args.tangent is not None:
        from ..api.streaming.plan import human_bytes, human_count, plan_tangent

        for p, width in zip(plans, widths):
            # the protocol's candidates: every block's output and the input boundary (before block 0)
            candidates = p.points + 1
            t = plan_tangent(p.dim, width, candidates, args.projection, args.streams)
            print(
                f"tangent of a new layer at {p.label} (MLP width F = {width}): r = {t['features']} features, "
                f"C is {p.dim} x {t['rank']}; {human_bytes(t['per_accumulator'])} per accumulator (Sum c_i "
                f"{human_bytes(t['c_sum_bytes'])}, w_in {human_bytes(t['w_in_bytes'])}), "
                f"{human_bytes(t['total'])} for {candidates} candidates ({p.points} block outputs and the "
                f"input boundary) x {args.streams} streams; plus the {candidates} new layers it keeps, "
                f"{human_count(t['block_params'])} parameters each (LLaMA, full KV heads): "
                f"{human_bytes(2 * t['block_params'] * candidates)} in bf16"
            )
            # fs.curvature_gain (scores.py): a forward-backward, then a forward, a create_graph
            # backward and a second backward per batch, on a grown copy of the model
            print(
                f"  curvature gain (fs.curvature_gain, optional): about 4 training steps' compute per "
                f"candidate and batch ({4 * candidates} per batch for all {candidates}), and a grown copy of "
                f"the model in memory while it runs (the model plus one new layer of "
                f"{human_count(t['block_params'])} parameters)"
            )
    print(
        "bytes of fp64 accumulator state (acc = one point, one stream; total = points x streams). "
        "auto is a pool up to N* samples, dense after; without --pool it is shown at its dense bound."
    )
    return 0


def _tangent_width(args, source) -> int:
    """The new layer's MLP width F for the shape read from ``source`` (a config or preset; None for
    --dim/--points, where ``--tangent F`` must give it); a given F that disagrees is refused."""
    from ..api.streaming.plan import model_intermediate
    from ..errors import FusedStatsError

    given = None if args.tangent == TANGENT_WIDTH_FROM_CONFIG else args.tangent
    known = None if source is None else model_intermediate(source)
    if known is None and given is None:
        where = "--dim/--points" if source is None else f"the config {source!r} (no intermediate_size)"
        raise FusedStatsError(f"--tangent needs the MLP width F for {where}: give --tangent F")
    if known is not None and given is not None and given != known:
        raise FusedStatsError(
            f"--tangent {given} disagrees with the MLP width of {source!r}, intermediate_size = {known}: "
            f"the new layer copies the model's; give --tangent alone (or --tangent {known})"
        )
    return given if known is None else known
