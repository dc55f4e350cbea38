"""An independent model of Megatron-Core's rank groups (megatron/core/parallel_state.py), for tests only.

Written from the documented algorithm, not from Megatron's code, and deliberately in a different
style from ``dsforge.compiler.plan.placement`` (which works with member offsets and base ranks): here
every rank's coordinates are decoded one rank at a time and ranks are bucketed by the coordinates
a group kind leaves fixed.

What Megatron documents and does:

* ``RankGenerator(tp, ep, dp, pp, cp, order)`` lays the ranks out as a mixed-radix number over the
  order string, the first axis varying fastest. An axis of size > 1 that the order does not name is
  a RuntimeError; axes of size 1 it does not name are appended at the end.
* ``generate_masked_orthogonal_rank_groups(world, sizes, mask)``: the ranks of one group differ only
  in the masked axes. Groups are numbered by the unmasked coordinates (mixed radix, first unmasked
  axis fastest); inside a group the ranks are numbered by the masked coordinates the same way. Both
  numberings are monotone in the rank, so each group is ascending and the groups are ordered by
  their first rank.
* ``initialize_model_parallel`` builds two generators over the same order: the decoder one
  (ep = 1, cp = cp, dp = world / (tp pp cp)) and the expert one (tp = expert_tensor_parallel_size,
  which defaults to tp; cp = 1; ep = ep; dp = world / (etp ep pp)). Then it asserts
  ``order.endswith("pp") or pp == 1 or expert_dp == dp`` ("When not using pp-last rank ordering,
  the data parallel size of the attention and moe layers must be the same") and that both
  generators give the same pipeline groups ("Pipeline parallel groups are expected to be the same
  for Non-Expert and Expert part").
"""

from __future__ import annotations

from dataclasses import dataclass

NAMES = ("tp", "pp", "dp", "ep", "cp")

PP_LAST = "pp-last"
PP_GROUPS = "pp-groups"
MISSING_AXIS = "missing-axis"
UNKNOWN_AXIS = "unknown-axis"
NOT_DIVISIBLE = "not-divisible"
DUPLICATE_AXIS = "duplicate-axis"


class MegatronRefusal(Exception):
    """Megatron would stop here; ``kind`` names which of its checks fired."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def decode(rank: int, radices: list[int]) -> list[int]:
    """The mixed-radix digits of ``rank``, least significant (fastest-varying) first."""
    digits = []
    for r in radices:
        digits.append(rank % r)
        rank //= r
    return digits


def encode(digits: list[int], radices: list[int]) -> int:
    """Inverse of ``decode``."""
    value, scale = 0, 1
    for d, r in zip(digits, radices):
        value += d * scale
        scale *= r
    return value


def masked_orthogonal_groups(world: int, sizes: list[int], mask: list[bool],
                             digits_of: list[list[int]] | None = None) -> list[list[int]]:
    """The groups of ranks that differ only in the masked axes, numbered as Megatron numbers them
    (``digits_of``: every rank's decoded digits, when the caller has them already)."""
    assert world == _product(sizes), (world, sizes)
    fixed = [s for s, m in zip(sizes, mask) if not m]
    free = [s for s, m in zip(sizes, mask) if m]
    groups: list[list[int | None]] = [[None] * _product(free) for _ in range(_product(fixed))]
    for rank in range(world):
        digits = digits_of[rank] if digits_of is not None else decode(rank, sizes)
        group_index = encode([d for d, m in zip(digits, mask) if not m], fixed)
        in_group = encode([d for d, m in zip(digits, mask) if m], free)
        assert groups[group_index][in_group] is None
        groups[group_index][in_group] = rank
    return [[r for r in g if r is not None] for g in groups]


def _product(values: list[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@dataclass
class Generator:
    """Megatron's RankGenerator for one grid (decoder or expert)."""

    tp: int
    ep: int
    dp: int
    pp: int
    cp: int
    order: str

    def __post_init__(self) -> None:
        size = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp}
        text = self.order.lower()
        for name in NAMES:
            # Megatron tests membership on the string, and appends the size-1 axes it does not find
            if name not in text:
                if size[name] != 1:
                    raise MegatronRefusal(MISSING_AXIS, f"the size of ({name}) is ({size[name]}), but the "
                                                        f"order ({self.order}) does not name it")
                text += "-" + name
        self.axes = text.split("-")
        for axis in self.axes:
            if axis not in size:
                raise MegatronRefusal(UNKNOWN_AXIS, f"unknown axis {axis!r}")  # a KeyError in Megatron
        self.sizes = [size[a] for a in self.axes]
        self.world = _product(list(size.values()))
        if _product(self.sizes) != self.world:
            # an axis of size > 1 named twice: Megatron's arithmetic no longer covers the world
            raise MegatronRefusal(DUPLICATE_AXIS, f"order {self.order!r} names an axis of size > 1 twice")

    def ranks(self, token: str) -> list[list[int]]:
        """The groups of ``token`` (axes joined by '-', e.g. 'dp-cp'), as Megatron's get_ranks returns
        them."""
        cache = self.__dict__.setdefault("_cache", {})
        if token not in cache:
            cache[token] = self._ranks(token)
        return [list(g) for g in cache[token]]

    def _ranks(self, token: str) -> list[list[int]]:
        wanted = token.split("-")
        mask = [False] * len(self.axes)
        for t in wanted:
            mask[self.axes.index(t)] = True  # the first occurrence, as list.index finds it
        if "_digits" not in self.__dict__:
            self._digits = [decode(r, self.sizes) for r in range(self.world)]
        return masked_orthogonal_groups(self.world, self.sizes, mask, self._digits)


@dataclass
class MegatronGroups:
    """What initialize_model_parallel builds for one layout: the two generators."""

    decoder: Generator
    expert: Generator

    def dense(self, token: str) -> list[list[int]]:
        """A decoder-grid group kind."""
        return self.decoder.ranks(token)

    def experts(self, token: str) -> list[list[int]]:
        """An expert-grid group kind ('ep', 'dp' = expert data parallel, 'tp' = expert tensor parallel)."""
        return self.expert.ranks(token)


def initialize(world: int, tp: int, pp: int, cp: int, ep: int, order: str,
               etp: int | None = None) -> MegatronGroups:
    """Megatron's initialize_model_parallel group construction and checks (no processes, no NCCL)."""
    model = tp * pp * cp
    if world % model:
        raise MegatronRefusal(NOT_DIVISIBLE, f"world_size ({world}) is not divisible by {model}")
    dp = world // model
    decoder = Generator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    etp = tp if etp is None else etp
    expert_model = etp * ep * pp
    if world % expert_model:
        raise MegatronRefusal(NOT_DIVISIBLE, f"world_size ({world}) is not divisible by "
                                             f"expert_tensor_model_pipeline_parallel size ({expert_model})")
    edp = world // expert_model
    expert = Generator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order)
    if not (order.endswith("pp") or pp == 1 or edp == dp):
        raise MegatronRefusal(PP_LAST, "When not using pp-last rank ordering, the data parallel size of the "
                                       "attention and moe layers must be the same")
    if decoder.ranks("pp") != expert.ranks("pp"):
        raise MegatronRefusal(PP_GROUPS, "Pipeline parallel groups are expected to be the same for "
                                         "Non-Expert and Expert part")
    return MegatronGroups(decoder, expert)
