"""The candidate space of a layout search: which fields are `auto`, and every combination of them that is
legal by construction (divisors of the world size, shapes divisible by tp, layers over the pipeline chunks,
experts over ep inside dp x cp, micro-batches that divide the per-replica batch, sequences over 2 x cp, no
ZeRO-2/3 with a pipeline). What construction cannot see is left to the rules `validate` runs
(dsforge/compiler/search/engine.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any

from dsforge.compiler.model.resolved import ResolvedModel
from dsforge.compiler.spec.schema import JobSpec, SearchSpec

AUTO = "auto"

#: Every key a job may leave `auto` for the search, as (section path, attribute).
AUTO_KEYS: tuple[tuple[str, ...], ...] = (
    ("parallel", "tp"), ("parallel", "pp"), ("parallel", "dp"), ("parallel", "cp"), ("parallel", "ep"),
    ("parallel", "zero"), ("parallel", "sequence_parallel"), ("parallel", "context_parallel", "kind"),
    ("parallel", "pipeline", "schedule"), ("parallel", "pipeline", "virtual_stages"),
    ("training", "micro_batch"), ("training", "recompute"), ("hardware", "nodes"),
)
RECOMPUTE = ("none", "selective", "full")
#: Model chunks per pipeline rank the search tries for the interleaved schedule (Narayanan et al. 2021 use
#: 2-4; beyond 8 the point-to-point traffic outgrows the bubble it saves).
MAX_VIRTUAL_STAGES = 8
SCHEDULES = ("1f1b", "interleaved", "gpipe")


def value_at(spec: JobSpec, path: tuple[str, ...]) -> Any:
    """The spec's value at a key path."""
    node: Any = spec
    for part in path:
        node = getattr(node, part)
    return node


def is_auto(spec: JobSpec, path: tuple[str, ...]) -> bool:
    """True when the key is `auto` (typed as its resolved type: the search replaces it before planning)."""
    return bool(value_at(spec, path) == AUTO)


def auto_keys(spec: JobSpec) -> list[tuple[str, ...]]:
    """The keys this job leaves to the search (`parallel.dp: auto` alone follows from the world size, no
    search)."""
    found = [k for k in AUTO_KEYS if value_at(spec, k) == AUTO]
    return [] if found in ([], [("parallel", "dp")]) else found


def wants_search(spec: JobSpec) -> bool:
    """True when the job has a field only the search can fill, or a `search:` section."""
    return bool(auto_keys(spec)) or spec.search is not None


def options(spec: JobSpec) -> SearchSpec:
    """The job's `search:` section, or its defaults."""
    return spec.search if spec.search is not None else _defaults()


@lru_cache(maxsize=1)
def _defaults() -> SearchSpec:
    out: SearchSpec = SearchSpec.model_validate({})  # validated once: the space asks for it per skeleton
    return out


@dataclass(frozen=True, order=True)
class Layout:
    """One candidate: a value for every field the search may set (the job's own value where it is not
    `auto`)."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    zero: int
    sequence_parallel: bool
    cp_kind: str
    schedule: str
    virtual_stages: int
    micro_batch: int
    recompute: str
    global_batch: int
    nodes: int

    @property
    def model_parallel(self) -> int:
        """Ranks one model replica is split over (tp x pp x cp): the seeds' order prefers the fewest."""
        return self.tp * self.pp * self.cp

    def tiebreak(self) -> tuple[Any, ...]:
        """The order among equally good layouts: less model parallelism first (tp x pp x cp, then tp, pp, cp,
        ep), then lower ZeRO, less recomputation, larger micro-batches; the remaining fields make it total."""
        return (self.nodes, self.model_parallel, self.tp, self.pp, self.cp, self.ep, self.zero,
                RECOMPUTE.index(self.recompute), -self.micro_batch, self.virtual_stages,
                SCHEDULES.index(self.schedule), self.sequence_parallel, self.cp_kind, -self.global_batch)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def label(self) -> str:
        """A short name: tp2 pp4 dp8 cp1 ep1 z1 mb1 sel."""
        return (f"tp{self.tp} pp{self.pp} dp{self.dp} cp{self.cp} ep{self.ep} z{self.zero} "
                f"mb{self.micro_batch} {self.recompute}")


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def powers_of_two(n: int) -> list[int]:
    """The powers of two that divide n (the micro-batches the search tries: 1, 2, 4, ...)."""
    out, p = [], 1
    while n % p == 0 and p <= n:
        out.append(p)
        p *= 2
    return out


def _pick(value: Any, choices: list[Any]) -> list[Any]:
    """`auto`: every choice; a written value: itself."""
    return choices if value == AUTO else [value]


def tp_fits(model: ResolvedModel, tp: int, replicate_kv: bool) -> bool:
    """Heads, KV heads and the MLP split evenly over tp (vocabulary padding lets any tp split the
    vocabulary)."""
    kv_ok = model.kv_heads % tp == 0 or (replicate_kv and tp % model.kv_heads == 0)
    moe_ok = model.moe is None or model.moe.ffn_hidden % tp == 0
    return model.heads % tp == 0 and kv_ok and model.ffn_hidden % tp == 0 and moe_ok


def batch_choices(spec: JobSpec) -> list[int]:
    """Global batches to consider: the job's, or powers of two within `search.global_batch` and both ends."""
    rng = options(spec).global_batch
    if rng is None:
        return [spec.training.global_batch]
    lo, hi = min(rng), max(rng)
    picks = {lo, hi}
    p = 1
    while p <= hi:
        if p >= lo:
            picks.add(p)
        p *= 2
    return sorted(picks)


def skeletons(spec: JobSpec, model: ResolvedModel,
              nodes: int) -> Iterator[tuple[int, int, int, int, int, int]]:
    """(tp, pp, dp, cp, ep, zero) of every degree combination legal by construction on ``nodes`` nodes."""
    par, opts = spec.parallel, options(spec)
    world = nodes * spec.hardware.gpus_per_node
    part = par.pipeline.partition
    v_fixed = par.pipeline.virtual_stages if isinstance(par.pipeline.virtual_stages, int) else None
    max_tp = opts.max_tp if opts.max_tp is not None else spec.hardware.gpus_per_node  # TP inside a node
    for tp in _pick(par.tp, divisors(world)):
        if world % tp or (par.tp == AUTO and not tp_fits(model, tp, par.replicate_kv_heads)):
            continue
        if par.tp == AUTO and tp > max_tp:
            continue
        for pp in _pick(par.pp, divisors(world // tp)):
            if (world // tp) % pp:
                continue
            if par.pp == AUTO:
                chunks_min = pp * (v_fixed or 1)
                if isinstance(part, list) and len(part) % pp:
                    continue
                if chunks_min > model.layers:
                    continue
            for cp in _pick(par.cp, divisors(world // (tp * pp))):
                if (world // (tp * pp)) % cp:
                    continue
                if par.cp == AUTO and cp > 1 and model.seq_len % (2 * cp):
                    continue
                dp = world // (tp * pp * cp)
                if par.dp != AUTO and par.dp != dp:
                    continue
                experts = model.moe.experts if model.moe is not None else 1
                for ep in _pick(par.ep, divisors(experts)):
                    if par.ep == AUTO and (dp * cp) % ep:
                        continue
                    for zero in _pick(par.zero, [0, 1, 2, 3]):
                        if par.zero == AUTO and pp > 1 and zero >= 2:
                            continue  # DeepSpeed's PipelineEngine refuses ZeRO-2/3
                        yield tp, pp, dp, cp, ep, zero


def layouts(spec: JobSpec, model: ResolvedModel, skeleton: tuple[int, int, int, int, int, int],
            nodes: int) -> Iterator[Layout]:
    """Every full candidate of one degree combination: SP, CP kind, schedule, chunks, batch, micro-batch,
    recompute."""
    tp, pp, dp, cp, ep, zero = skeleton
    par, t = spec.parallel, spec.training
    part = par.pipeline.partition
    # the innermost choices, the same for every SP, CP kind and schedule of this skeleton: listed once
    batches = [(gb, [mb for mb in _pick(t.micro_batch, powers_of_two(gb // dp)) if (gb // dp) % mb == 0])
               for gb in batch_choices(spec) if gb % dp == 0]
    recomputes = _pick(t.recompute, list(RECOMPUTE))
    for sp in _pick(par.sequence_parallel, [False, True] if tp > 1 else [False]):
        for kind in _pick(par.context_parallel.kind, ["ring", "ulysses"] if cp > 1 else ["ring"]):
            if par.context_parallel.kind == AUTO and kind == "ulysses" and (model.heads // tp) % cp:
                continue
            for schedule in _pick(par.pipeline.schedule, list(SCHEDULES) if pp > 1 else ["1f1b"]):
                for v in _virtual(par.pipeline.virtual_stages, schedule, pp, model.layers, part):
                    for gb, mbs in batches:
                        for mb in mbs:
                            for rc in recomputes:
                                yield Layout(tp, pp, dp, cp, ep, zero, sp, kind, schedule, v, mb, rc, gb,
                                             nodes)


def space_size(spec: JobSpec, model: ResolvedModel, nodes: int) -> int:
    """How many candidates `layouts` yields over every skeleton, counted without building them."""
    return sum(skeleton_size(spec, model, skel) for skel in skeletons(spec, model, nodes))


def skeleton_size(spec: JobSpec, model: ResolvedModel, skeleton: tuple[int, int, int, int, int, int]) -> int:
    """How many candidates `layouts` yields for one skeleton, counted without building them (the choices of
    SP, CP kind, schedule and chunks, batch and micro-batch, and recompute multiply)."""
    par, t = spec.parallel, spec.training
    tp, pp, dp, cp, _ep, _zero = skeleton
    rc = len(_pick(t.recompute, list(RECOMPUTE)))
    sps = len(_pick(par.sequence_parallel, [False, True] if tp > 1 else [False]))
    kinds = [k for k in _pick(par.context_parallel.kind, ["ring", "ulysses"] if cp > 1 else ["ring"])
             if not (par.context_parallel.kind == AUTO and k == "ulysses" and (model.heads // tp) % cp)]
    chunks = sum(len(_virtual(par.pipeline.virtual_stages, s, pp, model.layers, par.pipeline.partition))
                 for s in _pick(par.pipeline.schedule, list(SCHEDULES) if pp > 1 else ["1f1b"]))
    mbs = sum(sum(1 for mb in _pick(t.micro_batch, powers_of_two(gb // dp)) if (gb // dp) % mb == 0)
              for gb in batch_choices(spec) if gb % dp == 0)
    return sps * len(kinds) * chunks * mbs * rc


def _virtual(value: Any, schedule: str, pp: int, layers: int, part: Any) -> list[int]:
    """Model chunks per rank: 1 unless interleaved; interleaved: every v >= 2 whose pp x v chunks split the
    layers."""
    if value != AUTO:
        return [value]
    if schedule != "interleaved" or pp == 1:
        return [1]
    if isinstance(part, list):
        return [len(part) // pp] if len(part) % pp == 0 and len(part) // pp >= 2 else []
    return [v for v in range(2, min(layers // pp, MAX_VIRTUAL_STAGES) + 1) if layers % (pp * v) == 0]


def apply_layout(spec: JobSpec, lay: Layout) -> JobSpec:
    """The job with a candidate's values in place of its `auto` fields (and the search's batch)."""
    par, t = spec.parallel, spec.training
    pipe = par.pipeline.model_copy(update={"schedule": lay.schedule, "virtual_stages": lay.virtual_stages})
    cpk = par.context_parallel.model_copy(update={"kind": lay.cp_kind})
    new_par = par.model_copy(update={"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "ep": lay.ep,
                                     "zero": lay.zero, "sequence_parallel": lay.sequence_parallel,
                                     "context_parallel": cpk, "pipeline": pipe})
    new_t = t.model_copy(update={"micro_batch": lay.micro_batch, "recompute": lay.recompute,
                                 "global_batch": lay.global_batch})
    update: dict[str, Any] = {"parallel": new_par, "training": new_t}
    if spec.hardware.nodes != lay.nodes:
        update["hardware"] = spec.hardware.model_copy(update={"nodes": lay.nodes})
    out: JobSpec = spec.model_copy(update=update)
    return out


def written_layout(spec: JobSpec) -> Layout | None:
    """The job's own layout when it names every field (for `--compare`), else None."""
    par, t = spec.parallel, spec.training
    vals = [par.tp, par.pp, par.cp, par.ep, par.zero, par.sequence_parallel, par.context_parallel.kind,
            par.pipeline.schedule, par.pipeline.virtual_stages, t.micro_batch, t.recompute,
            spec.hardware.nodes]
    if any(v == AUTO for v in vals):
        return None
    tp, pp, cp, ep, zero = (int(v) for v in (par.tp, par.pp, par.cp, par.ep, par.zero))
    world = spec.hardware.nodes * spec.hardware.gpus_per_node
    dp = par.dp if isinstance(par.dp, int) else world // (tp * pp * cp)
    return Layout(tp, pp, dp, cp, ep, zero, par.sequence_parallel, par.context_parallel.kind,
                  par.pipeline.schedule, par.pipeline.virtual_stages, t.micro_batch, t.recompute,
                  t.global_batch, spec.hardware.nodes)
