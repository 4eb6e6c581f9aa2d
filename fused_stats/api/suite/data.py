"""The suite's shared windows: every run sees exactly the same token sequences.

A source is token ids (``.npy``, memory-mapped: a 1-D stream cut into consecutive ``seq_len``
windows, or an ``(N, T)`` array whose first rows are the windows, each row's first ``seq_len``
tokens when ``T > seq_len``: :func:`cut_rows`, the rule ``fused-stats probe --tokens`` uses too), text (``.txt``, tokenised
whole), JSON lines (``.jsonl``, the string ``field`` of each record) or a ``datasets`` folder
written by ``save_to_disk`` (its ``field`` column). Documents are tokenised one by one, joined
by the tokenizer's end-of-text id when it has one, until ``sequences × seq_len`` tokens are
there. Text is tokenised once per distinct tokenizer (identified by the SHA-256 of its files;
a folder without tokenizer files reads text as bytes), and the windows' SHA-256 (their int64
little-endian bytes, row-major) is recorded so that a report names exactly what it measured.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...errors import FusedStatsError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
BYTES = "bytes"


@dataclass
class Windows:
    """The train and test windows of one tokenizer, ``(sequences, seq_len)`` int64 each."""

    tokenizer: str  # tokenizer identity: "bytes" or the SHA-256 of its files
    train: np.ndarray
    test: np.ndarray
    sources: dict
    notes: list = field(default_factory=list)  # what was done to a source to make the windows

    def sha256(self, stream: str) -> str:
        rows = self.train if stream == "train" else self.test
        return hashlib.sha256(np.ascontiguousarray(rows, dtype="<i8").tobytes()).hexdigest()

    def describe(self) -> dict:
        return {
            stream: {
                "sha256": self.sha256(stream),
                "shape": list((self.train if stream == "train" else self.test).shape),
                "source": self.sources[stream],
            }
            for stream in ("train", "test")
        } | ({"notes": list(self.notes)} if self.notes else {})


def tokenizer_identity(folder: Path) -> str:
    """SHA-256 over the tokenizer files a checkpoint folder holds (names and bytes); ``"bytes"``
    when it holds none."""
    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        file = folder / name
        if file.is_file():
            found = True
            digest.update(name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest() if found else BYTES


def load_tokenizer(folder: Path):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise FusedStatsError(f"cannot load the tokenizer of {str(folder)!r}: {exc}") from None


def _encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        return list(text.encode("utf-8"))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _documents(source: Path, field: str):
    if source.is_dir():
        try:
            import datasets
        except ImportError:
            raise FusedStatsError(
                f"{str(source)!r} is a folder: reading a save_to_disk dataset needs `datasets` "
                "(pip install datasets)"
            ) from None
        try:
            ds = datasets.load_from_disk(str(source))
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise FusedStatsError(f"cannot read {str(source)!r} as a save_to_disk dataset: {exc}") from None
        if isinstance(ds, datasets.DatasetDict):
            raise FusedStatsError(
                f"{str(source)!r} holds a DatasetDict with splits {list(ds)}; name one split's folder"
            )
        if field not in ds.column_names:
            raise FusedStatsError(
                f"dataset {str(source)!r} has no column {field!r} (columns: {ds.column_names}); set [data] field"
            )
        for i, text in enumerate(ds[field]):
            if not isinstance(text, str):
                raise FusedStatsError(f"dataset {str(source)!r} row {i}: {field!r} is not a string")
            yield text
        return
    if source.suffix == ".txt":
        yield source.read_text(encoding="utf-8", errors="replace")
        return
    if source.suffix == ".jsonl":
        with source.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise FusedStatsError(f"{str(source)!r} line {number} is not JSON: {exc.msg}") from None
                text = record.get(field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise FusedStatsError(
                        f"{str(source)!r} line {number} has no string field {field!r} (set [data] field)"
                    )
                yield text
        return
    raise FusedStatsError(
        f"data source {str(source)!r}: expected .npy token ids, .txt, .jsonl or a save_to_disk folder"
    )


def cut_rows(rows, seq_len: int, what: str, setting: str):
    """``(rows, note)``: ``(N, T)`` token rows cut to their first ``seq_len`` tokens when
    ``T > seq_len`` (``note`` says so, naming ``setting``; else None); numpy or torch rows.
    Shorter rows are the caller's to judge: a suite needs exactly ``seq_len``."""
    n, length = int(rows.shape[0]), int(rows.shape[1])
    if length <= seq_len:
        return rows, None
    return rows[:, :seq_len], (
        f"{what} holds {(n, length)} sequences; using the first {setting} {seq_len} tokens of each: "
        f"{(n, seq_len)}"
    )


def _token_windows(source: Path, seq_len: int, sequences: int, stream: str, notes: list) -> np.ndarray:
    try:
        arr = np.load(source, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise FusedStatsError(f"cannot read {str(source)!r} as .npy: {exc}") from None
    if arr.dtype.kind not in "iu":
        raise FusedStatsError(f"token file {str(source)!r} has dtype {arr.dtype}; expected integers")
    if arr.ndim == 1:
        have = arr.shape[0] // seq_len
        rows = arr[: min(have, sequences) * seq_len].reshape(-1, seq_len)
    elif arr.ndim == 2:
        if arr.shape[1] < seq_len:
            raise FusedStatsError(
                f"token file {str(source)!r} holds sequences of length {arr.shape[1]}, shorter than "
                f"[data] seq_len = {seq_len}; set seq_len = {arr.shape[1]} or less (longer rows are cut)"
            )
        rows, note = cut_rows(arr, seq_len, f"[data] {stream} = {str(source)!r}", "[data] seq_len")
        rows = rows[:sequences]
        if note:
            notes.append(note)
        have = arr.shape[0]
    else:
        raise FusedStatsError(f"token file {str(source)!r} has shape {arr.shape}; expected 1-D or 2-D")
    if have < sequences:
        raise FusedStatsError(
            f"[data] {stream} = {str(source)!r} is too short: {have} windows of seq_len {seq_len}, "
            f"sequences = {sequences} requested"
        )
    return np.array(rows, dtype=np.int64)  # copies only the windows out of the memory map


def stream_windows(
    source: Path, tokenizer, seq_len: int, sequences: int, field: str, stream: str, notes: list | None = None
):
    """``(sequences, seq_len)`` int64 windows of one source (module docstring); what was done to
    the source to make them is appended to ``notes``."""
    if source.suffix == ".npy" and source.is_file():
        return _token_windows(source, seq_len, sequences, stream, [] if notes is None else notes)
    need = seq_len * sequences
    sep = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    ids: list[int] = []
    for doc in _documents(source, field):
        if ids and sep is not None:
            ids.append(sep)
        ids.extend(_encode(tokenizer, doc))
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise FusedStatsError(
            f"[data] {stream} = {str(source)!r} is too short: {len(ids):,} tokens make "
            f"{len(ids) // seq_len} windows of seq_len {seq_len}, sequences = {sequences} requested"
        )
    return np.asarray(ids[:need], dtype=np.int64).reshape(sequences, seq_len)


def build_windows(data: dict, identity: str, tokenizer) -> Windows:
    rows, sources, notes = {}, {}, []
    for stream in ("train", "test"):
        rows[stream] = stream_windows(
            data[stream], tokenizer, data["seq_len"], data["sequences"], data["field"], stream, notes
        )
        sources[stream] = str(data[stream])
    return Windows(tokenizer=identity, train=rows["train"], test=rows["test"], sources=sources, notes=notes)


def held_out_warnings(data: dict, windows: dict) -> list[str]:
    """Why the test windows are not held out: the same file as train, or the same windows."""
    if data["train"] == data["test"]:
        return [
            f"[data] train and test are the same file ({str(data['train'])!r}): the test statistics are "
            "not held out (the train windows measured again)"
        ]
    same = [key for key, w in windows.items() if w.sha256("train") == w.sha256("test")]
    if same:
        return ["[data] train and test give identical windows: the test statistics are not held out"]
    return []
