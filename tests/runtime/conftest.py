"""Runtime tests need torch; DeepSpeed must see the CPU accelerator before it is first imported."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest.importorskip("torch", reason="runtime tests need the `runtime` extra (torch, deepspeed)")
