"""The resolved plan: degrees, batch arithmetic, pipeline partition and rank placement.

Building a plan never raises on a bad layout: whatever cannot be resolved is left as None and
the rules explain why, so one run reports every problem at once. Once they found none,
`Plan.resolve()` gives the `ResolvedPlan` the estimates, the emitter, the search's candidates and
the runtime take: every value present, nothing left to check.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import accumulate
from typing import Any

from dsforge.compiler.model.params import embedding_params, head_params, is_moe_layer, layer_params
from dsforge.compiler.model.resolved import ResolvedModel, resolve_model
from dsforge.compiler.plan.megatron_split import accounted_partition
from dsforge.compiler.plan.placement import OrderError, Placement, place
from dsforge.compiler.spec.schema import JobSpec


@dataclass(frozen=True)
class Degrees:
    """Resolved parallel degrees; ``dp`` follows from the world size when it was `auto`."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int

    @property
    def product(self) -> int:
        """Ranks this layout occupies (ep is carved out of dp x cp, so it does not multiply)."""
        return self.tp * self.pp * self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel degree: replicas of each expert (Megatron's expert_data_parallel_size)."""
        return self.dp * self.cp // self.ep


def _int_or_none(value: int | str) -> int | None:
    return value if isinstance(value, int) else None


def balanced_partition(weights: Sequence[int], parts: int) -> list[int]:
    """Split a sequence of item weights into ``parts`` contiguous runs minimising the heaviest run.

    Same goal as DeepSpeed's ``partition_balanced`` (deepspeed/runtime/utils.py) used by
    PipelineModule's ``partition_method="parameters"``; returns the number of items per part.
    """
    if parts <= 0 or len(weights) < parts:
        return []
    n = len(weights)
    prefix = list(accumulate(weights, initial=0))

    def fits(cap: int) -> list[int] | None:
        # Greedy: each run takes as many items as fit under ``cap`` while leaving one item for every
        # later run; bisecting the prefix sums makes one try O(parts log n) (GPT-3's 98 items, ~37 tries).
        counts: list[int] = []
        i = 0
        while i < n:
            if len(counts) == parts:
                return None
            j = bisect_right(prefix, prefix[i] + cap, i + 1) - 1
            j = max(min(j, n - (parts - len(counts) - 1)), i + 1)
            counts.append(j - i)
            i = j
        return counts if len(counts) == parts else None

    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    best = fits(lo)
    return best if best is not None else []


@lru_cache(maxsize=256)
def layer_weights(model: ResolvedModel, tp: int) -> tuple[int, ...]:
    """Parameters of every layer as DeepSpeed's ``partition_method="parameters"`` weighs them: the embedding
    counted with the first layer and the head with the last.

    Cached per (model, tp): DSF301's fix search and `dsforge init` build many plans of one model, and
    re-counting every layer (and re-balancing them) for each took ~30 % of a validate that prices fixes.
    """
    weights = [layer_params(model, is_moe_layer(model, i)).total for i in range(model.layers)]
    weights[0] += embedding_params(model, tp)
    weights[-1] += head_params(model, tp)
    return tuple(weights)


@lru_cache(maxsize=1024)
def parameter_partition(model: ResolvedModel, tp: int, chunks: int) -> tuple[int, ...]:
    """Layers per chunk of DeepSpeed's ``partition_method="parameters"`` split (``balanced_partition`` of
    ``layer_weights``), cached per (model, tp, chunks) for the same reason; () if it cannot split."""
    return tuple(balanced_partition(layer_weights(model, tp), chunks))


def uniform_partition(items: int, parts: int) -> list[int]:
    """Split ``items`` into ``parts`` runs whose sizes differ by at most one (later runs larger)."""
    base, extra = divmod(items, parts)
    return [base + (1 if i >= parts - extra else 0) for i in range(parts)]


def end_stage_partition(layers: int, pp: int, vp: int, first: int | None, last: int | None) -> list[int]:
    """Layers per chunk (pipeline order, chunk j·pp + s of stage s) of Megatron-Core's uneven pipeline: the
    first (last) stage holds ``first`` (``last``) layers and the other stages share the rest evenly, each
    stage's layers split evenly over its ``vp`` chunks (megatron/core/transformer/transformer_config.py,
    the "Uneven PP" checks; transformer_block.py get_num_layers_to_build). Middle layers that do not split
    evenly give the later stages one more (DSF305 says when that happens); [] when no split exists."""
    ends = {0: first, pp - 1: last} if pp > 1 else {}
    fixed = {s: n for s, n in ends.items() if n is not None}
    middle_stages = pp - len(fixed)
    rest = layers - sum(fixed.values())
    if pp < 2 or rest < 0 or (rest > 0) != (middle_stages > 0) or (middle_stages and rest < middle_stages):
        return []
    middle = iter(uniform_partition(rest, middle_stages) if middle_stages else [])
    per_stage = [fixed[s] if s in fixed else next(middle) for s in range(pp)]
    if any(n < vp for n in per_stage):
        return []
    split = [uniform_partition(n, vp) for n in per_stage]
    return [split[s][j] for j in range(vp) for s in range(pp)]


@dataclass(frozen=True)
class Plan:
    """A job with everything derived: degrees, world size, batch split, stage partition, placement;
    ``search``: the layout search that chose its `auto` fields (dsforge/compiler/search/resolve.py record),
    for plan.json."""

    spec: JobSpec
    search: dict[str, Any] | None = field(default=None, compare=False, hash=False, repr=False)
    #: what plans of one job may share instead of computing it again (the search's candidates): the resolved
    #: model of ``spec.model``, and the placement (with its order error) of the plan's degrees, node size and
    #: order
    shared_model: ResolvedModel | None = field(default=None, compare=False, hash=False, repr=False,
                                               kw_only=True)
    shared_placement: tuple[Placement | None,
                            str | None] | None = field(default=None, compare=False, hash=False,
                                                                         repr=False, kw_only=True)

    @cached_property
    def model(self) -> ResolvedModel:
        """The job's model with every default filled (kv_heads, ffn_hidden, activation, position,
        moe.ffn_hidden)."""
        return self.shared_model if self.shared_model is not None else resolve_model(self.spec.model)

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return self.spec.hardware.nodes

    @property
    def gpus_per_node(self) -> int:
        """Ranks per node."""
        return self.spec.hardware.gpus_per_node

    @property
    def world_size(self) -> int:
        """Ranks in the job: nodes x gpus_per_node."""
        return self.nodes * self.gpus_per_node

    @cached_property
    def degrees(self) -> Degrees | None:
        """The degrees, with dp resolved from the world size; None while any other degree is `auto`."""
        p = self.spec.parallel
        tp, pp, cp, ep = (_int_or_none(v) for v in (p.tp, p.pp, p.cp, p.ep))
        if tp is None or pp is None or cp is None or ep is None:
            return None
        dp = _int_or_none(p.dp)
        if dp is None:
            dp = max(1, self.world_size // (tp * pp * cp))
        return Degrees(tp, pp, dp, cp, ep)

    @property
    def zero(self) -> int:
        """ZeRO stage (`auto` counts as 0 until the search picks one)."""
        return self.spec.parallel.zero if isinstance(self.spec.parallel.zero, int) else 0

    @property
    def layout_ok(self) -> bool:
        """True when the degrees are resolved and exactly fill the world size."""
        return self.degrees is not None and self.degrees.product == self.world_size

    @property
    def grad_accum(self) -> int | None:
        """Gradient-accumulation steps (micro-batches per step), None if global_batch does not split."""
        if self.degrees is None:
            return None
        t = self.spec.training
        per_step = t.micro_batch * self.degrees.dp
        if t.global_batch % per_step:
            return None
        return t.global_batch // per_step

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank (1 unless the interleaved schedule is chosen)."""
        return self.spec.parallel.pipeline.virtual_stages

    @cached_property
    def stage_layers(self) -> list[int]:
        """Transformer layers per model chunk, in pipeline order (pp x virtual_stages chunks); [] if
        unsplittable."""
        if self.degrees is None:
            return []
        pipe = self.spec.parallel.pipeline
        m, part = self.model, pipe.partition
        chunks = self.degrees.pp * self.virtual_stages
        if isinstance(part, list):
            return list(part) if len(part) == chunks and sum(part) == m.layers else []
        if getattr(pipe, "account_for_embedding", False) or getattr(pipe, "account_for_loss", False):
            # Megatron-Core's embedding/loss-counting split (plan/megatron_split.py; DSF306 refuses what
            # fails)
            return accounted_partition(m.layers, self.degrees.pp, self.virtual_stages,
                                       pipe.account_for_embedding, pipe.account_for_loss)
        if pipe.first_stage_layers is not None or pipe.last_stage_layers is not None:
            return end_stage_partition(m.layers, self.degrees.pp, self.virtual_stages,
                                       pipe.first_stage_layers, pipe.last_stage_layers)
        if m.layers < chunks:
            return []
        # Megatron-Core splits layers evenly over the chunks (DSF109 refuses what does not divide);
        # DeepSpeed's
        # type:transformer weighs each transformer layer 1 and the rest 0 (plan/megatron_split.py's neighbour)
        if part in ("uniform", "type:transformer") or chunks == 1 or self.spec.stack == "megatron-te":
            return uniform_partition(m.layers, chunks)
        # "parameters": DeepSpeed weighs every layer spec, embeddings and head included.
        return list(parameter_partition(m, self.degrees.tp, chunks))

    @cached_property
    def _placed(self) -> tuple[Placement | None, str | None]:
        """Placement and the order error, computed once (rules ask for both)."""
        if self.shared_placement is not None:
            return self.shared_placement
        d = self.degrees
        if d is None or not self.layout_ok or (d.dp * d.cp) % d.ep:
            return None, None
        try:
            return place(d.tp, d.pp, d.dp, d.cp, d.ep, self.gpus_per_node, self.spec.parallel.order), None
        except OrderError as exc:
            return None, str(exc)

    @property
    def placement(self) -> Placement | None:
        """Rank placement and groups, or None when the degrees do not fill the world or cannot be ordered."""
        return self._placed[0]

    def order_error(self) -> str | None:
        """Why the order string cannot place this layout, or None."""
        return self._placed[1]

    @cached_property
    def _resolved(self) -> ResolvedPlan | None:
        """The ResolvedPlan, built once (the estimates' memos live on it), or None while a value is
        unresolved."""
        d, m, p = self.degrees, self.grad_accum, self.placement
        if d is None or m is None or p is None or not self.stage_layers:
            return None
        return ResolvedPlan(self.spec, self.model, d, m, self.stage_layers, p,
                            self.search if self.search is not None else {})

    @cached_property
    def _priced(self) -> Priced | None:
        if self._resolved is not None:  # one object for the bounds, the estimates and the rules to share
                                        # memos
            return self._resolved
        d = self.degrees
        return None if d is None else PricedPlan(self.spec, self.model, d, self.stage_layers, self.placement,
                                                 self.grad_accum, self.layout_ok)

    def priced(self) -> Priced:
        """What the estimates read of this plan, built once (its memos live on it): the ResolvedPlan when the
        layout resolves, else a PricedPlan; UnresolvedPlan while a degree is `auto` (the search's candidates
        and the plans the memory rules price have every degree)."""
        priced = self._priced
        if priced is None:
            raise UnresolvedPlan("the plan is incomplete (degrees unresolved); "
                                 "run `dsforge validate` for the reasons")
        return priced

    def resolve(self) -> ResolvedPlan:
        """This plan with every derived value present (built once); UnresolvedPlan (naming what is missing)
        when its layout does not resolve, which the rules report first (DSF1xx), so a checked job never meets
        it."""
        resolved = self._resolved
        if resolved is None:
            missing = [name for name, absent in (("degrees", self.degrees is None),
                                                 ("grad_accum", self.grad_accum is None),
                                                 ("stage_layers", not self.stage_layers),
                                                 ("placement", self.placement is None)) if absent]
            raise UnresolvedPlan(f"the plan is incomplete ({', '.join(missing)} unresolved); run `dsforge "
                                 f"validate` for the reasons")
        return resolved


class UnresolvedPlan(ValueError):
    """`Plan.resolve()` of a plan whose layout does not resolve (the rules say why)."""


class _JobFacts:
    """What a resolved or priced plan reads straight from its job (a plain base: no dataclass fields)."""

    spec: JobSpec

    @property
    def nodes(self) -> int:
        """Number of nodes."""
        return self.spec.hardware.nodes

    @property
    def gpus_per_node(self) -> int:
        """Ranks per node."""
        return self.spec.hardware.gpus_per_node

    @property
    def world_size(self) -> int:
        """Ranks in the job: nodes x gpus_per_node."""
        return self.nodes * self.gpus_per_node

    @property
    def zero(self) -> int:
        """ZeRO stage (`auto` counts as 0 until the search picks one)."""
        return self.spec.parallel.zero if isinstance(self.spec.parallel.zero, int) else 0

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank (1 unless the interleaved schedule is chosen)."""
        return self.spec.parallel.pipeline.virtual_stages


@dataclass(frozen=True)
class ResolvedPlan(_JobFacts):
    """A plan whose layout resolved: degrees that fill the world, a batch that splits, a stage partition and a
    rank placement, none of them optional (`Plan.resolve()`). Equal when their specs are; ``search``: the
    layout search's record ({} when none ran)."""

    spec: JobSpec
    model: ResolvedModel = field(compare=False, repr=False)
    degrees: Degrees = field(compare=False)
    grad_accum: int = field(compare=False)
    stage_layers: list[int] = field(compare=False, repr=False)
    placement: Placement = field(compare=False, repr=False)
    search: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def layout_ok(self) -> bool:
        """Always True: the degrees fill the world (kept for code that reads either kind of plan)."""
        return True


@dataclass(frozen=True)
class PricedPlan(_JobFacts):
    """What the estimates read of a plan whose degrees resolved (`Plan.priced`), before the rules have judged
    it: DSF301's fixes and the search's bounds price such plans. ``stage_layers``: [] when the layers do not
    split; ``placement``: None when the degrees do not fill the world or cannot be ordered (every link then
    counts as intra-node, and the memory estimate refuses it); ``grad_accum``: None when global_batch does not
    split (the memory estimate then prices `memory.micro_batches`, the step estimate refuses it). Equal when
    their specs are."""

    spec: JobSpec
    model: ResolvedModel = field(compare=False, repr=False)
    degrees: Degrees = field(compare=False)
    stage_layers: list[int] = field(compare=False, repr=False)
    placement: Placement | None = field(compare=False, repr=False)
    grad_accum: int | None = field(compare=False)
    layout_ok: bool = field(compare=False)


#: What the estimates price: a plan with its degrees (DSF301's fixes and the search's bounds), or a resolved
#: one.
Priced = PricedPlan | ResolvedPlan

#: Any kind of plan: what reads the job's settings alone (ds_settings, the ZeRO settings, the FLOPs and
#: rates).
AnyPlan = Plan | PricedPlan | ResolvedPlan


def build_plan(spec: JobSpec) -> Plan:
    """Resolve a job spec into a plan (pure; bad layouts surface through the rules)."""
    return Plan(spec)
