"""Rank placement: which global ranks form each parallel group, as a pure function of an order string.

Follows the convention of Megatron-LM's ``RankGenerator`` (megatron/core/parallel_state.py): the
order string lists the axes fastest-varying first, so with ``tp-cp-ep-dp-pp`` neighbouring ranks
share a tensor-parallel group and the pipeline axis varies slowest. Dense layers use a generator
with ep = 1; expert layers use a second generator with cp = 1, ep = ep and dp = the expert
data-parallel size, both over the same order, exactly as Megatron builds its decoder and expert
groups. The same order therefore yields Megatron's groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from math import prod

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


class OrderError(ValueError):
    """The order string cannot place these degrees (unknown or repeated axis, missing axis > 1)."""


def parse_order(order: str, sizes: dict[str, int]) -> list[str]:
    """Split and check an order string; axes of size 1 that it omits are appended (as Megatron does)."""
    tokens = [t.strip() for t in order.lower().split("-") if t.strip()]
    unknown = [t for t in tokens if t not in AXES]
    if unknown:
        raise OrderError(f"unknown axis {unknown[0]!r} in order {order!r}; axes are {', '.join(AXES)}")
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise OrderError(f"axis {repeated[0]!r} appears twice in order {order!r}")
    missing = [a for a in AXES if a not in tokens and sizes.get(a, 1) != 1]
    if missing:
        raise OrderError(f"order {order!r} omits {missing[0]}={sizes[missing[0]]}; every axis of size > 1 must be placed")
    if sizes.get("ep", 1) > 1 and "ep-dp" not in "-".join(tokens) and "dp-ep" not in "-".join(tokens):
        raise OrderError(f"order {order!r} separates ep from dp; expert ranks are carved out of the data-parallel "
                         "ranks, so ep and dp must be adjacent")
    full = tokens + [a for a in AXES if a not in tokens]
    if sizes.get("ep", 1) > 1 and sizes.get("cp", 1) > 1:
        # The expert groups reuse the dp x cp ranks of each (tp, pp) position (Megatron's expert
        # RankGenerator sets cp=1 and dp=dp*cp/ep over the same order), so cp, ep and dp must form one
        # contiguous block; with pp or tp between them an expert group would span pipeline stages.
        where = sorted(full.index(a) for a in ("cp", "ep", "dp"))
        if where[2] - where[0] != 2:
            raise OrderError(f"order {order!r} separates cp from ep-dp; with ep > 1 and cp > 1 the axes cp, ep and "
                             "dp must be adjacent (e.g. tp-cp-ep-dp-pp)")
    return full


def _offsets(dims: list[int], strides: list[int], which: list[int]) -> list[int]:
    """Rank offsets of every coordinate combination along the axes ``which`` (sorted ascending)."""
    out = [0]
    for i in which:
        out = [o + c * strides[i] for c in range(dims[i]) for o in out]
    return sorted(out)


def group_shape(axes: list[str], sizes: dict[str, int], members: set[str]) -> tuple[list[int], list[int]]:
    """(member offsets, base ranks) of the groups whose ranks differ only along the ``members`` axes.

    A rank's coordinates are mixed-radix digits of its index, the first axis of ``axes`` varying
    fastest; every group has the same member offsets, shifted by its base rank.
    """
    dims = [sizes[a] for a in axes]
    strides = [prod(dims[:i]) for i in range(len(dims))]
    bases = _offsets(dims, strides, [i for i, a in enumerate(axes) if a not in members])
    return member_offsets(axes, sizes, members), bases


def member_offsets(axes: list[str], sizes: dict[str, int], members: set[str]) -> list[int]:
    """The ranks of the first group (the one holding rank 0) of the groups along the ``members`` axes."""
    dims = [sizes[a] for a in axes]
    strides = [prod(dims[:i]) for i in range(len(dims))]
    return _offsets(dims, strides, [i for i, a in enumerate(axes) if a in members])


def rank_groups(axes: list[str], sizes: dict[str, int], members: set[str]) -> list[list[int]]:
    """All groups whose ranks differ only along the ``members`` axes, ordered by their first rank.

    Linear in the world size (a 1,024-rank job has thousands of groups); the questions rules and
    estimates ask (the first group, whether any group crosses a node) use ``group_shape`` instead.
    """
    members_at, bases = group_shape(axes, sizes, members)
    return [[base + o for o in members_at] for base in bases]


class GroupTable(Mapping[str, list[list[int]]]):
    """The groups of each kind, each built on first access: a 1,024-rank layout has thousands of groups
    and validation reads only the tp, cp and ep kinds."""

    def __init__(self, builders: Mapping[str, Callable[[], list[list[int]]]],
                 shapes: Mapping[str, Callable[[], tuple[list[int], list[int]]]] | None = None,
                 firsts: Mapping[str, Callable[[], list[int]]] | None = None):
        self._builders = builders
        self._shapes = shapes or {}
        self._firsts = firsts or {}
        self._built: dict[str, list[list[int]]] = {}
        self._shaped: dict[str, tuple[list[int], list[int]]] = {}

    def __getitem__(self, kind: str) -> list[list[int]]:
        if kind not in self._built:
            self._built[kind] = self._builders[kind]()  # KeyError for an unknown kind, as a dict would
        return self._built[kind]

    def shape(self, kind: str) -> tuple[list[int], list[int]]:
        """(member offsets, base ranks) of this kind's groups, without building the groups themselves."""
        if kind not in self._shaped:
            if kind in self._shapes:
                self._shaped[kind] = self._shapes[kind]()
            else:  # a table built from plain lists: derive the shape from them
                groups = self[kind]
                first = groups[0] if groups else [0]
                self._shaped[kind] = ([r - first[0] for r in first], [g[0] for g in groups])
        return self._shaped[kind]

    def first(self, kind: str) -> list[int]:
        """The group holding rank 0, built alone."""
        if kind in self._shaped or kind not in self._firsts:
            return list(self.shape(kind)[0])
        return self._firsts[kind]()

    def __contains__(self, kind: object) -> bool:
        return kind in self._builders  # Mapping's default would build the groups to find out

    def __iter__(self) -> Iterator[str]:
        return iter(self._builders)

    def __len__(self) -> int:
        return len(self._builders)

    def __repr__(self) -> str:
        return f"GroupTable({dict(self.items())!r})"


@dataclass(frozen=True)
class Placement:
    """Every parallel group's member ranks, and which node each rank sits on."""

    world_size: int
    gpus_per_node: int
    order: tuple[str, ...]
    groups: Mapping[str, list[list[int]]] = field(default_factory=dict)

    def node_of(self, rank: int) -> int:
        """The node index hosting ``rank`` (ranks fill nodes in order, gpus_per_node each)."""
        return rank // self.gpus_per_node

    def shape(self, kind: str) -> tuple[list[int], list[int]] | None:
        """(member offsets, base ranks) of the groups of this kind (None for an unknown kind), none built."""
        if kind not in self.groups:
            return None
        if isinstance(self.groups, GroupTable):
            return self.groups.shape(kind)
        groups = self.groups[kind]
        first = groups[0] if groups else [0]
        return [r - first[0] for r in first], [g[0] for g in groups]

    def first_group(self, kind: str) -> list[int]:
        """The group of this kind that holds rank 0 (without building the others)."""
        if isinstance(self.groups, GroupTable):
            return self.groups.first(kind)
        return list(self.groups[kind][0])

    def nodes_spanned(self, kind: str) -> int:
        """The most nodes any one group of this kind spans (1: the group stays inside a node)."""
        shape = self.shape(kind)
        if shape is None:
            return 1
        offsets, bases = shape
        per = self.gpus_per_node
        # a group's nodes depend only on its base's position inside a node: one group per residue
        residues = {b % per: b for b in bases}
        return max((len({(b + o) // per for o in offsets}) for b in residues.values()), default=1)

    def crosses_nodes(self, kind: str) -> bool:
        """True if some group of this kind has members on two or more nodes."""
        shape = self.shape(kind)
        if shape is None:
            return False
        offsets, bases = shape
        per, span = self.gpus_per_node, offsets[-1]
        # groups are sorted and nodes hold consecutive ranks: a group stays in one node iff its ends do
        return any(b // per != (b + span) // per for b in bases)

    def crossing_group(self, kind: str) -> list[int] | None:
        """The first group of this kind with members on two or more nodes, or None."""
        shape = self.shape(kind)
        if shape is None:
            return None
        offsets, bases = shape
        per = self.gpus_per_node
        base = next((b for b in bases if b // per != (b + offsets[-1]) // per), None)
        return None if base is None else [base + o for o in offsets]

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of this kind that contains ``rank``."""
        for group in self.groups[kind]:
            if rank in group:
                return group
        raise KeyError(f"rank {rank} is in no {kind} group")

    def coordinates(self, rank: int) -> dict[str, int]:
        """The rank's index inside each of its groups (tp rank, pp stage, dp rank, ...)."""
        return {kind: self.group_of(kind, rank).index(rank) for kind in self.groups}


def place(tp: int, pp: int, dp: int, cp: int, ep: int, gpus_per_node: int,
          order: str = DEFAULT_ORDER) -> Placement:
    """Place tp*pp*dp*cp ranks by ``order`` and build the dense and expert groups (Megatron's rules)."""
    world = tp * pp * dp * cp
    dense = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    axes = parse_order(order, {**dense, "ep": ep})
    if (dp * cp) % ep:
        raise OrderError(f"ep={ep} does not divide dp*cp={dp * cp}")
    expert = {"tp": tp, "cp": 1, "ep": ep, "dp": dp * cp // ep, "pp": pp}
    members = {"tp": (dense, {"tp"}), "pp": (dense, {"pp"}), "dp": (dense, {"dp"}), "cp": (dense, {"cp"}),
               "dp-cp": (dense, {"dp", "cp"}), "tp-pp": (dense, {"tp", "pp"}), "ep": (expert, {"ep"}),
               "edp": (expert, {"dp"})}
    builders = {kind: partial(rank_groups, axes, sizes, kinds) for kind, (sizes, kinds) in members.items()}
    shapes = {kind: partial(group_shape, axes, sizes, kinds) for kind, (sizes, kinds) in members.items()}
    firsts = {kind: partial(member_offsets, axes, sizes, kinds) for kind, (sizes, kinds) in members.items()}
    return Placement(world, gpus_per_node, tuple(axes), GroupTable(builders, shapes, firsts))
