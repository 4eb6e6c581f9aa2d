"""All-reduce of accumulators over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

Every rank moves its state to one common centre (broadcast from the lowest rank that has data),
after which the centred sums add (DESIGN section 2: with a shared centre a plain SUM is a valid
merge); ``max |q|`` is a MAX. Pools are gathered and their Gram matrix rebuilt from the rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import FusedStatsError

F64 = torch.float64


def all_reduce_grad_stats(acc, group=None) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise FusedStatsError("all_reduce needs an initialised torch.distributed process group")
    world = dist.get_world_size(group)
    device = acc.device if acc.device is not None else (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl" else torch.device("cpu"))
    # agree on shape and mode first so a mismatch is an error on every rank, not a hang
    info = torch.tensor([acc.dim, acc.n, 1 if acc.mode == "pool" else 0], dtype=torch.int64,
                        device=device)
    infos = [torch.empty_like(info) for _ in range(world)]
    dist.all_gather(infos, info, group=group)
    infos = torch.stack(infos).cpu()
    if (infos[:, 0] != acc.dim).any():
        raise FusedStatsError(f"all_reduce: ranks disagree on dim: {infos[:, 0].tolist()}")
    counts = infos[:, 1]
    if int(counts.sum()) == 0:
        return
    source = int(torch.nonzero(counts > 0)[0, 0])
    centre = acc.centre.clone() if acc.n else torch.zeros(acc.dim, dtype=F64, device=device)
    dist.broadcast(centre, src=dist.get_global_rank(group, source) if group is not None else source,
                   group=group)
    all_pool = bool((infos[counts > 0, 2] == 1).all()) and acc.second_moment != "dense"
    if acc.n == 0:
        acc._init_state(centre)
        if not all_pool and acc.mode == "pool":
            acc._to_dense()
    else:
        acc._recentre(centre)
        if not all_pool and acc.mode == "pool":
            acc._to_dense()
    stacked = torch.cat([acc.s, acc.t, acc.a1.reshape(1), acc.a2.reshape(1),
                         acc.norm_sum.reshape(1),
                         torch.tensor([float(acc.n)], dtype=F64, device=device)])
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
    d = acc.dim
    acc.s, acc.t = stacked[:d].clone(), stacked[d:2 * d].clone()
    acc.a1, acc.a2, acc.norm_sum = (stacked[2 * d + k].clone() for k in range(3))
    acc.n = int(round(float(stacked[2 * d + 3])))
    dist.all_reduce(acc.norm_max, op=dist.ReduceOp.MAX, group=group)
    if acc.mode == "dense":
        dist.all_reduce(acc.S, op=dist.ReduceOp.SUM, group=group)
        return
    # pools: gather every rank's rows (padded to the longest), rebuild the Gram matrix
    longest = int(counts.max())
    padded = torch.zeros(longest, d, dtype=F64, device=device)
    padded[: acc.pool.shape[0]] = acc.pool
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    rows = torch.cat([g[: int(c)] for g, c in zip(gathered, counts)], dim=0)
    acc.pool = rows
    acc.gram = rows @ rows.T
    limit = acc.pool_limit
    if acc.second_moment == "auto" and limit is not None and acc.n > limit:
        acc._to_dense()
