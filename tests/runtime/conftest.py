"""Runtime tests need torch; DeepSpeed must see the CPU accelerator before it is first imported."""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without the `runtime` extra (torch, deepspeed) these tests are not collected at all.
if importlib.util.find_spec("torch") is None or importlib.util.find_spec("deepspeed") is None:
    collect_ignore_glob = ["test_*.py"]
