"""`dsforge run` relays its launcher's stderr without torchrun's ChildFailedError block
(dsforge.commands.launcher_output)."""

from __future__ import annotations

import io
import os
from pathlib import Path

from dsforge.commands.launcher_output import relay

RANK_LINE = b"dsforge: rank 0: DSF616: the file system of /ck is full\n"
CHILD_FAILED = b"""Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 1 (pid: 24674)
============================================================
"""
RANK_BUG = b"""Traceback (most recent call last):
  File "train.py", line 3, in <module>
ZeroDivisionError: division by zero
"""


def relayed(tmp_path: Path, data: bytes) -> bytes:
    out = tmp_path / "err"
    with open(out, "wb") as fh:
        relay(io.BytesIO(data), fh.fileno())
    return out.read_bytes()


def test_the_child_failed_block_is_dropped_and_the_rest_kept_in_order(tmp_path: Path) -> None:
    agent = (b"E1202 torch/distributed/elastic/multiprocessing/api.py:1002] "
             b"failed (exitcode: 1) local_rank: 0\n")
    assert relayed(tmp_path, RANK_LINE + agent + CHILD_FAILED) == RANK_LINE + agent


def test_other_tracebacks_pass_whole(tmp_path: Path) -> None:
    assert relayed(tmp_path, RANK_BUG) == RANK_BUG
    assert relayed(tmp_path,
                   RANK_LINE + RANK_BUG + b"more\n" + CHILD_FAILED) == RANK_LINE + RANK_BUG + b"more\n"
    plain = b"no newline at the end"
    assert relayed(tmp_path, plain) == plain
    assert os.path.getsize(tmp_path / "err") == len(plain)
