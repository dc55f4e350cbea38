"""Every model family's rewrite against its single-process dense model: tp=2, ep=2 (MoE) and cp=2, on 2 gloo
ranks.

One launch runs every family (starting processes costs seconds on 2 cores). For each, both ranks
build the same dense HF model (tests/runtime_rewrite/families.py, random weights), keep a copy as
the reference, rewrite the other by its rewrite plan, and train both for 2 SGD steps on the same
tokens: the loss of each step and the gradient of *every* parameter (this rank's slice of the
dense gradient; expert-parallel experts against the dense experts they own; replicated parameters
summed over the data-parallel ranks as the engine does) must match the reference. A wrong split
(Phi3's unequal fused blocks, NeoX's per-head [q k v]), a dropped scaling (Gemma's embedding
scale, soft-capping), a lost reduction (per-head q/k norms, OLMo2's whole-projection norms), a
wrong top-k or a dropped shared expert all err by far more than the tolerance. Two checks show the
test can fail: the Qwen3 policy with its q/k norms' gradient sum removed, and Gemma2 without its
embedding scale, both differ from the reference.

Tolerance: as tests/runtime_rewrite/test_apply_tp.py, 1e-5 of the reference's largest magnitude
(fp32 sums re-associated by the split, DeepSpeed's einsum combine of the experts).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsforge.compiler.model.params import total_params
from dsforge.compiler.plan.plan import build_plan
from dsforge.compiler.spec.schema import JobSpec
from dsforge.runtime.attention import positions, shard_sequence
from dsforge.runtime.groups import ParallelGroups, create_groups
from dsforge.runtime.hf_attention import install_context_parallel
from dsforge.runtime.models import build_model
from dsforge.runtime.rewrite import describe, plan_rewrite
from dsforge.runtime.rewrite.apply import apply_rewrite
from dsforge.runtime.rewrite.planner import ModulePlan, RewritePlan
from tests.runtime.launcher import report
from tests.runtime_rewrite.conftest import make_job
from tests.runtime_rewrite.families import FAMILY_JOBS

RTOL = 1e-5
LR = 0.5
STEPS = 2


def _tokens(vocab: int, seed: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _blocks(entry: ModulePlan, n: int) -> list[int]:
    if entry.widths:
        return list(entry.widths)
    return [n // entry.fused] * entry.fused


def expected_shard(full: torch.Tensor, entry: ModulePlan, name: str, rank: int, tp: int) -> torch.Tensor:
    """This rank's slice of a dense tensor under the plan's cut, written out independently of the layers."""
    shard = next(p for p in entry.params if p.name == name)
    if shard.dim is None:
        return full
    if entry.variant == "column":
        parts = full.split(_blocks(entry, full.shape[shard.dim]), dim=shard.dim)
        return torch.cat([p.chunk(tp, dim=shard.dim)[rank] for p in parts], dim=shard.dim)
    return full.chunk(tp, dim=shard.dim)[rank]


def lean(model: nn.Module, plan: Any) -> frozenset[str]:
    """The runtime's lean kernels for this job (training.kernels auto: each where it is exact) on
    ``model``."""
    from dsforge.runtime.engine import install_job_kernels

    install_job_kernels(model, plan)
    return frozenset(model._dsforge_kernels)


def lean_loss(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor, count: torch.Tensor | int,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The loss as the runtime forms it (engine.CausalLMLoss): the fused head + cross entropy where it
    runs."""
    if "fused_loss" in model._dsforge_kernels:
        from dsforge.runtime.kernels.loss import fused_token_loss_sum

        hidden = model.base_model(input_ids=ids, position_ids=position_ids).last_hidden_state
        return fused_token_loss_sum(hidden, targets, model.lm_head, -100) / count
    out = model(input_ids=ids, position_ids=position_ids).logits
    from dsforge.runtime.engine import token_loss_sum

    return token_loss_sum(out, targets, getattr(model, "lm_head", None)) / count


def _shifted(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def _sgd(params: list[nn.Parameter]) -> None:
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.sub_(LR * p.grad)
                p.grad = None


def _check_tp_grads(tag: str, model: nn.Module, dense: nn.Module, rp: RewritePlan, rank: int,
                    tp: int) -> None:
    """Every parameter of the rewritten model holds its slice of the dense weight and gradient."""
    entries = {m.name: m for m in rp.modules}
    ref = dict(dense.named_parameters())
    got = dict(model.named_parameters())
    if set(got) != set(ref):
        raise AssertionError(f"{tag}: parameters differ from the dense model's: "
                             f"{sorted(set(got) ^ set(ref))}")
    for pname, p in got.items():
        module = pname.rpartition(".")[0]
        owner = next((m for m in (module, *_parents(module)) if m in entries), None)
        entry = entries[owner] if owner is not None else None
        rel = pname[len(owner) + 1:] if owner else pname
        split = (
            entry is not None and entry.variant != "replicate" and any(s.name == rel for s in entry.params)
        )

        def cut(t: torch.Tensor, entry: ModulePlan | None = entry, rel: str = rel,
                split: bool = split) -> torch.Tensor:
            return expected_shard(t, entry, rel, rank, tp) if split and entry is not None else t

        want = cut(ref[pname].detach())
        if tuple(p.shape) != tuple(want.shape) or not torch.allclose(p.detach(), want, rtol=0, atol=1e-5):
            raise AssertionError(f"{tag} {pname}: rank {rank} does not hold its slice of the dense weight")
        if ref[pname].grad is None and p.grad is None:
            continue
        report(f"{tag} grad {pname}", p.grad, cut(ref[pname].grad), RTOL)


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def tp_parity(rank: int, spec: JobSpec, corrupt: bool = False, tag: str = "") -> None:
    """TP=2 rewrite of one family: loss and every gradient for STEPS SGD steps (``corrupt``: norms' sum
    dropped)."""
    plan = build_plan(spec)
    groups = create_groups(plan)
    tp = groups.size("tp")
    dense = build_model(plan.model, "cpu", tp, seed=7)
    model = copy.deepcopy(dense)
    rp = plan_rewrite(model, plan)
    if corrupt:  # the per-head q/k norms kept whole, but their partial gradients never summed
        rp = dataclasses.replace(rp,
                                 modules=[dataclasses.replace(m,
                                                              variant="replicate") if m.variant == "head_norm"
                                              else m for m in rp.modules])
    apply_rewrite(model, rp, groups, gather_logits=False)  # vocabulary-split logits, as the runtime's engine
    kernels = lean(model, plan)  # the runtime's lean kernels against the plain HF reference
    tag = tag or (f"{spec.model.arch}/{spec.model.factory.rpartition(':')[2] if spec.model.factory else ''} "
                  f"tp2")
    tag += f" [{','.join(sorted(kernels)) or 'no lean kernels'}]"
    for step in range(STEPS):
        ids = _tokens(spec.model.vocab, 3 + step)
        ref = dense(input_ids=ids, labels=ids)
        ref.loss.backward()
        targets = _shifted(ids)
        loss = lean_loss(model, ids, targets, (targets != -100).sum())
        loss.backward()
        report(f"{tag} step {step} loss", loss, ref.loss, RTOL)
        _check_tp_grads(f"{tag} step {step}", model, dense, rp, rank, tp)
        _sgd(list(dense.parameters()))
        _sgd(list(model.parameters()))


def _moe_blocks(rp: RewritePlan) -> list[str]:
    return [m.name.rpartition(".")[0] for m in rp.modules if m.variant == "expert"]


def ep_parity(rank: int, spec: JobSpec, formula: bool = True) -> None:
    """ep=2 (dp=2): each rank's own tokens; the reference sees both ranks' tokens on one process.
    ``formula=False``: the job's keys do not describe the experts (the HF zoo's), so the parameter count is
    checked against explain and the dense model only."""
    plan = build_plan(spec)
    groups = create_groups(plan)
    dense = build_model(plan.model, "cpu", 1, seed=7)
    model = copy.deepcopy(dense)
    rp = plan_rewrite(model, plan)
    apply_rewrite(model, rp, groups)
    kernels = lean(model, plan)
    tag = (f"{spec.model.arch} ep2 top-{spec.model.moe.top_k if spec.model.moe else 0} "
           f"[{','.join(sorted(kernels))}]")
    blocks = _moe_blocks(rp)
    dp = groups.size("dp-cp")
    held = sum(p.numel() for n, p in model.named_parameters() if ".deepspeed_experts." not in n)
    experts_held = torch.tensor(sum(p.numel() for n,
                                    p in model.named_parameters() if ".deepspeed_experts." in n))
    dist.all_reduce(experts_held, group=groups.ep)
    count = held + int(experts_held)
    explained = describe(spec, plan)["params"]["total"]
    by_formula = total_params(plan.model) if formula else count
    if not count == explained == by_formula == sum(p.numel() for p in dense.parameters()):
        raise AssertionError(f"{tag}: the ep=2 ranks hold {count} parameters, explain says {explained}, the "
                             f"formula {total_params(plan.model)}, the dense model has "
                             f"{sum(p.numel() for p in dense.parameters())}")
    for step in range(STEPS):
        batches = [_tokens(spec.model.vocab, 10 * step + r) for r in range(dp)]
        ref = dense(input_ids=torch.cat(batches), labels=torch.cat(batches))
        ref.loss.backward()
        mine = batches[groups.index("dp-cp")]
        targets = _shifted(mine)
        own = lean_loss(model, mine, targets, (targets != -100).sum())
        (own / dp).backward()
        loss = own.detach().clone()
        dist.all_reduce(loss, group=groups.dp_cp)
        report(f"{tag} step {step} loss", loss / dp, ref.loss, RTOL)
        ref_params = dict(dense.named_parameters())
        for name, p in model.named_parameters():
            if ".deepspeed_experts." in name:
                continue  # an expert's owner saw every token routed to it: its gradient is whole
            if p.grad is None:  # unused by the loss (afmoe's expert bias): zero on every rank, as in HF
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=groups.dp_cp)  # the engine's data-parallel sum of replicated
                                                         # gradients
            if ".deepspeed_moe." not in name:
                want = ref_params[name].grad
                report(f"{tag} step {step} grad {name}", p.grad,
                       torch.zeros_like(p) if want is None else want, RTOL)
        for block in blocks:
            moe = model.get_submodule(block)
            routed = getattr(moe, "routed", moe)
            dense_block = dense.get_submodule(block)
            report(f"{tag} step {step} grad {block}.gate", routed.gate_weight.grad,
                   dense_block.gate.weight.grad, RTOL)
            for i, expert in enumerate(moe.local_experts):
                e = moe.first_expert + i
                report(f"{tag} step {step} grad {block}.experts[{e}].gate_up", expert.gate_up.weight.grad,
                       dense_block.experts.gate_up_proj.grad[e], RTOL)
                report(f"{tag} step {step} grad {block}.experts[{e}].down", expert.down.weight.grad,
                       dense_block.experts.down_proj.grad[e], RTOL)
        _sgd(list(dense.parameters()))
        _sgd(list(model.parameters()))


def cp_parity(rank: int, spec: JobSpec) -> None:
    """cp=2 ring attention: each rank holds its load-balanced half of every sequence, with global
    positions."""
    plan = build_plan(spec)
    groups: ParallelGroups = create_groups(plan)
    cp, me = groups.size("cp"), groups.index("cp")
    dense = build_model(plan.model, "cpu", 1, seed=7)
    model = copy.deepcopy(dense)
    install_context_parallel(model, "ring", groups.cp)
    kernels = lean(model, plan)
    tag = f"{spec.model.arch} cp2 ring [{','.join(sorted(kernels))}]"
    for step in range(STEPS):
        ids = _tokens(spec.model.vocab, 20 + step)
        targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        count = (targets != -100).sum()
        logits = dense(input_ids=ids).logits
        ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                              reduction="sum") / count
        ref.backward()
        local = shard_sequence(ids, me, cp, dim=1, load_balanced=True)
        local_t = shard_sequence(targets, me, cp, dim=1, load_balanced=True)
        pos = positions(ids.shape[1], me, cp).unsqueeze(0).expand(ids.shape[0], -1)
        loss = lean_loss(model, local, local_t, count, position_ids=pos)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=groups.cp)
        report(f"{tag} step {step} loss", total, ref, RTOL)
        ref_params = dict(dense.named_parameters())
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad, group=groups.cp)  # the engine sums gradients over dp x cp
            report(f"{tag} step {step} grad {name}", p.grad, ref_params[name].grad, RTOL)
        _sgd(list(dense.parameters()))
        _sgd(list(model.parameters()))


def gemma_scale_matters(rank: int, spec: JobSpec) -> None:
    """Gemma2 without its embedding scale gives another loss: the parity above could see a dropped scale."""
    dense = build_model(build_plan(spec).model, "cpu", 1, seed=7)
    ids = _tokens(spec.model.vocab, 3)
    with torch.no_grad():
        scaled = dense(input_ids=ids, labels=ids).loss
        dense.model.embed_tokens.embed_scale.fill_(1.0)
        unscaled = dense(input_ids=ids, labels=ids).loss
    if abs(float(scaled - unscaled)) <= RTOL * abs(float(scaled)):
        raise AssertionError(f"gemma2: the loss {float(scaled)} does not depend on the embedding scale")


def _worker(rank: int, world: int, jobs: dict[str, Any]) -> None:
    torch.use_deterministic_algorithms(True)
    for spec in jobs["tp"]:
        tp_parity(rank, spec)
    try:
        tp_parity(rank, jobs["corrupt"], corrupt=True, tag="qwen3 corrupt (q/k norm sum dropped)")
    except AssertionError as exc:
        if "_norm" not in str(exc):
            raise
        print(f"PARITY rank={rank} corrupt policy fails as it must: {str(exc).splitlines()[0]}", flush=True)
    else:
        raise AssertionError("the corrupted Qwen3 policy (q/k norm "
                             "gradients not summed) passed the parity test")
    gemma_scale_matters(rank, jobs["gemma2"])
    for spec in jobs["ep"]:
        ep_parity(rank, spec)
    cp_parity(rank, jobs["cp"])


TP_FAMILIES = ("qwen3", "gemma2", "gemma3", "olmo2", "phi3", "gpt_neox", "mistral", "qwen2", "qwen2_moe",
               "qwen3_moe", "mixtral", "deepseek_v3")
EP_FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral")
#: Heads wider than hidden / heads (Gemma2-2B: 8 x 256 on hidden 2304): split by the model's head_dim.
GEMMA2_WIDE = {**FAMILY_JOBS["gemma2"], "factory": "tests.runtime_rewrite.families:gemma2_wide_heads"}


def worker_args(tmp: Path) -> tuple[Any, ...]:
    """The family jobs, for the 2-rank launch this directory's rewrite tests share (conftest.py)."""

    def job(model: dict[str, Any], parallel: dict[str, Any]) -> JobSpec:
        return make_job(tmp, model, parallel)

    jobs: dict[str, Any] = {
        "tp": [job(FAMILY_JOBS[f], {"tp": 2}) for f in TP_FAMILIES] + [job(GEMMA2_WIDE, {"tp": 2})],
        "corrupt": job(FAMILY_JOBS["qwen3"], {"tp": 2}),
        "gemma2": job(FAMILY_JOBS["gemma2"], {"tp": 2}),
        "ep": [job(FAMILY_JOBS[f], {"dp": 2, "ep": 2}) for f in EP_FAMILIES],
        "cp": job(FAMILY_JOBS["qwen3"], {"cp": 2}),
    }
    return (jobs,)


@pytest.mark.slow
def test_every_family_matches_its_dense_model_on_two_ranks(two_rank_rewrites: Callable[[str], None]) -> None:
    # one launch with test_apply_tp's rewrites (conftest.py two_rank_rewrites): the processes' start-up
    # (torch, transformers, DeepSpeed) costs more than every family's 2 steps together
    two_rank_rewrites("family_parity")
