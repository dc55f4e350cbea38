"""DSF180: the estimates' parameter count against the one config.json's structure gives (`model.pretrained`).

The sentence is dsforge.compiler.frontend.pretrained_params' (explain prints the same one under its summary).
"""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.frontend.pretrained_params import param_count_note
from dsforge.compiler.model.params import total_params
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.rules.registry import Context, Finding, rule
from dsforge.diagnostics import Severity


@rule("DSF180", "the estimates count the checkpoint's parameters exactly", severity=Severity.INFO,
      source="transformers PreTrainedModel.num_parameters() over the zoo's tiny configs "
             "(benchmarks/hf_param_counts.py)")
def pretrained_param_count(ctx: Context) -> Iterator[Finding]:
    """The model keys' formula (parameters, memory, FLOPs) against config.json's structural count: a
    difference, or a type whose structural count is not matched to HF's, makes the estimates approximate."""
    note = param_count_note(ctx.spec.model.pretrained, total_params(resolve_model(ctx.spec.model)))
    if note is not None:
        yield Finding(note, "nothing to do: compile's meta build counts the rewritten model exactly",
                      ("model", "pretrained"))
