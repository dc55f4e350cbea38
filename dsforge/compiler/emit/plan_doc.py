"""plan.json: everything dsforge.runtime needs to start the job, and what DeepSpeed will be told.

``dsforge.runtime.main.run_job(job_dir)`` reads this file and ds_config.json; it never re-parses the
job file, so the resolved spec, degrees, batch split, stage partition, rank placement and seed are
all here. The explain summary of the cost model is included when that module is installed, and the
rewrite plan (module -> parallel variant, shard shapes, exact parameter counts) when compile computed it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import asdict
from typing import Any

from dsforge.compiler.deepspeed.ds_settings import on_cpu
from dsforge.compiler.plan.placement import Placement
from dsforge.compiler.plan.plan import Degrees, ResolvedPlan
from dsforge.compiler.strict_json import non_finite
from dsforge.version import __version__

FORMAT = 1
GENERATOR = "dsforge"
SUMMARY_MODULE = "dsforge.compiler.estimate.summary"


def deepspeed_view(plan: ResolvedPlan, d: Degrees) -> dict[str, Any]:
    """How the runtime presents the plan to DeepSpeed, and the world size DeepSpeed's batch rule sees.

    DeepSpeedConfig takes its batch world size from ``mpu.get_data_parallel_world_size()`` when an mpu
    is given (deepspeed/runtime/config.py DeepSpeedConfig.__init__); a PipelineModule brings its own
    topology instead, and its engine asserts the same dp (runtime/pipe/engine.py). Any PipelineModule,
    even a one-stage one, refuses ZeRO-2/3 (PipelineEngine.__init__), so pp = 1 runs a plain module.
    """
    t = plan.spec.training
    return {
        "processes": plan.world_size,
        "batch_world_size": d.dp,
        "batch_identity": f"train_batch_size {t.global_batch} = micro {t.micro_batch} x "
                          f"gradient_accumulation_steps {plan.grad_accum} x data-parallel {d.dp}",
        "mpu": ("a PipelineModule topology built from the plan" if d.pp > 1
                else "an mpu built from the plan (dsforge.runtime DeepSpeedMPU)"),
        "pipeline_module": d.pp > 1,
        "autotp": False,
        "moe_layer": f"deepspeed.moe.layer.MoE(ep_size={d.ep})" if plan.spec.model.moe is not None else None,
        "sequence_parallel_size": d.cp,
    }


def summarize_safely(plan: ResolvedPlan) -> tuple[dict[str, Any] | None, str | None]:
    """The cost model's explain summary as data, or why there is none.

    (None, None) until that module exists; (None, reason) when it fails on this plan, so a bug in an
    estimate costs the job directory its summary, never the job directory itself (compile warns).
    """
    if importlib.util.find_spec(SUMMARY_MODULE) is None:
        return None, None
    try:
        result: dict[str, Any] = importlib.import_module(SUMMARY_MODULE).summarize(plan)
    except Exception as exc:  # noqa: BLE001 - isolation is the point, as for rules
        return None, f"{type(exc).__name__}: {exc}"
    found = non_finite(result)
    if found is not None:  # plan.json must stay strict JSON: a summary that is not is no summary
        return None, f"it computed {found[1]} for summary.{found[0]}"
    return result, None


#: Largest world whose groups plan.json lists rank by rank (16,384 ranks: ~130,000 numbers, about a megabyte);
#: above it each kind of group is summarised, so plan.json stays small and quick to write for any world.
LISTED_RANKS = 16_384
#: Members of a kind's first group shown in the summary (a data-parallel group can hold most of the world).
SHOWN_MEMBERS = 64


def placement_document(p: Placement) -> dict[str, Any]:
    """The placement as plan.json states it: every group of every kind, or above LISTED_RANKS ranks how many
    groups of what size each kind has, the first group's first SHOWN_MEMBERS ranks and the last group's first
    rank (the runtime re-derives the groups from the degrees and the order)."""
    if p.world_size <= LISTED_RANKS:
        return {"order": list(p.order), "groups": dict(p.groups)}
    shapes = {}
    for kind in p.groups:
        first = p.first_group(kind)
        # the last group holds the last rank, with the first group's offsets
        shapes[kind] = {"count": p.world_size // len(first), "size": len(first),
                        "first": first[:SHOWN_MEMBERS], "last_base": p.world_size - 1 - first[-1]}
    return {"order": list(p.order), "groups_summary": shapes,
            "note": f"{p.world_size} ranks: groups are summarised above {LISTED_RANKS} ranks"}


def plan_document(plan: ResolvedPlan, files: list[str], summary: dict[str, Any] | None = None,
                  rewrite: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plan.json document: resolved job, degrees, batch, partition, placement, DeepSpeed's view, summary,
    and the rewrite plan (``dsforge.runtime.rewrite.describe``, or why it was skipped)."""
    d, p = plan.degrees, plan.placement
    t = plan.spec.training
    doc: dict[str, Any] = {
        "format": FORMAT,
        "generator": GENERATOR,
        "dsforge_version": __version__,
        "name": plan.spec.name,
        "job": plan.spec.model_dump(mode="json", by_alias=True),
        "degrees": asdict(d),
        "world_size": plan.world_size,
        "nodes": plan.nodes,
        "gpus_per_node": plan.gpus_per_node,
        "zero": plan.zero,
        "batch": {"global_batch": t.global_batch, "micro_batch": t.micro_batch,
                  "grad_accum": plan.grad_accum},
        "seed": t.seed,
        "stage_layers": list(plan.stage_layers),
        "virtual_stages": plan.virtual_stages,
        "placement": placement_document(p),
        "deepspeed": deepspeed_view(plan, d),
        "dist_backend": "gloo" if on_cpu(plan) else "nccl",
        "launcher": plan.spec.launch.launcher,
        "files": sorted(files),
    }
    if plan.search:  # the layout search's record, where one ran
        doc["search"] = plan.search
    if summary is not None:
        doc["summary"] = summary
    if rewrite is not None:
        doc["rewrite"] = rewrite
    return doc
