"""`dsforge calibrate` launched on several nodes: the link inside a node and the link between nodes, measured
apart.

Under a launcher that starts one process per rank on every node (torchrun: RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE and GROUP_RANK, the node's index), the ranks join one process group and build two kinds of
group from where each rank says it runs: one group per node (its local ranks: what TP and the intra-node
collectives cross) and one group per local rank holding that rank of every node (a group that spans nodes:
what DP across nodes crosses). Every group of a kind runs its all-reduces at the same time, as a job's groups
do, so the inter-node figure is per rank while the node's other ranks share the network. Each kind's timings
are fitted to the ring model (`fits.fit_ring`) over its own group size: ``intra_node`` from the node
groups, ``inter_node`` from the spanning groups. Rank 0 reports; the others only take part.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dsforge.runtime.calibrate.fits import fit_ring, median_seconds

MESSAGE_BYTES = tuple(2 ** k for k in range(10, 23, 2))  # 1 KiB ... 4 MiB
#: the small all-reduce of the in-situ measurement (a TP activation of a tiny layer) and the work between
#: calls
IN_SITU_BYTES = 16 << 10
IN_SITU_OPS = 100


@dataclass(frozen=True)
class Launch:
    """This process's place in a launched multi-process world."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    node: int


def launched() -> Launch | None:
    """The launcher's world this process belongs to, or None when it was not started as one of several
    ranks."""
    try:
        world = int(os.environ["WORLD_SIZE"])
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        node = int(os.environ.get("GROUP_RANK", str(rank // max(1, local_world))))
    except (KeyError, ValueError):
        return None
    return Launch(rank, world, local_rank, local_world, node) if world > 1 else None


def _rows(group: Any, device: str, nccl: bool) -> list[tuple[int, float]]:
    """Median all-reduce seconds by message size over ``group`` (every member calls this together)."""
    import torch.distributed as dist

    rows = []
    for size in MESSAGE_BYTES:
        t = torch.ones(size // 4, dtype=torch.float32, device=device)

        def call(t: torch.Tensor = t) -> None:
            dist.all_reduce(t, group=group)
            if nccl:
                torch.cuda.synchronize()

        dist.barrier(group=group)
        rows.append((size, median_seconds(call, 7, 3)))
    return rows


def _link(rows: list[tuple[int, float]], n: int) -> dict[str, Any]:
    alpha, beta = fit_ring(rows, n)
    return {"bandwidth_gbs": round(beta / 1e9, 4), "latency_us": round(alpha * 1e6, 2), "bus_efficiency": 1.0,
            "ranks": n, "rows": rows}


def measure_links(launch: Launch, backend: str) -> dict[str, Any] | None:
    """Join the launched world, time all-reduce inside each node and across nodes; rank 0 gets
    ``{"nodes", "ranks_per_node", "intra_node", "inter_node"}`` (a link is None where its groups have one
    rank), the other ranks None."""
    import torch.distributed as dist

    nccl = backend == "nccl"
    device = f"cuda:{launch.local_rank}" if nccl else "cpu"
    if nccl:
        torch.cuda.set_device(launch.local_rank)
    dist.init_process_group(backend, rank=launch.rank, world_size=launch.world)
    places: list[Any] = [None] * launch.world
    dist.all_gather_object(places, (launch.node, launch.local_rank))
    nodes = sorted({node for node, _ in places})
    slots = sorted({slot for _, slot in places})
    by_node = {n: [r for r, (node, _) in enumerate(places) if node == n] for n in nodes}
    by_slot = {s: [r for r, (_, slot) in enumerate(places) if slot == s] for s in slots}
    # every rank creates every group, in one order (new_group is collective over the world)
    node_groups = {n: dist.new_group(ranks) for n, ranks in by_node.items()}
    slot_groups = {s: dist.new_group(ranks) for s, ranks in by_slot.items()}
    mine_node, mine_slot = by_node[launch.node], by_slot[launch.local_rank]
    intra = _rows(node_groups[launch.node], device, nccl) if len(mine_node) > 1 else []
    dist.barrier()
    inter = _rows(slot_groups[launch.local_rank], device, nccl) if len(mine_slot) > 1 else []
    dist.barrier()
    dist.destroy_process_group()
    if launch.rank != 0:
        return None
    return {"nodes": len(nodes), "ranks_per_node": len(mine_node),
            "intra_node": _link(intra, len(mine_node)) if intra else None,
            "inter_node": _link(inter, len(mine_slot)) if inter else None}


def in_situ_seconds(device: str, nccl: bool, repeats: int = 7, calls: int = 30) -> tuple[float, float]:
    """(median seconds one small all-reduce adds between compute, the spread (max - min) / median of the
    repeats): every rank runs IN_SITU_OPS dispatched ops then an all-reduce of IN_SITU_BYTES, ``calls`` times,
    against the same work without the collectives. A training step issues its collectives this way, between
    operations, so a rank that arrives first waits for its partner to be scheduled; on shared CPU cores that
    wait is what a step pays per collective, and a back-to-back loop of all-reduces (the rows) does not see
    it. Every member of the world calls this together."""
    import torch.distributed as dist

    x = torch.ones(8, 8, device=device)
    t = torch.ones(IN_SITU_BYTES // 4, dtype=torch.float32, device=device)

    def run(collective: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            y = x
            for _ in range(IN_SITU_OPS):
                y = y * 1.0001
            if collective:
                dist.all_reduce(t)
            if nccl:
                torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls

    run(True)  # warm-up
    extra = []
    for _ in range(repeats):  # alternate, so a change of load hits both alike
        bare = run(False)
        extra.append(max(0.0, run(True) - bare))
    median = statistics.median(extra)
    return median, (max(extra) - min(extra)) / median if median > 0 else 0.0


def _collective_worker(rank: int, world: int, init: str, out: str, backend: str) -> None:
    """One rank of the collective benchmark: all-reduce by size, then the in-situ cost; rank 0 writes the
    medians (the in-situ row as size 0 with its spread)."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    rows = []
    for size in MESSAGE_BYTES:
        t = torch.ones(size // 4, dtype=torch.float32, device=device)

        def call(t: torch.Tensor = t) -> None:
            dist.all_reduce(t)
            if backend == "nccl":
                torch.cuda.synchronize()

        dist.barrier()
        rows.append((size, median_seconds(call, 15, 3)))
    situ, spread = in_situ_seconds(device, backend == "nccl")
    if rank == 0:
        Path(out).write_text("\n".join([f"{s} {sec}" for s, sec in rows] + [f"0 {situ} {spread}"]),
                             encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()


@dataclass(frozen=True)
class CollectiveFit:
    """The ring model fitted to the back-to-back rows, and the in-situ cost of a small all-reduce."""

    alpha: float  # seconds per ring step, as a step pays it: the larger of the fit's and the in-situ one's
    beta: float  # bytes/s
    rows: list[tuple[int, float]]
    fitted_alpha: float  # seconds per ring step from the back-to-back rows alone
    in_situ_s: float  # median seconds one IN_SITU_BYTES all-reduce adds between compute
    in_situ_spread: float  # (max - min) / median over the in-situ repeats: the noise of the figure


def in_situ_alpha(in_situ_s: float, beta: float, ranks: int) -> float:
    """The ring model's alpha that prices one IN_SITU_BYTES all-reduce at its in-situ seconds."""
    wire = 2 * (ranks - 1) / ranks * IN_SITU_BYTES / beta
    return max(0.0, in_situ_s - wire) / (2 * (ranks - 1))


def collective_fit(ranks: int, backend: str) -> CollectiveFit:
    """The ring all-reduce model fitted over message sizes, its alpha raised to the in-situ cost where that is
    larger (what a step's collectives pay; see `in_situ_seconds`)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.txt")
        mp.spawn(_collective_worker, args=(ranks, f"file://{tmp}/store", out, backend), nprocs=ranks,
                 join=True)
        lines = [line.split() for line in Path(out).read_text().splitlines()]
    rows = [(int(v[0]), float(v[1])) for v in lines if int(v[0]) > 0]
    situ, spread = next((float(v[1]), float(v[2])) for v in lines if int(v[0]) == 0)
    alpha, beta = fit_ring(rows, ranks)
    return CollectiveFit(max(alpha, in_situ_alpha(situ, beta, ranks)), beta, rows, alpha, situ, spread)
