"""Walking a module tree: which rule claims which module, what kind of module it is, and its parameters.

Modules are visited parents first (``named_modules`` order). The first row whose regex fully matches
a module's qualified name claims that module and its whole subtree; a module that owns parameters
and sits under no claimed module is left over. The walk reads only names, classes and shapes, so it
runs as well on the ``meta`` device as on real weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from dsforge.compiler.model.rewrite_policies import PolicyRow


@dataclass(frozen=True)
class Claim:
    """A module claimed by a rule: its qualified name, the module, the row and the row's source label."""

    name: str
    module: nn.Module
    row: PolicyRow
    source: str


@dataclass
class Walk:
    """The result of matching rows against a module tree."""

    claims: list[Claim]
    leftover: list[str]
    unused: list[str]


def module_kind(module: nn.Module) -> str:
    """linear (weight out x in), conv1d (HF GPT-2 Conv1D, weight in x out), embedding, or other."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    # HF's Conv1D (transformers.pytorch_utils) is a Linear with a transposed weight; checked by
    # shape contract rather than import so a model without transformers still walks.
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return "conv1d"
    return "other"


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def match_rows(model: nn.Module, rows: list[tuple[str, PolicyRow]]) -> Walk:
    """Claim every module the rows match (first match wins, subtree included); list what is left."""
    compiled = [(re.compile(row.match), source, row) for source, row in rows]
    claimed: set[str] = set()
    claims: list[Claim] = []
    leftover: list[str] = []
    used: set[str] = set()
    for name, module in model.named_modules():
        if any(a in claimed for a in _ancestors(name)) or (name and "" in claimed):
            continue
        hit = next(((s, r) for rx, s, r in compiled if rx.fullmatch(name)), None)
        if hit is not None:
            claimed.add(name)
            used.add(hit[0])
            claims.append(Claim(name, module, hit[1], hit[0]))
        elif any(True for _ in module.parameters(recurse=False)):
            leftover.append(name or "<root>")
    unused = [s for s, _ in rows if s not in used]
    return Walk(claims, leftover, unused)


def direct_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Shapes of the parameters the module owns itself."""
    return {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}


def subtree_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Shapes of every parameter in the subtree, by name relative to the module (shared ones once)."""
    return {n: tuple(p.shape) for n, p in module.named_parameters()}


def expert_shapes(module: nn.Module) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """The expert parameters with the expert count leading: fused 3-D tensors as they are, or a
    list of expert modules (``experts.0.w1``) stacked by name; returns (shapes, problem)."""
    shapes = subtree_shapes(module)
    indexed = {n: s for n, s in shapes.items() if n.split(".")[0].isdigit()}
    if not indexed:
        return shapes, None
    if len(indexed) != len(shapes):
        return {}, f"mixes per-expert submodules with other parameters: {sorted(set(shapes) - set(indexed))}"
    by_rest: dict[str, dict[int, tuple[int, ...]]] = {}
    for n, s in indexed.items():
        index, _, rest = n.partition(".")
        by_rest.setdefault(rest, {})[int(index)] = s
    count = len({int(n.split(".")[0]) for n in indexed})
    stacked: dict[str, tuple[int, ...]] = {}
    for rest, per in by_rest.items():
        if len(per) != count or len(set(per.values())) != 1:
            return {}, f"its experts differ in `{rest}` (every expert must have the same parameters)"
        stacked[rest] = (count, *next(iter(per.values())))
    return stacked, None


def find_layer_list(model: nn.Module, layers: int) -> str | None:
    """Name of the ModuleList holding the decoder layers: the first one with exactly ``layers`` entries."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == layers and layers > 0:
            return name
    return None


def group_names(names: list[str]) -> list[str]:
    """Collapse per-layer names (``h.0.x``, ``h.1.x``) into ``h.{0..1}.x``, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for n in names:
        m = re.search(r"\.(\d+)(?=\.|$)", n)
        key = n if m is None else n[:m.start(1)] + "{}" + n[m.end(1):]
        groups.setdefault(key, []).append(int(m.group(1)) if m else -1)
    out = []
    for key, idx in groups.items():
        ids = sorted(set(idx))
        contiguous = ids == list(range(ids[0], ids[-1] + 1))
        label = (str(ids[0]) if len(ids) == 1 else f"{{{ids[0]}..{ids[-1]}}}" if contiguous
                 else "{" + ",".join(map(str, ids)) + "}")
        out.append(key.replace("{}", label, 1))
    return out
