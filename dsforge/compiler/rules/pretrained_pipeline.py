"""DSF173: pp > 1 for a `model.pretrained` family placed by its HF plans needs its base_model_pp_plan.

The hand-written families have their own stages; a family the derived policy places
(dsforge.compiler.frontend.pretrained_derived) is cut into pipeline stages by its transformers classes'
``base_model_pp_plan`` (dsforge.runtime.hf_pipeline). A type whose classes state none, or one of another
shape, was refused only by compile's rewrite plan (DSF607) and `dsforge run`; validate now refuses it from
config.json and the generated plan table, without torch. The glue check (HF's forward against the stages,
in float64) still needs the model and stays with the rewrite plan.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from dsforge.compiler.frontend.pretrained import FAMILIES, PretrainedError, read_config
from dsforge.compiler.model.hf_plans import NO_PP_PLAN, plans_for_type, pp_plan_problem_of
from dsforge.compiler.rules.registry import DSFORGE_RUNTIME, Context, Finding, rule


@rule(NO_PP_PLAN, "a pretrained family placed by its HF plans states a pipeline plan at pp > 1",
      source="transformers base_model_pp_plan (PreTrainedConfig); dsforge/runtime/hf_pipeline.py",
      reads=("pp",), stacks=DSFORGE_RUNTIME)
def pretrained_pipeline_plan(ctx: Context) -> Iterator[Finding]:
    """At pp > 1, a `model.pretrained` whose model_type has no hand-written family must state a
    base_model_pp_plan of the pieces embed_tokens, layers and norm, from which the stages are cut."""
    pretrained, degrees = ctx.spec.model.pretrained, ctx.plan.degrees
    if not pretrained or degrees is None or degrees.pp <= 1:
        return
    try:
        mtype = read_config(Path(pretrained)).get("model_type")
    except PretrainedError:
        return  # the loader reports the directory (DSF011)
    if not isinstance(mtype, str) or mtype in FAMILIES:
        return
    plans = plans_for_type(mtype)
    problem = pp_plan_problem_of(plans) if plans is not None else None
    if problem is not None:
        yield Finding(f"parallel.pp={degrees.pp}: {problem}",
                      "set parallel.pp: 1 (tensor, data and ZeRO parallelism still apply), or use "
                      "model.factory with a model whose family has hand-written stages", ("parallel", "pp"))
