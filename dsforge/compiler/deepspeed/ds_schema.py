"""DeepSpeed 0.19.8's config parse, written down without torch: what `DeepSpeedConfig(config, mpu)` accepts.

`parse(config, world_size)` walks a ds_config the way ``deepspeed/runtime/config.py``
``DeepSpeedConfig.__init__`` does (``_initialize_params``, ``_configure_train_batch_size``,
``_do_error_check``) and returns every problem that makes DeepSpeed raise, instead of the first. The
pydantic sections (``zero_optimization`` and its offload blocks, ``fp16``, ``bf16``, ``hybrid_engine``)
are described field by field (`MODELS`: type, default, bounds, alias, deprecated spelling) from the
models in runtime/zero/config.py, runtime/zero/offload_config.py, runtime/precision_config.py and
runtime/config.py, and validated with pydantic 2's lax coercions (`coerce`): a bool field takes "yes"
and 1, an int field takes "5" and 5.0 but not "5e8" or 1.5, a float field takes "5e8". The sections
DeepSpeed reads with plain dict lookups fail only where the lookup or an operator on the value fails
(``optimizer: null`` has no ``.keys()``, ``wall_clock_breakdown: "yes" | False`` is a TypeError).

The other sections are described in `dsforge.compiler.deepspeed.ds_sections` (the monitors, comms_logger,
timers, leaf_module, checkpoint, torch_autocast, flops_profiler, aio), whose problems `parse` adds. Not
modelled: `UNMODELLED`, the sections `ds_sections.REFUSED` refuses as `deepspeed:` overrides (rule DSF528),
with why. tests/compiler/deepspeed/test_ds_schema.py and test_ds_sections.py compare `MODELS` with the
installed DeepSpeed's pydantic models and the coercions with pydantic's own, and test_ds_differential.py there
compares `parse` with `DeepSpeedConfig` on generated jobs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dsforge.compiler.deepspeed import ds_sections
from dsforge.compiler.deepspeed.ds_fields import I64 as _I64
from dsforge.compiler.deepspeed.ds_fields import Field, Path, Problem, validate_in
from dsforge.compiler.deepspeed.ds_fields import is_number as _number
from dsforge.compiler.deepspeed.ds_fields import where as _where

#: Sections not described value by value: each is refused as a `deepspeed:` override (ds_sections.REFUSED,
#: DSF528).
UNMODELLED = ("zenflow", "zero_optimization.zenflow", "tensor_parallel", "expert_parallel", "compile",
              "autotuning", "data_efficiency", "weight_quantization", "checkpoint.writer")


def _f(kind: str, default: Any = None, **kw: Any) -> Field:
    return Field(kind, default, **kw)


_BOOL, _OPT_BOOL = _f("bool"), _f("bool", optional=True)

#: The pydantic models, field by field (deepspeed 0.19.8; every model has extra="forbid").
MODELS: dict[str, dict[str, Field]] = {
    "zero": {
        "stage": _f("enum", 0, choices=(0, 1, 2, 3)),
        "contiguous_gradients": _f("bool", True), "reduce_scatter": _f("bool", True),
        "reduce_bucket_size": _f("int", 500_000_000, gt=0),
        "use_multi_rank_bucket_allreduce": _f("bool", True), "allgather_partitions": _f("bool", True),
        "allgather_bucket_size": _f("int", 500_000_000, ge=0), "overlap_comm": _OPT_BOOL,
        "compute_grad_norm": _f("bool", True), "load_from_fp32_weights": _f("bool", True),
        "elastic_checkpoint": _f("bool", False),
        "offload_param": _f("model", optional=True, model="offload_param"),
        "offload_optimizer": _f("model", optional=True, model="offload_optimizer"),
        "zenflow": _f("opaque", optional=True),
        "sub_group_size": _f("int", 1_000_000_000, ge=0),
        "cpu_offload_param": _f("bool", optional=True, replaced_by="offload_param"),
        "cpu_offload_use_pin_memory": _OPT_BOOL,
        "cpu_offload": _f("bool", optional=True, replaced_by="offload_optimizer"),
        "prefetch_bucket_size": _f("int", 50_000_000, ge=0, alias="stage3_prefetch_bucket_size"),
        "param_persistence_threshold": _f("int", 100_000, ge=0, alias="stage3_param_persistence_threshold"),
        "model_persistence_threshold": _f("int", _I64 - 1, ge=0, alias="stage3_model_persistence_threshold"),
        "max_live_parameters": _f("int", 1_000_000_000, ge=0, alias="stage3_max_live_parameters"),
        "max_reuse_distance": _f("int", 1_000_000_000, ge=0, alias="stage3_max_reuse_distance"),
        "gather_16bit_weights_on_model_save": _f("bool", False,
                                                 alias="stage3_gather_16bit_weights_on_model_save"),
        "module_granularity_threshold": _f("int", 0, alias="stage3_module_granularity_threshold"),
        "use_all_reduce_for_fetch_params": _f("bool", False, alias="stage3_use_all_reduce_for_fetch_params"),
        "allgather_sequential": _f("bool", False, alias="stage3_allgather_sequential"),
        "stage3_gather_fp16_weights_on_model_save": _f("bool", False,
                                                       replaced_by="gather_16bit_weights_on_model_save"),
        **{k: _f("bool", v) for k, v in (
            ("ignore_unused_parameters", True), ("legacy_stage1", False), ("round_robin_gradients", False),
            ("parameter_alignment", False), ("zero_quantized_weights", False),
            ("zero_quantized_nontrainable_weights", False), ("zero_quantized_gradients", False),
            ("memory_efficient_linear", True), ("pipeline_loading_checkpoint", False),
            ("override_module_apply", True), ("log_trace_cache_warnings", False),
            ("enable_sanity_checks", False), ("save_muon_momentum_buffer_in_memory", False))},
        "zero_hpz_partition_size": _f("int", 1, ge=0),
        "leaf_module": _f("opaque", optional=True),  # null is {} (its before-validator); see ds_sections
    },
    "offload_param": {
        "device": _f("enum", "none", choices=("none", "cpu", "nvme")), "nvme_path": _f("path", optional=True),
        "buffer_count": _f("int", 5, ge=0), "buffer_size": _f("int", 100_000_000, ge=0),
        "max_in_cpu": _f("int", 1_000_000_000, ge=0), "pin_memory": _f("bool", True),
    },
    "offload_optimizer": {
        "device": _f("enum", "none", choices=("none", "cpu", "nvme")), "nvme_path": _f("path", optional=True),
        "buffer_count": _f("int", 4, ge=0), "pin_memory": _f("bool", True),
        "pipeline_read": _f("bool", False), "pipeline_write": _f("bool", False),
        "fast_init": _f("bool", False), "ratio": _f("float", 1.0, ge=0.0, le=1.0),
        "super_offload": _f("bool", False), "cpuadam_cores_perc": _f("float", 0.8, ge=0.0, le=1.0),
    },
    "fp16": {
        "enabled": _f("bool", False), "auto_cast": _f("bool", False), "loss_scale": _f("float", 0.0),
        "initial_scale_power": _f("int", 16), "loss_scale_window": _f("int", 1000),
        "hysteresis": _f("int", 2), "consecutive_hysteresis": _f("bool", False),
        "min_loss_scale": _f("int", 1), "fp16_master_weights_and_grads": _f("bool", False),
    },
    "bf16": {
        "enabled": _f("bool", False), "immediate_grad_update": _f("bool", False),
        "check_grad_overflow": _f("bool", True), "bf16_master_weights_and_grads": _f("bool", False),
        "bf16_optimizer_states": _f("bool", False),
    },
    "hybrid_engine": {
        "enabled": _f("bool", False), "max_out_tokens": _f("int", 512, gt=0),
        "inference_tp_size": _f("int", 1), "release_inference_cache": _f("bool", False),
        "pin_parameters": _f("bool", True), "tp_gather_partition_size": _f("int", 8),
        "enable_cuda_graph": _f("bool", False),
    },
}
MODELS.update(ds_sections.SECTION_MODELS)


def validate_model(name: str, data: Mapping[str, Any], path: Path) -> tuple[dict[str, Any], list[Problem]]:
    """Validate one pydantic section (any of `MODELS`) as DeepSpeed's model does: its values and problems."""
    return validate_in(MODELS, name, data, path)

def _zero(cfg: Mapping[str, Any], problems: list[Problem]) -> dict[str, Any]:
    """runtime/zero/config.py get_zero_config and DeepSpeedZeroConfig's validators."""
    block = cfg.get("zero_optimization", {})
    path: Path = ("zero_optimization",)
    if isinstance(block, bool):  # the deprecated form: stage 1 with the top-level allgather_size, or 0
        block = {"stage": 1,
                 "allgather_bucket_size": cfg.get("allgather_size", 5e8)} if block else {"stage": 0}
    if not isinstance(block, dict):
        problems.append(Problem(path, f"`zero_optimization`={block!r}: DeepSpeed takes a mapping (or the "
                                "deprecated true/false)", "set parallel.zero and remove it", "shape"))
        return {"stage": 0}
    zero, found = validate_model("zero", block, path)
    problems += found
    stage, offload = zero.get("stage"), zero.get("offload_optimizer")
    if zero.get("compute_grad_norm") is False and stage not in (1, 2):
        problems.append(Problem((*path, "compute_grad_norm"),
                                f"compute_grad_norm=false needs ZeRO stage 1 or 2, " f"not {stage}",
                                "remove compute_grad_norm", "cross"))
    ratio = offload.get("ratio", 1.0) if isinstance(offload, dict) else 1.0
    if isinstance(ratio, float) and ratio < 1.0 and stage != 3:
        problems.append(Problem((*path, "offload_optimizer", "ratio"), f"offload_optimizer.ratio={ratio:g} "
                                f"(partial offload) needs ZeRO-3, not stage {stage}", "remove ratio",
                                "cross"))
    return zero


def _fp16(block: dict[str, Any], problems: list[Problem]) -> dict[str, Any]:
    """DeepSpeedFP16Config and its field/model validators (runtime/precision_config.py)."""
    path: Path = ("fp16",)
    pre = dict(block)
    for key in ("loss_scale", "loss_scale_window", "min_loss_scale"):
        value = pre.get(key)
        if key not in pre or (isinstance(value, str) and value == "auto"):
            continue
        reason = _fp16_before(key, value)
        if reason:
            problems.append(Problem((*path, key), f"`fp16.{key}`={value!r}: DeepSpeed {reason}",
                                    "give a finite number >= 0 (0: dynamic)" if key == "loss_scale"
                                    else "give a whole number > 0"))
            pre.pop(key)
    fp16, found = validate_model("fp16", pre, path)
    problems += found
    if fp16["enabled"] is True and fp16["loss_scale"] == 0:
        for key in ("loss_scale_window", "min_loss_scale"):
            if isinstance(fp16[key], int) and fp16[key] <= 0:
                problems.append(Problem((*path, key), f"`fp16.{key}`={fp16[key]} must be > 0 with dynamic "
                                        f"loss scaling (loss_scale 0)", f"give {key} a whole number > 0",
                                        "cross"))
    return fp16


def _fp16_before(key: str, value: Any) -> str:
    """The `mode="before"` validators of DeepSpeedFP16Config: '' when the value passes them."""
    if isinstance(value, bool):
        return "takes a number, not true/false"
    try:
        number = float(value) if key == "loss_scale" else int(value)
    except (TypeError, ValueError, OverflowError):
        return "takes a number" if key == "loss_scale" else "takes a whole number"
    if key == "loss_scale":
        if not math.isfinite(number):
            return "takes a finite number"
        return "takes a number >= 0 (0 is dynamic loss scaling)" if number < 0 else ""
    return ""


def _mapping_or_missing(cfg: Mapping[str, Any], key: str, problems: list[Problem], fix: str,
                        null_ok: bool = False) -> dict[str, Any]:
    if key not in cfg or (null_ok and cfg[key] is None):
        return {}
    block = cfg[key]
    if isinstance(block, dict):
        return block
    problems.append(Problem((key,), f"`{key}`={block!r}: DeepSpeed reads it as a mapping", fix, "shape"))
    return {}


def _dtype(cfg: Mapping[str, Any], key: str, problems: list[Problem]) -> None:
    """get_communication_data_type: lower-cased, one of fp16, bf16, fp32 (null: chosen by DeepSpeed)."""
    value = cfg.get(key)
    if value is None:
        return
    if not isinstance(value, str) or value.lower() not in ("fp16", "bf16", "fp32"):
        problems.append(Problem((key,), f"`{key}`={value!r} is not one of fp16, bf16, fp32",
                                "use fp16, bf16 or fp32"))


def _or_flag(value: Any) -> bool:
    """``value | False`` works (bool or int): DeepSpeed ORs wall_clock_breakdown with the profiler's flag."""
    return isinstance(value, int)


def _keys_of(cfg: Mapping[str, Any], key: str, problems: list[Problem]) -> dict[str, Any] | None:
    """A section DeepSpeed reads with ``param_dict[key].keys()``: None when absent."""
    if key not in cfg:
        return None
    block = cfg[key]
    if not isinstance(block, dict):
        problems.append(Problem((key,), f"`{key}`={block!r}: DeepSpeed reads it as a mapping with `type` and "
                                "`params`", "remove it (dsforge writes it from training.optimizer/scheduler)",
                                "shape"))
        return None
    name = block.get("type")
    if name is not None and not isinstance(name, str):
        problems.append(Problem((key, "type"), f"`{key}.type`={name!r} is not a name", "give a type name"))
    return block


def parse(cfg: Mapping[str, Any], world_size: int) -> list[Problem]:
    """Every problem `DeepSpeedConfig(cfg, mpu)` raises on, with ``world_size`` the mpu's data-parallel
    size."""
    problems: list[Problem] = []
    op = _scalars(cfg, problems)
    zero = _zero(cfg, problems)
    _activation_checkpointing(cfg, problems)
    fp16, bf16, bf16_key = _precision(cfg, problems)
    _optimizer(cfg, problems)
    _monitors(cfg, problems)
    _sections(cfg, problems)
    problems += _batch(cfg, world_size)
    problems += ds_sections.check(cfg)
    _cross(op, zero.get("stage", 0), fp16, bf16, bf16_key, problems)
    return problems


def _scalars(cfg: Mapping[str, Any], problems: list[Problem]) -> Any:
    """The batch sizes as numbers, the communication dtypes, and the all-reduce op (returned: `_cross` reads
    it)."""
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = cfg.get(key)
        if value is not None and not (_number(value) or isinstance(value, bool)):
            problems.append(Problem((key,), f"`{key}`={value!r} is not a number",
                                    "remove it (dsforge sets it)"))
    for key in ("communication_data_type", "seq_parallel_communication_data_type"):
        _dtype(cfg, key, problems)
    op = cfg.get("gradient_allreduce_op", "mean")
    if (op.lower() if isinstance(op, str) else op) not in ("mean", "sum"):
        problems.append(Problem(("gradient_allreduce_op",), f"`gradient_allreduce_op`={op!r} "
                                                            f"is not mean or sum",
                                "use mean (the default) or sum"))
    return op


def _activation_checkpointing(cfg: Mapping[str, Any], problems: list[Problem]) -> None:
    """`activation_checkpointing` must be a mapping where it is given."""
    act = cfg.get("activation_checkpointing")
    if "activation_checkpointing" in cfg and not isinstance(act, dict):
        problems.append(Problem(("activation_checkpointing",),
                                f"`activation_checkpointing`={act!r}: DeepSpeed " "reads it as a mapping",
                                "remove it (training.recompute sets it)", "shape"))


def _precision(cfg: Mapping[str, Any], problems: list[Problem]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The fp16 and bf16 blocks as DeepSpeed reads them (and the bf16 block's key), not both enabled."""
    fp16 = _fp16(_mapping_or_missing(cfg, "fp16", problems, "remove it and set training.precision"), problems)
    bf16_key = "bf16" if cfg.get("bf16") is not None else "bfloat16"
    bf16_block = _mapping_or_missing(cfg, bf16_key, problems, "remove it and set training.precision")
    bf16, found = validate_model("bf16", bf16_block, (bf16_key,))
    problems += found
    if fp16["enabled"] is True and bf16["enabled"] is True:
        problems.append(Problem(("fp16",), "fp16 and bf16 are both enabled", "enable one "
                                "(training.precision)", "cross"))
    return fp16, bf16, bf16_key


def _optimizer(cfg: Mapping[str, Any], problems: list[Problem]) -> None:
    """The optimizer and scheduler blocks' keys, and the optimizer's params as a mapping with a numeric
    clip."""
    optimizer = _keys_of(cfg, "optimizer", problems)
    _keys_of(cfg, "scheduler", problems)
    params = optimizer.get("params") if optimizer is not None and optimizer.get("type") is not None else None
    if params is not None:
        if not isinstance(params, dict):
            problems.append(Problem(("optimizer", "params"),
                                    f"`optimizer.params`={params!r} is not a mapping",
                                    "give a mapping of the optimizer's parameters", "shape"))
        elif "max_grad_norm" in params and not _number(params["max_grad_norm"]):
            problems.append(Problem(("optimizer", "params", "max_grad_norm"),
                                    "`optimizer.params.max_grad_norm` is " "not a number",
                                    "remove it and set training.grad_clip"))


def _monitors(cfg: Mapping[str, Any], problems: list[Problem]) -> None:
    """`wall_clock_breakdown` and `flops_profiler.enabled`, which DeepSpeed ORs as flags."""
    flops = _mapping_or_missing(cfg, "flops_profiler", problems, "give a mapping, or remove it")
    wall = cfg.get("wall_clock_breakdown", False)
    if not _or_flag(wall) or not _or_flag(flops.get("enabled", False)):
        bad = ("wall_clock_breakdown",) if not _or_flag(wall) else ("flops_profiler", "enabled")
        problems.append(Problem(bad, f"`{_where(bad)}`={wall if len(bad) == 1 else flops.get('enabled')!r}: "
                                "DeepSpeed ORs it with a flag and needs true or false", "give true or false"))


def _sections(cfg: Mapping[str, Any], problems: list[Problem]) -> None:
    """The hybrid engine, pipeline, compile and data_types sections as mappings, and the fp32-module
    patterns."""
    he = _mapping_or_missing(cfg, "hybrid_engine", problems, "give a mapping, or remove it")
    problems += validate_model("hybrid_engine", he, ("hybrid_engine",))[1]
    _mapping_or_missing(cfg, "pipeline", problems, "remove it (parallel.pp and parallel.pipeline set it)")
    _mapping_or_missing(cfg, "compile", problems, "give a mapping, or remove it")
    data_types = _mapping_or_missing(cfg, "data_types", problems, "give a mapping, or remove it")
    keep = data_types.get("keep_in_fp32_modules", "auto")
    if keep != "auto" and not (isinstance(keep, list) and all(isinstance(n, str) for n in keep)):
        problems.append(Problem(("data_types", "keep_in_fp32_modules"),
                                "`data_types.keep_in_fp32_modules` must be "
                                    "\"auto\" or a list of name "
                                    "patterns", "give a list of strings, or \"auto\""))


def _cross(op: Any, stage: Any, fp16: dict[str, Any], bf16: dict[str, Any], bf16_key: str,
           problems: list[Problem]) -> None:
    """What the settings refuse together: a sum all-reduce under ZeRO-3, 16-bit master weights without ZeRO,
    bf16 optimizer states without bf16 master weights."""
    if isinstance(op, str) and op.lower() == "sum" and stage == 3:
        problems.append(Problem(("gradient_allreduce_op",),
                                "gradient_allreduce_op=sum is refused with ZeRO-3",
                                "remove it, or use ZeRO 0-2", "cross"))
    for block, key in ((fp16, "fp16_master_weights_and_grads"), (bf16, "bf16_master_weights_and_grads"),
                       (bf16, "bf16_optimizer_states")):
        if block.get(key) is True and stage not in (1, 2, 3):
            section = "fp16" if block is fp16 else bf16_key
            problems.append(Problem((section, key), f"`{section}.{key}` needs ZeRO stage 1-3, not {stage}",
                                    f"set parallel.zero: 1 (or 2, 3), or remove {key}", "cross"))
    if bf16.get("bf16_optimizer_states") is True and bf16.get("bf16_master_weights_and_grads") is not True:
        problems.append(Problem((bf16_key, "bf16_optimizer_states"), "bf16_optimizer_states needs "
                                "bf16_master_weights_and_grads: true",
                                "add bf16_master_weights_and_grads: true", "cross"))


def _batch(cfg: Mapping[str, Any], world_size: int) -> list[Problem]:
    """_set_batch_related_parameters and _batch_assertion, for numeric values."""
    tb, mb, gas = (cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                        "gradient_accumulation_steps"))
    if any(v is not None and not (_number(v) or isinstance(v, bool)) for v in (tb, mb, gas)):
        return []  # reported as "not a number" above
    if tb is not None and mb is not None and gas is None:
        gas = tb // mb // world_size if mb else None
    elif tb is not None and gas is not None and mb is None:
        mb = tb // world_size // gas if gas else None
    elif mb is not None and gas is not None and tb is None:
        tb = mb * gas * world_size
    elif tb is not None and mb is None and gas is None:
        gas, mb = 1, tb // world_size
    elif mb is not None and tb is None and gas is None:
        tb, gas = mb * world_size, 1
    elif tb is None and mb is None:
        return [Problem(("train_batch_size",), "neither train_batch_size nor train_micro_batch_size_per_gpu "
                        "is given", "remove the null batch overrides", "cross")]
    path: Path = ("train_batch_size",)
    if tb is None or mb is None or gas is None or not (tb > 0 and mb > 0 and gas > 0) or \
            tb != mb * gas * world_size:
        return [
            Problem(
                path,
                f"train_batch_size={tb!r} is not micro_batch {mb!r} x gradient_accumulation_steps "
                f"{gas!r} x data-parallel size {world_size}",
                "remove the batch overrides (dsforge sets them from training.global_batch and micro_batch)",
                "cross",
            )
        ]
    return []


#: zero_optimization keys that name the same setting (a field, its alias, a deprecated spelling): an override
#: of one replaces whatever spelling dsforge wrote.
def same_setting(key: str) -> set[str]:
    """The zero_optimization keys DeepSpeed reads as the setting ``key`` names (``key`` included)."""
    fields = MODELS["zero"]
    name = next((n for n, f in fields.items() if f.alias == key), key)
    group = {name}
    if name in fields and fields[name].alias:
        group.add(fields[name].alias)
    for other, f in fields.items():
        if f.replaced_by and (f.replaced_by == name or other == name):
            group |= {other, f.replaced_by}
            if fields[f.replaced_by].alias:
                group.add(fields[f.replaced_by].alias)
    return group


def merge_zero(emitted: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``emitted`` with ``override`` merged over it, each override replacing every spelling of its setting."""
    if not override:  # the common case, and on the search's per-candidate path: nothing to replace
        return dict(emitted)
    # drop what dsforge wrote under another spelling of an overridden setting (never the override's own keys:
    # two spellings in the override itself are the user's, and DeepSpeed's verdict on them stands)
    out = {k: v for k, v in emitted.items() if not ((same_setting(k) - {k}) & set(override))}
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def merge_overrides(emitted: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The ds_config: the job's `deepspeed:` overrides merged over what dsforge emits, replacing, never
    duplicating (zero_optimization by `merge_zero`; `bfloat16` into `bf16`; other mappings recursively)."""
    out = dict(emitted)
    for key, value in overrides.items():
        if key == "bfloat16":
            # the legacy spelling of `bf16`, which DeepSpeed reads only when `bf16` is absent: merged into it
            key = "bf16"
        if key == "zero_optimization" and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_zero(out[key], value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep(out[key], value)
        else:
            out[key] = value
    return out


def _deep(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _deep(out[key], value) if isinstance(value,
                                                        dict) and isinstance(out.get(key), dict) else value
    return out
