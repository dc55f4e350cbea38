"""No layout validates and then stops every rank at start-up: each refusal the runtime can raise is accounted
for.

The test reads every ``raise`` in dsforge/runtime (by file, enclosing function and exception class) and
requires each to be listed below: either with the rule ids that refuse the same job file before any rank
starts (validate, or compile for DSF607), or with the reason it cannot come from a job's layout (the
environment, a data or checkpoint file's content, a programming error the plan rules out). A new
``raise`` fails the test until it is classified, so a new runtime limitation comes with its rule. For the
runtime_support rules (DSF140-DSF143) the test also shows both sides: the bad-corpus job is refused by
validate, and the same plan is refused by the runtime code the rule mirrors.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.plan.plan import build_plan
from dsforge.compiler.rules.registry import get_rule
from dsforge.compiler.spec.schema import JobSpec
from dsforge.compiler.validate import validate_file
from tests.conftest import ROOT

RUNTIME = ROOT / "dsforge" / "runtime"
BAD = ROOT / "tests" / "fixtures" / "bad"

#: Refusals a job file can cause, and the rules that refuse that job first.
BY_RULE: dict[str, tuple[str, ...]] = {
    "api.py:initialize:EngineError": ("DSF140",),
    "api.py:initialize:JobError": ("DSF120", "DSF600"),
    "api.py:load_plan:JobError": ("DSF101",),  # the job's own validate errors, re-raised: any rule
    "engine.py:build_pipeline_module:EngineError": ("DSF140",),
    "engine.py:parallelize:EngineError": ("DSF600",),
    "engine.py:build_engine:EngineError": ("DSF600",),
    "pipeline_stages.py:layer_list:RewriteError": ("DSF141",),
    "pipeline_stages.py:boundaries:RewriteError": ("DSF142", "DSF109", "DSF119"),
    "rewrite/apply.py:_even:RewriteError": ("DSF143",),
    "attention/sequence.py:_chunks_of:ValueError": ("DSF111", "DSF112"),
    "data.py:__init__:DataError": ("DSF610", "DSF201"),  # also a token file's size and dtype: its content
    "data.py:batches_for:DataError": ("DSF205",),
    # The user's data (dsforge.runtime.datasets): validate reads the same files through
    # dsforge.compiler.frontend.data_files.
    "datasets/__init__.py:text_source:DataError": ("DSF623",),
    "datasets/__init__.py:source_for:DataError": ("DSF040",),
    "datasets/megatron_indexed.py:__init__:DataError": ("DSF620", "DSF625"),  # also the arrays' content
    "datasets/text_files.py:resolve_files:DataError": ("DSF620", "DSF626"),
    "datasets/tokenizer.py:render:DataError": ("DSF624",),
    "datasets/tokenizer.py:load_tokenizer:DataError": ("DSF622",),
    "groups.py:_placement_of:LayoutError": ("DSF101", "DSF600"),
    # cp apart from dp matters only with cp > 1 and pp > 1
    "groups.py:pipe_axes:LayoutError": ("DSF140", "DSF117"),
    "moe.py:__init__:LayoutError": ("DSF113",),
    # A spec dsforge's own HF families cannot express is refused at validate (DSF145, the same torch-free
    # check); building the model and planning its rewrite run at compile time on the meta device (plan.json's
    # `rewrite`): a failing factory or a module no rule places is DSF607.
    "models.py:family:ModelBuildError": ("DSF145",),
    "models.py:_require:ModelBuildError": ("DSF145",),
    "models.py:load_factory:ModelBuildError": ("DSF607",),
    "models.py:call_factory:ModelBuildError": ("DSF607",),
    "rewrite/__init__.py:resolve_arch:RewriteError": ("DSF607",),
    "rewrite/planner.py:plan_module:RewriteError": ("DSF607",),
    "rewrite/planner.py:plan_rewrite:RewriteError": ("DSF607",),
    "rewrite/sequence.py:wrap_sequence_parallel:RewriteError": ("DSF607",),  # the planner refuses it first
    "recompute.py:apply_recompute:RecomputeError": ("DSF607",),  # a factory model without decoder layers
    "hf_attention.py:install_context_parallel:ContextParallelError": ("DSF023",),  # also a factory model's
    # soft-capping, a sliding window shorter than the sequence, attention dropout under cp > 1: read from the
    # model compile builds on the meta device (DSF144), refused again when each rank starts
    "hf_attention.py:check_plain_causal:ContextParallelError": ("DSF144",),
}

#: Refusals no job layout causes, and why.
NOT_A_LAYOUT: dict[str, str] = {
    **{
        f"datasets/{site}:DataError": "data content: a record past the first, which validate reads (DSF621)"
        for site in (
            "__init__.py:_documents",
            "chat.py:check_messages",
            "chat.py:assistant_spans",
            "text_files.py:records",
            "text_files.py:_loads",
            "text_files.py:_field",
            "text_files.py:_parquet_records",
            "text_files.py:_hf_records",
        )
    },
    "datasets/packing.py:__init__:DataError": "data content: a corpus shorter than one sequence",
    "datasets/packing.py:example:DataError": "data content: a token id beyond "
    "model.vocab (DSF623 for a tokenizer)",
    "datasets/tokenize_cache.py:tokenized:DataError": "the environment: the data's directory is not writable",
    "datasets/tokenize_cache.py:_build:DataError": "data content: every document empty",
    "datasets/tokenizer.py:_eos:DataError": "tokenizer content: no end-of-text token",
    "datasets/__init__.py:require_document_masks:DataError": "the environment: transformers < 4.54 where it runs",  # noqa: E501
    "kernels/loss.py:check_fused_head:FusedLossError": "a model.factory module whose LM head or logit config "
    "is not its arch's (only the built module shows it; the "
    "message names training.kernels.fused_loss: false)",
    "main.py:load:JobDirError": "job directory: plan.json unreadable or from another dsforge version",
    "main.py:_stopped:exc": "re-raises the exception that stopped the rank",
    "versions.py:require_deepspeed:UnsupportedVersionError": "environment: the installed DeepSpeed version",
    "hf_attention.py:register:ContextParallelError": "environment: the installed transformers version",
    "groups.py:check_world_size:LayoutError": "environment: a launcher started another number of processes",
    "groups.py:create_groups:LayoutError": "API use: torch.distributed not initialised",
    "groups.py:pipe_topology:LayoutError": "programming error: DeepSpeed's grid "
    "differs from the plan's groups",
    "moe.py:register_expert_groups:LayoutError": "programming error: DeepSpeed holds other expert groups",
    "hf_attention.py:_attention:ContextParallelError": "a guard at the first forward behind "
    "check_plain_causal, which refuses the same models at start-up (DSF144)",
    "data.py:sample:DataError": "data file content: a token id outside the vocabulary",
    "checkpoint.py:commit:CheckpointError": "checkpoint state: a rank left no marker while saving",
    "checkpoint.py:resume:CheckpointError": "checkpoint state: the directory resumed from",
    "train_loop.py:finish:TrainingError": "training, not start-up: the loss stopped being finite",
    "faults.py:parse:ValueError": "test hook (DSFORGE_FAULT)",
    "faults.py:fault:InjectedFault": "test hook (DSFORGE_FAULT)",
    "layers/linear.py:__init__:ValueError": "programming error: argument checks "
    "of the TP layers the planner sizes",
    "layers/mappings.py:_shard:ValueError": "programming error: a tensor the planner sized does not split",
    "layers/mappings.py:_reduce_scatter:ValueError": "programming error: a sequence "
    "DSF123 splits does not split",
    "layers/norms.py:from_dense:TypeError": "programming error: a norm the planner placed is not an RMSNorm",
    "layers/sharding.py:block_widths:ValueError": "programming error: fused blocks the planner sized",
    "layers/sharding.py:check_blocks:ValueError": "programming error: fused blocks the planner sized",
    "layers/sharding.py:dense_weight:TypeError": "programming error: a module the planner placed",
    "layers/vocab.py:load_dense_rows:ValueError": "programming error: rows the planner sized",
    "layers/vocab.py:tie_to:ValueError": "programming error: a tie the planner placed",
    "moe.py:__init__:ValueError": "model content: a router DeepSpeed's gate cannot reproduce",
    "moe.py:load_dense:ValueError": "programming error: expert weights of another layer",
    "moe.py:from_mixtral:ValueError": "model content: the block's own top-k or expert activation",
    "rewrite/apply.py:apply_rewrite:RewriteError": "programming error: groups of another plan",
    "rewrite/apply.py:_verify:RewriteError": "programming error: shards that differ from the plan",
    "rewrite/apply.py:_vocab:RewriteError": "model content (factory): a `vocab` rule on another module type",
    "rewrite/apply.py:_expert:RewriteError": "model content (factory): expert "
    "parallelism of a non-Mixtral block",
    "rewrite/apply.py:_moe_block:RewriteError": "model content: DeepSpeed's MoE layer refused the block",
    "rewrite/apply.py:_tie:RewriteError": "model content (factory): a tied LM head with a bias",
    "rewrite/derived.py:derived_arch:ValueError": "programming error: resolve_arch "
    "asks prefers_derived first",
    "rewrite/derived.py:derived_arch:PlanRefusal": "model content: resolve_arch "
    "folds it into DSF607's reasons",
    "materialize.py:values:MaterializeError": "programming error: a parameter the build did not plan",
    "materialize.py:values:PretrainedLoadError": "checkpoint content: model.pretrained's tensors (DSF640)",
    "materialize.py:owned_ranges:MaterializeError": "programming error: a slice rule the build lacks",
    "materialize.py:_moe_targets:MaterializeError": "programming error: an expert "
    "block the build did not plan",
    "materialize.py:materialize:MaterializeError": "programming error: a module "
    "without the planned parameter",
    "materialize.py:_filled:MaterializeError": "programming error: a slice of another shape than planned",
    "materialize.py:_check_finite:WeightRangeError": "model content: a weight beyond "
    "fp16's range or not finite",
    "materialize.py:check_real:MaterializeError": "programming error: a parameter left on the meta device",
    "pretrained.py:__init__:PretrainedLoadError": "checkpoint content: model.pretrained "
    "unreadable (DSF011-DSF014)",
    "pretrained.py:resolve:PretrainedLoadError": "checkpoint content: an expert missing from the per-expert "
    "tensors (DSF640)",
    "pretrained.py:_read_stacked:PretrainedLoadError": "programming error: a cut of an expert stack the "
    "build never plans",
    "precision.py:match_precision:PrecisionError": "model content: weights of a dtype the job cannot train",
    "materialize.py:submodule:AttributeError": "programming error: a module the build did not plan",
    "export.py:_checkpoint:ExportError": "`dsforge export`, not a training start: "
    "the checkpoint directory's state",
    "export.py:assemble_checkpoint:ExportError": "`dsforge export`, not a training "
    "start: the checkpoint's content",
    "export.py:export_checkpoint:ExportError": "`dsforge export`, not a training start: its job directory",
    "export.py:write_export:TargetError": "`dsforge export`, not a training start: its output directory",
    "export.py:_write_hf:ExportError": "`dsforge export`, not a training start: "
    "the weights against the HF model",
    "export_hf.py:fill_hf_model:HfExportError": "`dsforge export`, not a training start: the weights against "
    "the HF model",
    "weights_io.py:assemble:ValueError": "checkpoint content: the saved slices do not assemble",
    "train_state.py:dense:TrainStateError": "checkpoint content: a layout-free piece missing (DSF642)",
    "train_state.py:cut:TrainStateError": "checkpoint content: a layout-free piece of another shape (DSF642)",
    "train_state.py:load_state:TrainStateError": (
        "checkpoint content: no layout-free state, or an optimizer whose state it cannot set (DSF641, DSF643)"
    ),
    # Faults of the machine (issue 26): no job file can show them.
    "checkpoint_manifest.py:_hasher:CheckpointError": "environment: the digest a checkpoint's manifest names",
    "checkpoint_manifest.py:read_manifest:DamagedCheckpoint": "checkpoint content: its manifest unreadable (DSF615)",  # noqa: E501
    "resume_check.py:intact_tag:with_fix": "checkpoint content: files that differ from the manifest (DSF615)",
    "disk_space.py:guard_save:DiskFullError": "the machine: the disk filled during a save (DSF616)",
    "preflight.py:lock_for_run:RunError": "the machine: a job directory in use (DSF612)",
    "preflight.py:lock_for_compile:TargetError": "the machine: a job directory in use (DSF612)",
    "preflight.py:before_launch:RunError": "the machine: a directory in use, free "
    "space, a build lock (DSF612-617)",
    "preflight.py:space_check:PreflightError": "the machine: too little free "
    "space for the retention (DSF614)",
    "preflight.py:build_lock_check:PreflightError": "the machine: a stale "
    "torch_extensions build lock (DSF617)",
    "run_lock.py:acquire:BusyError": "the machine: a directory in use or not lockable (DSF612)",
    "run_lock.py:_locked_fd:BusyError": "the machine: a directory in use or not lockable (DSF612)",
    "run_lock.py:lock_job_dir:BusyError": "the machine: a job directory's parent that cannot be created",
    "run_lock.py:lock_checkpoint_dir:BusyError": "the machine: a checkpoint directory that cannot be created",
}

#: Runtime refusals whose rule the runtime_support module adds, with the bad-corpus job that shows it.
OWN_RULES = {"DSF140": "dsf140-cp-with-pp.yaml", "DSF141": "dsf141-pipeline-custom-model.yaml",
             "DSF142": "dsf142-virtual-stages-dsforge-runtime.yaml",
             "DSF143": "dsf143-replicated-kv-heads-dsforge-runtime.yaml"}


def _exception_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute):
        return target.attr
    return target.id if isinstance(target, ast.Name) else ast.dump(target)


def refusal_sites() -> dict[str, list[int]]:
    """Every ``raise X`` of dsforge/runtime as "file:function:X" -> its line numbers (a bare re-raise
    skipped)."""
    sites: dict[str, list[int]] = {}

    def visit(node: ast.AST, func: str, rel: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Raise) and child.exc is not None:
                sites.setdefault(f"{rel}:{func}:{_exception_name(child.exc)}", []).append(child.lineno)
            visit(child, name, rel)

    for path in sorted(RUNTIME.rglob("*.py")):
        visit(ast.parse(path.read_text(encoding="utf-8")), "<module>", path.relative_to(RUNTIME).as_posix())
    return sites


def test_every_runtime_refusal_has_a_rule_or_a_reason() -> None:
    sites = refusal_sites()
    unlisted = {k: v for k, v in sites.items() if k not in BY_RULE and k not in NOT_A_LAYOUT}
    assert not unlisted, ("runtime refusals with neither a rule that refuses the job first nor a reason it "
                          f"cannot come from a job file (add a rule, or list "
                          f"them in {Path(__file__).name}): {unlisted}")
    assert not set(BY_RULE) & set(NOT_A_LAYOUT)
    for key, ids in BY_RULE.items():
        for rid in ids:
            assert get_rule(rid) is not None, f"{key}: rule {rid} is not registered"


def test_own_rules_mirror_a_refusal_that_still_exists() -> None:
    # A rule refusing what the runtime no longer refuses would turn away a job that runs.
    sites = refusal_sites()
    for rid in OWN_RULES:
        mirrored = [k for k, ids in BY_RULE.items() if rid in ids and k in sites]
        assert mirrored, f"{rid}: the runtime refusal it mirrors is gone; retire the rule"


@pytest.mark.parametrize("rid", sorted(OWN_RULES))
def test_own_rules_refuse_their_corpus_job(rid: str) -> None:
    found = [d.rule for d in validate_file(BAD / OWN_RULES[rid]).diagnostics]
    assert rid in found, found


def test_other_stacks_and_supported_layouts_pass(tmp_path: Path) -> None:
    base = "version: 1\nmodel: {preset: tiny-llama}\nhardware: {preset: cpu-local, gpus_per_node: 4}\n"
    train = "training: {global_batch: 8, micro_batch: 1, precision: fp32}\n"
    layouts = ["parallel: {pp: 2, zero: 1}\n", "parallel: {cp: 2, zero: 1}\n",
               "parallel: {tp: 2, pp: 2, zero: 1}\n"]
    for i, par in enumerate(layouts):
        path = tmp_path / f"ok{i}.yaml"
        path.write_text(base + par + train)
        assert not set(OWN_RULES) & {d.rule for d in validate_file(path).diagnostics}, par
    if "stack" not in JobSpec.model_fields:
        return
    for rid, name in OWN_RULES.items():  # another stack runs the job with its own engine and limits
        path = tmp_path / name
        path.write_text("stack: megatron-te\n" + (BAD / name).read_text(encoding="utf-8"))
        assert rid not in {d.rule for d in validate_file(path).diagnostics}, rid


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the runtime needs torch")


def _fixture_plan(name: str) -> object:
    job, diags = load_job(BAD / name)
    assert job is not None, diags
    return build_plan(job.spec)


@pytest.mark.slow  # imports torch and DeepSpeed (~7 s CPU)
@needs_torch
def test_the_runtime_refuses_what_the_rules_refuse() -> None:
    from dsforge.compiler.rules.runtime_support import PIPELINE_FAMILIES
    from dsforge.runtime.engine import EngineError, build_pipeline_module
    from dsforge.runtime.pipeline_stages import STRUCTURES, boundaries, layer_list
    from dsforge.runtime.rewrite.planner import RewriteError

    # DSF140: the pipeline engine's builder stops before it builds anything
    with pytest.raises(EngineError, match="cp > 1 with pp > 1"):
        build_pipeline_module(_fixture_plan(OWN_RULES["DSF140"]), None, {})  # type: ignore[arg-type]
    # DSF141: the families the stages know are the rule's
    assert set(STRUCTURES) == set(PIPELINE_FAMILIES)
    with pytest.raises(RewriteError, match="pipeline stages know the HF families"):
        layer_list(None, SimpleNamespace(arch="custom"))  # type: ignore[arg-type]
    # DSF142: one chunk per stage
    plan = _fixture_plan(OWN_RULES["DSF142"])
    with pytest.raises(RewriteError, match="virtual_stages=2"):
        boundaries(plan, 4, 1, 1)  # type: ignore[arg-type]


@pytest.mark.slow  # compiles with the rewrite plan: imports torch and transformers (~8 s CPU)
@needs_torch
def test_attention_context_parallelism_would_change_is_refused_at_compile_and_at_start_up(
    tmp_path: Path,
) -> None:
    """A sliding window shorter than the sequence (Mistral, Gemma3's local layers) under cp 2: compile refuses
    the job (DSF144, from the factory's model on the meta device) and the rank-start check refuses the model;
    a window covering the whole sequence, or a family without one, compiles."""
    import yaml

    from dsforge.commands.compile import compile_file
    from dsforge.runtime.hf_attention import ContextParallelError, check_plain_causal
    from dsforge.runtime.models import build_model
    from tests.runtime_rewrite.families import FAMILY_JOBS

    def compiled(model: dict[str, object], name: str) -> tuple[list[str], list[str]]:
        doc = {"version": 1, "model": model, "hardware": {"preset": "cpu-local", "gpus_per_node": 2},
               "parallel": {"cp": 2, "zero": 1},
               "training": {"global_batch": 2, "micro_batch": 1, "precision": "fp32"}}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc), encoding="utf-8")
        result = compile_file(path, tmp_path / name)
        return [d.rule for d in result.diagnostics], [
            d.message for d in result.diagnostics if d.rule == "DSF144"
        ]

    for family in ("mistral", "gemma3"):  # window 8, seq_len 16
        rules, messages = compiled(FAMILY_JOBS[family], family)
        assert "DSF144" in rules, (family, rules)
        assert ("a sliding window of 8 tokens (the sequence has 16) in "
                "model.layers.{0..1}.self_attn") in messages[0]
        job, _ = load_job(tmp_path / f"{family}.yaml")
        assert job is not None
        with pytest.raises(ContextParallelError, match="sliding window of 8 tokens"):
            check_plain_causal(build_model(job.spec.model, "meta"), job.spec.model.seq_len)
    rules, _ = compiled({**FAMILY_JOBS["mistral"], "seq_len": 8}, "mistral-in-window")
    assert "DSF144" not in rules and not [r for r in rules if r.startswith("DSF6")], rules
    # Gemma2 is refused for what its config does (soft-capping, its window of 8), not for being Gemma2
    rules, messages = compiled(FAMILY_JOBS["gemma2"], "gemma2")
    assert "DSF144" in rules and ("soft-capped attention scores "
                                  "(attn_logit_softcapping=5.0)") in messages[0], messages
    plain = {**FAMILY_JOBS["gemma2"], "factory": "tests.runtime_rewrite.families:gemma2_plain_attention"}
    rules, _ = compiled(plain, "gemma2-plain")
    assert "DSF144" not in rules and not [r for r in rules if r.startswith("DSF6")], rules
    rules, _ = compiled(FAMILY_JOBS["qwen3"], "qwen3")
    assert "DSF144" not in rules, rules
