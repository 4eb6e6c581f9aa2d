"""``fused-stats demo``: the width and depth trend experiments in miniature (see
:mod:`fused_stats.demo.experiment` for what is trained, probed and printed)."""

from __future__ import annotations


def _ints(text: str) -> tuple:
    return tuple(int(v) for v in text.replace(",", " ").split())


def register(sub) -> None:
    p = sub.add_parser(
        "demo", help="train small LLaMA-style models on the stdlib's source, probe d_align and AG_max",
        description="Width and depth sweeps of small byte-level LLaMA-style decoders trained in one "
                    "pass over this Python's standard-library source; prints tables and writes JSON "
                    "reports and PNG plots. Measured on a shared 2-core Intel Xeon VM: the default "
                    "280 s wall (187 s CPU), --quick 30 s wall (13 s CPU).")
    p.add_argument("--quick", action="store_true",
                   help="tiny sweep for a smoke test (30 s wall on a shared 2-core Intel Xeon VM)")
    p.add_argument("--out", default="fused_stats_out", help="output folder (default: %(default)s)")
    p.add_argument("--seeds", type=_ints, nargs="+", help="seeds, e.g. --seeds 0 1 2")
    p.add_argument("--widths", type=_ints, nargs="+", help="widths of the width sweep (multiples of 16)")
    p.add_argument("--depths", type=_ints, nargs="+", help="depths of the depth sweep")
    p.add_argument("--width-sweep-depth", type=int, help="depth of every width-sweep model")
    p.add_argument("--depth-sweep-width", type=int, help="width of every depth-sweep model")
    p.add_argument("--steps", type=int, help="training steps per model (batches of 16 x 64 bytes)")
    p.add_argument("--probe-batches", type=int, help="probe batches per stream (16 sequences each)")
    p.add_argument("--lr", type=float, help="base learning rate (scaled by 32/width)")
    p.add_argument("--split", type=int, help="M = K of the certificate and misalignment")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: these small models gain little from more, "
                        "and a second OpenMP thread on a busy machine ran 4-10x slower)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from ..demo.experiment import DemoConfig, run_demo

    overrides = {}
    for arg, key in (("seeds", "seeds"), ("widths", "widths"), ("depths", "depths")):
        value = getattr(args, arg)
        if value:
            overrides[key] = tuple(v for group in value for v in group)
    for arg, key in (("width_sweep_depth", "width_sweep_depth"),
                     ("depth_sweep_width", "depth_sweep_width"), ("steps", "train_steps"),
                     ("probe_batches", "probe_batches"), ("lr", "base_lr"), ("split", "split")):
        value = getattr(args, arg)
        if value is not None:
            overrides[key] = value
    cfg = DemoConfig.quick(**overrides) if args.quick else DemoConfig(**overrides)
    if args.threads is not None:
        import torch

        from ..errors import FusedStatsError

        if args.threads < 1:
            raise FusedStatsError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    run_demo(cfg, args.out, progress=False if args.no_progress else None)
    return 0
