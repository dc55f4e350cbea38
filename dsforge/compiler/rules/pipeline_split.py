"""DSF305: an uneven pipeline (`first_stage_layers` / `last_stage_layers`) that the job's stack can build."""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.rules.registry import Context, Finding, rule
from dsforge.diagnostics import Severity

_PIPE = ("parallel", "pipeline")


@rule("DSF305", "first_stage_layers / last_stage_layers leave a split the stack builds",
      source="Megatron-Core megatron/core/transformer/transformer_config.py (the uneven-PP checks of "
      "num_layers_in_first/last_pipeline_stage); transformer_block.py get_num_layers_to_build")
def end_stage_layers(ctx: Context) -> Iterator[Finding]:
    """Megatron-Core's `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers` give the
    first and last stage their own layer counts (they also hold the embedding and the loss) and split the
    rest evenly over the middle stages. Megatron-Core raises at start-up when the ends are combined with
    another layout, when middle layers remain without middle stages (or the reverse), when the middle
    layers do not divide over the middle stages, and with the interleaved schedule when a stage's layers
    do not divide by virtual_stages. dsforge's runtime builds the same split from the plan (its
    PipelineModule takes any boundaries), so there an uneven middle is only a warning: the later middle
    stages get one more layer and the largest sets the pace."""
    d, pipe, m = ctx.plan.degrees, ctx.spec.parallel.pipeline, ctx.spec.model
    first, last = pipe.first_stage_layers, pipe.last_stage_layers
    if d is None or (first is None and last is None):
        return
    key = (*_PIPE, "first_stage_layers" if first is not None else "last_stage_layers")
    if isinstance(pipe.partition, list):
        yield Finding("parallel.pipeline.partition lists the layers of every chunk and "
                      "first/last_stage_layers set the ends again: only one may give the split",
                      "drop one of them", key)
        return
    if d.pp < 2:
        yield Finding(f"first/last_stage_layers need a pipeline, but pp={d.pp}", "set pp >= 2, or drop them",
                      key)
        return
    fixed = [n for n in (first, last) if n is not None]
    middle_stages, rest = d.pp - len(fixed), m.layers - sum(fixed)
    ends = " + ".join(str(n) for n in fixed)
    if rest < 0 or (rest > 0) != (middle_stages > 0) or (middle_stages and rest < middle_stages):
        have = (f"{rest} layers remain for {middle_stages} middle stage(s)" if rest >= 0
                else f"the ends ({ends}) already exceed layers={m.layers}")
        yield Finding(f"first/last_stage_layers with pp={d.pp} and layers={m.layers}: {have}",
                      "give each middle stage at least one layer, and no layers without a middle stage", key)
        return
    vp = pipe.virtual_stages
    megatron = ctx.spec.stack == "megatron-te"
    per_middle, uneven = divmod(rest, middle_stages) if middle_stages else (0, 0)
    if megatron and vp > 1:
        bad = [f"{name}={n}" for name, n in (("first_stage_layers", first), ("last_stage_layers", last),
                                            ("each middle stage", per_middle if middle_stages else None))
               if n is not None and n % vp]
        if bad:
            yield Finding(f"with virtual_stages={vp} every stage's layers must divide into its chunks: "
                          f"{', '.join(bad)} do not", f"use layer counts that are multiples of {vp}",
                          (*_PIPE, "virtual_stages"))
            return
    if uneven:
        message = (f"the {rest} middle layers do not divide over the {middle_stages} middle stages "
                   f"(first/last_stage_layers {ends}, layers={m.layers})")
        fix = f"make layers - ({ends}) a multiple of {middle_stages}"
        if megatron:
            yield Finding(message + ": Megatron-Core refuses an uneven middle", fix, key)
        else:
            yield Finding(message + f" ({ctx.plan.stage_layers}): the largest stage sets the pace", fix, key,
                          Severity.WARNING)
