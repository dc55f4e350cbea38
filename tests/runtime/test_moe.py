"""Expert parallelism (ep 2) on DeepSpeed's MoE layer against a dense Mixtral MoE block.

The dense reference is ``DenseTop2MoE``: all experts on one process, softmax top-2 routing
renormalised over the two, in the parameter layout of transformers 5's ``MixtralSparseMoeBlock``;
a single-process test pins it to HF's own block (same outputs and gradients), so the multi-process
runs need not import transformers. Every rank builds the same reference and the token batches of
*all* ranks; the reference loss is the sum of every rank's loss. The expert-parallel layer holds
E/ep experts on each rank and sees only its own tokens, which DeepSpeed all-to-alls to the experts'
owners. Outputs and input gradients must equal the reference rows of this rank's tokens; each
local expert's gradient, summed over its expert-data-parallel replicas (as the engine does), must
equal the reference gradient of that expert; the router gradient summed over the data-parallel
group must equal the reference's. A failure means wrong routing, wrong expert placement (an
expert group that is not the plan's) or a lost gradient through the all-to-all.

Tolerance: rtol 1e-5 of the reference's scale: the same fp32 products, summed in a different
order (DeepSpeed combines the experts' outputs with an einsum over capacity slots), err by a few
ulps; a routing or placement bug errs by O(1).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsforge.compiler.plan.placement import place
from dsforge.runtime.groups import ParallelGroups, create_groups
from dsforge.runtime.moe import ExpertParallelMoE
from tests.runtime.launcher import report, run

RTOL = 1e-5
HIDDEN, FFN, EXPERTS = 16, 32, 4


class DenseTop2MoE(nn.Module):
    """Mixtral's routing written out densely, with transformers 5's MixtralSparseMoeBlock parameter layout."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.top_k = 2
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * FFN, HIDDEN, generator=gen) * 0.3)
        self.experts.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN, generator=gen) * 0.3)
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """softmax -> top-2 -> renormalise -> weighted sum of the two experts' SwiGLU outputs."""
        flat = x.reshape(-1, HIDDEN)
        top, idx = F.softmax(self.gate(flat), dim=-1).topk(self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(EXPERTS):
            rows, slot = torch.where(idx == e)
            gate, up = (flat[rows] @ self.experts.gate_up_proj[e].t()).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.experts.down_proj[e].t()
            out = out.index_add(0, rows, y * top[rows, slot].unsqueeze(-1))
        return out.view_as(x)


def mixtral_block(seed: int) -> nn.Module:
    """A tiny HF Mixtral sparse-MoE block with random weights (HF leaves them uninitialised standalone)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS,
                           num_experts_per_tok=2, router_jitter_noise=0.0)
    block = MixtralSparseMoeBlock(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block


def check_moe_parity(g: ParallelGroups, block: nn.Module, seed: int) -> None:
    """The expert-parallel layer reproduces the dense block on this rank's tokens, values and gradients."""
    dp, me = g.size("dp-cp"), g.index("dp-cp")  # token batches differ across the data-parallel ranks
    xs = [torch.randn(3, 5, HIDDEN,
                      generator=torch.Generator().manual_seed(seed + 100 + r)) for r in range(dp)]
    ws = [torch.randn(3, 5, HIDDEN,
                      generator=torch.Generator().manual_seed(seed + 200 + r)) for r in range(dp)]
    xs = [x.requires_grad_(True) for x in xs]
    refs = [block(x) for x in xs]
    sum((ref * w).sum() for ref, w in zip(refs, ws)).backward()

    moe = ExpertParallelMoE.from_mixtral(block, g)
    assert len(moe.local_experts) == EXPERTS // g.size("ep")
    x = xs[me].detach().clone().requires_grad_(True)
    out = moe(x)
    report(f"moe(ep={g.size('ep')}) out", out, refs[me], RTOL)
    (out * ws[me]).sum().backward()
    report("moe dx", x.grad, xs[me].grad, RTOL)
    for i, expert in enumerate(moe.local_experts):
        e = moe.first_expert + i
        # An expert sees the tokens of its ep group; its replicas over the edp group hold the rest.
        d_gate_up, d_down = expert.gate_up.weight.grad.clone(), expert.down.weight.grad.clone()
        dist.all_reduce(d_gate_up, group=g.edp)
        dist.all_reduce(d_down, group=g.edp)
        report(f"moe expert {e} d gate_up (summed over edp)", d_gate_up, block.experts.gate_up_proj.grad[e],
               RTOL)
        report(f"moe expert {e} d down (summed over edp)", d_down, block.experts.down_proj.grad[e], RTOL)
    router = moe.gate_weight.grad.clone()
    dist.all_reduce(router, group=g.dp_cp)  # what the engine's data-parallel reduction adds up
    report("moe router dW (summed over dp)", router, block.gate.weight.grad, RTOL)


def test_dense_reference_matches_hf_mixtral_block() -> None:
    pytest.importorskip("transformers")
    hf = mixtral_block(0)
    ours = DenseTop2MoE(seed=1)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(3, 5, HIDDEN, requires_grad=True)
    w = torch.randn(3, 5, HIDDEN)
    (hf(x) * w).sum().backward()
    hf_dx, x.grad = x.grad.clone(), None
    y = ours(x)
    (y * w).sum().backward()
    torch.testing.assert_close(y, hf(x), rtol=RTOL, atol=RTOL)  # O(1) values: rtol is also a fair atol
    torch.testing.assert_close(x.grad, hf_dx, rtol=RTOL, atol=RTOL)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, dict(hf.named_parameters())[name].grad, rtol=RTOL, atol=RTOL)


def _ep2_worker(rank: int, world: int) -> None:
    g = create_groups(place(tp=1, pp=1, dp=2, cp=1, ep=2, gpus_per_node=2))
    assert g.ranks("ep") == [0, 1] and g.ranks("edp") == [rank]
    check_moe_parity(g, DenseTop2MoE(seed=0), seed=0)


@pytest.mark.slow
def test_expert_parallel_moe_matches_dense_mixtral_ep2() -> None:
    run(_ep2_worker, 2)
