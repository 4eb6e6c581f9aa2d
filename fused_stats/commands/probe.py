"""``fused-stats probe``: probe a local Hugging Face causal LM (or a config-built random one) on a
text or token file, or on the bundled default data, and write a report.

Model: ``--model DIR`` is loaded with ``from_pretrained(DIR, local_files_only=True)`` (nothing is
downloaded); ``--model config.json`` (a config with ``model_type``) builds a randomly initialised
model with ``--seed``. Data, one of:

* ``--text FILE``: tokenised with the model folder's tokenizer when it has one, else as bytes;
* ``--tokens FILE``: ``.npy`` or ``.pt`` integer tokens, 1-D (cut into ``--seq-len`` windows) or
  2-D (one sequence per row, cut to ``--seq-len`` tokens when longer, which it says on stderr);
* neither: this Python's standard-library source as bytes, split by file
  (:class:`fused_stats.demo.corpus.StdlibCorpus`).

Train and test streams: for a file, the first 90 % of the windows feed the train stream and the
last 10 % (disjoint text) the test stream; for the default data, training and held-out files.
Per-sample losses are :func:`fused_stats.causal_lm_loss` (mean next-token cross-entropy per
sequence). Writes ``report.json``, ``report.md`` and ``report.png`` to ``--out``.

``--growth PROTOCOL.toml`` (:mod:`fused_stats.api.growth.protocol_file`) probes the protocol's
candidates with the exact tangent of the block ``fs.grow`` would insert at each
(``fs.Probe(model, cross=protocol)``); its report, which records the protocol and its digest, is
what ``fused-stats advise`` reads. Refused with ``--cross``, ``--points``, ``--stream-blocks``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..contracts import ACTIVATIONS
from ..errors import FusedStatsError
from ..networks.pretrained import resolve_model
from . import optimizer_args
from .args import check_out_folder, int_at_least, nonnegative_int, positive_int
from .probe_data import HELD_OUT, _batches, _split_rows, _split_stream, short_of_data  # noqa: F401

MASKS = ("labels", "attention", "none")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def register(sub) -> None:
    p = sub.add_parser(
        "probe",
        help="probe a local HF model (folder or config JSON) on a text/token file",
        description=__doc__.split("\n\n")[0].replace("``", "'"),
    )
    p.add_argument(
        "--model",
        required=True,
        help="local HF causal-LM folder, a config .json with a 'model_type', a .gguf file or "
        "'smollm2-135m' (a real pretrained LLaMA, converted once into a user cache) (required)",
    )
    data = p.add_mutually_exclusive_group()
    data.add_argument(
        "--text",
        help="text file, tokenised with the model folder's tokenizer if it "
        "has one, else read as bytes (default: the stdlib source)",
    )
    data.add_argument(
        "--tokens", help=".npy or .pt file of integer token ids, 1-D or (N, T) (default: the stdlib source)"
    )
    p.add_argument(
        "--points",
        nargs="+",
        default=None,
        help="module names to probe (default: the residual stream after every block)",
    )
    p.add_argument("--batches", type=positive_int, default=8, help="train-stream batches")
    p.add_argument(
        "--test-batches", type=positive_int, default=None, help="test-stream batches (default: as --batches)"
    )
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per batch")
    p.add_argument(
        "--seq-len",
        type=int_at_least(2),
        default=128,
        help="tokens per sequence (windows cut from 1-D data; longer 2-D rows are cut to it)",
    )
    p.add_argument(
        "--unit",
        default="sample",
        choices=["sample", "position", "flat"],
        help="one sample per sequence (summed over its positions), per position, or "
        "the flattened (T*d) gradient",
    )
    p.add_argument(
        "--mask",
        default=None,
        choices=list(MASKS),
        help="counted positions: 'labels' = positions that predict a next token (the "
        "last one has an exactly zero gradient), 'attention' = positions whose attention_mask "
        "is nonzero (this command's batches are unpadded windows, so: every position), "
        "'none' = every position, padding included (default: labels for --unit "
        "position, attention otherwise)",
    )
    p.add_argument(
        "--cross",
        type=cross_spec,
        default=None,
        metavar="RANK[,ACTIVATION]",
        help="also measure the depth probe's cross-gradient |C| and its saturation test "
        "for a zero-output block of RANK features (activation one of "
        f"{', '.join(ACTIVATIONS)}; default: off, gelu when only RANK is given)",
    )
    p.add_argument(
        "--growth",
        default=None,
        metavar="PROTOCOL.toml",
        help="probe a growth protocol file's candidates with the exact tangent of the block growth "
        "would insert there (fs.Probe(model, cross=protocol)); the report records the protocol and "
        "its digest, for 'fused-stats advise' (default: off)",
    )
    p.add_argument(
        "--second-moment",
        default=None,
        choices=["auto", "dense", "pool"],
        help="second-moment mode of the accumulators (default: pool for --unit sample with "
        "--trials > 0, since the empirical misalignment resamples the kept per-sample vectors; "
        "auto otherwise)",
    )
    p.add_argument(
        "--trials",
        type=nonnegative_int,
        default=2000,
        help="misalignment Monte Carlo splits (0: skip the empirical misalignment)",
    )
    p.add_argument(
        "--split",
        type=positive_int,
        nargs=2,
        metavar=("M", "K"),
        default=None,
        help="certificate/misalignment sizes (default: train n, test n)",
    )
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "float64", "bfloat16"], help="model dtype"
    )
    p.add_argument(
        "--device", default="cpu", help="torch device of the model and batches, e.g. cpu, cuda, cuda:1"
    )
    p.add_argument(
        "--seed",
        type=nonnegative_int,
        default=0,
        help="init seed for a config-built model (and the misalignment splits)",
    )
    p.add_argument(
        "--out", default="fused_stats_out/probe", help="output folder for report.json, report.md, report.png"
    )
    p.add_argument(
        "--force", action="store_true", help="write into an --out folder that is not empty (default: refuse)"
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress output, and no Hugging Face loading bar (default: a bar on a "
        "terminal, a line every 30 s otherwise)",
    )
    p.add_argument(
        "--stream-blocks",
        action="store_true",
        help="stream the --model folder's block weights from its safetensors shards, one "
        "block at a time (models larger than the device; default: load it whole)",
    )
    optimizer_args.add_optimizer_arguments(p)
    p.set_defaults(func=cmd_probe)


def cross_spec(text: str):
    """``RANK[,ACTIVATION]`` -> ``(rank, activation)`` (argparse type of ``--cross``)."""
    import argparse

    rank, _, activation = text.partition(",")
    try:
        value = int(rank)
    except ValueError:
        raise argparse.ArgumentTypeError(f"RANK must be an integer >= 1, got {rank!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"RANK must be an integer >= 1, got {value}")
    activation = activation.strip() or "gelu"
    if activation not in ACTIVATIONS:
        raise argparse.ArgumentTypeError(
            f"ACTIVATION must be one of {', '.join(ACTIVATIONS)}, got {activation!r}"
        )
    return value, activation


# ---------------------------------------------------------------------------- model
def check_causal_config(config, spec: str) -> None:
    """Raise unless ``config`` describes a decoder-only causal LM (the probe's loss is the
    next-token loss, which needs a model whose position t sees only tokens <= t)."""
    from transformers.models.auto import modeling_auto

    kind = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise FusedStatsError(
            f"--model {spec!r} is an encoder-decoder ({kind!r}) config; the probe needs a "
            "decoder-only causal LM (e.g. llama, gpt_neox, gpt2)"
        )
    if kind not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise FusedStatsError(
            f"--model {spec!r}: model_type {kind!r} has no causal-LM head in transformers; the probe "
            "needs a decoder-only causal LM (e.g. llama, gpt_neox, gpt2)"
        )
    if kind in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        raise FusedStatsError(
            f"--model {spec!r}: model_type {kind!r} is a bidirectional encoder (masked LM); its "
            "positions see later tokens, so a next-token loss is not causal. Use a decoder-only "
            'causal LM (e.g. llama, gpt_neox, gpt2), or set "is_decoder": true in the config'
        )


def _known_model_type(config_file: Path, spec: str, transformers) -> None:
    """A folder's config.json with an unknown ``model_type`` gets a one-line error (transformers'
    own message lists every known type); a folder without one is told so (transformers would ask
    for a model_type key)."""
    from transformers import CONFIG_MAPPING

    if not config_file.is_file():
        raise FusedStatsError(
            f"--model {spec!r}: the folder has no {config_file.name} (a saved Hugging Face model "
            "folder holds config.json beside its weights; or pass a config .json file)"
        )
    try:
        kind = json.loads(config_file.read_text()).get("model_type")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return  # transformers reports a missing or unreadable config itself
    if isinstance(kind, str) and kind not in CONFIG_MAPPING:
        raise FusedStatsError(
            f"--model {spec!r}: unknown model_type {kind!r} in {config_file.name} for transformers "
            f'{transformers.__version__} (e.g. "llama", "gpt_neox", "gpt2")'
        )


def _config_from_json(spec: str, raw, transformers):
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise FusedStatsError(
            f'config {spec!r} needs a \'model_type\' (e.g. "llama", "gpt_neox", "gpt2"); '
            f"got keys {sorted(raw) if isinstance(raw, dict) else type(raw).__name__}"
        )
    raw = dict(raw)
    kind = raw.pop("model_type")
    from transformers import CONFIG_MAPPING

    if not isinstance(kind, str) or kind not in CONFIG_MAPPING:
        raise FusedStatsError(
            f"config {spec!r}: unknown model_type {kind!r} for transformers "
            f'{transformers.__version__} (e.g. "llama", "gpt_neox", "gpt2")'
        )
    try:
        return transformers.AutoConfig.for_model(kind, **raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise FusedStatsError(f"config {spec!r}: {exc}") from None


def load_model(spec: str, seed: int, dtype: str):
    """``(model, tokenizer or None, description)`` from a local folder or a config JSON."""
    import torch

    try:
        import transformers
    except ImportError:
        raise FusedStatsError("fused-stats probe needs transformers: pip install 'fused-stats[hf]'") from None
    path = Path(spec)
    torch_dtype = getattr(torch, dtype)
    if path.is_dir():
        _known_model_type(path / "config.json", spec, transformers)
        try:
            config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise FusedStatsError(f"cannot read a model config in folder {spec!r}: {exc}") from None
        check_causal_config(config, spec)
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=torch_dtype
            )
        except (OSError, ValueError) as exc:
            raise FusedStatsError(f"cannot load a causal LM from folder {spec!r}: {exc}") from None
        return model, find_tokenizer(path), f"pretrained weights from {path}"
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FusedStatsError(f"cannot read model config {spec!r} as JSON: {exc}") from None
        config = _config_from_json(spec, raw, transformers)
        check_causal_config(config, spec)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except (ValueError, KeyError) as exc:
                raise FusedStatsError(f"config {spec!r} does not describe a causal LM: {exc}") from None
        return model.to(torch_dtype), None, f"random init (seed {seed}) from {path}"
    raise FusedStatsError(f"--model {spec!r} is neither a folder nor a config .json file")


def find_tokenizer(folder: Path):
    """The folder's tokenizer (``AutoTokenizer``, local files only) when it holds one of
    :data:`TOKENIZER_FILES`, else None (``--text`` is then read as bytes). The one rule for the
    in-memory and the streamed model."""
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        return None
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError):
        return None


def load_streamed(spec: str, device, dtype: str):
    """``(streamed model, tokenizer or None, description)``: :func:`fused_stats.stream_blocks` on
    a checkpoint folder (the streamer stays open until the process ends)."""
    import torch

    import fused_stats as fs

    if not Path(spec).is_dir():
        raise FusedStatsError(f"--stream-blocks needs a checkpoint folder as --model, got {spec!r}")
    streamer = fs.stream_blocks(spec, device=device, dtype=getattr(torch, dtype))
    path = Path(spec)
    return (
        streamer.model,
        find_tokenizer(path),
        (f"weights streamed block by block from {path} ({streamer.block_bytes:,} bytes a block)"),
    )


# ---------------------------------------------------------------------------- data
def load_tokens(args, tokenizer):
    """``(train (N, T) int64, test (N', T) int64, description)``."""
    import numpy as np
    import torch

    T = args.seq_len
    if args.tokens:
        path = Path(args.tokens)
        if not path.is_file():
            raise FusedStatsError(f"token file {args.tokens!r} does not exist")
        if path.suffix == ".npy":
            try:
                arr = torch.from_numpy(np.load(path, allow_pickle=False))
            except (ValueError, OSError) as exc:
                raise FusedStatsError(f"cannot read {args.tokens!r} as .npy: {exc}") from None
        elif path.suffix in (".pt", ".pth"):
            try:
                arr = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # torch raises several kinds for a bad file
                raise FusedStatsError(f"cannot read {args.tokens!r} as a tensor file: {exc}") from None
            if not isinstance(arr, torch.Tensor):
                raise FusedStatsError(f"{args.tokens!r} holds a {type(arr).__name__}, expected a tensor")
        else:
            raise FusedStatsError(f"token file must end in .npy or .pt, got {args.tokens!r}")
        if arr.is_floating_point() or arr.is_complex() or arr.dtype == torch.bool:
            raise FusedStatsError(f"token file {args.tokens!r} has dtype {arr.dtype}; expected integers")
        arr = arr.to(torch.int64)
        if arr.dim() == 2:
            from ..api.suite.data import cut_rows

            what = f"{args.tokens} ({tuple(arr.shape)} sequences)"
            # --seq-len applies to rows as to windows (a model's position limit is met by it); the
            # suite's [data] seq_len follows the same rule
            arr, note = cut_rows(arr, T, f"--tokens {args.tokens}", "--seq-len")
            if note:
                print(f"(note: {note})", file=sys.stderr)
                what = f"{args.tokens} ({tuple(arr.shape)} sequences, rows cut to --seq-len {T})"
            return _split_rows(arr, what)
        if arr.dim() != 1:
            raise FusedStatsError(
                f"token file {args.tokens!r} has shape {tuple(arr.shape)}; expected 1-D or 2-D"
            )
        return _split_stream(arr, T, f"{args.tokens} ({arr.numel():,} tokens)")
    if args.text:
        path = Path(args.text)
        if not path.is_file():
            raise FusedStatsError(f"text file {args.text!r} does not exist")
        raw = path.read_bytes()
        if tokenizer is not None:
            ids = tokenizer(
                raw.decode("utf-8", errors="replace"), return_tensors="pt", add_special_tokens=False
            )["input_ids"][0]
            how = f"{type(tokenizer).__name__} tokens"
        else:
            ids = torch.tensor(list(raw), dtype=torch.int64)
            how = "bytes"
        return _split_stream(ids.to(torch.int64), T, f"{args.text} ({ids.numel():,} {how})")
    from ..demo.corpus import StdlibCorpus

    test_batches = args.test_batches or args.batches  # None: as --batches
    corpus = StdlibCorpus(T)
    train = torch.cat(list(corpus.batches("train", 0, args.batch_size, args.batches)))
    test = torch.cat(list(corpus.batches("test", 0, args.batch_size, test_batches)))
    return train, test, f"python stdlib source as bytes ({corpus.describe()})"


# ---------------------------------------------------------------------------- command
def check_arguments(args):
    """Every check that needs neither the model nor the data; returns ``(device, out, protocol
    file or None)``."""
    import torch

    growth = None
    if args.growth is not None:
        for given, option in ((args.cross, "--cross"), (args.stream_blocks, "--stream-blocks")):
            if given:
                raise FusedStatsError(
                    f"--growth probes the protocol's own block; it cannot be combined with {option}"
                    + (
                        " (the tangent probe needs the whole model in memory)"
                        if option == "--stream-blocks"
                        else ""
                    )
                )
        if args.points:
            raise FusedStatsError(
                "--growth probes the protocol file's candidates; list the points there, not with --points"
            )
        if args.unit == "flat":
            raise FusedStatsError("--growth needs --unit sample or position; got --unit flat")
        from ..api.growth.protocol_file import read_protocol_file

        growth = read_protocol_file(args.growth)
    if optimizer_args.optimizer_settings(args) is not None:
        optimizer_args.check_prediction_arguments(growth and growth.arguments, args.batch_size)
    if args.cross is not None and args.unit == "flat":
        raise FusedStatsError(
            "--cross needs --unit sample or position (the cross-gradient sums "
            "q_t phi_t^T over positions); got --unit flat"
        )
    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError) as exc:
        raise FusedStatsError(f"--device {args.device!r} is not a torch device ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FusedStatsError(f"--device {args.device!r}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise FusedStatsError(
            f"--device {args.device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    if device.type not in ("cpu", "cuda"):
        raise FusedStatsError(f"--device {args.device!r}: only cpu and cuda devices are supported")
    from ..backend import resolve_backend

    resolve_backend("auto", device)  # CUDA without Triton: refused here, before the model loads
    return device, check_out_folder(args.out, args.force), growth


def check_data(args, model, train, test):
    """Checks of the loaded data against the model and the requested split sizes."""
    vocab = model.get_input_embeddings().num_embeddings
    low, top = int(min(train.min(), test.min())), int(max(train.max(), test.max()))
    if top >= vocab or low < 0:
        raise FusedStatsError(
            f"token ids span [{low}, {top}] but the model's vocabulary has {vocab} entries "
            "(byte-level data needs vocab_size >= 256)"
        )
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(
        model.config, "n_positions", None
    )
    if limit is not None and train.shape[1] > limit:
        raise FusedStatsError(
            f"sequences of length {train.shape[1]} exceed the model's {limit} positions; lower --seq-len"
        )
    if args.split and args.unit == "sample":
        M, K = args.split
        n_train = min(train.shape[0], args.batches * args.batch_size)
        n_test = min(test.shape[0], (args.test_batches or args.batches) * args.batch_size)
        if n_train + n_test < M + K:
            raise FusedStatsError(
                f"--split {M} {K}: the misalignment draws disjoint M + K = {M + K} samples from the "
                f"pooled {n_train} train + {n_test} test sequences; lower M, K or add batches"
            )


def default_second_moment(args) -> str:
    """``pool`` when the empirical misalignment is asked for (``--trials`` > 0) on per-sequence
    vectors: it resamples the kept vectors, which ``auto`` folds into the dense moment past its
    switch point. Per-position or flattened vectors are too many to keep by default: ``auto``."""
    return "pool" if args.trials > 0 and args.unit == "sample" else "auto"


def cmd_probe(args) -> int:
    import fused_stats as fs

    from ..demo.experiment import certificates_at
    from ..progress import Progress, quiet_hf_progress, stderr_is_terminal

    device, out, growth = check_arguments(args)
    args.model = resolve_model(args.model)  # a known pretrained name or a .gguf: its converted folder
    progress = not args.no_progress
    if not (progress and stderr_is_terminal()):
        quiet_hf_progress()  # the loading bars redraw with \r: only on a terminal
    if args.stream_blocks:  # the streamer places resident parts on device itself
        model, tokenizer, model_what = load_streamed(args.model, device, args.dtype)
    else:
        model, tokenizer, model_what = load_model(args.model, args.seed, args.dtype)
    # the candidates are checked against the model before any data is read
    plan = None if growth is None else growth.plan(model)
    protocol = None if plan is None else plan.protocol
    train, test, data_what = load_tokens(args, tokenizer)
    check_data(args, model, train, test)
    if not args.stream_blocks:
        model = model.to(device)
    mask = args.mask or ("labels" if args.unit == "position" else "attention")
    second_moment = args.second_moment or default_second_moment(args)
    cross = (
        plan
        if args.cross is None
        else fs.CrossSpec(rank=args.cross[0], activation=args.cross[1], seed=args.seed)
    )
    # a growth protocol's probe measures its candidates (points=None)
    points = None if protocol is not None else args.points or "residual"
    probe = fs.Probe(model, points=points, unit=args.unit, second_moment=second_moment, cross=cross)
    test_count = args.test_batches or args.batches
    counts = {}
    for stream, rows, count in (("train", train, args.batches), ("test", test, test_count)):
        short_of_data(stream, rows.shape[0], count, args)
        batches = _batches(rows, args.batch_size, count, device)
        with Progress(len(batches), f"probe {stream}", enabled=progress, unit="batches") as bar:
            for batch in batches:
                probe.step(batch, fs.causal_lm_loss, stream=stream, mask=mask)
                bar.update()
        counts[stream] = len(batches)
    meta = {
        "model_source": model_what,
        "data": data_what,
        "train_batches": counts["train"],
        "test_batches": counts["test"],
        "batch_size": args.batch_size,
        "seq_len": int(train.shape[1]),
        "mask": mask,
        "device": str(device),
    }
    if protocol is not None:
        meta["growth_protocol_file"] = str(args.growth)
    elif cross is not None:
        meta["cross"] = {"rank": cross.rank, "activation": cross.activation, "seed": cross.seed}
    report = probe.report(meta=meta, misalignment_trials=args.trials)
    if args.split:
        M, K = args.split
        data = certificates_at(probe, report.data, M, K, args.trials, seed=args.seed)
        data["meta"]["certificate_sizes"] = [M, K]
        report = fs.Report(data)
        missing = [
            p["name"]
            for p in report.points
            if p["certificate"] is None or (args.trials and p["misalignment"] is None)
        ]
        if missing:
            print(
                f"(note: the certificate or misalignment at M = {M}, K = {K} could not be "
                f"computed at {', '.join(missing)}: too few samples for these sizes, or no pool "
                "for the misalignment with --second-moment dense)"
            )
    skipped = [p["name"] for p in report.points if args.trials and p["misalignment"] is None]
    if skipped and not args.split:
        print(
            f"(note: no empirical misalignment at {', '.join(skipped)}: --second-moment "
            f"{second_moment} kept no sample pool there (or too few samples); pass --second-moment "
            "pool to compute it, or --trials 0 to skip it)",
            file=sys.stderr,
        )
    report.to_json(out / "report.json")
    report.to_markdown_file(out / "report.md")
    files = [out / "report.json", out / "report.md"]
    try:
        files.append(report.plot(out / "report.png"))
    except FusedStatsError as exc:
        print(f"(plot skipped: {exc})")
    print(f"model: {type(model).__name__}, {model_what}")
    print(f"data: {data_what}")
    print(report.to_markdown())
    print("wrote " + ", ".join(str(f) for f in files))
    settings = optimizer_args.optimizer_settings(args)
    if settings is not None:
        print("\n".join(optimizer_args.prediction_lines(probe, model, settings)))
    return 0
