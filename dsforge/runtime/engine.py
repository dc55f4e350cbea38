"""The DeepSpeed engine of a plan: the job's model rewritten for this rank, its loss, and
deepspeed.initialize.

pp = 1: a plain ``DeepSpeedEngine`` over a ``CausalLMLoss`` module, given the plan's groups as ``mpu``
so the batch rule counts the plan's dp and ZeRO partitions and reduces over the plan's dp (x cp) group.
pp > 1: a ``PipelineModule`` whose stages hold this rank's layers (dsforge.runtime.pipeline_stages),
with the plan's ``pipe_topology``; DeepSpeed refuses an mpu there and builds the same groups itself.
Every rank builds the dense model on the meta device, rewrites it there and makes only its own
slices real (dsforge.runtime.rank_build): from the job's seed, drawn so that each slice equals the
single-process model's (the equivalence tests rely on it), or read from `model.pretrained`; under
ZeRO-3 each parameter is partitioned as soon as it is filled, before ``deepspeed.initialize``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dsforge.compiler.plan.plan import ResolvedPlan
from dsforge.runtime.data import IGNORE_INDEX, Batch
from dsforge.runtime.errors import EngineError
from dsforge.runtime.groups import ParallelGroups, ensure_deepspeed_comm
from dsforge.runtime.layers import VocabParallelLMHead, vocab_parallel_cross_entropy
from dsforge.runtime.models import build_model
from dsforge.runtime.rewrite import plan_rewrite
from dsforge.runtime.rewrite.apply import apply_rewrite
from dsforge.runtime.versions import require_deepspeed


def token_loss_sum(logits: Tensor, targets: Tensor, head: nn.Module | None) -> Tensor:
    """Sum of next-token cross entropy over the non-ignored targets (vocab-parallel when ``head`` is
    split)."""
    if isinstance(head, VocabParallelLMHead) and head.tp > 1 and not head.gather_output:
        per_token = vocab_parallel_cross_entropy(logits, targets, head.pg, head.vocab_start, IGNORE_INDEX)
        return per_token.sum()
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


class CausalLMLoss(nn.Module):
    """The job's causal LM and its loss: this rank's share of the micro-batch's mean next-token loss.

    With context parallelism each rank holds 1/cp of every sequence; its loss is its tokens' sum
    over the *whole* micro-batch's token count, so the cp shares add up to the mean (DeepSpeed
    sums gradients over dp x cp and divides by dp only; see groups.DeepSpeedMPU).
    """

    def __init__(self, model: nn.Module, cp: int = 1, documents: bool = False) -> None:
        super().__init__()
        self.model, self.cp = model, cp
        self.head = getattr(model, "lm_head", None)
        # HF numbers the tokens it sees from 0: wrong for a context-parallel shard, the same otherwise. Packed
        # documents (``documents``) restart their positions, from which HF builds the per-document causal
        # mask.
        self.pass_positions = cp > 1 or documents
        # HF looks for packed documents in the positions only without a KV cache (masking_utils)
        self.extra = {"use_cache": False} if documents else {}

    def forward(self, ids: Tensor, targets: Tensor, positions: Tensor,
                denominator: float | None = None) -> Tensor:
        """(ids, targets, global positions[, divisor of masked data]) -> scalar loss share."""
        pos = positions if self.pass_positions else None
        divisor = denominator or targets.numel() * self.cp
        if "fused_loss" in getattr(self.model, "_dsforge_kernels", ()):  # dsforge/runtime/kernels/loss.py
            from dsforge.runtime.kernels.loss import fused_token_loss_sum

            hidden = self.model.base_model(input_ids=ids, position_ids=pos, **self.extra).last_hidden_state
            return fused_token_loss_sum(hidden, targets, self.head, IGNORE_INDEX) / divisor
        logits = self.model(input_ids=ids, position_ids=pos, **self.extra).logits
        return token_loss_sum(logits, targets, self.head) / divisor


def _sequence_parallel_hooks(model: nn.Module, group: dist.ProcessGroup) -> int:
    """Sum the partial gradients of sequence-parallel parameters over the TP group as autograd produces them.

    Megatron sums them after backward; under DeepSpeed, ZeRO's own gradient hooks may consume a
    gradient before backward returns, so the sum runs in a tensor hook, which fires first.
    """
    def hook(grad: Tensor) -> Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    count = 0
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.requires_grad:
            p.register_hook(hook)
            count += 1
    return count


def parallelize(model: nn.Module, plan: ResolvedPlan, groups: ParallelGroups, gather_logits: bool = False,
                source: Any = None, ds_config: dict[str, Any] | None = None) -> nn.Module:
    """Rewrite a dense model in place into this rank's parallel variant: experts, TP/SP layers, CP attention.

    ``gather_logits=False`` leaves the LM head's logits split over the vocabulary (CausalLMLoss
    computes a vocab-parallel cross entropy); True gives every rank whole logits (HF's own loss).
    ``source`` (a dsforge.runtime.materialize.WeightSource): the model's parameters are on the meta
    device and this rank's slices take their values from it after the rewrite; with a ZeRO-3 ``ds_config``
    each is partitioned as soon as it is filled (dsforge.runtime.rank_build.fill_rank).
    """
    d = plan.degrees
    rp = plan_rewrite(model, plan)  # also checks that the policies place every module of the model
    if d.tp > 1 or d.ep > 1:
        # With tp = ep = 1 every rank's shard is the whole model: the parallel layers would only add
        # no-op collectives and autograd nodes (a measured 5-15 % on the tiny models' step time).
        from dsforge.runtime.materialize import params_on_meta

        with params_on_meta() if source is not None else contextlib.nullcontext():
            apply_rewrite(model, rp, groups, gather_logits=gather_logits)
    if source is not None:
        from dsforge.runtime.materialize import check_real
        from dsforge.runtime.rank_build import fill_rank

        fill_rank(model, rp, groups, source, plan, ds_config=ds_config)
        check_real(model, "this rank's model")
    if d.cp > 1:
        from dsforge.runtime.hf_attention import check_plain_causal, install_context_parallel

        check_plain_causal(model, plan.model.seq_len)  # at start-up, not at the first forward (DSF144)
        install_context_parallel(model, plan.spec.parallel.context_parallel.kind, groups.cp)
    if rp.sequence_parallel:
        _finish_sequence_parallel(model, plan, groups)
    install_job_kernels(model, plan, fused_loss=not gather_logits)  # whole logits: the caller forms the loss
    return model


def install_job_kernels(model: nn.Module, plan: ResolvedPlan, fused_loss: bool = True) -> None:
    """The job's lean kernels (training.kernels; dsforge/runtime/kernels) on this rank's model
    (``fused_loss``: False where the caller computes the loss from the model's logits, as
    `dsforge.initialize`'s loop does)."""
    from dsforge.compiler.estimate.lean import requested_kernels
    from dsforge.compiler.model.lean_kernels import lean_kernels
    from dsforge.runtime.kernels.install import install_lean_kernels

    on = lean_kernels(plan.model, requested_kernels(plan), plan.degrees.pp)
    if not fused_loss:
        on -= {"fused_loss"}
    if "fused_loss" in on:
        from dsforge.runtime.kernels.loss import FusedLossError, check_fused_head

        try:
            check_fused_head(model)
        except FusedLossError:
            if requested_kernels(plan).get("fused_loss") != "auto":
                raise  # asked for by name: refused with the reason
            # auto means "where it is exact": a biased head (CodeGen, GPT-J, Phi) or a logit scale (Cohere,
            # Granite) the fused loss does not apply keeps the model's own logits and the plain loss
            on -= {"fused_loss"}
    install_lean_kernels(model, on)


def _finish_sequence_parallel(model: nn.Module, plan: ResolvedPlan, groups: ParallelGroups) -> None:
    """What sequence parallelism needs beyond the applier's sequence regions: the norm-gradient sums over
    TP."""
    _sequence_parallel_hooks(model, groups.tp)


def build_parallel_model(plan: ResolvedPlan, groups: ParallelGroups, seed: int | None = None,
                         ds_config: dict[str, Any] | None = None) -> nn.Module:
    """This rank's shard of the job's model: built on the meta device, rewritten, only its slices made real.

    With a ZeRO-3 ``ds_config`` (the one the engine will be built with) every parameter is partitioned
    over the data-parallel group as it is filled: no rank ever holds the whole model. Without one the
    parameters stay whole (callers that change the module before ``deepspeed.initialize``).
    A `model.factory` module has its own initialisation, so it is built whole from the seed and sliced.
    """
    seed = plan.spec.training.seed if seed is None else seed
    if plan.model.factory:
        return parallelize(build_model(plan.model, "cpu", plan.degrees.tp, seed=seed), plan, groups)
    from dsforge.runtime.rank_build import rank_skeleton

    skeleton, source = rank_skeleton(plan, seed)
    return parallelize(skeleton, plan, groups, source=source, ds_config=ds_config)


def pipeline_loss(logits: Tensor, targets: Tensor | tuple[Tensor, Tensor]) -> Tensor:
    """The last pipeline stage's loss: mean next-token cross entropy (targets come shifted by the data);
    masked data's labels carry the global divisor (pipeline_inputs), so DeepSpeed's means give the global
    token mean."""
    if isinstance(targets, (tuple, list)):
        targets, denominator = targets
        return token_loss_sum(logits, targets, None) / denominator
    return token_loss_sum(logits, targets, None) / (targets != IGNORE_INDEX).sum().clamp(min=1)


def pipeline_inputs(batches: list[Batch]) -> list[tuple[Tensor, Tensor | tuple[Tensor, Tensor]]]:
    """A step's micro-batches as PipelineEngine.train_batch reads them: (first stage's input, last stage's
    labels; with masked targets the labels are (targets, the micro-batch's share of the global divisor))."""
    return [(mb.ids,
             mb.targets if mb.denominator is None else (mb.targets, torch.tensor(float(mb.denominator))))
            for mb in batches]


def build_pipeline_module(plan: ResolvedPlan, groups: ParallelGroups, ds_config: dict[str, Any],
                          seed: int | None = None) -> nn.Module:
    """This rank's pipeline stage of the rewritten model as a PipelineModule cut by the plan's partition."""
    from dsforge.runtime.pipeline_stages import build_pipeline

    d = plan.degrees
    if d.cp > 1:
        raise EngineError("context parallelism inside a pipeline (cp > 1 with pp > 1) is not supported yet: "
                          "the pipeline stages number positions from 0; use pp 1 with cp, or cp 1 with pp")
    seed = plan.spec.training.seed if seed is None else seed
    stage_hooks: dict[str, Any] = {}
    if plan.model.factory:  # its own initialisation: built whole from the seed, each stage sliced from it
        dense = build_model(plan.model, "cpu", d.tp, seed=seed)
    else:
        from dsforge.runtime.materialize import params_on_meta
        from dsforge.runtime.rank_build import fill_rank, rank_skeleton

        dense, source = rank_skeleton(plan, seed)
        stage_hooks = {"on_meta": params_on_meta,
                       "after_rewrite": lambda model, only: fill_rank(model, rp, groups, source, plan, only)}
    rp = plan_rewrite(dense, plan)
    module = build_pipeline(dense, rp, plan, groups, loss_fn=pipeline_loss, **stage_hooks,
                            **pipeline_recompute(plan, groups, ds_config))
    if not plan.model.factory:
        from dsforge.runtime.materialize import check_real

        check_real(module, f"pipeline stage {groups.index('pp')}")
    if rp.sequence_parallel:
        _finish_sequence_parallel(module, plan, groups)
    install_job_kernels(module, plan)  # pp > 1: fused_loss is never among them (compiler/lean_kernels.py)
    return module


def _partition_group(plan: ResolvedPlan, groups: ParallelGroups, ds_config: dict[str, Any]) -> Any:
    from dsforge.runtime.recompute import partition_group

    d = plan.degrees
    return partition_group(ds_config, groups.tp, d.tp, plan.spec.parallel.sequence_parallel and d.tp > 1)


def apply_job_recompute(model: nn.Module, plan: ResolvedPlan, groups: ParallelGroups,
                        ds_config: dict[str, Any]) -> int:
    """``training.recompute`` on this rank's rewritten model (pp = 1); the number of checkpointed layers."""
    from dsforge.runtime.recompute import apply_recompute

    return apply_recompute(model, plan.spec.training.recompute, _partition_group(plan, groups, ds_config))


def pipeline_recompute(plan: ResolvedPlan, groups: ParallelGroups,
                       ds_config: dict[str, Any]) -> dict[str, Any]:
    """PipelineModule keywords for ``training.recompute``: each decoder layer checkpointed (interval 1 under
    full), by dsforge's checkpoint (which honours partition_activations); embeddings and head are not."""
    from functools import partial

    from dsforge.runtime.recompute import checkpoint

    interval = ds_config.get("pipeline", {}).get("activation_checkpoint_interval", 0)
    return {"activation_checkpoint_interval": interval, "checkpointable_layers": ["DecoderStage"],
            "activation_checkpoint_func": partial(checkpoint,
                                                  group=_partition_group(plan, groups, ds_config))}


def optimizer_parameters(module: nn.Module) -> list[Any]:
    """Parameter groups for DeepSpeed's optimizer: MoE expert parameters in their own groups when present."""
    params = [p for p in module.parameters() if p.requires_grad]
    from deepspeed.moe.utils import has_moe_layers, split_params_into_different_moe_groups_for_optimizer

    if has_moe_layers(module)[0]:
        return list(split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "dense"}))
    return params


def _release_expert_groups(module: nn.Module) -> None:
    """Let deepspeed.initialize set the MoE gates' expert group again.

    ExpertParallelMoE sets its layer's parallelism when built (so it runs without an engine);
    the engine calls ``set_deepspeed_parallelism`` once more and DeepSpeed's gate asserts that its
    group is still unset (moe/sharded_moe.py ``TopKGate._set_ep_group``). The group it sets is the
    same one: the plan's, registered under the layer's name (dsforge.runtime.moe).
    """
    from deepspeed.moe.layer import MoE

    for m in module.modules():
        if isinstance(m, MoE):
            m.deepspeed_moe.gate.ep_group = None


def _match_precision(module: nn.Module, ds_config: dict[str, Any]) -> None:
    """The weights in the job's precision (dsforge.runtime.precision); rank 0 says what arrived otherwise."""
    from dsforge.runtime.precision import job_dtype, match_precision

    said = match_precision(module, job_dtype(ds_config))
    if said and (not dist.is_initialized() or dist.get_rank() == 0):
        print(said + " (counted on rank 0)", flush=True)


def initialize_engine(module: nn.Module, ds_config: dict[str, Any], groups: ParallelGroups | None) -> Any:
    """deepspeed.initialize over ``module`` with the plan's mpu (None for a PipelineModule)."""
    require_deepspeed()  # a clear sentence instead of a failure deep inside initialize on every rank
    import deepspeed

    ensure_deepspeed_comm()
    _release_expert_groups(module)
    _match_precision(module, ds_config)
    engine, _, _, _ = deepspeed.initialize(model=module, model_parameters=optimizer_parameters(module),
                                           config=ds_config, mpu=groups.mpu() if groups is not None else None)
    return engine


def build_engine(plan: ResolvedPlan, ds_config: dict[str, Any], groups: ParallelGroups,
                 seed: int | None = None) -> Any:
    """The DeepSpeed engine of the plan on this rank (plain for pp = 1, pipeline for pp > 1)."""
    d = plan.degrees
    torch.manual_seed(plan.spec.training.seed if seed is None else seed)
    ensure_deepspeed_comm()  # PipelineModule and DeepSpeed's MoE layers talk through deepspeed.comm
    if d.pp > 1:
        engine = initialize_engine(build_pipeline_module(plan, groups, ds_config, seed), ds_config, None)
        if plan.spec.parallel.pipeline.schedule == "gpipe":  # DeepSpeed's own schedule is 1F1B
            from dsforge.runtime.gpipe import use_gpipe

            use_gpipe(engine)
        return engine
    model = build_parallel_model(plan, groups, seed, ds_config)
    apply_job_recompute(model, plan, groups, ds_config)
    data = plan.spec.training.data
    documents = data.kind in ("text", "megatron") and data.packing is True
    return initialize_engine(CausalLMLoss(model, d.cp, documents), ds_config, groups)
