"""No gloo thread outlives a rank: what kept them alive at exit, and dsforge.runtime.teardown's cure.

Two ranks, one ZeRO-1 DeepSpeed engine each, one step. Left alone after ``destroy_process_group``,
the engine (held by ZeRO's gradient-accumulator hooks, a cycle through C++) keeps its groups and
their threads; ``release_engine`` and ``leave`` join them all. The live-thread count is read from
/proc (thread names), so the test runs on Linux only.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsforge.runtime.teardown import before_init, communication_threads, leave, release_engine
from tests.runtime.launcher import free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names come from /proc")]


def one_engine_step() -> object:
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           config=config)
    loss = engine(torch.ones(1, 8)).sum()
    engine.backward(loss)
    engine.step()
    return engine


def join(port: int) -> None:
    import deepspeed.comm as ds_comm

    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


def worker(rank: int, world: int, ports: tuple[int, int]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    before_init()
    # As dsforge's runtime: the engine released, then the groups left: nothing is left running.
    join(ports[0])
    engine = one_engine_step()
    assert communication_threads(), "gloo runs no threads: this test cannot see what it is about"
    release_engine(engine)
    del engine
    leave(synchronize=True)
    assert communication_threads() == [], (f"rank {rank}: {communication_threads()} "
                                           f"still running after leave()")

    # Without release_engine the engine, and the groups it holds, survive destroy_process_group.
    join(ports[1])
    engine = one_engine_step()
    del engine
    import deepspeed.comm as ds_comm

    dist.barrier()
    ds_comm.destroy_process_group()
    gc.collect()
    left = communication_threads()
    assert left, f"rank {rank}: the unreleased engine's groups stopped on their own; the cause is elsewhere"
    (engine,) = [o for o in gc.get_objects() if type(o).__name__ == "DeepSpeedEngine"]
    release_engine(engine)
    del engine
    gc.collect()
    assert communication_threads() == [], f"rank {rank}: {communication_threads()} after releasing the engine"


def test_release_engine_and_leave_stop_every_gloo_thread() -> None:
    mp.spawn(worker, args=(2, (free_port(), free_port())), nprocs=2, join=True)
