"""Reading a rank's slices of an HF checkpoint: safetensors (single file or index) or a torch state dict.

Each request names a tensor, the dimension it is cut along and the ranges this rank owns there;
safetensors' ``get_slice`` reads only those bytes (a torch ``.bin`` is memory-mapped, so only the
pages of the slice are touched). Every request is recorded (``reads``; with ``DSFORGE_READ_LOG``
set, appended to that file as JSON lines), which is how the tests prove that no rank read a slice
it does not own. Tensors come back in their stored dtype; the caller converts them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dsforge.compiler.pretrained import (
    SAFETENSORS,
    SAFETENSORS_INDEX,
    TORCH_BIN,
    TORCH_INDEX,
    PretrainedError,
    weight_files,
)
from dsforge.runtime.models import ModelBuildError

Ranges = Sequence[tuple[int, int]]  # (start, length) along one dimension
READ_LOG_ENV = "DSFORGE_READ_LOG"


class PretrainedLoadError(ModelBuildError):
    """The checkpoint cannot fill this model (a tensor missing or of another shape); the message says which.

    A ModelBuildError, so a rank reports it in one line (dsforge.runtime.main.known_errors)."""


class CheckpointReader:
    """Sliced reads from the tensors of one HF model directory."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        try:
            files = weight_files(self.directory)
        except PretrainedError as exc:
            raise PretrainedLoadError(f"{exc.rule}: {exc.message}; {exc.fix}") from None
        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}  # tensor name -> open safetensors file, or a memory-mapped state dict
        self.reads: list[dict[str, Any]] = []
        self.stored: Counter[str] = Counter()
        for path in files:
            if path.name.endswith(".safetensors"):
                from safetensors import safe_open

                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
                for key in handle.keys():
                    self._where[key] = handle
            else:
                state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
                for key, value in state.items():
                    self._where[key] = state
        self._log = os.environ.get(READ_LOG_ENV)

    def close(self) -> None:
        """Close the open files."""
        self._stack.close()

    def keys(self) -> set[str]:
        """Names of every tensor in the checkpoint."""
        return set(self._where)

    def resolve(self, name: str, prefix: str = "") -> str | None:
        """The checkpoint's name for a model parameter: the same, or without the base model's prefix."""
        if name in self._where:
            return name
        if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in self._where:
            return name[len(prefix) + 1:]
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of a tensor."""
        src = self._where[key]
        if isinstance(src, dict):
            return tuple(src[key].shape)
        return tuple(src.get_slice(key).get_shape())

    def read(self, key: str, dim: int | None = None, ranges: Ranges = ()) -> Tensor:
        """The tensor ``key`` (whole, or its ``ranges`` along ``dim`` concatenated there), in its stored dtype."""
        src = self._where[key]
        shape = self.shape(key)
        if dim is None:
            parts: list[tuple[int, int]] = [(0, shape[0])] if shape else []
            dim_used = 0
        else:
            parts, dim_used = list(ranges), dim
        self._record(key, None if dim is None else dim, parts if dim is not None else [], shape)
        if isinstance(src, dict):
            full = src[key]
            if dim is None:
                out = full.clone()
            else:
                out = torch.cat([full.narrow(dim_used, s, n) for s, n in parts], dim=dim_used).clone()
        else:
            sl = src.get_slice(key)
            if dim is None:
                out = sl[:] if shape else src.get_tensor(key)
            else:
                lead = (slice(None),) * dim_used
                out = torch.cat([sl[(*lead, slice(s, s + n))] for s, n in parts], dim=dim_used)
        self.stored[str(out.dtype).replace("torch.", "")] += 1
        return out

    def _record(self, key: str, dim: int | None, parts: list[tuple[int, int]], shape: tuple[int, ...]) -> None:
        entry = {"rank": _rank(), "key": key, "dim": dim, "ranges": [list(p) for p in parts], "shape": list(shape)}
        self.reads.append(entry)
        if self._log:
            with open(self._log, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry) + "\n")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def hf_config(directory: str | Path) -> Any:
    """The transformers config of the directory's config.json, set up as dsforge runs its models (sdpa, no cache)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(directory))
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return cfg


__all__ = ["SAFETENSORS", "SAFETENSORS_INDEX", "TORCH_BIN", "TORCH_INDEX", "CheckpointReader", "PretrainedLoadError",
           "hf_config"]
