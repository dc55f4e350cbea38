"""DSF5xx: what DeepSpeed would reject only after every process has started, checked up front."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dsforge.compiler.deepspeed.ds_fields import Field, Invalid, coerce
from dsforge.compiler.deepspeed.ds_keys import (
    BF16_KEYS,
    COMM_DTYPES,
    FP16_KEYS,
    LEGACY_TOP_LEVEL_KEYS,
    PIPELINE_KEYS,
    REMOVED_TOP_LEVEL_KEYS,
    REMOVED_ZERO_KEYS,
    TENSOR_PARALLEL_KEYS,
    TOP_LEVEL_KEYS,
    TP_CONFIG_KEYS,
    ZERO_KEYS,
)
from dsforge.compiler.deepspeed.ds_schema import MODELS
from dsforge.compiler.deepspeed.ds_sections import LOOSE_KEYS, STRICT_SECTIONS
from dsforge.compiler.frontend.schema_errors import suggest
from dsforge.compiler.rules.registry import DEEPSPEED_ENGINE, Context, Finding, rule
from dsforge.diagnostics import Severity

DS = "deepspeed 0.19.8 "


@rule("DSF501", "ZeRO-2/3 is refused with pipeline parallelism",
      source=DS + "runtime/pipe/engine.py PipelineEngine.__init__", reads=("pp", "zero"),
      stacks=DEEPSPEED_ENGINE)
def zero_with_pipeline(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed's PipelineEngine asserts "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"
    on every rank at initialize (observed on CPU: PP2 x DP2 with ZeRO-2 fails; ZeRO-1 trains)."""
    d, zero = ctx.plan.degrees, ctx.plan.zero
    if d is not None and d.pp > 1 and zero >= 2:
        yield Finding(f"zero={zero} with pp={d.pp}: DeepSpeed's pipeline engine accepts only ZeRO 0 or 1",
                      "use zero: 1 with pipeline parallelism, or pp: 1 to use ZeRO-2/3", ("parallel", "zero"))


@rule("DSF502", "DeepSpeed's MoE layer is refused with ZeRO-3",
      source=DS + "runtime/engine.py _validate_zero3_moe_compatibility", reads=("zero",),
      stacks=DEEPSPEED_ENGINE)
def moe_with_zero3(ctx: Context) -> Iterator[Finding]:
    """The native MoE layer asserts "Native DeepSpeed MoE is not supported with ZeRO Stage 3" at
    initialize (observed on CPU with ep_size=2)."""
    if ctx.spec.model.moe is not None and ctx.plan.zero == 3:
        yield Finding("zero=3 with a mixture-of-experts model: DeepSpeed's MoE layer refuses ZeRO-3",
                      "use zero: 1 or 2 for MoE models", ("parallel", "zero"))


@rule("DSF503", "the accelerator supports the chosen precision",
      source=DS + "runtime/engine.py DeepSpeedEngine._do_sanity_check; accelerator is_bf16/fp16_supported",
      reads=())
def precision_supported(ctx: Context) -> Iterator[Finding]:
    """bf16 needs Ampere or newer (a V100 has none); DeepSpeed checks the accelerator only at start-up.
    An fp32 job needs the accelerator's fp32 peak (`fp32_tflops`): without it no step time can be
    estimated, and 0 says the accelerator has none."""
    prec, acc = ctx.spec.training.precision, ctx.spec.hardware.accelerator
    peak = {"bf16": acc.bf16_tflops,
            "fp16": acc.fp16_tflops if acc.fp16_tflops is not None else acc.bf16_tflops}
    if prec in peak and not peak[prec]:
        other = "fp16" if prec == "bf16" and peak["fp16"] else "bf16" if peak["bf16"] else "fp32"
        yield Finding(f"precision={prec} but {acc.name} has no {prec} support",
                      f"use precision: {other}", ("training", "precision"))
    if prec == "fp32" and not acc.fp32_tflops:
        given = "is 0" if acc.fp32_tflops == 0 else "is not given"
        other = " (or precision: bf16)" if acc.bf16_tflops else ""
        yield Finding(f"precision=fp32 but the fp32 peak of {acc.name} "
                      f"{given}: no step time can be estimated",
                      f"set hardware.accelerator.fp32_tflops to its data sheet's dense FP32 figure{other}",
                      ("training", "precision"))


@rule("DSF504", "optimizer offload needs ZeRO (NVMe needs ZeRO-3)",
      source=DS + "runtime/zero/config.py offload_optimizer; ZeRO-Infinity (Rajbhandari et al. 2021)",
      reads=("zero",))
def offload_needs_zero(ctx: Context) -> Iterator[Finding]:
    """Optimizer offload is part of the ZeRO optimizers: with stage 0 the section is ignored and the
    states stay on the device; offload to NVMe is implemented only by ZeRO-3 (ZeRO-Infinity)."""
    off, zero = ctx.spec.training.optimizer.offload, ctx.plan.zero
    path = ("training", "optimizer", "offload")
    if off != "none" and zero == 0:
        yield Finding(f"optimizer offload to {off} needs ZeRO, but zero=0",
                      "set zero: 1, 2 or 3, or offload: none", path)
    elif off == "nvme" and zero != 3:
        yield Finding(f"optimizer offload to nvme needs zero=3, not {zero}", "use zero: 3, or offload: cpu",
                      path)


@rule("DSF505", "ZeRO supports the optimizer", source=DS + "runtime/zero/utils.py ZERO_SUPPORTED_OPTIMIZERS; "
      "runtime/engine.py _configure_zero_optimizer", reads=("zero",))
def zero_optimizer(ctx: Context) -> Iterator[Finding]:
    """ZeRO accepts Adam, AdamW, Adagrad and Lion; others (LAMB, SGD) need `zero_allow_untested_optimizer`
    or the engine asserts at initialize."""
    name = ctx.spec.training.optimizer.name
    if ctx.plan.zero >= 1 and name in {"lamb",
                                       "sgd"} and not ctx.spec.deepspeed.get("zero_allow_untested_optimizer"):
        yield Finding(f"optimizer {name} is not one ZeRO supports (Adam, AdamW, Adagrad, Lion)",
                      "use adamw, or set deepspeed.zero_allow_untested_optimizer: true",
                      ("training", "optimizer", "name"))


@rule("DSF506", "DeepSpeed's pipeline engines run 1F1B (PipelineEngine) "
                "and DualPipeV, not GPipe or interleaved",
      severity=Severity.WARNING,
      source=DS + "runtime/pipe/schedule.py TrainSchedule, DualPipeVSchedule; runtime/pipe/dualpipev.py",
      reads=())
def pipeline_schedule(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed 0.19.8's PipelineEngine executes its TrainSchedule, a 1F1B schedule with one chunk per
    rank; it also ships DualPipeV (DualPipeVModule + DualPipeVEngine: two stages per rank, micro-batches
    >= 2 x stages), a different module and engine that dsforge's pipeline stages do not build. No
    DeepSpeed engine runs GPipe or Megatron's interleaved 1F1B: those are estimated by `dsforge explain`
    but run as 1F1B. dsforge's own runtime (`stack: dsforge`) runs GPipe on the PipelineEngine with a
    schedule of its own (dsforge/runtime/gpipe.py), so GPipe is not warned about there."""
    d, sched = ctx.plan.degrees, ctx.spec.parallel.pipeline.schedule
    runs_gpipe = sched == "gpipe" and getattr(ctx.spec, "stack", "dsforge") == "dsforge"
    if d is not None and d.pp > 1 and sched not in ("1f1b", "auto") and not runs_gpipe:
        yield Finding(f"schedule={sched}: DeepSpeed runs its pipelines with 1F1B (or DualPipeV, which "
                      f"dsforge does not build), so the job will run 1F1B",
                      "set schedule: 1f1b (explain shows what the other schedule would gain)",
                      ("parallel", "pipeline", "schedule"))


def _section(ctx: Context, key: str) -> dict[str, Any]:
    value = ctx.spec.deepspeed.get(key)
    return value if isinstance(value, dict) else {}


#: ds_config sections whose keys DeepSpeed checks: (path, known keys, True if DeepSpeed rejects unknown keys).
_CHECKED_SECTIONS = (
    (("zero_optimization",), ZERO_KEYS, True),
    (("zero_optimization", "offload_optimizer"), frozenset(MODELS["offload_optimizer"]), True),
    (("zero_optimization", "offload_param"), frozenset(MODELS["offload_param"]), True),
    (("bf16",), BF16_KEYS, True),
    (("fp16",), FP16_KEYS, True),
    (("tensor_parallel",), TENSOR_PARALLEL_KEYS, True),
    (("tensor_parallel", "tp"), TP_CONFIG_KEYS, True),
    (("pipeline",), PIPELINE_KEYS, False),
    # the sections ds_sections describes: pydantic ones reject unknown keys, dict-read ones ignore them
    *((path, frozenset(MODELS[model]), True) for path, model in STRICT_SECTIONS),
    *((path, keys, False) for path, keys in LOOSE_KEYS.items()),
)


def _subsection(ds: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    node: Any = ds
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


@rule("DSF507", "deepspeed overrides use keys DeepSpeed knows",
      source=DS + "runtime/config.py _reject_removed_config_keys, get_pipeline_config; "
      "runtime/zero/config.py, runtime/precision_config.py, "
      "runtime/tensor_parallel/config.py (pydantic, extra=forbid)")
def override_keys(ctx: Context) -> Iterator[Finding]:
    """Removed keys and unknown keys of the zero_optimization (and its offload and leaf_module blocks), bf16,
    fp16, tensor_parallel, comms_logger, timers.throughput and monitor (tensorboard, wandb, csv_monitor,
    comet) sections fail DeepSpeed's parse, and so does a field given under its own name beside its alias
    (`max_live_parameters` with `stage3_max_live_parameters`): pydantic reads the alias and the name is an
    extra key; unknown top-level keys, and those of pipeline, checkpoint, torch_autocast, flops_profiler and
    aio (read with dict lookups), are silently ignored by DeepSpeed, so a typo there would quietly not apply
    (a warning)."""
    ds = ctx.spec.deepspeed
    for key in ds:
        path: tuple[str, ...] = ("deepspeed", key)
        if key in REMOVED_TOP_LEVEL_KEYS:
            yield Finding(f"deepspeed.{key} was removed from DeepSpeed and is rejected at parse", "remove it",
                          path, at_key=True)
        elif key not in TOP_LEVEL_KEYS | LEGACY_TOP_LEVEL_KEYS:
            yield Finding(f"deepspeed.{key} is not a DeepSpeed key and would be ignored"
                          f"{suggest(key, sorted(TOP_LEVEL_KEYS))}", "fix the spelling or remove it", path,
                          Severity.WARNING, at_key=True)
    for section, known, rejected in _CHECKED_SECTIONS:
        where = ".".join(section)
        for key in _subsection(ds, section):
            path = ("deepspeed", *section, key)
            if section == ("zero_optimization",) and key in REMOVED_ZERO_KEYS:
                yield Finding(f"zero_optimization.{key} was removed from DeepSpeed", "remove it", path,
                              at_key=True)
            elif key not in known:
                effect = "DeepSpeed rejects it at parse" if rejected else "DeepSpeed would ignore it silently"
                yield Finding(f"{where}.{key} is not a {where} key: {effect}{suggest(key, sorted(known))}",
                              "fix the spelling or remove it", path, None if rejected else Severity.WARNING,
                              at_key=True)
            elif (alias := _alias(section, key)) and alias in _subsection(ds, section):
                # pydantic fills the field from its alias; the field's own name beside it is then an extra key
                yield Finding(f"{where}.{key} and {where}.{alias} are two spellings of one setting, and "
                              f"DeepSpeed rejects {key} at parse when {alias} is given",
                              "keep only one of them", path, at_key=True)


#: The pydantic model of each checked section whose fields may have an alias.
_MODEL_OF = {("zero_optimization",): "zero", ("zero_optimization", "offload_optimizer"): "offload_optimizer",
             ("zero_optimization", "offload_param"): "offload_param", ("bf16",): "bf16", ("fp16",): "fp16"}


def _alias(section: tuple[str, ...], key: str) -> str:
    """The alias DeepSpeed's model gives the field ``key`` of ``section`` ("" when it has none)."""
    field = MODELS.get(_MODEL_OF.get(section, ""), {}).get(key)
    return field.alias if field is not None else ""


_PLANNED = {
    "train_micro_batch_size_per_gpu": ("training", "micro_batch"),
    "gradient_accumulation_steps": ("training", "global_batch"),
    "train_batch_size": ("training", "global_batch"),
}


@rule("DSF508", "deepspeed overrides agree with the plan", source="dsforge (overrides are merged last)")
def override_agrees(ctx: Context) -> Iterator[Finding]:
    """The `deepspeed:` section is merged into the emitted ds_config last; an override of a value the plan
    decides (batch sizes, ZeRO stage, precision) would make the job run a different layout than the one
    validated and explained, so it must agree or be set in the plan's own keys."""
    ds, t, plan = ctx.spec.deepspeed, ctx.spec.training, ctx.plan
    planned: dict[str, Any] = {"train_micro_batch_size_per_gpu": t.micro_batch,
                               "gradient_accumulation_steps": plan.grad_accum,
                               "train_batch_size": t.global_batch}
    for key, want in planned.items():
        # exactly the plan's integer: 8.0 or true compare equal to 8 or 1 in Python, yet describe another job
        if key in ds and want is not None and not (type(ds[key]) is int and ds[key] == want):
            yield Finding(f"deepspeed.{key}={ds[key]!r} contradicts the plan's {want}",
                          f"remove it and set {'.'.join(_PLANNED[key])} instead", ("deepspeed", key))
    block = ds.get("zero_optimization")
    if isinstance(block, bool):
        yield Finding(f"deepspeed.zero_optimization={block!r} is DeepSpeed's deprecated form of ZeRO stage "
                      f"{int(block)}, replacing the stage-{plan.zero} block of parallel.zero",
                      "remove it and set parallel.zero", ("deepspeed", "zero_optimization"))
    stage = _section(ctx, "zero_optimization").get("stage")
    if stage is not None and _as(MODELS["zero"]["stage"], stage) != plan.zero:
        yield Finding(f"deepspeed.zero_optimization.stage={stage!r} contradicts parallel.zero={plan.zero}",
                      "remove it and set parallel.zero", ("deepspeed", "zero_optimization", "stage"))
    if "bf16" in ds and "bfloat16" in ds:
        yield Finding("deepspeed gives both bf16 and its legacy spelling bfloat16 (DeepSpeed reads only one)",
                      "remove bfloat16", ("deepspeed", "bfloat16"), at_key=True)
    for section, prec in (("bf16", "bf16"), ("bfloat16", "bf16"), ("fp16", "fp16")):
        if section in ds and not isinstance(ds[section], dict) and t.precision == prec:
            yield Finding(f"deepspeed.{section}={ds[section]!r} replaces the {prec} block of "
                          f"training.precision={t.precision}", "remove it and set training.precision",
                          ("deepspeed", section))
        enabled = _section(ctx, section).get("enabled")
        # DeepSpeed reads "false" as false (pydantic): compare what it will run, not Python truthiness
        if enabled is not None and _as(MODELS[prec]["enabled"], enabled) != (t.precision == prec):
            yield Finding(f"deepspeed.{section}.enabled={enabled!r} contradicts "
                          f"training.precision={t.precision}",
                          "remove it and set training.precision", ("deepspeed", section, "enabled"))
    yield from _degree_overrides(ctx)


def _as(field: Field, value: Any) -> Any:
    """The value DeepSpeed reads (pydantic's conversion), or ``value`` itself when it refuses it (DSF517)."""
    try:
        return coerce(field, value)
    except Invalid:
        return None


def _degree_overrides(ctx: Context) -> Iterator[Finding]:
    """Degree keys of the ds_config that must equal the plan's degrees (0 or 1 means "off" for
    AutoTP/AutoEP)."""
    d, ds = ctx.plan.degrees, ctx.spec.deepspeed
    if d is None:
        return
    keyed = {("tensor_parallel", "autotp_size"): ("tp", d.tp),
             ("expert_parallel", "autoep_size"): ("ep", d.ep), ("sequence_parallel_size",): ("cp", d.cp),
             ("data_parallel_size",): ("dp", d.dp)}
    for path, (name, want) in keyed.items():
        value = _subsection(ds, path[:-1]).get(path[-1])
        off = len(path) == 2 and value in (0, 1) and want == 1
        if value is not None and value != want and not off:
            yield Finding(f"deepspeed.{'.'.join(path)}={value!r} contradicts parallel.{name}={want}",
                          f"remove it and set parallel.{name}", ("deepspeed", *path))


@rule("DSF509", "deepspeed override values DeepSpeed accepts",
      source=DS + "runtime/config.py _do_error_check, get_communication_data_type")
def override_values(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed rejects fp16 together with bf16, communication dtypes other than fp16/bf16/fp32 (in any case:
    it lower-cases them), a gradient all-reduce op other than mean/sum (lower-cased too), and a `sum`
    gradient all-reduce under ZeRO-3 (which averages inside its reduce-scatter)."""
    ds = ctx.spec.deepspeed
    if _as(MODELS["bf16"]["enabled"], _section(ctx, "bf16").get("enabled", False)) is True and \
            _as(MODELS["fp16"]["enabled"], _section(ctx, "fp16").get("enabled", False)) is True:
        yield Finding("deepspeed enables both bf16 and fp16", "enable one (training.precision)",
                      ("deepspeed", "fp16"))
    for key in ("communication_data_type", "seq_parallel_communication_data_type"):
        if key in ds and ds[key] is not None and (not isinstance(ds[key],
                                                                 str) or ds[key].lower() not in COMM_DTYPES):
            yield Finding(f"deepspeed.{key}={ds[key]!r} is not one of "
                          f"fp16, bf16, fp32 (DeepSpeed lower-cases it)",
                          "use fp16, bf16 or fp32", ("deepspeed", key))
    op = ds.get("gradient_allreduce_op", "mean")
    if (op.lower() if isinstance(op, str) else op) not in ("mean", "sum"):
        yield Finding(f"deepspeed.gradient_allreduce_op={op!r} is not mean or sum (DeepSpeed lower-cases it)",
                      "use mean (the default) or sum", ("deepspeed", "gradient_allreduce_op"))
    elif isinstance(op, str) and op.lower() == "sum" and ctx.plan.zero == 3:
        yield Finding("gradient_allreduce_op=sum is refused with ZeRO-3", "remove it, or use zero <= 2",
                      ("deepspeed", "gradient_allreduce_op"))
