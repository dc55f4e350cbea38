"""One run per job directory: an OS lock beside the job directory (and in an outside checkpoint directory).

`dsforge run` and `dsforge compile --force` take the lock of the job directory before they write anything
there, and `dsforge run` that of its checkpoint directory when ``training.checkpoint.dir`` lies outside
the job directory, before any rank starts. A second command on a directory in use is refused in one
line naming the holder (pid, host, since when) and what to do.

The lock is ``fcntl.flock`` on a small file (``.<job dir name>.dsforge-lock`` beside the job directory,
so that a compile replacing the directory as a whole, or ``--fresh`` deleting it, keeps it;
``.dsforge-lock`` inside a checkpoint directory). The kernel drops it when its holder exits however
it exits (SIGKILL, a crash, a node reboot), so a crashed run never leaves a lock that blocks the next;
the file's text (pid, host, start time) only names the holder. A clean exit deletes the file (while
still holding the lock; a process that opened it meanwhile sees that the path now names another
file, or none, and locks again), so only a crash leaves one: a file whose text names a process that
is no longer running, with no lock held on it, is taken over and the takeover is said.

Network file systems: on NFS (v4, or v3 with lockd) Linux maps flock onto POSIX byte-range locks,
which the server arbitrates, so two hosts exclude each other; after a client crashes the server
releases its locks once the lease (NFSv4, 90 s by default) expires. Mounted with ``nolock`` (or Lustre
with ``localflock``), locks are local to each host: then the lock keeps out a second run on the same
host only, and two hosts sharing a job directory are not detected. The checkpoint directory's
lock has the same limits.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsforge.runtime.errors import RuntimeRefusal

LOCK_SUFFIX = ".dsforge-lock"
CHECKPOINT_LOCK = ".dsforge-lock"  # inside an outside checkpoint directory

#: Locks this process holds (fd open = lock held), released at exit by the kernel.
_HELD: dict[Path, Lock] = {}


class BusyError(RuntimeRefusal, RuntimeError):
    """Another command holds the lock of a directory; the message names it and what to do (DSF612)."""


@dataclass
class Lock:
    """A lock held by this process: the lock file, its open descriptor, and what the takeover (if any) was."""

    path: Path
    fd: int
    took_over: str = ""

    def release(self) -> None:
        """Drop the lock and delete its file (while still holding it: see ``acquire`` for why that is
        safe)."""
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        _HELD.pop(self.path, None)


def lock_file_of_job(job_dir: Path) -> Path:
    """The lock file of the job directory ``job_dir``: a hidden sibling, so replacing the directory keeps
    it."""
    job_dir = Path(os.path.abspath(job_dir))
    return job_dir.parent / f".{job_dir.name}{LOCK_SUFFIX}"


def _holder(text: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe(holder: dict[str, Any] | None) -> str:
    """``pid N on host H, since T (command)`` for a lock file's text."""
    if not holder:
        return "a process that left no details"
    what = f" ({holder['command']})" if holder.get("command") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}{what}"


def acquire(path: Path, what: str, command: str, how_to_proceed: str) -> Lock:
    """Take the lock file ``path`` (created if needed) for ``command``; BusyError naming its holder if held.

    ``what``: the directory it guards, as the refusal names it. Taking a lock this process already
    holds returns that lock.
    """
    path = Path(os.path.abspath(path))
    if path in _HELD:
        return _HELD[path]
    for _ in range(20):
        fd = _locked_fd(path, what, how_to_proceed)
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        # The holder deleted the file as it released it, after this process opened it: lock the new one.
        os.close(fd)
    else:
        raise BusyError(f"cannot lock {path}: it is deleted and re-created faster than it can be locked")
    previous = _holder(_read(fd))
    took_over = ""
    if previous and previous.get("pid") is not None:
        same_host = previous.get("host") == socket.gethostname()
        gone = same_host and not _alive(int(previous["pid"]))
        state = "which is no longer running" if gone else "which holds no lock on it any more"
        took_over = f"took over the lock {path} of {describe(previous)}, {state}"
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "command": command}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    os.fsync(fd)
    lock = Lock(path, fd, took_over)
    _HELD[path] = lock
    return lock


def _locked_fd(path: Path, what: str, how_to_proceed: str) -> int:
    """``path`` opened (created if needed) and flock-ed; BusyError naming the holder when another process has
    it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise BusyError(f"cannot create the lock file {path} ({exc.strerror}); {what} needs a writable "
                        f"parent directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        text = _read(fd)
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise BusyError(f"cannot lock {path} ({exc.strerror}); the file system of {what} must support "
                            "locks (docs/runtime.md, 'One run per job directory')") from None
        raise BusyError(f"DSF612: {what} is in use by another dsforge command: {describe(_holder(text))} "
                        f"(lock {path}); {how_to_proceed}") from None
    return fd


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", "replace")
    except OSError:
        return ""


def lock_job_dir(job_dir: Path, command: str) -> Lock:
    """The lock of a job directory for ``command`` (`dsforge run`, `dsforge compile --force`)."""
    job_dir = Path(os.path.abspath(job_dir))
    try:
        job_dir.parent.mkdir(parents=True, exist_ok=True)  # `dsforge run -o a/b/job` creates a/b, as before
    except OSError as exc:
        raise BusyError(f"cannot create {job_dir.parent} ({exc.strerror})") from None
    return acquire(lock_file_of_job(job_dir), str(job_dir), command,
                   "wait for it to finish or stop it, or give this run another job directory with -o")


def lock_checkpoint_dir(directory: Path, job_dir: Path, command: str) -> Lock | None:
    """The lock of a checkpoint directory outside ``job_dir`` (created if needed); None when it lies
    inside."""
    directory, job_dir = Path(os.path.abspath(directory)), Path(os.path.abspath(job_dir))
    if directory == job_dir or job_dir in directory.parents:
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BusyError(f"cannot create the checkpoint directory {directory} ({exc.strerror})") from None
    return acquire(directory / CHECKPOINT_LOCK, f"the checkpoint directory {directory}", command,
                   "two jobs must not share one training.checkpoint.dir: give this job its own, or wait for "
                   "the other run to finish")


def held() -> list[Lock]:
    """The locks this process holds."""
    return list(_HELD.values())


def release_all() -> None:
    """Drop every lock this process holds (the kernel does it at exit; tests call this)."""
    for lock in list(_HELD.values()):
        lock.release()
