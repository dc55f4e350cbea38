"""Reading a rank's slices of an HF checkpoint: safetensors (single file or index) or a torch state dict.

Each request names a tensor, the dimension it is cut along and the ranges this rank owns there;
safetensors' ``get_slice`` reads only those bytes (a torch ``.bin`` is memory-mapped, so only the
pages of the slice are touched). Every request is recorded (``reads``; with ``DSFORGE_READ_LOG``
set, appended to that file as JSON lines), which is how the tests prove that no rank read a slice
it does not own. Tensors come back in their stored dtype; the caller converts them.

MoE checkpoints store each expert's projections as tensors of their own (Mixtral:
``block_sparse_moe.experts.E.w1/w2/w3.weight``; Qwen2-MoE and Qwen3-MoE: ``mlp.experts.E.gate_proj/
up_proj/down_proj.weight``), which transformers stacks on load into the model's ``experts.gate_up_proj``
[E, 2F, H] (gate rows, then up rows) and ``experts.down_proj`` [E, H, F], and Mixtral's
``block_sparse_moe`` is the model's ``mlp`` (transformers/conversion_mapping.py). The reader offers those
model names as well: a request for experts [e, e + n) of a stacked tensor reads only those experts'
tensors (and, for a cut along another dimension, only the rows or columns asked for), each read
recorded under the checkpoint's own name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dsforge.compiler.frontend.pretrained import (
    SAFETENSORS,
    SAFETENSORS_INDEX,
    TORCH_BIN,
    TORCH_INDEX,
    PretrainedError,
    weight_files,
)
from dsforge.runtime.errors import ModelBuildError

Ranges = Sequence[tuple[int, int]]  # (start, length) along one dimension
READ_LOG_ENV = "DSFORGE_READ_LOG"


class PretrainedLoadError(ModelBuildError):
    """The checkpoint cannot fill this model (a tensor missing or of another shape); the message says which.

    A ModelBuildError, so a rank reports it in one line (dsforge.runtime.errors)."""


#: A checkpoint tensor of one expert's projection: (block, expert index, projection).
_EXPERT_KEY = re.compile(r"^(?P<block>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>[A-Za-z0-9_]+)\.weight$")
#: Stacked model tensor -> the per-expert projections it concatenates along its rows, per family's naming
#: (transformers' conversion_mapping.py: Mixtral w1 = gate, w3 = up, w2 = down; Qwen-MoE's names as in a dense
#: MLP).
STACKS: dict[str, tuple[tuple[str, ...], ...]] = {"gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj")),
                                                  "down_proj": (("w2",), ("down_proj",))}
#: Names a checkpoint uses for what the transformers 5 model calls otherwise, the tensor's shape the same:
#: Mixtral's ``block_sparse_moe`` is the model's ``mlp``; GraniteMoE stores its router as ``router.layer`` and
#: its stacked experts as ``input_linear`` [E, 2F, H] / ``output_linear`` [E, H, F]
#: (transformers/conversion_mapping.py).
RENAMES = ((".block_sparse_moe.", ".mlp."),
           (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.router.weight"),
           (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
           (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"))


@dataclass(frozen=True)
class Stacked:
    """A model tensor [E, rows, cols] the checkpoint stores as E x len(parts) tensors of [part rows, cols]."""

    parts: tuple[tuple[str, ...], ...]  # per expert, the checkpoint tensors stacked along its rows
    rows: tuple[int, ...]  # rows of each part
    cols: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """The stacked model tensor's shape."""
        return (len(self.parts), sum(self.rows), self.cols)


class CheckpointReader:
    """Sliced reads from the tensors of one HF model directory."""

    def __init__(self, directory: str | Path, renamings: Sequence[Any] = (),
                 converters: Sequence[Any] = ()) -> None:
        """``renamings``, ``converters``: transformers' key renamings and tensor conversions for the model
        read (hf_renamings, hf_converters)."""
        self.directory = Path(directory)
        self._converters = list(converters)
        try:
            files = weight_files(self.directory)
        except PretrainedError as exc:
            raise PretrainedLoadError(f"{exc.rule}: {exc.message}; {exc.fix}") from None
        self._stack = contextlib.ExitStack()
        self._where: dict[str, Any] = {}  # tensor name -> open safetensors file, or a memory-mapped state
                                          # dict
        self.reads: list[dict[str, Any]] = []
        self.stored: Counter[str] = Counter()
        for path in files:
            if path.name.endswith(".safetensors"):
                from safetensors import safe_open

                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
                for key in handle.keys():  # noqa: SIM118  # a safe_open handle is not iterable
                    self._where[key] = handle
            else:
                state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
                for key in state:
                    self._where[key] = state
        self._log = os.environ.get(READ_LOG_ENV)
        self._renamed: dict[str, str] = {}  # model name -> the checkpoint's
        self._stacked: dict[str, Stacked] = {}
        self._broken: dict[str, str] = {}  # model name -> why the checkpoint's experts cannot form it
        self._alias_renamed(renamings)
        self._alias_experts()

    def _alias_renamed(self, renamings: Sequence[Any]) -> None:
        """Offer the model's names for the keys transformers renames on load (Exaone's ``transformer.h``,
        GPT-NeoX's ``embed_out``), as from_pretrained applies them."""
        if not renamings:
            return
        from transformers.core_model_loading import apply_renamings

        for key in list(self._where):
            new = apply_renamings(key, list(renamings))
            if new != key and new not in self._where:
                self._renamed[new] = key

    def _alias_experts(self) -> None:
        """Offer the model's names for renamed blocks and for experts stored one tensor each."""
        for key in self._where:
            for old, new in RENAMES:
                if old in key and key.replace(old, new) not in self._where:
                    self._renamed[key.replace(old, new)] = key
        experts: dict[str, dict[str, dict[int, str]]] = {}  # block (model naming) -> projection -> expert ->
                                                            # key
        for key in self._where:
            m = _EXPERT_KEY.match(key)
            if m:
                block = m["block"] + "."
                for old, new in RENAMES:
                    block = block.replace(old, new)
                block = block[:-1]
                experts.setdefault(block, {}).setdefault(m["proj"], {})[int(m["expert"])] = key
        for block, projs in experts.items():
            for stacked, namings in STACKS.items():
                naming = next((n for n in namings if all(p in projs for p in n)), None)
                if naming is None:
                    continue
                name = f"{block}.experts.{stacked}"
                if name in self._where:
                    continue
                found = [projs[p] for p in naming]
                count = max(max(f) for f in found) + 1
                gaps = sorted({e for f in found for e in range(count) if e not in f})
                shapes = {(e, p): self.shape(f[e]) for p, f in zip(naming, found, strict=True) for e in f}
                per_part = [{shapes[e, p] for e in range(count) if (e, p) in shapes} for p in naming]
                if gaps:
                    self._broken[name] = (f"the checkpoint lacks expert(s) {gaps[:8]} of {block} "
                                          f"({', '.join(naming)}), which holds {count}")
                elif any(len(s) != 1 or len(next(iter(s))) != 2 for s in per_part) or \
                        len({next(iter(s))[1] for s in per_part}) != 1:
                    self._broken[name] = (f"the experts of {block} ({', '.join(naming)}) are not all 2-D "
                                          f"tensors of one width: "
                                          f"{sorted({tuple(v) for v in shapes.values()})[:4]}")
                else:
                    rows = tuple(next(iter(s))[0] for s in per_part)
                    self._stacked[name] = Stacked(tuple(tuple(f[e] for f in found) for e in range(count)),
                                                  rows, next(iter(per_part[0]))[1])

    def unconverted(self, name: str) -> str | None:
        """Why a model parameter the checkpoint lacks is one transformers builds on load (a WeightConverter of
        its conversion mapping: fused tensors split, per-head ones concatenated), or None."""
        def listed(patterns: Any) -> list[str]:
            return [patterns] if isinstance(patterns, str) else list(patterns)

        for conv in self._converters:
            if any(re.search(t, name) for t in listed(conv.target_patterns)):
                ops = ", ".join(type(o).__name__ for o in getattr(conv, "operations", []))
                return (f"transformers builds it on load from the checkpoint's "
                        f"{', '.join(listed(conv.source_patterns))} ({ops}, its conversion mapping); dsforge "
                        f"reads tensors as stored or renamed only")
        return None

    def close(self) -> None:
        """Close the open files."""
        self._stack.close()

    def keys(self) -> set[str]:
        """Names of every tensor in the checkpoint."""
        return set(self._where)

    def resolve(self, name: str, prefix: str = "") -> str | None:
        """The key to read a model parameter by: its own name, or without the base model's prefix; a renamed
        block or an expert stack (see the module docstring) under the model's name. None: not in the
        checkpoint."""
        names = [name]
        if prefix and name.startswith(prefix + "."):
            names.append(name[len(prefix) + 1:])
        for n in names:
            if n in self._where or n in self._stacked or n in self._renamed:
                return n
        for n in names:
            if n in self._broken:
                raise PretrainedLoadError(f"DSF640: {self.directory}: {self._broken[n]}; the model's "
                                          f"parameter {name} stacks them")
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of a tensor (a stack's: [experts, rows, cols])."""
        if key in self._stacked:
            return self._stacked[key].shape
        key = self._renamed.get(key, key)
        src = self._where[key]
        if isinstance(src, dict):
            return tuple(src[key].shape)
        return tuple(src.get_slice(key).get_shape())

    def read(self, key: str, dim: int | None = None, ranges: Ranges = ()) -> Tensor:
        """The tensor ``key`` (whole, or its ``ranges`` along ``dim`` concatenated there), in its stored
        dtype."""
        if key in self._stacked:
            return self._read_stacked(self._stacked[key], dim, ranges)
        key = self._renamed.get(key, key)
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

    def _read_stacked(self, st: Stacked, dim: int | None, ranges: Ranges) -> Tensor:
        """Experts of a stack read from their own tensors: only the experts (dim 0), rows (1) or columns (2)
        asked."""
        if dim not in (None, 0, 1, 2):
            raise PretrainedLoadError(f"a stack of experts has 3 dimensions, not a cut along dimension {dim}")
        chosen = [e for s, n in ranges for e in range(s, s + n)] if dim == 0 else range(len(st.parts))
        out = []
        for e in chosen:
            if dim in (None, 0):
                pieces = [self.read(k) for k in st.parts[e]]
            elif dim == 2:
                pieces = [self.read(k, 1, ranges) for k in st.parts[e]]
            else:  # rows of the concatenated parts: each range split over the parts it spans
                if list(ranges) != sorted(ranges):  # parts are read in order: the ranges must be too
                    raise PretrainedLoadError("rows of a stack of experts must "
                                              "be asked for in increasing order")
                pieces, offset = [], 0
                for k, rows in zip(st.parts[e], st.rows, strict=True):
                    mine = [(max(s, offset) - offset, min(s + n, offset + rows) - max(s, offset)) for s,
                            n in ranges if s < offset + rows and s + n > offset]
                    if mine:
                        pieces.append(self.read(k, 0, mine))
                    offset += rows
            out.append(torch.cat(pieces, dim=0))
        return torch.stack(out)

    def _record(self, key: str, dim: int | None, parts: list[tuple[int, int]],
                shape: tuple[int, ...]) -> None:
        entry = {"rank": _rank(), "key": key, "dim": dim, "ranges": [list(p) for p in parts],
                 "shape": list(shape)}
        self.reads.append(entry)
        if self._log:
            with open(self._log, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry) + "\n")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _conversions(model: Any, kind: str) -> list[Any]:
    """The entries of class ``kind`` (core_model_loading's WeightRenaming or WeightConverter) of
    transformers' conversion mapping for ``model``; none for a transformers without one, or another model."""
    try:
        from transformers import core_model_loading
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return []
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return []
    cls = getattr(core_model_loading, kind)
    return [t for t in get_model_conversion_mapping(model) if isinstance(t, cls)]


def hf_renamings(model: Any) -> list[Any]:
    """transformers' own renamings between a model's checkpoint keys and its parameter names (the
    WeightRenaming entries of its conversion mapping)."""
    return _conversions(model, "WeightRenaming")


def hf_converters(model: Any) -> list[Any]:
    """transformers' tensor conversions between a model's checkpoint and its parameters (the WeightConverter
    entries of its conversion mapping: splits, concatenations, stacks)."""
    return _conversions(model, "WeightConverter")


def hf_config(directory: str | Path) -> Any:
    """The transformers config of the directory's config.json, set up as dsforge runs its models (sdpa, no
    cache)."""
    from transformers import AutoConfig

    from dsforge.runtime.attention_impl import attention_of

    cfg = AutoConfig.from_pretrained(str(directory))
    cfg._attn_implementation = attention_of(cfg)
    cfg.use_cache = False
    return cfg


__all__ = ["SAFETENSORS", "SAFETENSORS_INDEX", "TORCH_BIN", "TORCH_INDEX", "CheckpointReader",
           "PretrainedLoadError", "hf_config", "hf_converters",
           "hf_renamings"]
