"""``fused-stats grow-demo``: grown vs scratch in miniature (see :mod:`fused_stats.demo.growth`
for what is trained, grown, probed and compared)."""

from __future__ import annotations

from .args import check_out_folder, int_list, positive_float, positive_int


def register(sub) -> None:
    p = sub.add_parser(
        "grow-demo",
        help="probe a shallow model, grow it where the advisor says (and controls), compare with scratch",
        description="Train a shallow byte-level LLaMA on this Python's standard-library source, probe "
        "the exact tangent of a new layer at every block boundary, grow one zero layer at each boundary "
        "(the advisor's top, its last and the middle one among them; a copy as control), continue "
        "training, and compare held-out loss with no growth and with the deeper model trained from "
        "scratch at equal FLOPs and equal steps, over seeds; per candidate every advisor score (|C|_F^2, "
        "signal fraction, SGD and Adam first-step predictions, split Adam score, curvature gain) and its "
        "rank correlation with the realised drop of the new layer trained alone and with the realised "
        "gain over no growth after continued training, pooled over seeds.",
    )
    p.add_argument("--quick", action="store_true", help="tiny run for a smoke test")
    p.add_argument("--out", default="fused_stats_out/grow_demo", help="output folder")
    p.add_argument(
        "--force", action="store_true", help="write into an --out folder that is not empty (default: refuse)"
    )
    p.add_argument("--seeds", type=int_list(0), nargs="+", help="seeds (default: 0 .. 9; --quick: 0 1)")
    p.add_argument("--width", type=positive_int, help="model width, a multiple of 16 (default: 32)")
    p.add_argument("--depth", type=positive_int, help="depth of the shallow model (default: 6)")
    p.add_argument("--steps1", type=positive_int, help="training steps before growth (default: 96)")
    p.add_argument("--steps2", type=positive_int, help="training steps after growth (default: 48)")
    p.add_argument(
        "--lr", type=positive_float, help="base learning rate, scaled by 32/width (default: 0.003)"
    )
    p.add_argument(
        "--ladder",
        action="store_true",
        help="run the 'when to stop' depth ladder instead (depth 1, grow one layer a rung at the advisor's "
        "choice, compare with staying at the same depth for the same FLOPs)",
    )
    p.add_argument("--rungs", type=positive_int, help="ladder: growths per seed (default: 6; --quick: 3)")
    p.add_argument(
        "--budget", type=positive_int, help="ladder: training steps after each growth (default: 48)"
    )
    p.add_argument(
        "--confirm",
        action="store_true",
        help="run the pre-registered confirmatory seeds (100 .. 109; --quick: 100 101) and print and write "
        "the claims of docs/grow_demo_confirm.md side by side with the exploratory run (confirm.md, confirm.json)",
    )
    p.add_argument(
        "--exploratory",
        help="--confirm: the exploratory growth_demo.json (default: bench/results/grow_demo_scores_cpu.json)",
    )
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    p.set_defaults(func=cmd_grow_demo)


def cmd_grow_demo(args) -> int:
    from ..demo.growth import GrowthDemoConfig, run_growth_demo
    from ..errors import FusedStatsError

    if args.exploratory and not args.confirm:
        raise FusedStatsError("--exploratory is read by --confirm only")
    if args.confirm and (args.ladder or args.seeds):
        raise FusedStatsError(
            "--confirm runs the pre-registered seeds of the grow-demo: no --seeds, no --ladder"
        )
    if args.ladder:
        return _ladder(args)

    overrides = {}
    if args.seeds:
        overrides["seeds"] = tuple(v for group in args.seeds for v in group)
    if args.confirm:
        from ..demo.confirm import confirm_seeds, load_exploratory

        exploratory = load_exploratory(args.exploratory)
        overrides["seeds"] = confirm_seeds(args.quick)
    for arg, key in (
        ("width", "width"),
        ("depth", "depth"),
        ("steps1", "steps1"),
        ("steps2", "steps2"),
        ("lr", "base_lr"),
    ):
        value = getattr(args, arg)
        if value is not None:
            overrides[key] = value
    cfg = GrowthDemoConfig.quick(**overrides) if args.quick else GrowthDemoConfig(**overrides)
    cfg.validate()
    check_out_folder(args.out, args.force)
    import torch

    torch.set_num_threads(args.threads)
    record = run_growth_demo(cfg, args.out)
    if args.confirm:
        from ..demo.confirm import write_confirm

        write_confirm(exploratory, record, args.out, args.exploratory)
    return 0


def _ladder(args) -> int:
    from ..demo.ladder import LadderConfig, run_ladder

    overrides = {}
    if args.seeds:
        overrides["seeds"] = tuple(v for group in args.seeds for v in group)
    for arg, key in (("width", "width"), ("rungs", "rungs"), ("budget", "budget"), ("lr", "base_lr")):
        value = getattr(args, arg)
        if value is not None:
            overrides[key] = value
    cfg = LadderConfig.quick(**overrides) if args.quick else LadderConfig(**overrides)
    cfg.validate()
    out = args.out if args.out != "fused_stats_out/grow_demo" else "fused_stats_out/depth_ladder"
    check_out_folder(out, args.force)
    import torch

    torch.set_num_threads(args.threads)
    run_ladder(cfg, out)
    return 0
