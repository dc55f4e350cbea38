"""The launcher's standard error, relayed by `dsforge run` without torchrun's own ChildFailedError block.

When a rank fails, torchrun ends with an uncaught ``ChildFailedError``: a Python traceback of its own
agent and a framed summary ("train.py FAILED ... Root Cause"), printed after the rank's one-line
dsforge report, which it buries. `dsforge run` reads the launcher's stderr through a pipe and copies
it to its own file descriptor 2 as it comes, line by line, except that an unprefixed traceback is
held back until the next one starts or the stream ends: held back at the end, a traceback whose
exception is ``ChildFailedError`` is dropped (dsforge's report names the failed rank instead). Any
other traceback (a rank's, a launcher bug) is passed on whole, in order.
"""

from __future__ import annotations

import os
import threading
from typing import IO

TRACEBACK = b"Traceback (most recent call last):"
CHILD_FAILED = b"ChildFailedError"


def _write(fd: int, data: bytes) -> None:
    while data:
        try:
            n = os.write(fd, data)
        except InterruptedError:
            continue
        except OSError:
            return  # our stderr is gone: nothing to tell
        data = data[n:]


def _is_child_failed(block: list[bytes]) -> bool:
    """Whether a held-back traceback is torchrun's: its exception line (the first unindented after the
    header)."""
    for line in block[1:]:
        if line[:1] not in (b" ", b"\t") and line.strip():
            return CHILD_FAILED in line
    return False


def relay(stream: IO[bytes], fd: int = 2) -> None:
    """Copy ``stream`` to ``fd`` until it ends, dropping a final ChildFailedError traceback (see the
    module)."""
    held: list[bytes] | None = None
    for line in iter(stream.readline, b""):
        if line.startswith(TRACEBACK):
            if held:
                _write(fd, b"".join(held))
            held = [line]
        elif held is not None:
            held.append(line)
        else:
            _write(fd, line)
    if held and not _is_child_failed(held):
        _write(fd, b"".join(held))


def start_relay(stream: IO[bytes] | None) -> threading.Thread | None:
    """Relay ``stream`` in a daemon thread (join it once the launcher has exited)."""
    if stream is None:
        return None
    thread = threading.Thread(target=relay, args=(stream,), name="dsforge-launcher-stderr", daemon=True)
    thread.start()
    return thread
