"""``fused-stats grow``: grow a saved Hugging Face model under a protocol file and save the result.

Loads ``DIR`` with ``from_pretrained(DIR, local_files_only=True, dtype="auto")`` (the checkpoint's
own dtype, so a zero-init growth keeps its logits bit for bit), runs ``fs.grow(model, protocol,
at=POINTS, init=...)`` and writes the grown model with ``save_pretrained`` to ``--out``, with the
tokenizer files of ``DIR`` copied byte for byte. The config's growth record
(``fused_stats_growth``, :func:`fused_stats.growth_history`) gets one entry per point, with the
protocol's digest and, given ``--advice advice.json`` (written by ``fused-stats advise`` under the
same protocol, on the same model), the ``cross_frob2``, ``p_value`` and ``p_adjusted`` that
motivated it. Everything is checked before anything is written: a non-empty ``--out`` without
``--force``, ``--out`` equal to ``DIR``, a bad protocol file, family ``cross_block`` (a hooked-in
block that ``from_pretrained`` cannot rebuild), ``--at`` outside the protocol, an advice of another
protocol or model.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ..errors import FusedStatsError
from ..networks.pretrained import resolve_model
from .args import check_out_folder

INITS = ("zero", "copy", "random")
# the files of a HF folder that describe its tokenizer (copied as they are)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)


def register(sub) -> None:
    p = sub.add_parser(
        "grow",
        help="grow a local HF model folder at protocol candidates and save it (fs.grow)",
        description=__doc__.split("\n\n")[0].replace("``", "'"),
    )
    p.add_argument(
        "model", metavar="DIR", help="local HF causal-LM folder (from_pretrained, local files only)"
    )
    p.add_argument(
        "--protocol", required=True, metavar="PROTOCOL.toml", help="growth protocol file (required)"
    )
    p.add_argument(
        "--at",
        required=True,
        nargs="+",
        metavar="POINT",
        help="candidates of the protocol to grow at (required)",
    )
    p.add_argument(
        "--init",
        default=None,
        choices=INITS,
        help="initialisation of the new parameters (default: the protocol's)",
    )
    p.add_argument(
        "--advice",
        default=None,
        metavar="advice.json",
        help="advice of 'fused-stats advise' under the same protocol: its |C|_F^2 and p-values of the "
        "points grown go into the growth record (default: none recorded)",
    )
    p.add_argument("--out", required=True, help="output folder of the grown model (required)")
    p.add_argument(
        "--force", action="store_true", help="write into an --out folder that is not empty (default: refuse)"
    )
    p.set_defaults(func=cmd_grow)


def check_at(points: list[str], candidates) -> None:
    """Refuse a point of ``--at`` that is not a candidate, or one named twice."""
    outside = [p for p in points if p not in candidates]
    if outside:
        raise FusedStatsError(
            f"--at {outside[0]!r} is not a candidate of the protocol; candidates: {list(candidates)}"
        )
    twice = sorted({p for p in points if points.count(p) > 1})
    if twice:
        raise FusedStatsError(f"--at names {twice} twice")


def read_advice(path, protocol, model, points) -> tuple[dict, list[str]]:
    """``({point: {cross_frob2, p_value, p_adjusted}}, the points the advice calls saturated)``
    from an ``advice.json`` made under ``protocol`` on ``model`` (refused otherwise, or when a
    grown point has no row)."""
    from ..api.growth.record import EVIDENCE_KEYS
    from ..api.report.identity import model_fingerprint

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FusedStatsError(f"cannot read --advice {str(path)!r} as JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != "fused_stats.advice":
        raise FusedStatsError(f"--advice {str(path)!r} is not an advice file written by 'fused-stats advise'")
    from ..api.growth.protocol import check_record_version

    check_record_version(data.get("protocol"), f"the protocol of --advice {str(path)!r}")
    if data.get("digest") != protocol.digest:
        raise FusedStatsError(
            f"--advice {str(path)!r} was made under protocol {str(data.get('digest'))[:12]}…, not this "
            f"protocol file's {protocol.digest[:12]}…"
        )
    measured = (data.get("model") or {}).get("fingerprint")
    if measured != model_fingerprint(model):
        raise FusedStatsError(
            f"--advice {str(path)!r} was measured on another model (its fingerprint: config, parameter "
            "count and parameter bytes, differs from this folder's; a probe --dtype other than the "
            "checkpoint's own also changes the bytes)"
        )
    rows = {row.get("point"): row for row in data.get("ranked", []) if isinstance(row, dict)}
    missing = [p for p in points if p not in rows]
    if missing:
        raise FusedStatsError(f"--advice {str(path)!r} has no row for {missing}")
    evidence = {p: {key: rows[p].get(key) for key in EVIDENCE_KEYS} for p in points}
    return evidence, [p for p in points if rows[p].get("saturated") is not False]


def load_folder(folder: str):
    """The causal LM saved in ``folder``, in its own dtype."""
    from .probe import _known_model_type, check_causal_config

    try:
        import transformers
    except ImportError:
        raise FusedStatsError("fused-stats grow needs transformers: pip install 'fused-stats[hf]'") from None
    path = Path(folder)
    if not path.is_dir():
        raise FusedStatsError(f"DIR {folder!r} is not a folder (a saved Hugging Face model)")
    _known_model_type(path / "config.json", folder, transformers)
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise FusedStatsError(f"cannot read a model config in folder {folder!r}: {exc}") from None
    check_causal_config(config, folder)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype="auto")
    except (OSError, ValueError) as exc:
        raise FusedStatsError(f"cannot load a causal LM from folder {folder!r}: {exc}") from None


def cmd_grow(args) -> int:
    import fused_stats as fs

    from ..api.growth.protocol import check_init
    from ..api.growth.protocol_file import read_protocol_file

    args.model = resolve_model(args.model)  # a known pretrained name or a .gguf: its converted folder
    source = Path(args.model)
    out = check_out_folder(args.out, args.force)
    if source.is_dir() and out.exists() and out.resolve() == source.resolve():
        raise FusedStatsError(
            f"--out {str(out)!r} is the model folder itself; write the grown model elsewhere"
        )
    growth = read_protocol_file(args.protocol)
    if growth.arguments.get("family") == "cross_block":
        raise FusedStatsError(
            f"{growth.where}: family 'cross_block' hooks the probe's block onto a module, which "
            "from_pretrained cannot rebuild, so it cannot be saved as a model folder; use 'layer' or 'mlp_width'"
        )
    if growth.candidates is not None:  # listed: --at is checked before the model loads
        check_at(args.at, growth.candidates)
    if args.init is not None:
        try:
            check_init(growth.arguments.get("family", "layer"), args.init)
        except FusedStatsError as exc:
            raise FusedStatsError(f"--init: {exc}") from None
    from ..progress import quiet_hf_progress, stderr_is_terminal

    if not stderr_is_terminal():
        quiet_hf_progress()  # the loading and writing bars redraw with \r: only on a terminal
    model = load_folder(args.model)
    plan = growth.plan(model)
    protocol = plan.protocol
    check_at(args.at, protocol.candidates)
    evidence, saturated = (
        (None, []) if args.advice is None else read_advice(args.advice, protocol, model, args.at)
    )
    result = fs.grow(model, plan, at=args.at, init=args.init, evidence=evidence)
    if saturated:
        print(f"(note: the advice finds no significant gain at {', '.join(saturated)})", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
            copied.append(name)
    for point in args.at:
        print(f"grew at {point}: {result.positions[point]} ({protocol.family}, init {result.init})")
    print(f"protocol digest: {protocol.digest}")
    print(f"new parameters: {len(result.new_parameters)}, widened: {len(result.widened)}")
    print(f"wrote {out}" + (f" (tokenizer files: {', '.join(copied)})" if copied else ""))
    return 0
