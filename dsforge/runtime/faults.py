"""A test hook that makes one rank fail on purpose: ``DSFORGE_FAULT=<how>:<rank>:<point>:<step>``.

``how``: ``kill`` (SIGKILL itself: what the out-of-memory killer or a lost node does), ``raise`` (an
exception on that rank alone) or ``exit`` (leave with code 3 without a word); ``point``: ``step``
(at the start of optimizer step ``step``, 1-based) or ``save`` (inside the save of the checkpoint
after ``step`` steps, once this rank's files are written and before the checkpoint is committed).
The tests of lost ranks and interrupted checkpoints use it; unset, it costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "DSFORGE_FAULT"
HOWS, POINTS = ("kill", "raise", "exit"), ("step", "save")


class InjectedFault(RuntimeError):
    """The failure DSFORGE_FAULT asked for (``raise``)."""


def parse(text: str) -> tuple[str, int, str, int]:
    """``how:rank:point:step`` as its four parts; ValueError with the expected form otherwise."""
    parts = text.split(":")
    if len(parts) != 4 or parts[0] not in HOWS or parts[2] not in POINTS:
        raise ValueError(f"{ENV}={text!r}: expected <{'|'.join(HOWS)}>:<rank>:<{'|'.join(POINTS)}>:<step>")
    return parts[0], int(parts[1]), parts[2], int(parts[3])


def fault(point: str, step: int) -> None:
    """Fail here if DSFORGE_FAULT names this rank, this point and this step."""
    text = os.environ.get(ENV)
    if not text:
        return
    how, rank, at, when = parse(text)
    if at != point or when != step or rank != int(os.environ.get("RANK", "0")):
        return
    print(f"dsforge: rank {rank}: {ENV}: {how} at {point} {step}", file=sys.stderr, flush=True)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exit":
        os._exit(3)
    raise InjectedFault(f"{ENV}: injected failure at {point} {step}")
