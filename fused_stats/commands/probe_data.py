"""The probe command's token streams: windows of a 1-D stream, the train/test split of rows, the
batches of each stream, and the warning when a stream is shorter than its batches ask for."""

from __future__ import annotations

import sys

from ..errors import FusedStatsError

# the share of a --text / --tokens stream held out as the test stream (its last rows)
HELD_OUT = 0.1


def _split_stream(ids, T: int, what: str):
    n = ids.numel() // T
    if n < 2:
        raise FusedStatsError(f"{what}: fewer than 2 windows of --seq-len {T}")
    windows = ids[: n * T].view(n, T)
    return _split_rows(windows, what)


def _split_rows(rows, what: str):
    n = rows.shape[0]
    n_test = max(1, round(n * HELD_OUT))
    if n - n_test < 1:
        raise FusedStatsError(f"{what}: {n} sequences are too few for a train and a test part")
    return (
        rows[: n - n_test],
        rows[n - n_test :],
        f"{what}; first {n - n_test} sequences -> train, last {n_test} -> test",
    )


def short_of_data(stream: str, have: int, count: int, args) -> None:
    """A line on stderr when a stream holds fewer sequences than its batches ask for: the run goes
    on with what there is, but M or K is then smaller than the command line suggests."""
    want = count * args.batch_size
    if have < want:
        option = "--batches" if stream == "train" else "--test-batches"
        print(
            f"warning: the {stream} stream has {have} sequences, fewer than the {want} that "
            f"{option} {count} x --batch-size {args.batch_size} ask for; it runs on {have} "
            f"({'M' if stream == 'train' else 'K'} = {have}). Give more text or lower {option}.",
            file=sys.stderr,
        )


def _batches(rows, batch_size: int, count: int, device):
    """Batches of ``input_ids`` with ``labels`` (the same ids: ``causal_lm_loss`` shifts them)."""
    out = [rows[i : i + batch_size].to(device) for i in range(0, rows.shape[0], batch_size)][:count]
    return [{"input_ids": b, "labels": b} for b in out]
