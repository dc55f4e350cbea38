"""End-to-end runtime tests need torch, DeepSpeed and transformers; DeepSpeed must see the CPU accelerator."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest.importorskip("torch", reason="runtime tests need the `runtime` extra (torch, deepspeed)")
pytest.importorskip("deepspeed", reason="runtime tests need the `runtime` extra (torch, deepspeed)")
pytest.importorskip("transformers", reason="runtime tests build HF models")
