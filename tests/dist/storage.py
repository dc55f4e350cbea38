"""Count tensor bytes by storage: live tensors of a process, and tensors autograd saves for backward.

Views share their base's storage, so bytes are summed once per storage (its full size), never per
tensor. Parameters are excluded from saved-activation counts: autograd saves the weight of a linear
layer, but that is model state, not activation memory.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from dsforge.runtime.measure import storage_key, tensors_in


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the whole storage under a tensor (a view counts its base in full)."""
    return t.untyped_storage().nbytes()


class SavedTensors:
    """Bytes of the distinct storages autograd saves for backward inside `record()` blocks, by region."""

    def __init__(self, exclude: Iterable[torch.Tensor]) -> None:
        self.exclude = {storage_key(t) for t in exclude}
        self.seen: dict[int, tuple[str, int]] = {}
        self.keep: list[torch.Tensor] = []  # hold saved tensors so their addresses stay unique

    @contextmanager
    def record(self, region: str) -> Iterator[None]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            key = storage_key(t)
            if key and key not in self.exclude and key not in self.seen:
                self.seen[key] = (region, storage_bytes(t))
                self.keep.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def by_region(self) -> dict[str, int]:
        """Saved bytes per region name."""
        out: dict[str, int] = {}
        for region, nbytes in self.seen.values():
            out[region] = out.get(region, 0) + nbytes
        return out


def live_tensors(extra: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Every tensor the garbage collector tracks (objects frozen by `gc.freeze()` excepted), plus
    ``extra`` (tensors only C++ may hold, e.g. .grad)."""
    gc.collect()
    found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    found.extend(extra)
    return found


def classify(tensors: list[torch.Tensor], classes: list[tuple[str, Callable[[], list[Any]]]],
             skip: set[int]) -> dict[str, int]:
    """Bytes of distinct storages, by the first class whose members use them; the rest is "other"."""
    owner: dict[int, str] = {}
    for name, members in classes:
        found: list[torch.Tensor] = []
        tensors_in(members(), found, max_depth=4)
        for t in found:
            owner.setdefault(storage_key(t), name)
    out: dict[str, int] = {name: 0 for name, _ in classes}
    out["other"] = 0
    done: set[int] = set()
    for t in tensors:
        key = storage_key(t)
        if not key or key in done or key in skip:
            continue
        done.add(key)
        if t.device.type == "meta":
            continue
        name = owner.get(key, "other")
        out[name] += storage_bytes(t)
    return out
