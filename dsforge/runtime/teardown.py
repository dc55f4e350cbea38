"""Leave torch.distributed so that no communication thread outlives the interpreter.

Each gloo process group owns threads (a ``gloo_tcp_loop`` and two ``pt_gloo_runloop``); they stop
only when the group's C++ object is destroyed, and ``destroy_process_group`` does not destroy it:
it unregisters the group, and whoever still holds it keeps it. A DeepSpeed engine does: ZeRO's
gradient hooks sit on the parameters' gradient accumulators (C++ autograd nodes) and hold the
optimizer, which holds the parameters, which hold their data-parallel group (``param._dp_group``):
a cycle through C++ that Python's garbage collector cannot see. So the engine, its groups and
their threads lived until the process exited, and a rank could abort in the exit code itself
("terminate called without an active exception", SIGABRT) after training had finished.
The world group had one more holder: ``torch.distributed.nn.functional`` (imported by
``torch._dynamo``, which DeepSpeed and transformers load lazily) takes ``group=group.WORLD`` as
default arguments, evaluated when it is imported: imported after ``init_process_group``, ten
functions' defaults hold the world group for good. ``before_init`` imports it first (its defaults
are then None). ``release_engine`` removes the hooks (``engine.destroy()``), ``leave`` destroys the
groups through deepspeed.comm (which also drops DeepSpeed's own references to them) and collects
the garbage, so the groups are destroyed, and their threads joined, while the interpreter is
whole. ``communication_threads`` tells whether any is left.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any

#: Thread names of gloo's communication threads (/proc/<pid>/task/<tid>/comm).
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def before_init() -> None:
    """Call before ``init_process_group``: import what would otherwise capture the world group for good."""
    import torch.distributed.nn.functional  # noqa: F401  -- its default arguments are group.WORLD at import


def release_engine(engine: Any) -> None:
    """Remove the hooks a DeepSpeed engine set on its parameters, so that the engine and its groups can be
    freed.

    Safe on an engine that failed half-way and on objects without ``destroy`` (a plain module).
    """
    destroy = getattr(engine, "destroy", None)
    if callable(destroy):
        with contextlib.suppress(Exception):  # a half-built engine lacks some of what destroy() removes
            destroy()


def release_all_engines() -> int:
    """``release_engine`` on every DeepSpeed engine still alive in this process; how many there were.

    For code that does not hold its engines any more (a test that built several); it walks every
    object the garbage collector tracks, so it costs a fraction of a second.
    """
    import sys

    engine_module = sys.modules.get("deepspeed.runtime.engine")
    if engine_module is None:
        return 0
    engines = [o for o in gc.get_objects() if isinstance(o, engine_module.DeepSpeedEngine)]
    for engine in engines:
        release_engine(engine)
    return len(engines)


def leave(synchronize: bool) -> None:
    """Destroy every process group of this process and free them now (no-op when none was joined).

    ``synchronize``: first wait at a barrier until every rank is done communicating (the end of a
    successful run). A failing rank passes False: the other ranks may be gone.
    """
    try:
        import torch.distributed as dist
    except ImportError:
        return
    if not (dist.is_available() and dist.is_initialized()):
        gc.collect()
        return
    try:
        if synchronize:
            dist.barrier()  # raises when a rank is gone: the groups are destroyed all the same
    finally:
        ds_comm = _deepspeed_comm()
        if ds_comm is not None and ds_comm.is_initialized():
            ds_comm.destroy_process_group()  # torch's, and DeepSpeed's own references to the groups
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


def _deepspeed_comm() -> Any:
    """deepspeed.comm if this process imported it (never imported here: a plain torch job need not have
    it)."""
    import sys

    return sys.modules.get("deepspeed.comm")


def communication_threads() -> list[str]:
    """Names of this process's gloo threads still running (Linux; empty where /proc is absent)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as fh:
                name = fh.read().strip()
        except OSError:
            continue
        if name.startswith(GLOO_THREADS):
            names.append(name)
    return names
