"""Rank placement: which global ranks form each parallel group, as a pure function of an order string.

Follows Megatron-Core's ``RankGenerator`` and ``initialize_model_parallel``
(megatron/core/parallel_state.py): the order string lists the axes fastest-varying first, so with
``tp-cp-ep-dp-pp`` neighbouring ranks share a tensor-parallel group and the pipeline axis varies
slowest. Dense layers use a grid with ep = 1; expert layers use a second grid with cp = 1, ep = ep and
dp = the expert data-parallel size dp*cp/ep, both over the same order, exactly as Megatron builds its
decoder and expert groups. An order Megatron accepts gets Megatron's groups, rank for rank; an order
Megatron refuses is refused with its reason (``OrderError.rule``):

* DSF117: an unknown or repeated axis, or an axis of size > 1 the order does not name;
* DSF124: pp is not last, pp > 1 and the expert data-parallel size differs from dp;
* DSF125: the expert grid's pipeline groups differ from the dense grid's.

One more refusal is dsforge's own (DSF126): when cp, ep or dp precede tp so that Megatron's expert
grid has other tensor-parallel groups than the dense one (expert tensor parallelism apart from tp,
"MoE parallel folding"), dsforge has no group to run it with. With ep > 1 that is an OrderError; with
ep = 1 only a MoE model needs the expert grid, so the placement records why in ``expert_note`` (the
rule refuses MoE models) and a dense model keeps the order. Whatever the order, ``edp`` holds the
dense dp x cp ranks of one (tp, pp) position that hold the same experts (with ep = 1: the dp-cp group).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from math import gcd, prod

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


class OrderError(ValueError):
    """The order string cannot place these degrees; ``rule`` is the diagnostic id that reports why."""

    def __init__(self, message: str, rule: str = "DSF117") -> None:
        super().__init__(message)
        self.rule = rule


def order_tokens(order: str) -> list[str]:
    """The axes an order string names, in its order (case and spaces ignored)."""
    return [t.strip() for t in order.lower().split("-") if t.strip()]


def parse_order(order: str, sizes: dict[str, int]) -> list[str]:
    """Split and check an order string; axes of size 1 that it omits are appended (as Megatron does)."""
    tokens = order_tokens(order)
    if len(tokens) != len(order.split("-")):
        raise OrderError(f"order {order!r} has an empty axis name (nothing between two dashes, or at an end)"
                         if tokens else f"order {order!r} names no axis")
    unknown = [t for t in tokens if t not in AXES]
    if unknown:
        raise OrderError(f"unknown axis {unknown[0]!r} in order {order!r}; axes are {', '.join(AXES)}")
    repeated = sorted({t for t in tokens if tokens.count(t) > 1})
    if repeated:
        raise OrderError(f"axis {repeated[0]!r} appears twice in order {order!r}")
    missing = [a for a in AXES if a not in tokens and sizes.get(a, 1) != 1]
    if missing:
        raise OrderError(f"order {order!r} omits {missing[0]}={sizes[missing[0]]}; "
                         f"every axis of size > 1 must be placed")
    return tokens + [a for a in AXES if a not in tokens]


def stride(axes: list[str], sizes: Mapping[str, int], axis: str) -> int:
    """How far apart two ranks are that differ by one step along ``axis`` (the product of the faster axes)."""
    return prod(sizes[a] for a in axes[:axes.index(axis)])


def _before(axes: list[str], sizes: Mapping[str, int], axis: str) -> str:
    """The axes of size > 1 placed before ``axis``, as 'cp=2, dp=4'."""
    return ", ".join(f"{a}={sizes[a]}" for a in axes[:axes.index(axis)] if sizes[a] > 1) or "no axis above 1"


def check_expert_grid(order: str, axes: list[str], dense: Mapping[str, int],
                      expert: Mapping[str, int]) -> str | None:
    """Megatron's two order checks of initialize_model_parallel (OrderError DSF124/DSF125), then whether its
    expert grid keeps the dense tensor-parallel groups: None if so, else why not (the DSF126 message)."""
    pp, edp, dp = dense["pp"], expert["dp"], dense["dp"]
    if pp > 1 and order_tokens(order)[-1:] != ["pp"] and edp != dp:
        raise OrderError(
            f"order {order!r} does not end with pp while pp={pp} and the expert data-parallel size "
            f"dp*cp/ep = {edp} differs from dp={dp}: Megatron refuses it (\"When not using pp-last rank "
            "ordering, the data parallel size of the attention and moe layers must be the same\")", "DSF124")
    dense_pp, expert_pp = stride(axes, dense, "pp"), stride(axes, expert, "pp")
    if pp > 1 and dense_pp != expert_pp:
        raise OrderError(
            f"order {order!r} puts {_before(axes, expert, 'pp')} before pp in the expert grid but "
            f"{_before(axes, dense, 'pp')} in the dense grid, so the expert layers' pipeline stages are "
            f"{expert_pp} rank(s) apart and the dense layers' {dense_pp}: Megatron refuses it (\"Pipeline "
            "parallel groups are expected to be the same for Non-Expert and Expert part\")", "DSF125")
    dense_tp, expert_tp = stride(axes, dense, "tp"), stride(axes, expert, "tp")
    if dense["tp"] > 1 and dense_tp != expert_tp:
        return (f"order {order!r} places tp after {_before(axes, dense, 'tp')}, so Megatron's expert grid "
                f"(cp=1, ep={expert['ep']}, dp={edp}) gives the expert layers other tensor-parallel groups "
                f"(stride {expert_tp}) than the dense layers (stride {dense_tp}): expert tensor parallelism "
                "apart from tp (MoE parallel folding) is not something dsforge runs")
    return None


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


#: Work (residues x coordinates) above which `node_view` enumerates the base ranks instead.
_RESIDUE_WORK = 200_000


def node_view(axes: list[str], sizes: dict[str, int], members: set[str],
              per: int) -> tuple[int, dict[int, int]]:
    """(span, {base rank mod ``per``: the smallest base rank with it}) of the groups along ``members``.

    Whether a group leaves its node depends only on its base's position inside a node (nodes hold ``per``
    consecutive ranks, and every group is its base plus the same offsets, the last ``span`` away), so the
    node questions need the residues, not the bases: at 2^20 ranks there are up to a million bases but at
    most ``per`` residues. Bases are sums of coordinate x stride over the other axes; a coordinate past the
    residue's period repeats a residue with a larger base, so each axis contributes at most its period.
    """
    dims = [sizes[a] for a in axes]
    strides = [prod(dims[:i]) for i in range(len(dims))]
    span = sum((dims[i] - 1) * strides[i] for i, a in enumerate(axes) if a in members)
    best = {0: 0}
    for i, a in enumerate(axes):
        if a in members or dims[i] == 1 or strides[i] % per == 0:
            continue  # this axis moves whole nodes: every residue keeps its smallest base
        choices = min(dims[i], per // gcd(strides[i], per))
        if len(best) * choices > _RESIDUE_WORK:
            bases = _offsets(dims, strides, [j for j, b in enumerate(axes) if b not in members])
            out: dict[int, int] = {}
            for b in bases:  # ascending: the first base of each residue is its smallest
                out.setdefault(b % per, b)
            return span, out
        nxt: dict[int, int] = {}
        for r, b in best.items():
            for c in range(choices):
                r2, b2 = (r + c * strides[i]) % per, b + c * strides[i]
                if b2 < nxt.get(r2, b2 + 1):
                    nxt[r2] = b2
        best = nxt
    return span, best


def max_gap(axes: list[str], sizes: dict[str, int], members: set[str]) -> int:
    """The largest difference between two consecutive ranks of a group along ``members`` (0 for one rank).

    With the member axes by stride, each one's first step lands ``stride - (the extent of the smaller
    axes)`` past the last rank so far; a step no larger than that extent lands inside it (no new gap).
    """
    dims = [sizes[a] for a in axes]
    strides = [prod(dims[:i]) for i in range(len(dims))]
    gap, extent = 0, 0
    for i in sorted((i for i, a in enumerate(axes) if a in members and dims[i] > 1),
                    key=lambda i: strides[i]):
        gap = max(gap, strides[i] - extent)
        extent += (dims[i] - 1) * strides[i]
    return gap


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
                 firsts: Mapping[str, Callable[[], list[int]]] | None = None,
                 views: Mapping[str, Callable[[], tuple[int, dict[int, int]]]] | None = None,
                 gaps: Mapping[str, Callable[[], int]] | None = None):
        self._builders = builders
        self._shapes = shapes or {}
        self._firsts = firsts or {}
        self._views = views or {}
        self._viewed: dict[str, tuple[int, dict[int, int]]] = {}
        self._gaps = gaps or {}
        self._first: dict[str, list[int]] = {}
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

    def view(self, kind: str) -> tuple[int, dict[int, int]] | None:
        """`node_view` of this kind's groups (None for a table built from plain lists)."""
        if kind not in self._views:
            return None
        if kind not in self._viewed:
            self._viewed[kind] = self._views[kind]()
        return self._viewed[kind]

    def first_ranks(self, kind: str, head: int | None = None) -> list[int]:
        """The first ``head`` ranks (all when None) of the group holding rank 0, without copying the rest."""
        if kind in self._shaped or kind not in self._firsts:
            return list(self.shape(kind)[0][:head])
        if kind not in self._first:
            self._first[kind] = self._firsts[kind]()
        return self._first[kind][:head]

    def gap(self, kind: str) -> int:
        """`max_gap` of this kind's groups (their size when the table was built from plain lists)."""
        return self._gaps[kind]() if kind in self._gaps else max(len(self.first(kind)), 1) * 2**62

    def first(self, kind: str) -> list[int]:
        """The group holding rank 0, built alone (once)."""
        return self.first_ranks(kind)

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
    #: why Megatron's expert grid for this order has other tensor-parallel groups (None: it has not);
    #: only a MoE model needs that grid, so DSF126 refuses MoE models when it is set
    expert_note: str | None = None
    #: answers of `crosses_nodes` by kind: the cost model asks for every collective of every pass, and each
    #: answer scans every group's base rank (thousands at 16,384 ranks)
    _crossing: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

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

    def _table(self, kind: str) -> GroupTable | None:
        """The lazy table, when this kind's groups are in one (plain lists answer by scanning)."""
        return self.groups if isinstance(self.groups, GroupTable) and kind in self.groups else None

    def _view(self, kind: str) -> tuple[int, dict[int, int]] | None:
        table = self._table(kind)
        return table.view(kind) if table is not None else None

    def nodes_spanned(self, kind: str) -> int:
        """The most nodes any one group of this kind spans (1: the group stays inside a node)."""
        table = self._table(kind)
        view = table.view(kind) if table is not None else None
        if table is not None and view is not None:
            span, residues = view
            per = self.gpus_per_node
            if table.gap(kind) <= per:
                # no node lies between two consecutive members: the group touches every node from its first
                # to its last rank
                return max(((r + span) // per + 1 for r in residues), default=1)
            offsets = self.first_group(kind)
            return max((len({(r + o) // per for o in offsets}) for r in residues), default=1)
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
        known = self._crossing.get(kind)
        if known is not None:
            return known
        view = self._view(kind)
        if view is not None:
            span, residues = view
            self._crossing[kind] = any(r + span >= self.gpus_per_node for r in residues)
            return self._crossing[kind]
        shape = self.shape(kind)
        if shape is None:
            return False
        offsets, bases = shape
        per, span = self.gpus_per_node, offsets[-1]
        # groups are sorted and nodes hold consecutive ranks: a group stays in one node iff its ends do
        self._crossing[kind] = any(b // per != (b + span) // per for b in bases)
        return self._crossing[kind]

    def crossing_group(self, kind: str, head: int | None = None) -> list[int] | None:
        """The first group of this kind with members on two or more nodes (its first ``head`` ranks), or
        None."""
        table = self._table(kind)
        view = table.view(kind) if table is not None else None
        if table is not None and view is not None:
            span, residues = view
            base = min((b for r, b in residues.items() if r + span >= self.gpus_per_node), default=None)
            offsets = table.first_ranks(kind, head)
            return None if base is None else [base + o for o in offsets]
        shape = self.shape(kind)
        if shape is None:
            return None
        offsets, bases = shape
        per = self.gpus_per_node
        base = next((b for b in bases if b // per != (b + offsets[-1]) // per), None)
        return None if base is None else [base + o for o in offsets[:head]]

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
    parse_order(order, dense)  # Megatron's checks in its order: the dense grid, ep's divisibility, the expert
                               # grid
    if (dp * cp) % ep:
        raise OrderError(f"ep={ep} does not divide dp*cp={dp * cp}", "DSF114")
    axes = parse_order(order, {**dense, "ep": ep})
    expert = {"tp": tp, "cp": 1, "ep": ep, "dp": dp * cp // ep, "pp": pp}
    if expert["dp"] > 1 and "dp" not in axes[:len(order_tokens(order))]:
        raise OrderError(f"order {order!r} omits dp, but the expert layers' data-parallel size dp*cp/ep = "
                         f"{dp}*{cp}/{ep} = {expert['dp']} > 1 must be "
                         f"placed (Megatron's expert RankGenerator)")
    note = check_expert_grid(order, axes, dense, expert)
    if note and ep > 1:
        raise OrderError(note, "DSF126")
    members = {"tp": (dense, {"tp"}), "pp": (dense, {"pp"}), "dp": (dense, {"dp"}), "cp": (dense, {"cp"}),
               "dp-cp": (dense, {"dp", "cp"}), "tp-pp": (dense, {"tp", "pp"}), "ep": (expert, {"ep"}),
               "edp": (expert, {"dp"})}
    if note:  # ep = 1: every rank holds every expert, so the dp x cp ranks holding the same experts are dp-cp
        members.update(ep=(dense, {"ep"}), edp=(dense, {"dp", "cp"}))
    builders = {kind: partial(rank_groups, axes, sizes, kinds) for kind, (sizes, kinds) in members.items()}
    shapes = {kind: partial(group_shape, axes, sizes, kinds) for kind, (sizes, kinds) in members.items()}
    firsts = {kind: partial(member_offsets, axes, sizes, kinds) for kind, (sizes, kinds) in members.items()}
    views = {kind: partial(node_view, axes, sizes, kinds, gpus_per_node) for kind,
             (sizes, kinds) in members.items()}
    gaps = {kind: partial(max_gap, axes, sizes, kinds) for kind, (sizes, kinds) in members.items()}
    return Placement(world, gpus_per_node, tuple(axes), GroupTable(builders, shapes, firsts, views, gaps),
                     note)
