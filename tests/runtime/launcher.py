"""Run one function on N gloo processes (torch.multiprocessing.spawn) and fail the test if any rank fails.

A test launches one process group per parallel layout and asserts many things inside it, because
starting processes (importing torch and DeepSpeed) costs seconds on a 2-core machine.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsforge.runtime.teardown import before_init, leave, release_all_engines


def free_port() -> int:
    """An unused TCP port on localhost for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu",
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    before_init()  # dsforge's runtime teardown (dsforge.runtime.teardown): no gloo thread outlives a worker
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    finished = False
    try:
        fn(rank, world, *args)
        finished = True
    finally:
        release_all_engines()  # the engines the test built: ZeRO's hooks keep them and their groups alive
        leave(synchronize=finished)


def run(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Call ``fn(rank, world, *args)`` on ``world`` processes; a rank's exception re-raises here with its
    traceback."""
    mp.spawn(_worker, args=(world, free_port(), fn, args), nprocs=world, join=True)


def report(name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> tuple[float, float]:
    """Compare with a tolerance relative to the reference's scale; print and return (max abs, max rel) error.

    The absolute tolerance is ``rtol * max|expected|``: rounding errors of a reordered fp32 sum scale
    with the magnitude of the terms, not with the (possibly tiny) individual result.
    """
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    scale = expected.abs().max().item() or 1.0
    err = (actual - expected).abs().max().item()
    rel = err / scale
    print(f"PARITY rank={dist.get_rank() if dist.is_initialized() else 0} {name}: "
          f"max abs {err:.2e}, rel {rel:.2e}", flush=True)
    if not rel <= rtol:
        raise AssertionError(f"{name}: max abs error {err:.3e} is {rel:.3e} of the reference's scale "
                             f"{scale:.3e} (allowed {rtol:.0e})")
    return err, rel
