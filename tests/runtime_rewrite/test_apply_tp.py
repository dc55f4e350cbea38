"""TP2 (with and without sequence parallelism) and EP2 rewrites of HF models against the dense ones (2 ranks).

Every rank builds the same dense model (same seed), keeps a copy as the single-process reference,
rewrites the other by its rewrite plan and compares logits, loss and gradients. A logits/loss
failure means a module was swapped for the wrong variant or a head count was left global; a
gradient failure means a collective's backward is wrong; a shard failure means the applier did
not keep exactly this rank's slice of the dense weight.

Tolerance: 1e-5 of the reference's largest magnitude (as tests/runtime/test_tp_layers.py): fp32
rounds at 6e-8 relative and sharding re-associates sums of at most 128 products (plus one
two-way all-reduce), about 128 x 6e-8 = 8e-6 of the terms' scale; a wrong shard or a missing
all-reduce errs by O(1).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

from dsforge.compiler.plan.plan import build_plan
from dsforge.compiler.spec.schema import JobSpec
from dsforge.runtime.groups import create_groups
from dsforge.runtime.layers import allreduce_sequence_parallel_grads
from dsforge.runtime.models import build_model
from dsforge.runtime.rewrite import plan_rewrite
from dsforge.runtime.rewrite.apply import apply_rewrite
from tests.runtime.launcher import report
from tests.runtime_rewrite.conftest import make_job

RTOL = 1e-5


def _slice(t: torch.Tensor, rank: int, tp: int, dim: int, blocks: int = 1) -> torch.Tensor:
    """This rank's slice of every one of ``blocks`` equal blocks of ``t`` along ``dim``."""
    parts = t.chunk(blocks, dim=dim)
    return torch.cat([p.chunk(tp, dim=dim)[rank] for p in parts], dim=dim)


def _compare(rank: int, spec: JobSpec, checks: dict[str, tuple[int, int]]) -> None:
    """Parity of one model: logits, loss, and the gradient and values of the named weights' shards.

    ``checks`` maps a weight's qualified name to (dense dim cut, fused blocks); HF Conv1D weights are
    compared transposed, as the parallel layers store (out, in).
    """
    plan = build_plan(spec)
    groups = create_groups(plan)
    tp = groups.size("tp")
    dense = build_model(spec.model, "cpu", tp, seed=7)
    model = copy.deepcopy(dense)
    ids = torch.randint(0, spec.model.vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    ref = dense(input_ids=ids, labels=ids)
    ref.loss.backward()
    rp = plan_rewrite(model, plan)
    apply_rewrite(model, rp, groups)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    sp = spec.parallel.sequence_parallel
    if sp:  # norms and row biases saw 1/tp of the tokens: their gradients are partial sums
        allreduce_sequence_parallel_grads(model.parameters(), groups.tp)
    name = f"{spec.model.preset}{' sp' if sp else ''}"
    report(f"{name} logits", out.logits, ref.logits, RTOL)
    report(f"{name} loss", out.loss, ref.loss, RTOL)
    # Sequence-parallel wrappers nest the original modules under `.block` / `.layer`.
    params = {re.sub(r"\.(block|layer)(?=\.)", "", n): p for n, p in model.named_parameters()}
    ref_params = dict(dense.named_parameters())
    for pname, (dim, blocks) in checks.items():
        want, got = ref_params[pname], params[pname]
        owner = type(dense.get_submodule(pname.rpartition(".")[0])).__name__
        transposed = owner == "Conv1D" and want.dim() == 2
        want_w, want_g = (want.t(), want.grad.t()) if transposed else (want, want.grad)
        cut = (1 - dim) if transposed else dim
        shard = _slice(want_w, rank, tp, cut, blocks) if dim >= 0 else want_w
        if tuple(got.shape) != tuple(shard.shape):
            raise AssertionError(f"{name} {pname}: rank {rank} holds "
                                 f"{tuple(got.shape)}, expected {tuple(shard.shape)}")
        if not torch.equal(got.detach(), shard.detach()):
            raise AssertionError(f"{name} {pname}: rank {rank} does not hold its slice of the dense weight")
        grad = _slice(want_g, rank, tp, cut, blocks) if dim >= 0 else want_g
        report(f"{name} grad {pname}", got.grad, grad, RTOL)


def _compare_ep(rank: int, spec: JobSpec) -> None:
    """Parity of an expert-parallel Mixtral: logits and loss, and each rank's experts are the dense ones it
    owns."""
    plan = build_plan(spec)
    groups = create_groups(plan)
    dense = build_model(spec.model, "cpu", 1, seed=7)
    model = copy.deepcopy(dense)
    ids = torch.randint(0, spec.model.vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    ref = dense(input_ids=ids, labels=ids)
    apply_rewrite(model, plan_rewrite(model, plan), groups)
    out = model(input_ids=ids, labels=ids)
    report("mixtral ep2 logits", out.logits, ref.logits, RTOL)
    report("mixtral ep2 loss", out.loss, ref.loss, RTOL)
    moe, experts = model.model.layers[1].mlp, dense.model.layers[1].mlp.experts
    local = list(moe.local_experts)
    if len(local) != 2 or not all(torch.equal(e.gate_up.weight, experts.gate_up_proj[moe.first_expert + i])
                                  for i, e in enumerate(local)):
        raise AssertionError(f"rank {rank} does not hold experts {moe.first_expert}..{moe.first_expert + 1}")


def _worker(rank: int, world: int, specs: list[tuple[JobSpec, dict[str, tuple[int, int]]]],
            ep: JobSpec) -> None:
    torch.use_deterministic_algorithms(True)
    for spec, checks in specs:
        _compare(rank, spec, checks)
    _compare_ep(rank, ep)


def worker_args(tmp: Path) -> tuple[Any, ...]:
    """The jobs and shard checks of the TP/SP/EP rewrites, for the shared 2-rank launch (conftest.py)."""

    def job(model: dict[str, Any], parallel: dict[str, Any]) -> JobSpec:
        return make_job(tmp, model, parallel)

    llama = job({"preset": "tiny-llama"}, {"tp": 2})
    gpt2 = job({"preset": "tiny-gpt2"}, {"tp": 2})
    mixtral = job({"preset": "tiny-mixtral"}, {"tp": 2})
    attn = "model.layers.1.self_attn"
    llama_checks = {f"{attn}.q_proj.weight": (0, 1), f"{attn}.k_proj.weight": (0, 1),
                    f"{attn}.o_proj.weight": (1, 1), "model.layers.0.mlp.down_proj.weight": (1, 1),
                    "model.embed_tokens.weight": (0, 1), "lm_head.weight": (0, 1),
                    "model.layers.0.input_layernorm.weight": (-1, 1)}
    # dims are in the dense module's own layout; Conv1D (in, out) is handled by the comparison
    gpt2_checks = {"transformer.h.0.attn.c_attn.weight": (1, 3), "transformer.h.0.attn.c_attn.bias": (0, 3),
                   "transformer.h.1.attn.c_proj.weight": (0, 1), "transformer.h.1.mlp.c_fc.weight": (1, 1),
                   "transformer.wte.weight": (0, 1), "transformer.wpe.weight": (-1, 1),
                   "transformer.h.1.ln_2.weight": (-1, 1), "transformer.h.1.mlp.c_proj.bias": (-1, 1)}
    mixtral_checks = {"model.layers.0.mlp.experts.gate_up_proj": (-1, 1),
                      "model.layers.0.mlp.gate.weight": (-1, 1), f"{attn}.v_proj.weight": (0, 1)}
    mixtral_ep = job({"preset": "tiny-mixtral"}, {"dp": 2, "ep": 2})
    llama_sp = job({"preset": "tiny-llama"}, {"tp": 2, "sequence_parallel": True})
    gpt2_sp = job({"preset": "tiny-gpt2"}, {"tp": 2, "sequence_parallel": True})
    mixtral_sp = job({"preset": "tiny-mixtral"}, {"tp": 2, "sequence_parallel": True})
    return ([(llama, llama_checks), (gpt2, gpt2_checks), (mixtral, mixtral_checks), (llama_sp, llama_checks),
             (gpt2_sp, gpt2_checks), (mixtral_sp, mixtral_checks)], mixtral_ep)


@pytest.mark.slow
def test_tp2_and_ep2_rewrites_match_the_dense_model(two_rank_rewrites: Callable[[str], None]) -> None:
    # runs in the 2-rank launch this directory's rewrite tests share (conftest.py two_rank_rewrites)
    two_rank_rewrites("apply_tp")
