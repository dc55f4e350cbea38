"""DSF510-DSF526: `deepspeed:` overrides checked against DeepSpeed 0.19.8: its config parse (DSF517-DSF519,
from `dsforge.compiler.deepspeed.ds_schema`), and what it accepts at parse but refuses once every rank runs.

Each check reads the raw override values, which may hold anything a person typed, so every value is
type-checked before any arithmetic (a string where a number belongs is DeepSpeed's parse error, not
an internal error here).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from dsforge.compiler.deepspeed.ds_fields import Invalid, Problem, coerce
from dsforge.compiler.deepspeed.ds_schema import MODELS, merge_overrides, parse
from dsforge.compiler.deepspeed.ds_settings import (
    DS_OPTIMIZER,
    emitted_zero_block,
    on_cpu,
    precision_section,
    scheduler_type,
    zero_section,
)
from dsforge.compiler.rules.registry import Context, Finding, rule
from dsforge.compiler.rules.util import choices, divisors
from dsforge.diagnostics import Severity

DS = "deepspeed 0.19.8 "


def _get(ctx: Context, *path: str) -> Any:
    """The override value at ``path`` under `deepspeed:`, or None."""
    node: Any = ctx.spec.deepspeed
    for part in path:
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _read(field: Any, value: Any) -> Any:
    """The value DeepSpeed reads for ``field`` (pydantic's conversion); None where it refuses it (DSF517)."""
    try:
        return coerce(field, value)
    except Invalid:
        return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@rule("DSF510", "reduced-precision master weights need ZeRO 1-3",
      source=DS + "runtime/config.py DeepSpeedConfig._do_error_check")
def master_weights_need_zero(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed keeps fp16/bf16 master weights and bf16 optimizer states only inside its ZeRO optimizers:
    `fp16_master_weights_and_grads`, `bf16_master_weights_and_grads` and `bf16_optimizer_states` assert
    ZeRO stage 1-3, and `bf16_optimizer_states` also needs `bf16_master_weights_and_grads`."""
    flags = [("fp16", "fp16_master_weights_and_grads"), ("bf16", "bf16_master_weights_and_grads"),
             ("bf16", "bf16_optimizer_states")]
    for section, key in flags:
        if _enabled(ctx, section, key) and ctx.plan.zero == 0:
            yield Finding(f"deepspeed.{section}.{key} needs ZeRO stage 1-3, but parallel.zero=0",
                          f"set parallel.zero: 1 (or 2, 3), or remove {key}", ("deepspeed", section, key))
    if _enabled(ctx, "bf16",
                "bf16_optimizer_states") and not _enabled(ctx, "bf16", "bf16_master_weights_and_grads"):
        yield Finding("deepspeed.bf16.bf16_optimizer_states needs bf16_master_weights_and_grads: true",
                      "add bf16_master_weights_and_grads: true, or remove bf16_optimizer_states",
                      ("deepspeed", "bf16", "bf16_optimizer_states"))


@rule("DSF511", "LAMB needs dynamic loss scaling",
      source=DS + "runtime/engine.py DeepSpeedEngine._do_sanity_check")
def lamb_dynamic_loss_scale(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed's LAMB asserts dynamic loss scaling at initialize; a fixed `fp16.loss_scale` (any value
    other than 0) turns dynamic scaling off."""
    scale = _get(ctx, "fp16", "loss_scale")
    if ctx.spec.training.optimizer.name == "lamb" and isinstance(scale, (int, float)) and scale != 0:
        yield Finding(f"optimizer lamb with deepspeed.fp16.loss_scale={scale}: DeepSpeed's LAMB needs "
                      f"dynamic loss scaling", "set fp16.loss_scale: 0 (dynamic), or use adamw",
                      ("deepspeed", "fp16", "loss_scale"))


@rule("DSF512", "managed_gradient_accumulation: false fits the layout",
      source=DS + "runtime/engine.py DeepSpeedEngine._do_sanity_check")
def unmanaged_accumulation(ctx: Context) -> Iterator[Finding]:
    """With `managed_gradient_accumulation: false` DeepSpeed refuses pipeline parallelism and supports
    ZeRO's overlap_comm only when gradients are partitioned (ZeRO-2 or 3); both are asserted at
    initialize, after every rank has started. overlap_comm is the merged value: dsforge itself writes
    `overlap_comm: true` for ZeRO jobs on GPUs."""
    if _get(ctx, "managed_gradient_accumulation") is not False:
        return
    d, path = ctx.plan.degrees, ("deepspeed", "managed_gradient_accumulation")
    if d is not None and d.pp > 1:
        yield Finding(f"managed_gradient_accumulation=false is refused with pipeline parallelism (pp={d.pp})",
                      "remove managed_gradient_accumulation, or use pp: 1", path)
    if _read(MODELS["zero"]["overlap_comm"], emitted_zero_block(ctx.plan).get("overlap_comm")) is True and \
            ctx.plan.zero < 2:
        yield Finding(f"managed_gradient_accumulation=false supports overlap_comm only with ZeRO-2/3, not "
                      f"zero={ctx.plan.zero}", "set overlap_comm: false, or parallel.zero: 2",
                      ("deepspeed", "zero_optimization", "overlap_comm"))


@rule("DSF513", "AutoTP's inner tp_size agrees with autotp_size",
      source=DS + "runtime/engine.py _apply_autotp_partitioning")
def autotp_sizes(ctx: Context) -> Iterator[Finding]:
    """`tensor_parallel.tp.tp_size` must be 1 or equal `autotp_size`, else DeepSpeed raises a ValueError at
    initialize. (That `autotp_size` equals parallel.tp is DSF508's check; a world size it does not divide,
    which DeepSpeed never checks and which fails inside torch's DeviceMesh with an IndexError, is then
    DSF101's.)"""
    autotp = _int(_get(ctx, "tensor_parallel", "autotp_size"))
    if autotp is None or autotp <= 1:
        return
    for key in ("tp", "tensor_parallel"):  # `tp` is the alias DeepSpeed documents
        tp_size = _int(_get(ctx, "tensor_parallel", key, "tp_size"))
        if tp_size is not None and tp_size not in (1, autotp):
            yield Finding(f"tensor_parallel.{key}.tp_size={tp_size} does not match autotp_size={autotp}",
                          f"remove {key}.tp_size, or set it to {autotp}",
                          ("deepspeed", "tensor_parallel", key, "tp_size"))


@rule("DSF514", "AutoEP divides the experts", source=DS + "module_inject/auto_ep_config.py "
      "validate_autoep_post_detection")
def autoep_experts(ctx: Context) -> Iterator[Finding]:
    """AutoEP gives each rank experts/autoep_size whole experts; DeepSpeed checks `autoep_size <= num_experts`
    and `num_experts % autoep_size == 0` only after it has found the MoE layers in the live model.
    Enabling it on a dense model finds no MoE layer to replace."""
    if _get(ctx, "expert_parallel", "enabled") is not True:
        return
    moe, size = ctx.spec.model.moe, _int(_get(ctx, "expert_parallel", "autoep_size"))
    path = ("deepspeed", "expert_parallel", "autoep_size")
    if moe is None:
        yield Finding("deepspeed.expert_parallel is enabled but the model has no `moe:` section",
                      "remove expert_parallel, or describe the MoE layers", ("deepspeed", "expert_parallel",
                                                                            "enabled"))
    elif size is not None and size > 0 and moe.experts % size:
        yield Finding(f"autoep_size={size} does not divide moe.experts={moe.experts}: each rank must own "
                      f"whole experts", f"use autoep_size in {choices(divisors(moe.experts))}", path)


@rule("DSF515", "compile passes compose with the ZeRO stage", severity=Severity.WARNING,
      source=DS + "runtime/engine.py get_autosp_backend, _compile (AutoTP pass)")
def compile_passes(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed's AutoSP compile pass does not compose with ZeRO-2/3 and silently falls back to plain
    torch.compile (one log line); the AutoTP pass raises NotImplementedError when combined with AutoSP or
    the ZeRO passes."""
    passes = _get(ctx, "compile", "passes")
    if not isinstance(passes, list):
        return
    path = ("deepspeed", "compile", "passes")
    if "autosp" in passes and ctx.plan.zero >= 2:
        yield Finding(f"compile pass autosp with zero={ctx.plan.zero}: DeepSpeed silently falls back to "
                      f"plain torch.compile", "use zero: 0 or 1 with autosp, or drop the pass", path)
    if "autotp" in passes and ({"autosp", "z1", "z3"} & set(passes)):
        yield Finding("compile pass autotp cannot be combined with autosp or the ZeRO passes "
                      "(NotImplementedError at the first compile)", "run autotp on its own", path,
                      Severity.ERROR)


def _non_finite(node: Any, path: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], float]]:
    if isinstance(node, float) and not math.isfinite(node):
        yield path, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _non_finite(value, (*path, str(key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _non_finite(value, (*path, i))


@rule("DSF516", "overrides are finite numbers", source="RFC 8259 sec. 6 (JSON numbers); " + DS +
      "runtime/config.py (ds_config.json is read with json.load)")
def finite_overrides(ctx: Context) -> Iterator[Finding]:
    """YAML reads `.nan`, `.inf` and numbers past 1.8e308 as NaN or infinity, which no JSON document can hold:
    ds_config.json would need the non-standard `NaN`/`Infinity` that strict parsers (and other tools reading
    the job directory) reject, and no DeepSpeed setting means anything with them."""
    for path, value in _non_finite(ctx.spec.deepspeed, ("deepspeed",)):
        where = ".".join(str(p) for p in path)
        yield Finding(f"`{where}` is {value}: ds_config.json holds only finite numbers",
                      f"give `{where}` a finite number, or remove it", path)


# --- the overrides against DeepSpeed's own config parse (ds_schema)
# ------------------------------------------

def seen_by_deepspeed(ctx: Context) -> dict[str, Any]:
    """The parts of the emitted ds_config that DeepSpeed's parse looks at, with the job's overrides merged as
    compile merges them (the emitter writes the same blocks from the same ds_settings functions)."""
    plan, t = ctx.plan, ctx.spec.training
    base: dict[str, Any] = {"train_batch_size": t.global_batch,
                            "train_micro_batch_size_per_gpu": t.micro_batch,
                            "gradient_accumulation_steps": plan.grad_accum,
                            "zero_optimization": zero_section(plan), **precision_section(plan),
                            "gradient_clipping": t.grad_clip,
                            "optimizer": {"type": DS_OPTIMIZER[t.optimizer.name], "params": {}},
                            "wall_clock_breakdown": False}
    sched = scheduler_type(t.scheduler.name, t.scheduler.warmup_steps)
    if sched is not None:
        base["scheduler"] = {"type": sched, "params": {}}
    return merge_overrides(base, ctx.spec.deepspeed)


def _problems(ctx: Context) -> list[Problem]:
    d = ctx.plan.degrees
    if d is None or ctx.plan.grad_accum is None:
        return []  # the layout or batch rules report why there is no plan to emit
    return parse(seen_by_deepspeed(ctx), d.dp)


#: Problems other rules report: unknown keys (DSF507), the communication dtypes and allreduce op, fp16 with
#: bf16 (DSF509), reduced-precision master weights (DSF510) and the batch keys (DSF508 refuses any batch
#: override that is not the plan's own number).
_ELSEWHERE = {("communication_data_type",), ("seq_parallel_communication_data_type",),
              ("gradient_allreduce_op",), ("train_batch_size",), ("train_micro_batch_size_per_gpu",),
              ("gradient_accumulation_steps",)}


def _reported_here(p: Problem) -> bool:
    return p.kind != "extra" and p.path not in _ELSEWHERE and (p.kind,
                                                               p.path) != ("cross", ("fp16",)) and not (
        p.kind == "cross" and str(p.path[-1]) in ("fp16_master_weights_and_grads",
                                                  "bf16_master_weights_and_grads", "bf16_optimizer_states"))


@rule("DSF517", "override values have the types and ranges DeepSpeed's config takes",
      source=DS + "runtime/zero/config.py, runtime/zero/offload_config.py, runtime/precision_config.py "
      "(pydantic models, lax mode), runtime/config.py DeepSpeedConfig._initialize_params")
def override_value_types(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed validates zero_optimization, its offload blocks, fp16, bf16 and hybrid_engine with pydantic
    models: a bucket size must be a whole number above 0 (YAML reads `5e8` as text, which an int field
    refuses; `5.0e+8` is a number), `stage: null` or an offload `device: gpu` fails the parse. Values such as
    "yes" for a bool or "5" for an int are converted as pydantic converts them, exactly as DeepSpeed will.
    Top-level values DeepSpeed computes with (`wall_clock_breakdown | flops_profiler.enabled`) must have a
    type that computation takes. An HF-style "auto" at the top of a pydantic section is dropped by DeepSpeed
    (its default applies) and is accepted here too. The other sections are checked the same way
    (dsforge/compiler/deepspeed/ds_sections.py): the monitors, comms_logger, timers and ZeRO's leaf_module
    (pydantic), and the values of checkpoint (`tag_validation` one of warn, ignore, fail), torch_autocast
    (`dtype` one of DeepSpeed's dtype names) and aio that DeepSpeed's parse refuses."""
    for p in _problems(ctx):
        value = _get(ctx, *(str(k) for k in p.path))
        if isinstance(value, float) and not math.isfinite(value):
            continue  # DSF516's: no JSON document holds it
        if p.kind == "value" and _reported_here(p):
            yield Finding(p.message, p.fix, ("deepspeed", *p.path))


@rule("DSF518", "override sections DeepSpeed reads as mappings are mappings",
      source=DS + "runtime/config.py DeepSpeedConfig._initialize_params "
                  "(param_dict[...].keys(), Model(**dict))")
def override_sections(ctx: Context) -> Iterator[Finding]:
    """`optimizer: null`, `fp16: null`, `pipeline: 1f1b` or `zero_optimization: 1` make DeepSpeed's parse
    call `.keys()`, `.items()` or `**` on something that is not a mapping; it fails with an AttributeError
    or TypeError on every rank. (`bf16: null` is the one DeepSpeed tolerates: it then reads `bfloat16`.)"""
    for p in _problems(ctx):
        if p.kind == "shape" and _reported_here(p):
            yield Finding(p.message, p.fix, ("deepspeed", *p.path))


@rule("DSF519", "override values DeepSpeed refuses together",
      source=DS + "runtime/zero/config.py DeepSpeedZeroConfig validators (compute_grad_norm_valid, "
      "offload_ratio_check, deprecated fields), runtime/precision_config.py "
      "_validate_dynamic_loss_scale_params")
def override_cross_keys(ctx: Context) -> Iterator[Finding]:
    """Conditions DeepSpeed's parse checks across keys: `compute_grad_norm: false` only at ZeRO 1-2, partial
    optimizer offload (`ratio` < 1) only at ZeRO-3, a deprecated spelling (`cpu_offload`,
    `stage3_gather_fp16_weights_on_model_save`) never beside the setting that replaced it, and dynamic fp16
    loss scaling with a positive `loss_scale_window` and `min_loss_scale`."""
    for p in _problems(ctx):
        if p.kind == "cross" and _reported_here(p):
            yield Finding(p.message, p.fix, ("deepspeed", *p.path))


def _type_name(block: Any) -> str | None:
    name = block.get("type") if isinstance(block, dict) else None
    return name.lower() if isinstance(name, str) else None


@rule("DSF520", "optimizer and scheduler overrides keep the job's types",
      source="dsforge (training.optimizer and training.scheduler are authoritative); " + DS +
      "runtime/engine.py _configure_basic_optimizer")
def optimizer_type_override(ctx: Context) -> Iterator[Finding]:
    """The `deepspeed:` overrides are merged into the optimizer and scheduler blocks dsforge writes, so
    another `type` would keep the job's parameters (`optimizer: {type: SGD}` keeps AdamW's `betas` and fails
    at initialize), and the estimate, the explain report and the runtime's optimizer would describe a
    different job. The type is the job's: change training.optimizer / training.scheduler instead. (DeepSpeed
    reads an optimizer type in any case; a scheduler's is a class name: `warmupcosinelr` is not found.)"""
    t = ctx.spec.training
    emitted = {"optimizer": DS_OPTIMIZER[t.optimizer.name],
               "scheduler": scheduler_type(t.scheduler.name, t.scheduler.warmup_steps)}
    for key, want in emitted.items():
        block = ctx.spec.deepspeed.get(key)
        if not isinstance(block, dict) or "type" not in block:
            continue
        # DeepSpeed lower-cases its own optimizer names, but finds a scheduler with getattr(lr_schedules,
        # type)
        given = _type_name(block) if key == "optimizer" else block["type"]
        if given != ((want.lower() if key == "optimizer" else want) if want else None):
            where = "training.optimizer.name" if key == "optimizer" else "training.scheduler"
            yield Finding(f"deepspeed.{key}.type={block['type']!r} replaces the {want or 'absent'} {key} the "
                          f"job describes, while keeping its parameters", f"remove it and set {where}",
                          ("deepspeed", key, "type"))


def _params(ctx: Context, key: str) -> dict[str, Any]:
    block = ctx.spec.deepspeed.get(key)
    params = block.get("params") if isinstance(block, dict) else None
    return params if isinstance(params, dict) else {}


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@rule("DSF521", "optimizer and scheduler parameters the optimizer and scheduler accept",
      source="torch 2.13 torch/optim/adamw.py, adam.py (argument checks); " + DS +
      "runtime/lr_schedules.py WarmupLR, WarmupCosineLR (warmup_num_steps)")
def optimizer_param_values(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed passes `optimizer.params` to the optimizer's constructor and `scheduler.params` to the
    scheduler's at initialize, after every rank started: torch refuses a negative lr, eps or weight decay and
    betas that are not two numbers in [0, 1); DeepSpeed's warm-up schedulers refuse a `warmup_num_steps` that
    is not a whole number above 0."""
    params, path = _params(ctx, "optimizer"), ("deepspeed", "optimizer", "params")
    for key in ("lr", "eps", "weight_decay"):
        if key in params and not (_real(params[key]) and params[key] >= 0):
            yield Finding(f"optimizer.params.{key}={params[key]!r}: the optimizer takes a finite number >= 0",
                          f"remove it and set training.optimizer.{key}", (*path, key))
    if "betas" in params:
        betas = params["betas"]
        if not (isinstance(betas, list) and len(betas) == 2 and all(_real(b) and 0 <= b < 1 for b in betas)):
            yield Finding(f"optimizer.params.betas={betas!r}: the optimizer takes two numbers in [0, 1)",
                          "remove it and set training.optimizer.betas", (*path, "betas"))
    sched = _params(ctx, "scheduler")
    warm = sched.get("warmup_num_steps")
    if "warmup_num_steps" in sched and not (isinstance(warm,
                                                       int) and not isinstance(warm, bool) and warm > 0):
        yield Finding(f"scheduler.params.warmup_num_steps={warm!r}: DeepSpeed's warm-up schedulers take a "
                      f"whole number > 0", "remove it and set training.scheduler.warmup_steps",
                      ("deepspeed", "scheduler", "params", "warmup_num_steps"))


@rule("DSF522", "the optimizer has a kernel on this accelerator",
      source=DS + "runtime/engine.py _configure_basic_optimizer (FusedLamb, FusedLion); ops/op_builder/cpu "
      "(cpu_adam, cpu_lion, cpu_adagrad, fused_adam only)")
def optimizer_kernel(ctx: Context) -> Iterator[Finding]:
    """On the CPU accelerator DeepSpeed builds Lamb as FusedLamb and Lion (without ZeRO-Offload) as FusedLion,
    whose kernels exist only for CUDA/ROCm: the CPU op builders have none, and initialize fails on every
    rank. Lion with optimizer offload runs DeepSpeedCPULion."""
    opt = ctx.spec.training.optimizer
    if not on_cpu(ctx.plan):
        return
    if opt.name == "lamb" or (opt.name == "lion" and opt.offload == "none"):
        alternative = "adamw" if opt.name == "lamb" else "offload: cpu (DeepSpeedCPULion) or adamw"
        yield Finding(f"optimizer {opt.name} has no kernel on the CPU accelerator: DeepSpeed builds "
                      f"Fused{opt.name.capitalize()}, a CUDA op", f"use {alternative}",
                      ("training", "optimizer", "name"))


def _zero_value(ctx: Context, key: str) -> Any:
    """A setting of the merged zero_optimization block as DeepSpeed reads it (its default when absent)."""
    field = MODELS["zero"][key]
    value = emitted_zero_block(ctx.plan).get(key, field.default)
    return value if field.kind == "model" else _read(field, value)


def _offload_device(ctx: Context) -> str:
    """The optimizer offload device of the merged zero_optimization block, as DeepSpeed reads it."""
    zero = emitted_zero_block(ctx.plan)
    off = zero.get("offload_optimizer")
    if isinstance(off, dict):
        device = off.get("device", "none")
        return device if isinstance(device, str) else "none"
    return "cpu" if _read(MODELS["zero"]["cpu_offload"], zero.get("cpu_offload")) is True else "none"


@rule(
    "DSF523",
    "optimizer offload follows training.optimizer.offload",
    source="dsforge (training.optimizer.offload is authoritative); " + DS + "runtime/zero/offload_config.py",
)
def offload_override(ctx: Context) -> Iterator[Finding]:
    """`zero_optimization.offload_optimizer.device` (or the deprecated `cpu_offload`) in the overrides would
    move the optimizer states where the memory estimate, the CPU-optimizer choice and the offload rules do not
    expect them; the job's `training.optimizer.offload` decides."""
    zero = ctx.spec.deepspeed.get("zero_optimization")
    if not (isinstance(zero, dict) and ({"cpu_offload", "offload_optimizer"} & set(zero))):
        return
    want, got = ctx.spec.training.optimizer.offload, _offload_device(ctx)
    if got != want:  # at ZeRO-0 too, where DeepSpeed would ignore the block silently
        key = "cpu_offload" if "cpu_offload" in zero else "offload_optimizer"
        yield Finding(f"deepspeed.zero_optimization.{key} offloads the optimizer to {got}, but "
                      f"training.optimizer.offload is {want}", "remove it and set training.optimizer.offload",
                      ("deepspeed", "zero_optimization", key))


def _enabled(ctx: Context, section: str, key: str) -> bool:
    block = ctx.spec.deepspeed.get(section)
    value = block.get(key) if isinstance(block, dict) else None
    return value is not None and _read(MODELS[section][key], value) is True


@rule("DSF524", "overrides fit the ZeRO optimizer DeepSpeed builds",
      source=DS + "runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.__init__ (compute_grad_norm, "
      "_enforce_cpu_offload, reduce-scatter asserts); runtime/zero/stage3.py; runtime/swap_tensor")
def zero_optimizer_conditions(ctx: Context) -> Iterator[Finding]:
    """Conditions the ZeRO optimizers assert at initialize, after every rank started: `compute_grad_norm:
    false` needs `gradient_clipping: 0` and no optimizer offload; reduced-precision master weights
    (`bf16/fp16_master_weights_and_grads`) need ZeRO-Offload with DeepSpeedCPUAdam (adam/adamw, offload cpu);
    with reduce-scatter (which dsforge writes at ZeRO-2/3) `prescale_gradients` and a
    `gradient_predivide_factor` other than 1.0 are refused; NVMe parameter offload needs `nvme_path`."""
    zero, ds, t = ctx.plan.zero, ctx.spec.deepspeed, ctx.spec.training
    zpath = ("deepspeed", "zero_optimization")
    if zero in (1, 2) and _zero_value(ctx, "compute_grad_norm") is False:
        clip = ds.get("gradient_clipping", t.grad_clip)
        if _real(clip) and clip > 0:
            yield Finding(f"compute_grad_norm=false with gradient clipping {clip:g}: the ZeRO optimizer "
                          f"needs the norm to clip", "set training.grad_clip: 0, or remove compute_grad_norm",
                          (*zpath, "compute_grad_norm"))
        if _offload_device(ctx) != "none":
            yield Finding("compute_grad_norm=false is refused with optimizer offload",
                          "remove compute_grad_norm", (*zpath, "compute_grad_norm"))
    for section in ("bf16", "fp16"):
        key = f"{section}_master_weights_and_grads"
        if zero in (1, 2, 3) and _enabled(ctx, section, key) and not (
                _offload_device(ctx) == "cpu" and t.optimizer.name in ("adam", "adamw")):
            yield Finding(f"deepspeed.{section}.{key} needs ZeRO-Offload with DeepSpeedCPUAdam (optimizer "
                          f"adam or adamw with offload: cpu); the job has {t.optimizer.name} with offload "
                          f"{_offload_device(ctx)}", "set training.optimizer.offload: "
                                                     "cpu with adamw, or remove it",
                          ("deepspeed", section, key))
    if zero >= 2 and _zero_value(ctx, "reduce_scatter") is not False:
        if ds.get("prescale_gradients") not in (None, False, 0):
            yield Finding(f"prescale_gradients with ZeRO-{zero} reduce-scatter is refused at initialize",
                          "remove prescale_gradients", ("deepspeed", "prescale_gradients"))
        factor = ds.get("gradient_predivide_factor")
        if factor is not None and factor != 1.0:
            yield Finding(f"gradient_predivide_factor={factor!r} with ZeRO-{zero} reduce-scatter is refused "
                          f"at initialize", "remove gradient_predivide_factor",
                          ("deepspeed", "gradient_predivide_factor"))
    off = _zero_value(ctx, "offload_param")
    if isinstance(off, dict) and off.get("device") == "nvme" and not off.get("nvme_path"):
        yield Finding("offload_param to nvme needs the NVMe directory (nvme_path)",
                      "set offload_param.nvme_path " "to a local NVMe mount", (*zpath, "offload_param"))


@rule("DSF525", "top-level overrides have the types DeepSpeed computes with",
      source=DS + "runtime/engine.py (steps_per_print in _take_model_step, gradient_clipping, "
      "gradient_predivide_factor, prescale_gradients)")
def top_level_types(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed reads these top-level values without checking them and computes with them once training
    runs: `global_steps % steps_per_print` (text is a TypeError, 0 a ZeroDivisionError at the first step),
    `gradient_clipping > 0.0`, the predivide factor in the gradient averaging. `gradient_clipping` is the
    job's `training.grad_clip` (the estimate and the ZeRO checks read it), so an override must agree."""
    ds, path = ctx.spec.deepspeed, ("deepspeed",)
    every = ds.get("steps_per_print")
    if "steps_per_print" in ds and every is not None and not (type(every) is int and every >= 1) and not (
            isinstance(every, float) and not math.isfinite(every)):  # DSF516's
        yield Finding(f"deepspeed.steps_per_print={every!r}: DeepSpeed takes a whole number >= 1 (it "
                      f"computes global_steps % steps_per_print)", "give a whole number >= 1, or remove it",
                      (*path, "steps_per_print"))
    clip = ds.get("gradient_clipping")
    if "gradient_clipping" in ds and not (_real(clip) and clip == ctx.spec.training.grad_clip) and not (
            isinstance(clip, float) and not math.isfinite(clip)):
        yield Finding(f"deepspeed.gradient_clipping={clip!r} contradicts training.grad_clip="
                      f"{ctx.spec.training.grad_clip}", "remove it and set training.grad_clip",
                      (*path, "gradient_clipping"))
    factor = ds.get("gradient_predivide_factor")
    if (
        "gradient_predivide_factor" in ds
        and not (_real(factor) and factor is not None and factor > 0)
        and not (isinstance(factor, float) and not math.isfinite(factor))
    ):
        yield Finding(f"deepspeed.gradient_predivide_factor={factor!r}: DeepSpeed divides gradients by it",
                      "give a number > 0, or remove it", (*path, "gradient_predivide_factor"))
    for key in ("prescale_gradients", "managed_gradient_accumulation", "memory_breakdown", "dump_state",
                "zero_allow_untested_optimizer", "disable_allgather"):
        if key in ds and not isinstance(ds[key], bool):
            yield Finding(f"deepspeed.{key}={ds[key]!r}: DeepSpeed tests it as true or false, so text such "
                          f"as \"false\" would count as true", "give true or false", (*path, key))


@rule("DSF526", "fp16.auto_cast only with fp16 precision",
      source=DS + "runtime/engine.py DeepSpeedEngine.forward (fp16_auto_cast casts the inputs to half)")
def fp16_auto_cast(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed casts every floating-point input of the forward pass to half when `fp16.auto_cast` is true,
    whether or not fp16 is enabled: in an fp32 or bf16 job the first layer then multiplies half inputs with
    fp32/bf16 weights and the first step fails (measured: "mat1 and mat2 must have the same dtype")."""
    if _enabled(ctx, "fp16", "auto_cast") and ctx.spec.training.precision != "fp16":
        yield Finding(f"deepspeed.fp16.auto_cast casts the inputs to half, but training.precision is "
                      f"{ctx.spec.training.precision}", "remove auto_cast, or use training.precision: fp16",
                      ("deepspeed", "fp16", "auto_cast"))
