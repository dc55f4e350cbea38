"""Layout-free weights inside a checkpoint: each rank's slices, named by the dense parameter they cut.

``dsforge.runtime.materialize`` tags every parameter it makes real with the dense parameter it
is a slice of (name, full shape, the dimension cut and this rank's ranges there). At each save,
the ranks that hold a distinct copy of their slices (data-parallel index 0; for expert parameters
expert-data-parallel index 0) write them to ``dsforge-weights/rank<N>.safetensors`` beside
DeepSpeed's own files, with the tags in the file's metadata; ZeRO-3 parameters are gathered over
their group first. ``dsforge export`` (dsforge.runtime.export) assembles the dense tensors from
these files whatever the layout was: TP cuts, pipeline stages, experts, ZeRO, tied and fused weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

WEIGHTS_DIR = "dsforge-weights"
TAG = "_dsforge_slice"


@dataclass(frozen=True)
class SliceTag:
    """Which part of which dense parameter a rank's parameter holds (storage layout of the dense model)."""

    dense: str
    shape: tuple[int, ...]
    dim: int | None
    ranges: tuple[tuple[int, int], ...]
    transpose: bool = False

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"dense": self.dense, "shape": list(self.shape), "dim": self.dim,
                "ranges": [list(r) for r in self.ranges], "transpose": self.transpose}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SliceTag:
        """Inverse of ``to_json``."""
        return cls(str(doc["dense"]), tuple(doc["shape"]), doc["dim"],
                   tuple((int(a), int(b)) for a, b in doc["ranges"]), bool(doc.get("transpose", False)))


def tag(param: nn.Parameter, slice_tag: SliceTag) -> None:
    """Record on a parameter the dense slice it holds."""
    setattr(param, TAG, slice_tag)


def tagged(module: nn.Module) -> list[tuple[nn.Parameter, SliceTag]]:
    """The module's distinct tagged parameters in order."""
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        t = getattr(p, TAG, None)
        if t is not None and id(p) not in seen:
            seen.add(id(p))
            out.append((p, t))
    return out


def replica_index(engine: Any, param: nn.Parameter) -> int:
    """This rank's index among the ranks holding the same slice of ``param`` (0: it writes the slice).

    Expert parameters (DeepSpeed marks them ``allreduce=False``) are replicated over their
    expert-data-parallel group, the others over the data-parallel group of the engine's grid or mpu.
    """
    if not getattr(param, "allreduce", True):
        from deepspeed.utils import groups as ds_groups

        return int(ds_groups._get_expert_data_parallel_rank(param.group_name))
    grid = getattr(engine, "grid", None)  # a PipelineEngine's topology grid
    if grid is not None:
        return int(grid.get_data_parallel_rank())
    mpu = getattr(engine, "mpu", None)
    return int(mpu.get_data_parallel_rank()) if mpu is not None else 0


def save_rank_weights(engine: Any, directory: Path, rank: int) -> Path | None:
    """Write this rank's distinct slices of ``engine.module`` into ``directory/dsforge-weights``
    (collective under ZeRO-3, whose parameters are gathered first); the file, or None when it holds none."""
    from safetensors.torch import save_file

    module = getattr(engine, "module", None)
    if not isinstance(module, nn.Module):
        return None  # nothing dsforge built (a stand-in engine in the checkpoint tests)
    params = tagged(module)
    partitioned = [p for p, _ in params if hasattr(p, "ds_id")]
    tensors: dict[str, Tensor] = {}
    meta: dict[str, Any] = {}
    with _gathered(partitioned):
        for i, (p, t) in enumerate(params):
            if replica_index(engine, p) != 0:
                continue
            key = f"t{i}"
            tensors[key] = p.detach().to("cpu").contiguous().clone()
            meta[key] = t.to_json()
    if not tensors:
        return None
    out = directory / WEIGHTS_DIR
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank{rank}.safetensors"
    save_file(tensors, str(path), metadata={"dsforge": json.dumps(meta)})
    return path


def _gathered(params: list[nn.Parameter]) -> Any:
    """ZeRO-3's context that holds these partitioned parameters whole (a no-op context without any)."""
    import contextlib

    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def load_slices(directory: Path) -> list[tuple[SliceTag, Tensor]]:
    """Every slice the ranks wrote into a checkpoint's ``dsforge-weights``."""
    from safetensors import safe_open

    out = []
    for path in sorted((directory / WEIGHTS_DIR).glob("rank*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get("dsforge", "{}"))
            for key in fh.keys():  # noqa: SIM118 - safe_open is no dict: keys() is its API
                out.append((SliceTag.from_json(meta[key]), fh.get_tensor(key)))
    return out


def assemble(slices: list[tuple[SliceTag, Tensor]], first_copy_wins: bool = False) -> dict[str, Tensor]:
    """Dense tensors from their slices; a ValueError when a tensor is not covered exactly (gaps, or two
    copies of a slice that differ, unless ``first_copy_wins``: optimizer state of a tied weight, whose
    copies on two pipeline stages may differ in the last bit)."""
    dense: dict[str, Tensor] = {}
    filled: dict[str, Tensor] = {}
    for t, piece in slices:
        if t.transpose:
            piece = piece.t()
        if t.dim is not None and len(t.shape) == piece.dim() + 1:
            piece = piece.unsqueeze(t.dim)  # one expert of the stacked experts
        full = dense.get(t.dense)
        if full is None:
            full = dense[t.dense] = torch.zeros(t.shape, dtype=piece.dtype)
            filled[t.dense] = torch.zeros(t.shape, dtype=torch.bool)
        mask = filled[t.dense]
        if t.dim is None:
            targets = [(full, mask, piece)]
        else:
            targets, offset = [], 0
            for start, length in t.ranges:
                targets.append((full.narrow(t.dim, start, length), mask.narrow(t.dim, start, length),
                                piece.narrow(t.dim, offset, length)))
                offset += length
        for region, seen, value in targets:
            if tuple(region.shape) != tuple(value.shape):
                raise ValueError(f"{t.dense}: a slice of {list(value.shape)} "
                                 f"does not fit its place {list(region.shape)}")
            if seen.any():
                if not seen.all():
                    raise ValueError(f"{t.dense}: two saved slices overlap in part")
                if not first_copy_wins and not torch.equal(region, value.to(region.dtype)):
                    raise ValueError(f"{t.dense}: two ranks saved different values for the same elements")
                continue
            region.copy_(value)
            seen.fill_(True)
    gaps = [name for name, m in filled.items() if not bool(m.all())]
    if gaps:
        raise ValueError(f"no rank saved part of {', '.join(gaps[:4])}")
    return dense
