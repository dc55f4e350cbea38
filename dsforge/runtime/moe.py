"""Expert parallelism on DeepSpeed's native MoE layer, with the plan's expert groups.

DeepSpeed's ``deepspeed.moe.layer.MoE`` does the gating, the all-to-all of tokens to the ranks
that own their experts, and the expert-data-parallel gradient reduction in its engine. Left to
itself it derives the expert groups from rank arithmetic (deepspeed/utils/groups.py
``_create_expert_and_data_parallel``: consecutive ranks form an expert-parallel group), which
agrees with the plan only for some orders. So dsforge installs the plan's ep / edp groups into
DeepSpeed's expert-group registry under the name the layer looks up (``ep_size_<ep>``) before
the layer asks for them; DeepSpeed then creates nothing and uses exactly the plan's groups.

Routing defaults are chosen for exactness: no token dropping (capacity = the busiest expert),
no random token selection and a deterministic second expert. DeepSpeed 0.19.8's gate
(moe/sharded_moe.py) routes softmax top-1 (weight: the probability), top-2 (weights renormalised
over the two) and, for any k > 2, ``topkgating`` (weights renormalised over the k): Mixtral's
routing, and Qwen-MoE's with ``norm_topk_prob``. A router that does not renormalise (Qwen2-MoE's
and Qwen3-MoE's default) weighs each expert by its plain probability p_i; the renormalised output
times S = the sum of the k chosen probabilities is exactly that (sum p_i/S E_i x S), so the layer
multiplies by S, computed from the same router weight (its gradient flows through both).
With ``drop_tokens`` the capacity is DeepSpeed's: ceil(tokens / experts x capacity_factor x k).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsforge.runtime.groups import LayoutError, ParallelGroups, ensure_deepspeed_comm


class GatedExpert(nn.Module):
    """A SwiGLU expert, down(silu(gate(x)) * up(x)), with gate and up fused as in HF Mixtral's
    ``gate_up_proj``."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Expert MLP on a batch of tokens."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def expert_group_name(ep: int) -> str:
    """The key DeepSpeed's MoE layer uses for its expert groups (moe/layer.py ``expert_group_name``)."""
    return f"ep_size_{ep}"


def register_expert_groups(groups: ParallelGroups) -> str:
    """Install the plan's ep and edp groups in DeepSpeed's expert-group registry; return the group name.

    Raises LayoutError if DeepSpeed already holds different groups under that name (a MoE layer set
    up before this call would have built its own).
    """
    from deepspeed.utils import groups as ds_groups

    name = expert_group_name(groups.size("ep"))
    want = {"ep": groups.ranks("ep"), "edp": groups.ranks("edp")}
    have = {"ep": ds_groups._EXPERT_PARALLEL_GROUP_RANKS.get(name),
            "edp": ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS.get(name)}
    if have["ep"] is None and have["edp"] is None:
        ds_groups._EXPERT_PARALLEL_GROUP[name] = groups.ep
        ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = want["ep"]
        ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = groups.edp
        ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = want["edp"]
        return name
    for kind in ("ep", "edp"):
        if have[kind] is None or list(have[kind]) != want[kind]:
            raise LayoutError(
                f"DeepSpeed already holds {kind} groups {name!r} with ranks "
                f"{have[kind] and list(have[kind])}, but the plan's are {want[kind]} on rank {groups.rank}; "
                f"call register_expert_groups before any DeepSpeed MoE layer "
                f"is set up (deepspeed.initialize creates them otherwise)")
    return name


class ExpertParallelMoE(nn.Module):
    """DeepSpeed's MoE layer with ep from the plan: E experts, E/ep of them on this rank, top-k routing."""

    def __init__(self, hidden: int, expert: nn.Module, num_experts: int, groups: ParallelGroups,
                 top_k: int = 2, drop_tokens: bool = False, capacity_factor: float = 1.0,
                 min_capacity: int = 0, renormalize: bool = True) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE
        from deepspeed.utils import groups as ds_groups

        ep = groups.size("ep")
        if num_experts % ep:
            raise LayoutError(f"{num_experts} experts do not split over ep={ep} ranks; choose ep dividing "
                              f"{num_experts}")
        ensure_deepspeed_comm()
        self.name = register_expert_groups(groups)
        if top_k == 1 and renormalize:
            raise ValueError("DeepSpeed's top-1 gate weights the expert by its softmax probability, a "
                             "renormalised top-1 router by 1; such a block has no exact DeepSpeed twin")
        self.num_experts, self.ep, self.top_k = num_experts, ep, top_k
        # top-1 already weighs by the plain probability; k >= 2 renormalises, undone by the factor S.
        self.scale_by_mass = not renormalize and top_k > 1
        self.num_local = num_experts // ep
        # experts [first, first + num_local) live here
        self.first_expert = groups.index("ep") * self.num_local
        self.moe = MoE(hidden_size=hidden, expert=expert, num_experts=num_experts, ep_size=ep, k=top_k,
                       capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor,
                       min_capacity=min_capacity, drop_tokens=drop_tokens, use_rts=False,
                       noisy_gate_policy=None, top2_2nd_expert_sampling=False)
        self.moe.set_deepspeed_parallelism()
        if list(ds_groups._get_expert_parallel_group_ranks(self.name)) != groups.ranks("ep"):
            raise LayoutError(f"DeepSpeed's MoE layer picked expert group "
                              f"{list(ds_groups._get_expert_parallel_group_ranks(self.name))}, the plan's is "
                              f"{groups.ranks('ep')}")
        self.aux_loss: Tensor | None = None
        self.shared_name: str | None = None  # the block's shared expert, kept beside the routed ones
                                             # (keep_shared)

    @property
    def local_experts(self) -> nn.ModuleList:
        """This rank's experts, global indices first_expert .. first_expert + num_local - 1."""
        return self.moe.deepspeed_moe.experts.deepspeed_experts

    @property
    def gate_weight(self) -> nn.Parameter:
        """The router's (num_experts, hidden) weight, replicated on every rank."""
        return self.moe.deepspeed_moe.gate.wg.weight

    def keep_shared(self, name: str, shared: nn.Module, gate: nn.Module | None) -> None:
        """Run the block's shared expert beside the routed ones: routed + sigmoid(gate(x)) * shared(x)
        (Qwen2-MoE), or routed + shared(x) without a gate (DeepSeek). Both keep their HF names, so the
        rewrite plan places them (column/row under TP, whole otherwise) and checkpoints name them as the
        dense model does."""
        self.shared_name = name
        self.add_module(name, shared)
        if gate is not None:
            self.add_module(SHARED_GATE, gate)

    def forward(self, hidden: Tensor) -> Tensor:
        """[..., hidden] -> [..., hidden]; the load-balancing loss of this call is kept in ``aux_loss``."""
        out, self.aux_loss, _ = self.moe(hidden)
        if self.scale_by_mass:
            logits = F.linear(hidden.float(), self.gate_weight.float())
            mass = F.softmax(logits, dim=-1).topk(self.top_k, dim=-1).values.sum(-1, keepdim=True)
            out = out * mass.to(out.dtype)
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(hidden)
            gate: Any = getattr(self, SHARED_GATE, None)
            if gate is not None:
                shared = torch.sigmoid(gate(hidden)) * shared
            out = out + shared
        return out

    def load_dense(self, gate_weight: Tensor, experts: Sequence[Mapping[str, Tensor]]) -> None:
        """Load a dense MoE block: the router weight, and this rank's experts out of all ``experts`` state
        dicts."""
        if len(experts) != self.num_experts:
            raise ValueError(f"got {len(experts)} expert state dicts for "
                             f"a layer of {self.num_experts} experts")
        with torch.no_grad():
            self.gate_weight.copy_(gate_weight)
            for i, local in enumerate(self.local_experts):
                local.load_state_dict(experts[self.first_expert + i])

    def load_mixtral(self, block: nn.Module) -> None:
        """Load a HF MixtralSparseMoeBlock (fused 3-D ``experts.gate_up_proj``/``down_proj``, or per-expert
        w1/w2/w3)."""
        experts: Any = block.experts
        if hasattr(experts, "gate_up_proj"):  # transformers >= 5: [E, 2F, H] and [E, H, F]
            dicts = [{"gate_up.weight": experts.gate_up_proj[e], "down.weight": experts.down_proj[e]}
                     for e in range(self.num_experts)]
        else:  # transformers 4: experts[e].w1 (gate), w3 (up), w2 (down)
            dicts = [{"gate_up.weight": torch.cat([x.w1.weight, x.w3.weight]), "down.weight": x.w2.weight}
                     for x in experts]
        gate: Any = block.gate
        self.load_dense(gate.weight, dicts)

    @classmethod
    def from_mixtral(cls, block: nn.Module, groups: ParallelGroups, top_k: int | None = None,
                     drop_tokens: bool = False, capacity_factor: float = 1.0) -> ExpertParallelMoE:
        """An expert-parallel twin of a HF Mixtral / Qwen2-MoE / Qwen3-MoE sparse block's router and experts.

        ``top_k``: the job's (moe.top_k); it must be the block's own. The router's ``norm_topk_prob``
        (absent: renormalised, as Mixtral) decides whether the weights are renormalised over the k.
        """
        gate: Any = block.gate
        num_experts, hidden = gate.weight.shape
        own = next((k for k in (getattr(gate, "top_k", None),
                                getattr(block, "top_k", None)) if isinstance(k, int)),
                   None)
        if top_k is None:
            top_k = own if own is not None else 2
        elif own is not None and own != top_k:
            raise ValueError(f"the block routes top-{own} but the job says moe.top_k={top_k}")
        renormalize = bool(getattr(gate, "norm_topk_prob", getattr(block, "norm_topk_prob", True)))
        experts: Any = block.experts
        act = getattr(experts, "act_fn", None)
        if act is not None and not isinstance(act, nn.SiLU) and "SiLU" not in type(act).__name__:
            raise ValueError(f"its experts use {type(act).__name__}; the "
                             f"expert-parallel experts are SwiGLU (SiLU)")
        ffn = experts.down_proj.shape[-1] if hasattr(experts, "down_proj") else experts[0].w2.weight.shape[1]
        layer = cls(hidden, GatedExpert(hidden, ffn).to(gate.weight.dtype), num_experts, groups,
                    top_k=top_k, drop_tokens=drop_tokens, capacity_factor=capacity_factor,
                    renormalize=renormalize)
        layer.load_mixtral(block)
        return layer


#: Names HF gives a MoE block's shared expert and its gate (Qwen2-MoE: shared_expert + shared_expert_gate,
#: DeepSeek-V2/V3: shared_experts without a gate).
SHARED_NAMES = ("shared_expert", "shared_experts")
SHARED_GATE = "shared_expert_gate"


def from_hf_block(block: nn.Module, groups: ParallelGroups, top_k: int | None = None,
                  drop_tokens: bool = False, capacity_factor: float = 1.0) -> ExpertParallelMoE:
    """The expert-parallel twin of an HF sparse MoE block: routed experts on DeepSpeed, shared experts
    kept."""
    layer = ExpertParallelMoE.from_mixtral(block, groups, top_k, drop_tokens, capacity_factor)
    name = next((n for n in SHARED_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
    if name is not None:
        gate = getattr(block, SHARED_GATE, None)
        layer.keep_shared(name, getattr(block, name), gate if isinstance(gate, nn.Module) else None)
    return layer
