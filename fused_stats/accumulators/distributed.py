"""All-reduce of accumulators over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

Each rank holds a :class:`~fused_stats.accumulators.grad_stats.GradStats` fed with its own share of
the samples. After :func:`all_reduce_grad_stats` every rank holds the state of one accumulator fed
with all of them. The merge is the one of DESIGN section 2 ("with a shared centre, a plain
all-reduce SUM is a valid merge"):

1. every rank publishes ``(dim, n, mode, second_moment, unit, pool_capacity, skipped)`` with one
   ``all_gather``; a disagreement (or a pool that would overflow its capacity) raises the same
   :class:`FusedStatsError` on every rank, before any state changes, instead of a hang;
2. the centre ``c`` of the lowest rank that has data is broadcast, and every rank moves its sums to
   ``c`` with the exact shift of DESIGN section 2 (``s' = s − nδ``, ``S' = S − δsᵀ − sδᵀ + nδδᵀ``,
   ``A1'``, ``t'``, ``A2'``; for a pool ``Y' = Y − 1δᵀ``);
3. ``n, s, t, A1, A2, Σ|q|`` and a dense ``S`` are summed (``ReduceOp.SUM``), ``max |q|`` is a
   ``ReduceOp.MAX``; pools are all-gathered (padded to the longest) in rank order and their Gram
   matrix ``G = Y Yᵀ`` is rebuilt in fp64 from the gathered rows.

The representation after the reduce is the one a single accumulator fed with all samples would
have: a pool only if every rank with data holds a pool and (for ``auto``) the total still fits
under the switch point, dense otherwise. All totals stay in fp64. Communication runs on the device
the backend needs (CUDA for NCCL, CPU for gloo); the state stays on its own device.

:func:`all_reduce_cross_stats` does the same for a
:class:`~fused_stats.accumulators.cross_stats.CrossStats` (the depth probe's cross-gradient sums).
Its state has no centre: ``n``, ``batches``, ``Σ c_i``, ``Σ |c_i|_F²``, the tuple sums ``u`` and
their counts ``p`` are all plain sums, so the reduce is a SUM of each. First every rank publishes
``(dim, rank, in_dim, activation, unit, n, batches, p, digest of w_in)`` with one ``all_gather``; a
disagreement on the block (or on the unit among ranks with samples) raises the same error on every
rank before anything changes. The integer counts are summed from that table (exact); the fp64 sums
go through one ``all_reduce``.

:func:`all_reduce_many` does the same for a named set of accumulators (e.g. every point and stream of
a probe, GradStats and CrossStats alike) after checking that all ranks hold the same names and kinds.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..errors import FusedStatsError

F64 = torch.float64
_SECOND_MOMENTS = ("auto", "dense", "pool")
_UNITS = ("sample", "position", "flat")
# columns of the per-rank info row exchanged before any state moves
_DIM, _N, _IS_POOL, _SECOND, _UNIT, _CAPACITY, _SKIPPED, _NINFO = range(8)


def _require_initialised() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise FusedStatsError(
            "all_reduce needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group('nccl' or 'gloo', ...))")


def comm_device(group, state_device: torch.device | None) -> torch.device:
    """Device the collectives run on: CUDA for NCCL, CPU for gloo (whatever the state's device)."""
    backend = str(dist.get_backend(group)).lower()
    on_cuda = state_device is not None and state_device.type == "cuda"
    if backend == "nccl" or ("nccl" in backend and (on_cuda or "gloo" not in backend)):
        return (state_device if on_cuda else torch.device("cuda", torch.cuda.current_device()))
    if "gloo" in backend or backend == "mpi":
        return torch.device("cpu")
    return state_device if state_device is not None else torch.device("cpu")


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _info_row(acc) -> list[int]:
    row = [0] * _NINFO
    row[_DIM] = acc.dim
    row[_N] = acc.n
    row[_IS_POOL] = 1 if acc.mode == "pool" else 0
    row[_SECOND] = _SECOND_MOMENTS.index(acc.second_moment)
    row[_UNIT] = -1 if acc.unit is None else _UNITS.index(acc.unit)
    row[_CAPACITY] = -1 if acc.pool_capacity is None else acc.pool_capacity
    row[_SKIPPED] = acc.skipped_batches
    return row


def _gather_info(acc, group, device) -> torch.Tensor:
    """(world, _NINFO) int64 table of every rank's info row, on CPU."""
    world = dist.get_world_size(group)
    info = torch.tensor(_info_row(acc), dtype=torch.int64, device=device)
    table = [torch.empty_like(info) for _ in range(world)]
    dist.all_gather(table, info, group=group)
    return torch.stack(table).cpu()


def _check_agreement(acc, infos: torch.Tensor) -> None:
    """Raise (identically on every rank) unless the ranks' accumulators can be summed."""
    where = acc._where()
    for col, what in ((_DIM, "dim"), (_SECOND, "second_moment"), (_CAPACITY, "pool_capacity")):
        values = infos[:, col].tolist()
        if len(set(values)) > 1:
            if col == _SECOND:
                values = [_SECOND_MOMENTS[v] for v in values]
            raise FusedStatsError(f"all_reduce{where}: ranks disagree on {what}: {values} (by rank)")
    units = {int(u) for u, n in zip(infos[:, _UNIT], infos[:, _N]) if n > 0}
    if len(units) > 1:
        raise FusedStatsError(
            f"all_reduce{where}: ranks were fed different units: "
            f"{[None if u < 0 else _UNITS[u] for u in infos[:, _UNIT].tolist()]} (by rank)")
    total = int(infos[:, _N].sum())
    if acc.second_moment == "pool" and acc.pool_capacity is not None and total > acc.pool_capacity:
        raise FusedStatsError(
            f"all_reduce{where}: the ranks hold {infos[:, _N].tolist()} samples, {total} in all, "
            f"more than pool_capacity={acc.pool_capacity}. Use second_moment='auto' or 'dense'")


def _target_mode(acc, infos: torch.Tensor) -> str:
    """The representation one accumulator fed with every rank's samples would end in."""
    if acc.second_moment == "dense":
        return "dense"
    with_data = infos[:, _N] > 0
    if not bool((infos[with_data, _IS_POOL] == 1).all()):
        return "dense"  # an auto accumulator that switched somewhere never switches back
    limit = acc.pool_limit
    if acc.second_moment == "auto" and limit is not None and int(infos[:, _N].sum()) > limit:
        return "dense"
    return "pool"


def all_reduce_grad_stats(acc, group=None) -> None:
    """Replace ``acc`` on every rank of ``group`` by the merge of all ranks' accumulators.

    A collective: every rank of ``group`` must call it, in the same order for several accumulators.
    Errors found in the exchanged configuration are raised on every rank and leave ``acc`` as it was.
    """
    from .grad_stats import GradStats

    _require_initialised()
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    device = comm_device(group, acc.device)
    infos = _gather_info(acc, group, device)
    _check_agreement(acc, infos)
    counts = infos[:, _N]
    total = int(counts.sum())
    skipped = int(infos[:, _SKIPPED].sum())
    if total == 0:
        acc.skipped_batches = skipped
        return
    state_device = acc.device if acc.device is not None else device
    units = [int(u) for u, n in zip(infos[:, _UNIT], counts) if n > 0]
    target = _target_mode(acc, infos)

    source = int(torch.nonzero(counts > 0)[0, 0])
    centre = (acc.centre.to(device=device, dtype=F64, copy=True) if rank == source
              else torch.zeros(acc.dim, dtype=F64, device=device))
    dist.broadcast(centre, src=_global_rank(group, source), group=group)
    centre = centre.to(state_device)

    # Work on a shallow twin: shifting the centre builds new tensors, so ``acc`` keeps its state
    # until the commit at the end (a failed collective leaves it untouched).
    work = GradStats(acc.dim, acc.second_moment, acc.pool_capacity, state_device, acc.backend,
                     acc.nonfinite, acc.name)
    if acc.n == 0:
        if target == "dense":
            work.mode = "dense"
        work._init_state(centre)
    else:
        work._adopt(acc)
        work._recentre(centre)
        if target == "dense" and work.mode == "pool":
            work._to_dense()

    d = acc.dim
    sums = torch.cat([work.s, work.t, work.a1.reshape(1), work.a2.reshape(1),
                      work.norm_sum.reshape(1)]).to(device=device, dtype=F64)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    norm_max = work.norm_max.to(device=device, dtype=F64, copy=True).reshape(1)
    dist.all_reduce(norm_max, op=dist.ReduceOp.MAX, group=group)

    if target == "dense":
        S = work.S.to(device=device, dtype=F64, copy=True)
        dist.all_reduce(S, op=dist.ReduceOp.SUM, group=group)
        work.S = S.to(state_device)
    else:
        longest = int(counts.max())
        padded = torch.zeros(longest, d, dtype=F64, device=device)
        padded[: work.pool.shape[0]] = work.pool.to(device)
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=group)
        rows = torch.cat([g[: int(c)] for g, c in zip(gathered, counts)], dim=0).to(state_device)
        work.pool = rows
        # fp64 GEMM on purpose: the recentred rows are not fp32-representable any more
        work.gram = rows @ rows.T

    sums = sums.to(state_device)
    work.s, work.t = sums[:d].clone(), sums[d:2 * d].clone()
    work.a1, work.a2, work.norm_sum = (sums[2 * d + k].clone() for k in range(3))
    work.norm_max = norm_max.to(state_device).reshape(())
    work.n = total
    work.unit = _UNITS[units[0]]
    work.skipped_batches = skipped
    acc._adopt(work)


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


# columns of the per-rank info row of a CrossStats
(_C_DIM, _C_RANK, _C_IN, _C_ACT, _C_UNIT, _C_N, _C_BATCHES, _C_P2, _C_P3, _C_P4, _C_W,
 _C_NINFO) = range(12)
_CROSS_UNITS = ("sample", "position")


def _cross_info_row(acc) -> list[int]:
    from ..contracts import ACTIVATIONS

    row = [0] * _C_NINFO
    row[_C_DIM], row[_C_RANK], row[_C_IN] = acc.dim, acc.rank, acc.in_dim
    row[_C_ACT] = ACTIVATIONS.index(acc.activation)
    row[_C_UNIT] = -1 if acc.unit is None else _CROSS_UNITS.index(acc.unit)
    row[_C_N], row[_C_BATCHES] = acc.n, acc.batches
    row[_C_P2], row[_C_P3], row[_C_P4] = acc.p
    row[_C_W] = tensor_digest(acc.w_in)
    return row


def _check_cross_agreement(acc, infos: torch.Tensor) -> None:
    """Raise (identically on every rank) unless the ranks hold statistics of the same block."""
    from ..contracts import ACTIVATIONS

    where = acc._where()
    diffs = []
    for col, what in ((_C_DIM, "dim"), (_C_RANK, "rank"), (_C_IN, "in_dim"),
                      (_C_ACT, "activation"), (_C_W, "w_in")):
        values = infos[:, col].tolist()
        if len(set(values)) > 1:
            if col == _C_ACT:
                values = [ACTIVATIONS[v] for v in values]
            if col == _C_W:
                # which ranks share a projection: group labels by first occurrence, not raw digests
                first = {}
                values = [first.setdefault(v, len(first)) for v in values]
                diffs.append(f"w_in (dtype or values; projection groups by rank {values})")
            else:
                diffs.append(f"{what} {values} (by rank)")
    units = {int(u) for u, n in zip(infos[:, _C_UNIT], infos[:, _C_N]) if n > 0}
    if len(units) > 1:
        diffs.append(f"unit {[None if u < 0 else _CROSS_UNITS[u] for u in infos[:, _C_UNIT].tolist()]} "
                     "(by rank)")
    if diffs:
        raise FusedStatsError(f"all_reduce of cross statistics{where}: ranks disagree on "
                              + "; ".join(diffs))


def all_reduce_cross_stats(acc, group=None) -> None:
    """Replace a :class:`CrossStats` on every rank of ``group`` by the sum over all ranks.

    A collective (every rank calls it, in the same order for several accumulators). A mismatch of
    the block (dim, rank, in_dim, activation, w_in) or of the unit raises on every rank and leaves
    ``acc`` as it was; so does a failed collective (the state is replaced only at the end).
    """
    _require_initialised()
    device = comm_device(group, acc.device)
    world = dist.get_world_size(group)
    info = torch.tensor(_cross_info_row(acc), dtype=torch.int64, device=device)
    table = [torch.empty_like(info) for _ in range(world)]
    dist.all_gather(table, info, group=group)
    infos = torch.stack(table).cpu()
    _check_cross_agreement(acc, infos)
    # the float sums of an empty accumulator are zeros, so every rank takes part alike
    sums = torch.cat([acc.c_sum.reshape(-1), acc.sq_norm_sum.reshape(1), acc.u]).to(
        device=device, dtype=F64, copy=True)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    sums = sums.to(acc.device)
    units = [int(u) for u, n in zip(infos[:, _C_UNIT], infos[:, _C_N]) if n > 0]
    totals = infos.sum(dim=0).tolist()
    dr = acc.dim * acc.rank
    # ---- commit
    acc.c_sum = sums[:dr].reshape(acc.dim, acc.rank).clone()
    acc.sq_norm_sum = sums[dr].clone()
    acc.u = sums[dr + 1:dr + 4].clone()
    acc.n, acc.batches = int(totals[_C_N]), int(totals[_C_BATCHES])
    acc.p = [int(totals[_C_P2]), int(totals[_C_P3]), int(totals[_C_P4])]
    acc.unit = _CROSS_UNITS[units[0]] if units else None


def _kind(acc) -> str:
    from .cross_stats import CrossStats
    from .grad_stats import GradStats

    if isinstance(acc, GradStats):
        return "grad"
    if isinstance(acc, CrossStats):
        return "cross"
    raise FusedStatsError(f"all_reduce: cannot reduce a {type(acc).__name__} (GradStats or CrossStats)")


def all_reduce_many(accs: dict, group=None) -> None:
    """:func:`all_reduce_grad_stats` / :func:`all_reduce_cross_stats` for every accumulator of
    ``accs`` (name -> GradStats or CrossStats).

    The names are visited in sorted order; all ranks must hold the same names with the same kinds
    (checked first with one all_gather of a digest, so a mismatch raises on every rank rather than
    deadlocking).
    """
    _require_initialised()
    names = sorted(accs)
    kinds = [_kind(accs[name]) for name in names]
    some = next(iter(accs.values()), None)
    device = comm_device(group, None if some is None else some.device)
    mine = torch.tensor([names_digest([f"{k}:{n}" for k, n in zip(kinds, names)]), len(names)],
                        dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)
    table = torch.stack(table).cpu()
    if bool((table != table[0]).any()):
        raise FusedStatsError(
            f"all_reduce: ranks hold different sets of accumulators (counts by rank "
            f"{table[:, 1].tolist()}); this rank has {names}")
    for name, kind in zip(names, kinds):
        if kind == "grad":
            all_reduce_grad_stats(accs[name], group)
        else:
            all_reduce_cross_stats(accs[name], group)
