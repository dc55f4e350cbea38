"""The rewrite plan: every parameter-owning module with its variant, full and per-rank shard shapes.

``plan_rewrite`` walks a module tree (normally built on the ``meta`` device, so even a 405B model
costs no memory), matches the policy rows, computes the shards the plan's tp and ep imply and
checks them; it raises ``RewriteError`` naming every module no rule placed and every shard that
does not divide. The result is plain data (``RewritePlan.to_dict``) for plan.json and explain.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from dsforge.compiler.model.rewrite_policies import POLICIES, rows_for
from dsforge.compiler.plan.plan import AnyPlan
from dsforge.runtime.errors import RuntimeRefusal
from dsforge.runtime.hf_attention import plain_causal_problems
from dsforge.runtime.rewrite.shard import (
    Heads,
    ParamShard,
    ShardResult,
    block_widths,
    head_norm_weight,
    replicated,
    scalar_params,
    shard_experts,
    shard_norm_weight,
    shard_tensor_parallel,
)
from dsforge.runtime.rewrite.walk import (
    Claim,
    direct_shapes,
    expert_shapes,
    find_layer_list,
    group_names,
    match_rows,
    module_kind,
    subtree_shapes,
)


class RewriteError(RuntimeRefusal, ValueError):
    """The policies cannot place the model under this plan; ``problems`` lists every reason."""

    def __init__(self, arch: str, problems: list[str], leftover: list[str] | None = None) -> None:
        self.arch, self.problems, self.leftover = arch, problems, leftover or []
        super().__init__(f"cannot rewrite the model with the `{arch}` policy:\n  " + "\n  ".join(problems))


@dataclass
class ModulePlan:
    """One claimed module: variant, the rule that chose it, its layer, and its parameter shards."""

    name: str
    type: str
    variant: str
    rule: str
    kind: str
    layer: int | None
    params: list[ParamShard]
    owners: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    fused: int = 1
    heads: str | None = None
    stage: int = 0
    widths: tuple[int, ...] = ()  # a fused weight's unequal block widths (Phi3's qkv_proj); () when equal

    @property
    def tied_to(self) -> str | None:
        """The module whose parameters this one shares (tied LM head), if any."""
        names = {o.rsplit(".", 1)[0] for p, o in self.owners.items() if o != _join(self.name, p)}
        return names.pop() if len(names) == 1 else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "type": self.type, "kind": self.kind, "variant": self.variant,
                "rule": self.rule, "layer": self.layer, "stage": self.stage, "tied_to": self.tied_to,
                "notes": self.notes,
                "params": {p.name: {"shape": list(p.shape), "shard": list(p.shard), "dim": p.dim}
                           for p in self.params}}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass
class RewritePlan:
    """The whole plan: arch, degrees and the modules in walk order."""

    arch: str
    tp: int
    ep: int
    pp: int
    sequence_parallel: bool
    modules: list[ModulePlan]
    layer_list: str | None
    head_dim: int
    attr_scales: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    moe: MoERouting | None = None
    #: What context parallelism (cp > 1) would drop from the model's attention (DSF144); empty when cp = 1.
    cp_refusals: list[str] = field(default_factory=list)

    def module(self, name: str) -> ModulePlan:
        """The entry of one module by qualified name."""
        return next(m for m in self.modules if m.name == name)

    def _distinct(self, modules: list[ModulePlan], shard: bool) -> int:
        seen: dict[str, int] = {}
        for m in modules:
            for p in m.params:
                seen.setdefault(m.owners.get(p.name, _join(m.name, p.name)),
                                p.shard_numel if shard else p.numel)
        return sum(seen.values())

    @property
    def total_params(self) -> int:
        """Exact parameters of the model, every expert and a tied weight once."""
        return self._distinct(self.modules, shard=False)

    def stage_params(self) -> list[int]:
        """Exact parameters one rank of each pipeline stage holds (a tied weight on both its stages)."""
        return [self._distinct([m for m in self.modules if m.stage == s], shard=True) for s in range(self.pp)]

    def summary(self) -> list[dict[str, Any]]:
        """Modules grouped by rule, variant and shapes: one row per repeated pattern, for explain."""
        rows: dict[tuple[Any, ...], dict[str, Any]] = {}
        for m in self.modules:
            shapes = tuple((p.name, p.shape, p.shard) for p in m.params)
            key = (m.rule, m.variant, m.type, shapes, m.tied_to is not None)
            row = rows.setdefault(key, {"rule": m.rule, "variant": m.variant, "type": m.type, "names": [],
                                        "params": {p.name: {"shape": list(p.shape), "shard": list(p.shard)}
                                                   for p in m.params},
                                        "tied_to": m.tied_to, "notes": m.notes})
            row["names"].append(m.name)
        out = []
        for row in rows.values():
            names = row.pop("names")
            out.append({"modules": ", ".join(group_names(names)), "count": len(names), **row})
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for plan.json: summary, every module, exact parameter counts."""
        per_stage = self.stage_params()
        # only when there is something to refuse: plan.json (and its goldens) of every job compile accepts
        # stay as they were
        refusals = {"context_parallel_refusals": list(self.cp_refusals)} if self.cp_refusals else {}
        return {**refusals, "arch": self.arch, "tp": self.tp, "ep": self.ep, "pp": self.pp,
                "sequence_parallel": self.sequence_parallel, "layer_list": self.layer_list,
                "head_dim": self.head_dim,
                "attr_scales": [{"module": n, "attr": a} for n, a in self.attr_scales],
                "params": {"total": self.total_params, "per_rank_by_stage": per_stage,
                           "max_per_rank": max(per_stage)},
                "summary": self.summary(), "modules": [m.to_dict() for m in self.modules],
                "warnings": self.warnings}


@dataclass(frozen=True)
class MoERouting:
    """How the expert-parallel MoE layers route, from the job (checked against the model's blocks)."""

    top_k: int
    drop_tokens: bool
    capacity_factor: float


#: Router classes whose routing dsforge reproduces on DeepSpeed's gate (softmax over all experts, top-k,
#: renormalised over the k or not): HF Mixtral, Qwen2-MoE, Qwen3-MoE (transformers 5), or a plain nn.Linear
#: router (transformers 4 Mixtral). DeepSeek-V3's sigmoid, group-limited router is not among them.
SOFTMAX_ROUTERS = ("MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "Linear")
#: Where those HF routers live (their forward is the reference a copied router is compared with).
_KNOWN_ROUTER_MODULES = {"MixtralTopKRouter": "mixtral", "Qwen2MoeTopKRouter": "qwen2_moe",
                         "Qwen3MoeTopKRouter": "qwen3_moe"}


def _forward_text(cls: type) -> str | None:
    import inspect

    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    return " ".join(source.split())


@functools.cache
def _known_router_forwards() -> frozenset[str]:
    import importlib

    found = set()
    for name, module in _KNOWN_ROUTER_MODULES.items():
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
        except (ImportError, AttributeError):
            continue
        if (text := _forward_text(cls)) is not None:
            found.add(text)
    return frozenset(found)


def softmax_router(router: nn.Module) -> bool:
    """A router DeepSpeed's gate reproduces: one of SOFTMAX_ROUTERS, or a class whose forward is, character
    for character (whitespace aside), one of theirs (transformers copies Qwen3-MoE's into OLMoE, Qwen3-Next,
    FlexOlmo, ...)."""
    cls = type(router)
    return cls.__name__ in SOFTMAX_ROUTERS or _forward_text(cls) in _known_router_forwards()


def model_top_k(block: nn.Module) -> int | None:
    """The top-k an HF MoE block routes with (its router's or its own ``top_k``), None when it keeps none."""
    for holder in (getattr(block, "gate", None), block):
        k = getattr(holder, "top_k", None)
        if isinstance(k, int):
            return k
    config = getattr(block, "config", None)
    k = getattr(config, "num_experts_per_tok", None)
    return k if isinstance(k, int) else None


def _moe_problems(model: nn.Module, claim: Claim, plan: AnyPlan, ep: int) -> list[str]:
    """The job's moe.top_k must be the block's; under ep > 1 the router must be one DeepSpeed's gate
    reproduces."""
    moe = plan.model.moe
    parent = claim.name.rpartition(".")[0]
    block = model.get_submodule(parent) if parent else model
    problems = []
    k = model_top_k(block)
    if moe is not None and k is not None and k != moe.top_k:
        problems.append(f"the model routes each token to top-{k} experts "
                        f"but the job says moe.top_k={moe.top_k}")
    shared = next((getattr(block, n) for n in ("shared_expert", "shared_experts")
                   if isinstance(getattr(block, n, None), nn.Module)), None)
    down = getattr(shared, "down_proj", None)
    width = down.in_features if isinstance(down, nn.Linear) else None
    if moe is not None and (shared is None) != (moe.shared_experts == 0):
        problems.append(f"the block has {'a' if shared is not None else 'no'} shared expert but the job says "
                        f"moe.shared_experts={moe.shared_experts}")
    elif moe is not None and width is not None and width != moe.shared_experts * moe.shared_ffn_hidden:
        problems.append(f"its shared expert is {width} wide, the job's moe.shared_experts x "
                        f"shared_ffn_hidden = {moe.shared_experts} x {moe.shared_ffn_hidden}")
    if ep > 1 and not (isinstance(getattr(block, "gate", None), nn.Module) and hasattr(block, "experts")):
        # refused here, at compile's meta build, rather than by the applier when the run starts
        problems.append(f"under ep > 1 the block is replaced by DeepSpeed's MoE layer, which dsforge builds "
                        f"from a block holding its router as `gate` beside `experts`; {type(block).__name__} "
                        f"has no `gate`: use ep 1 (its experts stay whole on each rank)")
    elif ep > 1:
        router = type(getattr(block, "gate", None)).__name__
        if not softmax_router(block.gate):
            problems.append(f"its router {router} is not a softmax top-k router; DeepSpeed's gate "
                            "(moe/sharded_moe.py) has no exact twin of it under ep > 1")
        gate = getattr(block, "gate", None)
        renormalize = bool(getattr(gate, "norm_topk_prob", getattr(block, "norm_topk_prob", True)))
        if k == 1 and renormalize:
            problems.append("top-1 routing renormalised to weight 1 has no DeepSpeed twin (its top-1 gate "
                            "weighs the expert by its probability); use ep 1 or top_k >= 2")
        if getattr(block, "jitter_noise", 0) or getattr(gate, "jitter_noise", 0):
            problems.append("router jitter noise has no DeepSpeed twin; set router_jitter_noise 0")
    return problems


def _embedding_problem(module: nn.Module) -> str | None:
    """A vocab-parallel embedding keeps nn.Embedding's lookup and Gemma's scale; any other override is
    refused."""
    if type(module) is nn.Embedding or not isinstance(module, nn.Embedding):
        return None
    if type(module).__name__.endswith("ScaledWordEmbedding") and hasattr(module, "embed_scale"):
        return None
    return (f"{type(module).__name__} overrides nn.Embedding's forward; the vocab-parallel embedding keeps "
            f"only the lookup and a Gemma-style embed_scale")


def model_head_dim(model: nn.Module) -> int | None:
    """Channels per head as the model's attention modules hold them (HF's ``head_dim``), None if none says.

    Gemma and some Qwen3 sizes use a head_dim other than hidden / heads (Gemma2-2B: 256, not 2304 / 8);
    the shards must follow the model's real head width.
    """
    for module in model.modules():
        head_dim = getattr(module, "head_dim", None)
        if type(module).__name__.endswith("Attention") and isinstance(head_dim, int) and head_dim > 0:
            return head_dim
    return None


def _heads(plan: AnyPlan, head_dim: int | None = None) -> Heads:
    m = plan.model
    return Heads(m.heads, m.kv_heads, head_dim or m.hidden // m.heads, plan.spec.parallel.replicate_kv_heads)


def _shard(claim: Claim, tp: int, ep: int, plan: AnyPlan, heads: Heads) -> ShardResult:
    """Shards of one claimed module under its row's variant."""
    variant, module = claim.row.variant, claim.module
    if variant == "vocab" and (problem := _embedding_problem(module)):
        return ShardResult(problems=[problem])
    if variant in ("column", "row", "vocab"):
        return shard_tensor_parallel(variant, module_kind(module), direct_shapes(module), tp,
                                     claim.row.fused, claim.row.heads, heads, type(module).__name__,
                                     claim.row.blocks)
    if variant == "head_norm":
        return head_norm_weight(subtree_shapes(module), tp, heads, type(module).__name__)
    if variant == "shard_norm":
        if type(module).__name__ not in SHARD_NORMS:
            names = ", ".join(SHARD_NORMS)
            return ShardResult(problems=[(f"`shard_norm` reproduces {names} only, not "
                                          f"{type(module).__name__}")])
        return shard_norm_weight(subtree_shapes(module), tp, claim.row.heads or "q", heads,
                                 type(module).__name__)
    if variant == "expert":
        shapes, problem = expert_shapes(module)
        if problem:
            return ShardResult(problems=[problem])
        moe = plan.model.moe
        result = shard_experts(shapes, ep, moe.experts if moe else None)
        if tp > 1:
            result.notes.append(f"experts kept whole on each of the tp={tp} ranks")
        return result
    if variant == "scalars":
        return scalar_params(subtree_shapes(module), tp, type(module).__name__)
    result = replicated(subtree_shapes(module))
    if variant == "norm" and plan.spec.parallel.sequence_parallel and tp > 1:
        result.notes.append("sequence-parallel: gradients summed over the tensor-parallel group")
    return result


#: Norms whose forward the sharded RMSNorm (dsforge.runtime.layers.norms) reproduces operation for operation
#: (fp32, then weight x x / rms(x), then the cast); Llama's casts before the weight, so it is not listed.
SHARD_NORMS = ("Olmo2RMSNorm",)


def _owners(claim: Claim, seen: dict[int, str]) -> dict[str, str]:
    """Qualified name of the first owner of each parameter (a tied weight points to its first module)."""
    out = {}
    for pname, param in claim.module.named_parameters():
        out[pname] = seen.setdefault(id(param), _join(claim.name, pname))
    if claim.row.variant == "expert" and all(n.split(".")[0].isdigit() for n in out):
        # List-style experts are reported stacked (`w1.weight` over all experts): key them that way.
        out = {n.partition(".")[2]: _join(claim.name, n.partition(".")[2]) for n in out}
    return out


def _derived_stages(arch: str, model: nn.Module) -> bool:
    from dsforge.runtime.stage_structures import derived_pipeline

    return derived_pipeline(arch, model)


def _derived_pipeline_refusal(arch: str, model: nn.Module) -> str | None:
    """Why a policy derived from an HF plan cannot run at pp > 1 (refused at compile, not at each rank's
    start): no pp plan of the built shape, or a forward whose glue the stages do not reproduce."""
    from dsforge.runtime.hf_pipeline import glue_problem

    problem = glue_problem(model)
    return None if problem is None else f"pp > 1 ({arch}): {problem}; use pp: 1"


def _layer_regex(arch: str, model: nn.Module, layers: int) -> tuple[re.Pattern[str] | None, str | None]:
    """Regex of a decoder layer's name (group 1: index) and the name of the layer list."""
    policy = POLICIES.get(arch)
    found = find_layer_list(model, layers)
    if policy is not None:
        return re.compile(policy.layers + r"(?=\.|$)"), found
    return (re.compile(re.escape(found) + r"\.(\d+)(?=\.|$)") if found is not None else None), found


def _stage_of_layers(plan: AnyPlan, layers: int) -> list[int]:
    """Pipeline rank of every layer, from the plan's chunk partition (chunk c runs on rank c mod pp)."""
    pp = plan.degrees.pp if plan.degrees else 1
    chunks = plan.stage_layers or ([layers] if pp == 1 else [])
    out: list[int] = []
    for c, n in enumerate(chunks):
        out += [c % pp] * n
    return out


def _assign_stages(entries: list[ModulePlan], model: nn.Module, plan: AnyPlan, problems: list[str]) -> None:
    """Set each module's pipeline stage: its layer's, else first (before the layers) or last."""
    layers = plan.model.layers
    stages = _stage_of_layers(plan, layers)
    pp = plan.degrees.pp if plan.degrees else 1
    if len(stages) != layers:
        problems.append(f"the plan has no pipeline partition of {layers} layers over pp={pp}")
        return
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    first_layer = min((order[m.name] for m in entries if m.layer is not None), default=len(order))
    for m in entries:
        if m.layer is not None:
            m.stage = stages[m.layer] if m.layer < layers else pp - 1
        else:
            m.stage = 0 if order[m.name] < first_layer else pp - 1


def plan_module(model: nn.Module, plan: AnyPlan, arch: str) -> RewritePlan:
    """Plan the rewrite of an already built module tree under ``arch``'s policy and the job's rules."""
    spec, d = plan.spec, plan.degrees
    if d is None:
        raise RewriteError(arch, ["the parallel degrees are not resolved (a degree is still `auto`)"])
    walk = match_rows(model, rows_for(arch, list(spec.rewrite)))
    heads = _heads(plan, model_head_dim(model))
    problems: list[str] = []
    if walk.leftover:
        problems.append(
            "no rule places these modules with parameters: "
            + ", ".join(group_names(walk.leftover))
            + " (add `rewrite:` rules for them, e.g. {match: '<regex>', as: replicate})"
        )
    layer_rx, layer_list = _layer_regex(arch, model, plan.model.layers)
    seen: dict[int, str] = {}
    entries: list[ModulePlan] = []
    for claim in walk.claims:
        result = _shard(claim, d.tp, d.ep, plan, heads)
        if claim.row.variant == "expert":
            result.problems += _moe_problems(model, claim, plan, d.ep)
        problems += [f"{claim.name} ({claim.source}, {claim.row.variant}): {p}" for p in result.problems]
        hit = layer_rx.match(claim.name) if layer_rx else None
        widths = tuple(block_widths(claim.row.blocks, heads)) if claim.row.blocks else ()
        entries.append(ModulePlan(claim.name, type(claim.module).__name__, claim.row.variant, claim.source,
                                  module_kind(claim.module), int(hit.group(1)) if hit else None,
                                  result.params, _owners(claim, seen), result.notes, claim.row.fused,
                                  claim.row.heads, widths=widths))
    policy = POLICIES.get(arch)
    sp = spec.parallel.sequence_parallel is True and d.tp > 1
    if sp and (policy is None or not policy.sequence_parallel):
        known = sorted(a for a, p in POLICIES.items() if p.sequence_parallel)
        problems.append(f"sequence parallelism is implemented for the families {', '.join(known)}, not "
                        f"`{arch}`; set parallel.sequence_parallel: false")
    found = {m.layer for m in entries if m.layer is not None}
    if found and len(found) != plan.model.layers:
        problems.append(f"the model has {len(found)} decoder layers but the job says "
                        f"layers={plan.model.layers}")
    refusal = _derived_pipeline_refusal(arch, model) if d.pp > 1 and _derived_stages(arch, model) \
        else None
    if refusal is not None:
        problems.append(refusal)
    if not problems:
        _assign_stages(entries, model, plan, problems)
    if problems:
        raise RewriteError(arch, problems, walk.leftover)
    scales = [(n, a.attr) for n, _ in model.named_modules() for a in (policy.attr_scales if policy else ())
              if re.fullmatch(a.match, n)] if d.tp > 1 else []
    warnings = [f"{s} matched no module" for s in walk.unused if s.startswith("rewrite[")]
    moe = plan.model.moe
    routing = MoERouting(moe.top_k, spec.model.moe.drop_tokens if spec.model.moe else False,
                         moe.capacity_factor) if moe is not None else None
    cp_refusals = plain_causal_problems(model, plan.model.seq_len) if d.cp > 1 else []
    return RewritePlan(arch, d.tp, d.ep, d.pp, sp, entries, layer_list, heads.head_dim, scales, warnings,
                       routing, cp_refusals)
