"""``fused-stats probe``: probe a local Hugging Face causal LM (or a config-built random one) on a
text or token file, or on the bundled default data, and write a report.

Model: ``--model DIR`` is loaded with ``from_pretrained(DIR, local_files_only=True)`` (nothing is
downloaded); ``--model config.json`` (a config with ``model_type``) builds a randomly initialised
model with ``--seed``. Data, one of:

* ``--text FILE``: tokenised with the model folder's tokenizer when it has one, else as bytes;
* ``--tokens FILE``: ``.npy`` or ``.pt`` integer tokens, 1-D (cut into ``--seq-len`` windows) or
  2-D (one sequence per row);
* neither: this Python's standard-library source as bytes, split by file
  (:class:`fused_stats.demo.corpus.StdlibCorpus`).

Train and test streams: for a file, the first 90 % of the windows feed the train stream and the
last 10 % (disjoint text) the test stream; for the default data, training and held-out files.
Per-sample losses are :func:`fused_stats.causal_lm_loss` (mean next-token cross-entropy per
sequence). Writes ``report.json``, ``report.md`` and ``report.png`` to ``--out``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import FusedStatsError

HELD_OUT = 0.1


def register(sub) -> None:
    p = sub.add_parser(
        "probe", help="probe a local HF model (folder or config JSON) on a text/token file",
        description=__doc__.split("\n\n")[0].replace("``", "'"))
    p.add_argument("--model", required=True, help="local HF model folder, or a config .json")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--text", help="text file (model tokenizer if present, else bytes)")
    data.add_argument("--tokens", help=".npy or .pt file of integer token ids, 1-D or (N, T)")
    p.add_argument("--points", nargs="+", default=None,
                   help="module names to probe (default: the residual stream after every block)")
    p.add_argument("--batches", type=int, default=8, help="train-stream batches (default 8)")
    p.add_argument("--test-batches", type=int, default=None,
                   help="test-stream batches (default: as --batches)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--unit", default="sample", choices=["sample", "position", "flat"])
    p.add_argument("--second-moment", default="auto", choices=["auto", "dense", "pool"])
    p.add_argument("--trials", type=int, default=2000, help="misalignment Monte Carlo splits")
    p.add_argument("--split", type=int, nargs=2, metavar=("M", "K"), default=None,
                   help="certificate/misalignment sizes (default: train n, test n)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--seed", type=int, default=0, help="init seed for a config-built model")
    p.add_argument("--out", default="fused_stats_out/probe", help="output folder")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--stream-blocks", action="store_true",
                   help="stream the --model folder's block weights from its safetensors shards, one "
                        "block at a time (models larger than the device)")
    p.add_argument("--device", default=None, help="where the model runs, e.g. cuda (default: cpu)")
    p.set_defaults(func=cmd_probe)


# ---------------------------------------------------------------------------- model
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
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=torch_dtype)
        except (OSError, ValueError) as exc:
            raise FusedStatsError(f"cannot load a causal LM from folder {spec!r}: {exc}") from None
        tokenizer = None
        if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                             "vocab.json", "tokenizer.model")):
            try:
                tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
            except (OSError, ValueError):
                tokenizer = None
        return model, tokenizer, f"pretrained weights from {path}"
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FusedStatsError(f"cannot read model config {spec!r} as JSON: {exc}") from None
        if not isinstance(raw, dict) or "model_type" not in raw:
            raise FusedStatsError(
                f"config {spec!r} needs a 'model_type' (e.g. \"llama\", \"gpt_neox\", \"gpt2\"); "
                f"got keys {sorted(raw) if isinstance(raw, dict) else type(raw).__name__}")
        raw = dict(raw)
        kind = raw.pop("model_type")
        try:
            config = transformers.AutoConfig.for_model(kind, **raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise FusedStatsError(f"config {spec!r}: {exc}") from None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except (ValueError, KeyError) as exc:
                raise FusedStatsError(f"config {spec!r} does not describe a causal LM: {exc}") from None
        return model.to(torch_dtype), None, f"random init (seed {seed}) from {path}"
    raise FusedStatsError(f"--model {spec!r} is neither a folder nor a config .json file")


def load_streamed(spec: str, device, dtype: str):
    """``(streamed model, tokenizer or None, description)``: :func:`fused_stats.stream_blocks` on
    a checkpoint folder (the streamer stays open until the process ends)."""
    import torch

    import fused_stats as fs

    if not Path(spec).is_dir():
        raise FusedStatsError(f"--stream-blocks needs a checkpoint folder as --model, got {spec!r}")
    streamer = fs.stream_blocks(spec, device=device, dtype=getattr(torch, dtype))
    tokenizer = None
    path = Path(spec)
    if any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        import transformers

        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError):
            tokenizer = None
    return streamer.model, tokenizer, (f"weights streamed block by block from {path} "
                                       f"({streamer.block_bytes:,} bytes a block)")


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
            split = _split_rows(arr, f"{args.tokens} ({tuple(arr.shape)} sequences)")
            return split
        if arr.dim() != 1:
            raise FusedStatsError(f"token file {args.tokens!r} has shape {tuple(arr.shape)}; expected 1-D or 2-D")
        return _split_stream(arr, T, f"{args.tokens} ({arr.numel():,} tokens)")
    if args.text:
        path = Path(args.text)
        if not path.is_file():
            raise FusedStatsError(f"text file {args.text!r} does not exist")
        raw = path.read_bytes()
        if tokenizer is not None:
            ids = tokenizer(raw.decode("utf-8", errors="replace"), return_tensors="pt",
                            add_special_tokens=False)["input_ids"][0]
            how = f"{type(tokenizer).__name__} tokens"
        else:
            ids = torch.tensor(list(raw), dtype=torch.int64)
            how = "bytes"
        return _split_stream(ids.to(torch.int64), T, f"{args.text} ({ids.numel():,} {how})")
    from ..demo.corpus import StdlibCorpus

    test_batches = args.test_batches or args.batches
    corpus = StdlibCorpus(T)
    train = torch.cat(list(corpus.batches("train", 0, args.batch_size, args.batches)))
    test = torch.cat(list(corpus.batches("test", 0, args.batch_size, test_batches)))
    return train, test, f"python stdlib source as bytes ({corpus.describe()})"


def _split_stream(ids, T: int, what: str):
    n = ids.numel() // T
    if n < 2:
        raise FusedStatsError(f"{what}: fewer than 2 windows of --seq-len {T}")
    windows = ids[:n * T].view(n, T)
    return _split_rows(windows, what)


def _split_rows(rows, what: str):
    n = rows.shape[0]
    n_test = max(1, int(round(n * HELD_OUT)))
    if n - n_test < 1:
        raise FusedStatsError(f"{what}: {n} sequences are too few for a train and a test part")
    return rows[:n - n_test], rows[n - n_test:], f"{what}; first {n - n_test} sequences -> train, last {n_test} -> test"


def _batches(rows, batch_size: int, count: int):
    out = [rows[i:i + batch_size] for i in range(0, rows.shape[0], batch_size)][:count]
    return [{"input_ids": b} for b in out]


# ---------------------------------------------------------------------------- command
def cmd_probe(args) -> int:
    import fused_stats as fs

    from ..demo.experiment import certificates_at

    for name in ("batches", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            raise FusedStatsError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.stream_blocks:
        model, tokenizer, model_what = load_streamed(args.model, args.device, args.dtype)
    else:
        model, tokenizer, model_what = load_model(args.model, args.seed, args.dtype)
        model = model.to(args.device) if args.device else model
    train, test, data_what = load_tokens(args, tokenizer)
    if args.device:
        train, test = train.to(args.device), test.to(args.device)
    vocab = model.get_input_embeddings().num_embeddings
    top = int(max(train.max(), test.max()))
    if top >= vocab or int(min(train.min(), test.min())) < 0:
        raise FusedStatsError(
            f"token ids span [{int(min(train.min(), test.min()))}, {top}] but the model's vocabulary "
            f"has {vocab} entries (byte-level data needs vocab_size >= 256)")
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if limit is not None and train.shape[1] > limit:
        raise FusedStatsError(
            f"sequences of length {train.shape[1]} exceed the model's {limit} positions; lower --seq-len")
    probe = fs.Probe(model, points=args.points or "residual", unit=args.unit,
                     second_moment=args.second_moment)
    progress = not args.no_progress
    test_count = args.test_batches or args.batches
    n_train = probe.run(_batches(train, args.batch_size, args.batches), fs.causal_lm_loss,
                        stream="train", progress=progress)
    n_test = probe.run(_batches(test, args.batch_size, test_count), fs.causal_lm_loss,
                       stream="test", progress=progress)
    meta = {"model_source": model_what, "data": data_what, "train_batches": n_train,
            "test_batches": n_test, "batch_size": args.batch_size, "seq_len": int(train.shape[1])}
    report = probe.report(meta=meta, misalignment_trials=args.trials)
    if args.split:
        M, K = args.split
        data = certificates_at(probe, report.data, M, K, args.trials, seed=args.seed)
        data["meta"]["certificate_sizes"] = [M, K]
        report = fs.Report(data)
    out = Path(args.out)
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
    return 0
