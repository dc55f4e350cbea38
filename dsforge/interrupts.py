"""Interrupts as exceptions: SIGTERM raises like Ctrl-C, so the cleanup that runs on one runs on both.

The CLI (and every rank of a job) turns SIGTERM into ``Terminated``, a KeyboardInterrupt: a compile
puts the old job directory back, ``dsforge run`` stops its launcher, a rank reports where it
stopped. Exit codes follow the shell's convention, 128 + the signal: 130 for Ctrl-C, 143 for SIGTERM.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (a launcher, a scheduler or `kill` asked this process to stop)."""

    signum = signal.SIGTERM


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def catch_sigterm() -> Callable[[], None]:
    """Raise Terminated on SIGTERM from now on (main thread only: elsewhere Python cannot set handlers).

    Returns the function that puts the previous handler back (for callers that return, like tests).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, _raise_terminated)

    def restore() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)

    return restore


def exit_code(exc: BaseException) -> int:
    """128 + the signal behind an interrupt: 143 for Terminated, 130 for Ctrl-C."""
    return 128 + int(getattr(exc, "signum", signal.SIGINT))
