"""DSF140-DSF145: layouts and models dsforge's own runtime refuses at start-up, refused at validate time
instead.

Each rule mirrors one refusal of `dsforge.runtime` (tests/compiler/rules/test_runtime_refusals.py lists every
`raise` of the runtime and checks that each start-up limitation names a rule here or elsewhere). They
apply to `stack: dsforge` only (`stacks=DSFORGE_RUNTIME`, so run_rules skips them for another stack, and
docs/rules.md says so): another stack runs the job with its own engine and its own limits.
"""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.model.builtin_models import NotBuiltIn, builtin_problem
from dsforge.compiler.rules.registry import DSFORGE_RUNTIME, Context, Finding, rule

DS = "deepspeed/"

#: Families whose decoder dsforge.runtime.pipeline_stages can cut into DeepSpeed pipeline layers (its
#: STRUCTURES table; tests/compiler/rules/test_runtime_refusals.py keeps the two equal).
PIPELINE_FAMILIES = ("gpt2", "llama", "mixtral")


def _dsforge_runtime(ctx: Context) -> bool:
    """True when dsforge's runtime runs the job (`stack: dsforge`, the default; read so that a schema
    without the key means the same)."""
    return getattr(ctx.spec, "stack", "dsforge") == "dsforge"


@rule("DSF140", "dsforge's runtime does not combine context and pipeline parallelism",
      source="dsforge.runtime.engine build_pipeline_module; dsforge/runtime/pipeline_stages.py DecoderStage",
      reads=("cp", "pp"), stacks=DSFORGE_RUNTIME)
def cp_with_pp(ctx: Context) -> Iterator[Finding]:
    """The pipeline stages pass only hidden states between them and number token positions from 0 in
    each stage, while ring and Ulysses attention need every rank's global positions and a causal mask over
    them; rather than train a wrong model, every rank stops at start-up, so validate refuses the layout."""
    d = ctx.plan.degrees
    if d is None or not _dsforge_runtime(ctx) or d.cp == 1 or d.pp == 1:
        return
    yield Finding(f"cp={d.cp} with pp={d.pp}: dsforge's runtime does not run context parallelism inside a "
                  "pipeline (its stages number token positions from 0; ring/Ulysses attention needs the "
                  "global ones), so every rank would stop at start-up",
                  f"use cp: 1 with pp: {d.pp}, or pp: 1 with cp: {d.cp} (and dp for the other ranks)",
                  ("parallel", "cp"))


@rule("DSF141", "pipeline parallelism needs a family the runtime can cut into stages",
      source="dsforge/runtime/stage_structures.py STRUCTURES, pipeline_stages.py layer_list; "
             + DS + "runtime/pipe/module.py",
      reads=("pp",), stacks=DSFORGE_RUNTIME)
def pipeline_family(ctx: Context) -> Iterator[Finding]:
    """For pp > 1 the runtime hands DeepSpeed a flat layer list (embedding, one entry per decoder layer,
    final norm and head), which it knows how to build for the families in its structure table only; for
    any other `model.arch` every rank stops at start-up."""
    d, arch = ctx.plan.degrees, ctx.plan.model.arch
    if d is None or not _dsforge_runtime(ctx) or d.pp == 1 or arch == "auto" or arch in PIPELINE_FAMILIES:
        return
    yield Finding(f"pp={d.pp} with model.arch {arch}: dsforge's runtime cuts only "
                  f"{', '.join(PIPELINE_FAMILIES)} decoders into pipeline "
                  f"stages, so every rank would stop at start-up",
                  "use pp: 1 (with tp, dp or ZeRO for the memory), or a model of those families",
                  ("parallel", "pp"))


@rule("DSF142", "dsforge's runtime runs one model chunk per pipeline stage",
      source="dsforge/runtime/pipeline_stages.py boundaries; " + DS + "runtime/pipe/module.py PipelineModule",
      reads=("pp", "virtual_stages"), stacks=DSFORGE_RUNTIME)
def one_chunk_per_stage(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed's PipelineModule gives each stage one contiguous run of layers; interleaved model chunks
    (virtual_stages > 1, Narayanan et al. 2021 sec. 2.2) have no form there, so the runtime refuses them
    at start-up. `dsforge explain` still estimates the interleaved schedule for comparison."""
    d, pipe = ctx.plan.degrees, ctx.spec.parallel.pipeline
    if d is None or not _dsforge_runtime(ctx) or d.pp == 1 or pipe.virtual_stages == 1:
        return
    yield Finding(f"virtual_stages={pipe.virtual_stages}: dsforge's runtime builds DeepSpeed's "
                  f"PipelineModule, which runs one model chunk per "
                  f"stage, so every rank would stop at start-up",
                  "set virtual_stages: 1 and schedule: 1f1b", ("parallel", "pipeline", "virtual_stages"))


@rule("DSF143", "dsforge's runtime shards whole KV heads (no KV-head replication)",
      source="dsforge/runtime/rewrite/apply.py _even; Ainslie et al. 2023 (GQA)", reads=("tp",),
      stacks=DSFORGE_RUNTIME)
def replicated_kv_heads(ctx: Context) -> Iterator[Finding]:
    """`parallel.replicate_kv_heads: true` lets tp exceed kv_heads (each KV head copied onto tp/kv_heads
    ranks), which the cost model and DeepSpeed's AutoTP know; dsforge's tensor-parallel layers cut every
    projection into equal 1/tp blocks and refuse the replicated K/V projections when every rank starts."""
    d, m = ctx.plan.degrees, ctx.plan.model
    if (
        d is None
        or not _dsforge_runtime(ctx)
        or m.kv_heads % d.tp == 0
        or not ctx.spec.parallel.replicate_kv_heads
    ):
        return
    yield Finding(f"tp={d.tp} with kv_heads={m.kv_heads} replicated: dsforge's runtime gives each "
                  f"tensor-parallel rank whole KV heads of its own and cannot build replicated K/V "
                  f"projections, so every rank would stop at start-up",
                  f"use tp dividing kv_heads={m.kv_heads} (and dp or pp for the other ranks)",
                  ("parallel", "tp"))


@rule("DSF144", "context-parallel attention is plain causal attention: no soft-capping, windows or dropout",
      source="dsforge/runtime/hf_attention.py plain_causal_problems, check_plain_causal; HF "
             "Gemma2/Gemma3/Mistral/Phi3/Qwen2 attention (sliding_window, attn_logit_softcapping)",
             phase="compile",
      stacks=DSFORGE_RUNTIME)
def context_parallel_attention(ctx: Context) -> Iterator[Finding]:
    """Ring and Ulysses attention compute causal softmax attention over the whole sequence; a model whose
    attention also soft-caps its scores (Gemma2), attends within a sliding window shorter than
    `model.seq_len` (Mistral, Phi3, Gemma2/3's local layers, Qwen2 with use_sliding_window) or drops
    attention weights would train as another model, so every rank refuses it at start-up. Whether a model
    does so is in its config, which for `model.factory` only the built module knows: compile builds it on
    the meta device (the rewrite plan, as DSF607) and reads every attention module, so a Gemma2 whose
    config sets attn_logit_softcapping null (and a window covering the sequence) is let through. dsforge's
    own gpt2/llama/mixtral models have none of these, and a `model.pretrained` config with a sliding window
    shorter than model.seq_len is refused at validate (DSF012). Where compile cannot build the model
    (`--no-rewrite`, no torch, a factory not importable there) the
    ranks refuse it at start-up with the same message."""
    desc = getattr(ctx, "rewrite", None)
    d = ctx.plan.degrees
    if not isinstance(desc, dict) or d is None or d.cp == 1:
        return
    for problem in desc.get("context_parallel_refusals") or []:
        yield Finding(
            f"cp={d.cp}: context-parallel attention is plain causal softmax attention, but the "
            f"model has {problem}, which it would drop",
            f"use cp: 1 (tp, pp or recompute for the memory of "
            f"seq_len={ctx.plan.model.seq_len}), or a model without it",
            ("parallel", "cp"),
        )


@rule("DSF145", "dsforge's built-in model families can express the model keys",
      source="dsforge/compiler/model/builtin_models.py (the checks dsforge.runtime.models.hf_config makes); "
             "transformers GPT2Config, LlamaConfig, Qwen2Config, MixtralConfig", reads=(),
      stacks=DSFORGE_RUNTIME)
def builtin_model(ctx: Context) -> Iterator[Finding]:
    """Without `model.factory` or `model.pretrained`, dsforge builds the model itself as an HF GPT-2, Llama
    (Qwen2 with q/k/v biases) or Mixtral from the model keys, and each of those configs holds some shapes only
    (GPT-2: no grouped-query attention, a fused QKV of hidden x 3 hidden with its bias; Llama: SwiGLU and
    RoPE, dense; Mixtral: every layer sparse, no q/k/v biases). A spec outside them cannot be built: compile
    would stop at DSF607 and `--no-rewrite` ranks at start-up, so validate refuses it first, naming the
    key."""
    if not _dsforge_runtime(ctx):
        return
    m = ctx.plan.model
    try:
        found = builtin_problem(m)
    except NotBuiltIn as exc:
        yield Finding(f"model.arch {m.arch}: {exc}", "set model.factory or model.pretrained, or use arch "
                      "gpt2, llama, mixtral or auto with the shape keys", ("model", "arch"))
        return
    if found is not None:
        family, what = found
        yield Finding(f"dsforge builds this model as an HF {family} (model.arch {m.arch}), which cannot "
                      f"express it: {what}", f"change the model keys to fit {family}, or set model.factory "
                      f"to a callable that builds the module",
                      ("model", "arch") if ctx.written(("model", "arch")) else ("model",))
