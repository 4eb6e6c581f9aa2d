"""Two-process gloo runs for the distributed tests.

A worker ``worker(rank, world, outdir)`` joins a gloo group through a file rendezvous in
``outdir`` (no TCP port to race concurrent jobs for; see :func:`init_gloo`), does its checks and
writes ``rank{r}.json``; :func:`run_two_ranks` spawns it twice and returns both JSON results.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def init_gloo(rank: int, world: int, outdir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{outdir}/rendezvous", rank=rank, world_size=world)


def run_two_ranks(worker, outdir) -> list[dict]:
    mp.spawn(worker, args=(2, str(outdir)), nprocs=2, join=True)
    return [json.loads((Path(outdir) / f"rank{r}.json").read_text()) for r in range(2)]
