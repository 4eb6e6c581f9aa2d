"""All-reduce of accumulators over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

:meth:`Accumulator.all_reduce <fused_stats.accumulators.base.Accumulator.all_reduce>` runs, on
every rank of a group:

1. one ``all_gather`` of the accumulator's settings row (dims, counts, unit, ...): a disagreement
   raises the same :class:`~fused_stats.FusedStatsError` on every rank, before any state changes,
   instead of a hang;
2. the accumulator's alignment hook (for the centred sums of a GradStats: the centre of the lowest
   rank with data is broadcast and every rank moves its sums there exactly; "with a shared centre,
   a plain all-reduce SUM is a valid merge", docs/design.md, section 2);
3. :func:`reduce_fields`: one ``ReduceOp.SUM`` over every declared ``sum`` field, one
   ``ReduceOp.MAX`` over every ``max`` field, an ``all_gather`` (padded to the longest, in rank
   order) of every ``rows`` field, whose ``gram`` field is rebuilt in fp64 from the gathered rows.

Communication runs on the device the process group needs (CUDA for NCCL, CPU for gloo); the state
stays on its own device. :func:`all_reduce_many` reduces a named set of accumulators of any kinds
after checking that all ranks hold the same names and kinds.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..errors import FusedStatsError

F64 = torch.float64


def require_initialised() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise FusedStatsError(
            "all_reduce needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group('nccl' or 'gloo', ...))"
        )


def comm_device(group, state_device: torch.device | None) -> torch.device:
    """Device the collectives run on: CUDA for NCCL, CPU for gloo (whatever the state's device)."""
    backend = str(dist.get_backend(group)).lower()
    on_cuda = state_device is not None and state_device.type == "cuda"
    if backend == "nccl" or ("nccl" in backend and (on_cuda or "gloo" not in backend)):
        return state_device if on_cuda else torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend or backend == "mpi":
        return torch.device("cpu")
    return state_device if state_device is not None else torch.device("cpu")


def global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def gather_rows(row: list[int], group, device) -> torch.Tensor:
    """(world, len(row)) int64 table of every rank's row, on CPU."""
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    return torch.stack(table).cpu()


def reduce_fields(acc, state: dict, counters: dict | None, table: torch.Tensor, group, device) -> dict:
    """The reduced state: ``state`` (this rank's, aligned) combined over the ranks field by field
    as the declaration says; ``counters``: those of the result (None: no rank holds samples, the
    state stays as it is)."""
    if counters is None:
        return state
    out = dict(state)
    out.update(counters)
    present = acc.present_fields(counters)
    for f in acc.FIELDS:
        if f not in present:
            out[f.name] = None
    state_device = acc.device if acc.device is not None else device
    for op, reduction in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max")):
        fields = [f for f in present if f.reduction == reduction]
        if not fields:
            continue
        flat = torch.cat([state[f.name].reshape(-1).to(device=device, dtype=F64) for f in fields])
        dist.all_reduce(flat, op=op, group=group)
        flat = flat.to(state_device)
        start = 0
        for f in fields:
            size = state[f.name].numel()
            out[f.name] = flat[start : start + size].reshape(state[f.name].shape).clone()
            start += size
    rows = [f for f in present if f.reduction == "rows"]
    if rows:
        counts = acc._row_counts(table)
        longest = max(counts)
        world = dist.get_world_size(group)
        for f in rows:
            mine = state[f.name]
            padded = torch.zeros(longest, *mine.shape[1:], dtype=F64, device=device)
            padded[: mine.shape[0]] = mine.to(device)
            gathered = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(gathered, padded, group=group)
            out[f.name] = torch.cat([g[:c] for g, c in zip(gathered, counts)], dim=0).to(state_device)
    for f in present:
        if f.reduction == "gram":
            # fp64 GEMM on purpose: recentred rows are not fp32-representable any more
            out[f.name] = out[f.rows] @ out[f.rows].T
    return out


def names_digest(names) -> int:
    """A 63-bit digest of an ordered list of names (to check that ranks agree, without pickle)."""
    digest = hashlib.sha256("\n".join(names).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tensor_digest(value: torch.Tensor) -> int:
    """A 63-bit digest of a tensor's dtype, shape and bytes (ranks compare ``w_in`` by it)."""
    flat = value.detach().to("cpu").contiguous().reshape(-1)
    digest = hashlib.sha256(f"{flat.dtype}{tuple(value.shape)}".encode())
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)


def all_reduce_many(accs: dict, group=None) -> None:
    """``all_reduce`` of every accumulator of ``accs`` (name -> accumulator of any kind).

    The names are visited in sorted order; all ranks must hold the same names with the same kinds
    (checked first with one all_gather of a digest, so a mismatch raises on every rank rather than
    deadlocking).
    """
    require_initialised()
    names = sorted(accs)
    for name in names:
        if not isinstance(getattr(accs[name], "KIND", None), str):
            raise FusedStatsError(
                f"all_reduce: cannot reduce a {type(accs[name]).__name__} at {name!r} (not an accumulator)"
            )
    kinds = [accs[name].KIND for name in names]
    some = next(iter(accs.values()), None)
    device = comm_device(group, None if some is None else some.device)
    table = gather_rows([names_digest([f"{k}:{n}" for k, n in zip(kinds, names)]), len(names)], group, device)
    if bool((table != table[0]).any()):
        raise FusedStatsError(
            f"all_reduce: ranks hold different sets of accumulators (counts by rank "
            f"{table[:, 1].tolist()}); this rank has {names}"
        )
    for name in names:
        accs[name].all_reduce(group)
