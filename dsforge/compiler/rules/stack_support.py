"""DSF306-DSF312: what each stack can run of the keys only some stacks have (Megatron-Core's pipeline split
options, the gradient-reduction dtype, FP8 and its recipes, ZeRO-3/FSDP, the attention kernel).

A key a stack has no form for is refused here rather than estimated as if it ran: the estimate would price a
job the stack does not train (the house rule "exact or refused").
"""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.plan.megatron_split import accounted_partition, accounted_total
from dsforge.compiler.rules.registry import Context, Finding, rule
from dsforge.compiler.rules.util import choices, divisors

_PIPE = ("parallel", "pipeline")
MEGATRON_CORE = ("NVIDIA/Megatron-LM megatron/core/transformer/transformer_block.py:146-201 "
                 "get_num_layers_to_build")
#: The FP8 recipes Transformer Engine has (transformer_engine/common/recipe/__init__.py: DelayedScaling,
#: Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling); Megatron-Core's --fp8-recipe names them
#: delayed, tensorwise, blockwise, mxfp8 (megatron/training/arguments.py).
FP8_RECIPES = ("delayed", "current", "blockwise", "mxfp8")


@rule("DSF306", "account_for_embedding / account_for_loss give a split Megatron-Core builds",
      source=MEGATRON_CORE + "; transformer_config.py:2228-2260, 2370-2415 (__post_init__ checks)",
      reads=("pp", "virtual_stages"))
def accounted_split(ctx: Context) -> Iterator[Finding]:
    """Megatron-Core's `--account-for-embedding-in-pipeline-split` and `--account-for-loss-in-pipeline-split`
    count the embedding (the loss) as one layer of the first (last) stage: layers + 1 (+ 1) must divide by
    pp, each stage's share by virtual_stages, and the first (last) chunk builds one transformer layer fewer.
    Megatron-Core raises at start-up for another split, and for the two keys together with
    first/last-stage counts or an explicit layout; no other stack has the keys."""
    pipe, d, m = ctx.spec.parallel.pipeline, ctx.plan.degrees, ctx.spec.model
    emb, loss = pipe.account_for_embedding, pipe.account_for_loss
    if not (emb or loss) or d is None:
        return
    key = (*_PIPE, "account_for_embedding" if emb else "account_for_loss")
    if ctx.spec.stack != "megatron-te":
        yield Finding(
            f"account_for_embedding/account_for_loss are Megatron-Core's split options, but the "
            f"job runs on stack {ctx.spec.stack}",
            "drop them, or give the stages their layers with parallel.pipeline.partition (a list)",
            key,
        )
        return
    if isinstance(pipe.partition,
                  list) or pipe.first_stage_layers is not None or pipe.last_stage_layers is not None:
        yield Finding("account_for_embedding/account_for_loss with first/last_stage_layers or a partition "
                      "list: Megatron-Core takes one way of splitting only", "drop one of them", key)
        return
    if d.pp < 2:
        yield Finding(f"account_for_embedding/account_for_loss need a pipeline, but pp={d.pp}",
                      "set pp >= 2, or " "drop them", key)
        return
    total, vp = accounted_total(m.layers, emb, loss), pipe.virtual_stages
    if total % d.pp:
        yield Finding(f"layers={m.layers} with the embedding/loss counted is {total}, not divisible by "
                      f"pp={d.pp}: Megatron-Core refuses the split", f"use pp in "
                                                         f"{choices([p for p in divisors(total) if p > 1])}",
                      ("parallel", "pp"))
    elif (total // d.pp) % vp:
        yield Finding(f"{total // d.pp} layers per stage (embedding/loss counted) do not divide over "
                      f"virtual_stages={vp}", f"use virtual_stages in {choices(divisors(total // d.pp))}",
                      (*_PIPE, "virtual_stages"))
    elif not accounted_partition(m.layers, d.pp, vp, emb, loss):
        yield Finding(f"with the embedding/loss counted, a chunk of pp={d.pp} x virtual_stages={vp} would "
                      f"build fewer than no layers", "use fewer pipeline chunks", ("parallel", "pp"))


@rule("DSF307", "the gradient-reduction dtype is one the stack has",
      source="NVIDIA/Megatron-LM megatron/training/arguments.py:1213-1216 (--grad-reduce-in-bf16); "
             "megatron/core/distributed/param_and_grad_buffer.py (grad_dtype); DeepSpeed runtime/engine.py "
             "communication_data_type", reads=())
def grad_reduce_dtype(ctx: Context) -> Iterator[Finding]:
    """Megatron-Core keeps the main-grad buffer and reduces it in fp32 for bf16 training unless
    `--grad-reduce-in-bf16`; both are `training.grad_reduce` values there. dsforge's runtime and
    Megatron-DeepSpeed run DeepSpeed's engine, which dsforge configures to reduce in the compute dtype:
    fp32 reduction of 16-bit gradients is not what that job would run, and a 16-bit reduction of fp32
    training is no setting of either stack."""
    t = ctx.spec.training
    if t.grad_reduce == "auto":
        return
    if ctx.spec.stack == "megatron-te":
        if t.grad_reduce == "bf16" and t.precision not in ("bf16", "fp8"):
            yield Finding(f"grad_reduce: bf16 with precision {t.precision}: Megatron's --grad-reduce-in-bf16 "
                          f"is a bf16 setting", "set grad_reduce: auto", ("training", "grad_reduce"))
        return
    compute = "fp32" if t.precision == "fp32" else t.precision
    if t.grad_reduce != compute:
        yield Finding(f"grad_reduce: {t.grad_reduce} on stack {ctx.spec.stack}: DeepSpeed's engine there "
                      f"reduces gradients in the compute dtype ({compute})", "set grad_reduce: auto",
                      ("training", "grad_reduce"))


@rule("DSF308", "FP8 training runs on a stack with Transformer Engine's FP8 GEMMs",
      source="NVIDIA/TransformerEngine transformer_engine/pytorch/fp8.py (fp8_autocast); Megatron-LM "
             "megatron/core/fp8_utils.py", reads=())
def fp8_stack(ctx: Context) -> Iterator[Finding]:
    """`precision: fp8` is Transformer Engine's: bf16 weights with FP8 copies cast per GEMM and scaled by a
    recipe. dsforge's runtime has no FP8 GEMM (its layers are torch's, in bf16) and Megatron-DeepSpeed's
    fused kernels are bf16/fp16, so on those stacks an FP8 job would train in bf16: refused, not estimated
    as FP8. Use `stack: megatron-te`."""
    t = ctx.spec.training
    if t.precision == "fp8" and ctx.spec.stack != "megatron-te":
        yield Finding(f"precision: fp8 on stack {ctx.spec.stack}, which "
                      f"has no FP8 GEMMs (it would train in bf16)",
                      "use precision: bf16, or stack: megatron-te (Transformer Engine)",
                      ("training", "precision"))


@rule("DSF309", "fp8_recipe goes with precision fp8", source="NVIDIA/TransformerEngine "
      "transformer_engine/common/recipe/__init__.py (DelayedScaling, Float8CurrentScaling, "
      "Float8BlockScaling, MXFP8BlockScaling)", reads=())
def fp8_recipe(ctx: Context) -> Iterator[Finding]:
    """A scaling recipe only means something for FP8 GEMMs; with another precision it would be ignored."""
    t = ctx.spec.training
    if t.fp8_recipe is not None and t.precision != "fp8":
        yield Finding(f"fp8_recipe: {t.fp8_recipe} with precision "
                      f"{t.precision}: the recipe scales FP8 GEMMs only",
                      "set precision: fp8, or drop fp8_recipe", ("training", "fp8_recipe"))


@rule("DSF310", "FP8 needs the accelerator's FP8 peak", source="NVIDIA H100/H200/B200 data sheets (dense FP8 "
      "Tensor Core TFLOP/s)", reads=())
def fp8_peak(ctx: Context) -> Iterator[Finding]:
    """The step time of an FP8 job prices its GEMMs at the accelerator's dense FP8 rate
    (`hardware.accelerator.fp8_tflops`); an accelerator without one (A100, V100: no FP8 Tensor Cores)
    cannot run it."""
    t, acc = ctx.spec.training, ctx.spec.hardware.accelerator
    if t.precision == "fp8" and not getattr(acc, "fp8_tflops", None):
        given = "is 0" if getattr(acc, "fp8_tflops", None) == 0 else "is not given"
        yield Finding(f"precision: fp8 but the FP8 peak of {acc.name} {given}",
                      "set hardware.accelerator.fp8_tflops to its data sheet's dense FP8 figure, or use "
                      "precision: bf16", ("training", "precision"))


@rule("DSF311", "ZeRO-2/3 under megatron-te is Megatron-FSDP without a pipeline",
      source="NVIDIA/Megatron-LM megatron/core/distributed/distributed_data_parallel_config.py:103 "
             "(data_parallel_sharding_strategy: optim, optim_grads, optim_grads_params); megatron/training/"
             "arguments.py:1035 (--use-torch-fsdp2 is not supported with pipeline parallelism)",
      reads=("zero", "pp"))
def megatron_fsdp(ctx: Context) -> Iterator[Finding]:
    """Under `stack: megatron-te`, zero 1 is the distributed optimizer and zero 2/3 are Megatron-FSDP's
    `optim_grads` / `optim_grads_params` sharding, priced as such (estimate/stacks/megatron_fsdp.py). Torch
    FSDP2 refuses pipeline parallelism in Megatron (arguments.py:1035), and the per-stage buffers of
    Megatron-FSDP inside a pipeline are not modelled, so zero 2/3 with pp > 1 is refused on that stack
    rather than priced as something it is not."""
    d = ctx.plan.degrees
    if ctx.spec.stack == "megatron-te" and d is not None and ctx.plan.zero in (2, 3) and d.pp > 1:
        yield Finding(f"zero={ctx.plan.zero} with pp={d.pp} on stack megatron-te: dsforge prices FSDP "
                      "(optim_grads/optim_grads_params) without a pipeline only",
                      "use zero: 1 (the distributed " "optimizer) with pp, or pp: 1", ("parallel", "zero"))


@rule("DSF312", "the attention kernel is one the stack runs",
      source="NVIDIA/Megatron-LM megatron/core/transformer/enums.py:51 (AttnBackend: flash, fused, unfused), "
             "megatron/core/transformer/dot_product_attention.py:57-59 (context parallelism only in TE's "
             "attention); deepspeedai/Megatron-DeepSpeed megatron/arguments.py:927-935 (--use-flash-attn*)",
      reads=("cp",))
def attention_kernel(ctx: Context) -> Iterator[Finding]:
    """`training.attention` names the attention core's kernel, which the step time and the activations
    price differently. Megatron-Core runs TE's flash attention or its own unfused one
    (`--attention-backend`), but context parallelism only inside TE's; Megatron-DeepSpeed runs its unfused
    attention or flash attention with `--use-flash-attn`. dsforge's runtime runs HF's SDPA attention and
    has no switch for another kernel, so a job that names one there would be estimated as something it
    does not run."""
    t, d = ctx.spec.training, ctx.plan.degrees
    if t.attention == "auto":
        return
    if ctx.spec.stack == "dsforge":
        yield Finding(f"attention: {t.attention} on stack dsforge, whose runtime runs HF's SDPA attention "
                      f"and has no other kernel", "set attention: auto", ("training", "attention"))
    elif (ctx.spec.stack == "megatron-te" and t.attention == "unfused" and d is not None and d.cp > 1):
        yield Finding(f"attention: unfused with cp={d.cp}: Megatron-Core runs context parallelism only in "
                      f"Transformer Engine's attention", "set attention: auto, or cp: 1",
                      ("training", "attention"))
