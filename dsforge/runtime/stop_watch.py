"""A rank asked to stop (its launcher's SIGTERM) stops within a bound, whatever its main thread is doing.

Python runs signal handlers in the main thread between bytecodes. A rank blocked inside a collective
(a gloo wait can last the whole process-group timeout) does not see torchrun's SIGTERM before
torchrun's 30 s grace ends in SIGKILL: it then leaves no last word in its status file, and the run's
report counts it among the dead. So SIGTERM is blocked in every thread this process starts and taken
by one watcher thread (``sigwait``): it records the stop in the status file at once, interrupts the
main thread (which unwinds and reports as before, ``dsforge.interrupts.Terminated``), and ends the
process itself when the main thread has not finished within ``GRACE_S``. A main thread that is
already stopping on its own (a lost peer, its own error) is not interrupted again: a second
interrupt would only break its report and teardown.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
from typing import Any

#: Seconds the main thread has to finish after SIGTERM; below torchrun's 30 s grace before SIGKILL.
GRACE_S = 15.0
WHY = "by SIGTERM (a launcher ends every rank when one fails)"

_stopping = threading.Event()


def watch_sigterm(status: Any, rank: int) -> bool:
    """Take SIGTERM in a watcher thread from now on (call before torch starts threads); False where it cannot.

    ``status`` is the rank's ``RankStatus``. Only in the main thread of a process that has no other threads
    yet: the signal mask is inherited by the threads started later, so none of them takes the signal.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        return False
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_watch, args=(status, rank), name="dsforge-sigterm", daemon=True).start()
    return True


def stopping() -> None:
    """Say that the main thread is stopping on its own: SIGTERM then only bounds how long it may take."""
    _stopping.set()


def _watch(status: Any, rank: int) -> None:
    signal.sigwait({signal.SIGTERM})
    if not _stopping.is_set():
        _stopping.set()
        status.update("stopped", message=WHY)  # the last word, even if the main thread never returns
        _thread.interrupt_main(signal.SIGTERM)  # raises Terminated there (dsforge.interrupts' handler)
    time.sleep(GRACE_S)
    print(f"dsforge: rank {rank}: stopped {status.where()} {WHY}; its main thread did not finish within "
          f"{GRACE_S:.0f} s (blocked in a collective), so the process ends now", file=sys.stderr, flush=True)
    os._exit(128 + signal.SIGTERM)
