"""The rest of DeepSpeed 0.19.8's config sections, value by value: the monitors, comms_logger, timers,
ZeRO-3's leaf_module (pydantic models, joined into `ds_schema.MODELS`), and checkpoint, torch_autocast,
flops_profiler and aio (read with plain dict lookups in runtime/config.py,
runtime/model_checkpointing/config.py, profiling/config.py and runtime/swap_tensor/aio_config.py).

`check(cfg)` returns the `ds_schema.Problem`s DeepSpeedConfig raises on in these sections (ds_schema.parse
adds them to its own); `loose(cfg)` returns what DeepSpeed accepts but reads loosely (a flag it only tests for
truth, a number it compares later): validate warns about those instead of refusing what DeepSpeed takes.

`REFUSED` names the sections dsforge does not describe value by value, each with the reason it refuses them as
`deepspeed:` overrides (rule DSF528): they configure machinery dsforge.runtime replaces or never calls, or
they change the training the job describes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsforge.compiler.deepspeed.ds_fields import Field, Path, Problem, validate_in

#: Sections refused as overrides, and why (dsforge.runtime's own machinery, or another training than the
#: job's).
REFUSED: dict[str, str] = {
    "zenflow": "DeepSpeed reads ZenFlow only under zero_optimization "
               "(and ignores it here), where it is refused",
    "zero_optimization.zenflow": "ZenFlow updates only the most important gradient columns each step and the "
                                 "rest asynchronously on the CPU, a different "
                                 "update rule than training.optimizer's",
    "tensor_parallel": "dsforge.runtime shards tensor-parallel layers itself from parallel.tp; this section "
                       "configures DeepSpeed's AutoTP, a second sharding whose keys apply only to it",
    "expert_parallel": "dsforge.runtime builds DeepSpeed's MoE layers itself from parallel.ep; this section "
                       "configures AutoEP, which would replace those layers again",
    "compile": "dsforge.runtime never calls engine.compile(), so DeepCompile and its passes would not run",
    "autotuning": "DeepSpeed's autotuner re-chooses the micro batch and ZeRO settings the plan fixes "
                  "(`dsforge search` ranks layouts instead)",
    "data_efficiency": "curriculum data sampling and random-LTD need DeepSpeed's own data loader and layer "
                       "hooks, which dsforge.runtime does not use (training.data decides what is read)",
    "checkpoint.writer": "its checkpoint writers read CROSS_SIZE and CROSS_RANK, which only DeepSpeed's own "
                         "launcher sets, not torch's (measured without "
                         "them: KeyError 'CROSS_SIZE' at initialize)",
    "weight_quantization": "it quantizes the model's weights (ZeRO-Inference), numerics training.precision "
                           "does not describe",
}


#: Every section of DeepSpeed 0.19.8's config (a key it reads as a mapping), ZeRO's sub-sections as dotted
#: names: described by ds_schema (MODELS and parse), by this module, or refused (REFUSED).
SECTION_NAMES = frozenset({
    "zero_optimization", "zero_optimization.offload_param", "zero_optimization.offload_optimizer", "fp16",
    "bf16", "bfloat16", "hybrid_engine", "optimizer", "scheduler", "pipeline", "activation_checkpointing",
    "data_types", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "timers",
    "zero_optimization.leaf_module", "checkpoint", "torch_autocast", "flops_profiler", "aio", *REFUSED})


def _f(kind: str, default: Any = None, **kw: Any) -> Field:
    return Field(kind, default, **kw)


_MONITOR_FILE = {"enabled": _f("bool", False), "output_path": _f("str", ""),
                 "job_name": _f("str", "DeepSpeedJobName")}
_OPT_STR = _f("str", optional=True)

#: pydantic models of the sections described here (deepspeed 0.19.8; every model has extra="forbid").
SECTION_MODELS: dict[str, dict[str, Field]] = {
    # monitor/config.py: each read with param_dict.get(key, {}) into DeepSpeedMonitorConfig
    "tensorboard": dict(_MONITOR_FILE),
    "csv_monitor": dict(_MONITOR_FILE),
    "wandb": {"enabled": _f("bool", False), "group": _OPT_STR, "team": _OPT_STR,
              "project": _f("str", "deepspeed")},
    "comet": {"enabled": _f("bool", False), "samples_log_interval": _f("int", 100),
              **{k: _OPT_STR for k in ("project", "workspace", "api_key", "experiment_name", "experiment_key",
                                       "mode")},
              "online": _f("bool", optional=True)},
    # comm/config.py CommsLoggerConfig(**ds_config["comms_logger"])
    "comms_logger": {"enabled": _f("bool", False), "prof_all": _f("bool", True), "prof_ops": _f("list", []),
                     "verbose": _f("bool", False), "debug": _f("bool", False)},
    # utils/config.py DeepSpeedThroughputTimerConfig(**timers["throughput"])
    "timers_throughput": {"enabled": _f("bool", True), "synchronized": _f("bool", True)},
    # runtime/zero/leaf_module_config.py DeepSpeedZeroLeafModuleConfig (a single string becomes a list of one)
    "leaf_module": {"classes": _f("strs", []), "names": _f("strs", []), "name_suffixes": _f("strs", [])},
}

MONITORS = ("tensorboard", "wandb", "csv_monitor", "comet")

#: Keys of the sections DeepSpeed reads with dict lookups (it ignores any other key silently: DSF507 warns).
LOOSE_KEYS: dict[tuple[str, ...], frozenset[str]] = {
    ("checkpoint",
     ): frozenset({"tag_validation", "load_universal", "use_node_local_storage", "parallel_write",
                                "checkpoint_serialization", "writer"}),
    ("checkpoint", "parallel_write"): frozenset({"pipeline_stage"}),
    ("checkpoint", "writer"): frozenset({"type", "io_buffer_size", "io_buffer_double", "show_statistics",
                                         "data_parallel", "decoupled", "io_multiplier"}),
    ("torch_autocast",): frozenset({"enabled", "dtype", "lower_precision_safe_modules"}),
    ("flops_profiler",
     ): frozenset({"enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules",
                                    "detailed", "output_file"}),
    ("aio",
     ): frozenset({"block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events",
                         "use_gds"}),
    ("timers",): frozenset({"throughput"}),
    ("data_types",): frozenset({"grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules"}),
}

#: Sections whose keys DeepSpeed checks (pydantic, extra="forbid"), for DSF507: (path, model name).
STRICT_SECTIONS: tuple[tuple[tuple[str, ...], str], ...] = (
    *(((m,), m) for m in MONITORS), (("comms_logger",), "comms_logger"),
    (("timers", "throughput"), "timers_throughput"), (("zero_optimization", "leaf_module"), "leaf_module"),
)

#: DtypeEnum's spellings (runtime/config.py), each with the dtype it names: torch_autocast.dtype and the
#: data_types dtypes are looked up in it, case-sensitively.
DTYPE_OF = {**dict.fromkeys(("torch.float16", "fp16", "float16", "half"), "fp16"),
            **dict.fromkeys(("torch.float32", "fp32", "float32", "float"), "fp32"),
            **dict.fromkeys(("torch.int8", "int8"), "int8"),
            **dict.fromkeys(("torch.bfloat16", "bf16", "bfloat16"), "bf16")}
AUTOCAST_DTYPES = tuple(DTYPE_OF)
TAG_VALIDATION = ("WARN", "IGNORE", "FAIL")
WRITER_TYPES = ("MOCK", "PYTHON", "FAST")
DATA_PARALLEL_UNITS = ("REPLICA", "SOCKET", "MACHINE")


def _problem(path: Path, message: str, fix: str, kind: str = "value") -> Problem:
    return Problem(path, message, fix, kind)


def _shape(path: Path, value: Any, how: str = "a mapping") -> Problem:
    where = ".".join(str(p) for p in path)
    return _problem(path, f"`{where}`={value!r}: DeepSpeed reads it as {how}",
                    "give a mapping of its keys, or " "remove it", "shape")


def _model(name: str, block: Any, path: Path, problems: list[Problem]) -> None:
    """A pydantic section given as ``Model(**block)``: a mapping, validated field by field."""
    if not isinstance(block, Mapping):
        problems.append(_shape(path, block))
        return
    problems += validate_in(SECTION_MODELS, name, dict(block), path)[1]


def _monitors(cfg: Mapping[str, Any], problems: list[Problem]) -> None:
    for key in MONITORS:
        if key in cfg and not (isinstance(cfg[key], str) and cfg[key] == "auto"):  # "auto" dropped at the top
            _model(key, cfg[key], (key,), problems)


def _timers(cfg: Mapping[str, Any], problems: list[Problem]) -> None:
    """get_timers_config: ``"throughput" in timers`` (None or a number is a TypeError), then the model."""
    if "timers" not in cfg:
        return
    timers = cfg["timers"]
    if not isinstance(timers, (Mapping, str, list)):
        problems.append(_shape(("timers",), timers))
    elif "throughput" in timers:
        if not isinstance(timers, Mapping):
            problems.append(_shape(("timers",), timers))
        else:
            _model("timers_throughput", timers["throughput"], ("timers", "throughput"), problems)


def _leaf_module(cfg: Mapping[str, Any], problems: list[Problem]) -> None:
    """DeepSpeedZeroLeafModuleConfig's before-validator: null is {}, a string field is a list of one."""
    zero = cfg.get("zero_optimization")
    if not isinstance(zero, Mapping) or "leaf_module" not in zero:
        return
    block, path = zero["leaf_module"], ("zero_optimization", "leaf_module")
    if block is None or (isinstance(block, str) and block == "auto"):
        return
    if not isinstance(block, Mapping):
        problems.append(_shape(path, block))
        return
    block = {k: [v] if isinstance(v, str) and v != "auto" else v for k, v in block.items()}
    problems += validate_in(SECTION_MODELS, "leaf_module", block, path)[1]


def _upper(value: Any, path: Path, choices: tuple[str, ...], problems: list[Problem], none_ok: bool) -> None:
    """A value DeepSpeed upper-cases and looks up in ``choices`` (text only; None where ``none_ok``)."""
    if value is None and none_ok:
        return
    where = ".".join(str(p) for p in path)
    if not isinstance(value, str) or value.upper() not in choices:
        problems.append(_problem(path, f"`{where}`={value!r} is not one of {', '.join(choices)} (any case)",
                                 f"use one of {', '.join(c.lower() for c in choices)}"))


def _checkpoint(cfg: Mapping[str, Any], problems: list[Problem]) -> None:
    """get_checkpoint_params / _tag_validation_mode / _parallel_write_pipeline, get_checkpoint_config."""
    if "checkpoint" not in cfg:
        return
    block = cfg["checkpoint"]
    if not isinstance(block, Mapping):
        problems.append(_shape(("checkpoint",), block))
        return
    _upper(block.get("tag_validation", "WARN"), ("checkpoint", "tag_validation"), TAG_VALIDATION, problems,
           False)
    write = block.get("parallel_write", {})
    if not isinstance(write, Mapping):
        problems.append(_shape(("checkpoint", "parallel_write"), write))
    elif write.get("pipeline_stage", False) not in (True, False):  # ``in [True, False]``: 1 and 0.0 pass
        problems.append(
            _problem(
                ("checkpoint", "parallel_write", "pipeline_stage"),
                "`checkpoint.parallel_write."
                f"pipeline_stage`={write['pipeline_stage']!r}: "
                f"DeepSpeed takes true or false",
                "give true or false",
            )
        )
    writer = block.get("writer")
    if writer is None:
        return
    if not isinstance(writer, Mapping):
        problems.append(_shape(("checkpoint", "writer"), writer))
        return
    _upper(writer.get("type", "FAST"), ("checkpoint", "writer", "type"), WRITER_TYPES, problems, True)
    _upper(writer.get("data_parallel"), ("checkpoint", "writer", "data_parallel"), DATA_PARALLEL_UNITS,
           problems, True)


def _torch_autocast(cfg: Mapping[str, Any], problems: list[Problem]) -> None:
    """get_torch_autocast_enabled / _dtype / get_lower_precision_safe_modules."""
    if "torch_autocast" not in cfg:
        return
    block, path = cfg["torch_autocast"], ("torch_autocast",)
    if not isinstance(block, Mapping):
        problems.append(_shape(path, block))
        return
    if "dtype" in block:
        dtype = block["dtype"]
        if not (isinstance(dtype, str) and dtype in AUTOCAST_DTYPES):
            problems.append(_problem((*path, "dtype"), f"`torch_autocast.dtype`={dtype!r} is not a dtype "
                                     f"DeepSpeed knows (case matters)", "use bf16, fp16 or fp32"))
    if "lower_precision_safe_modules" in block:
        names = block["lower_precision_safe_modules"]
        items = list(names) if isinstance(names, (list, str, Mapping)) else None
        if items is None or not all(isinstance(n, str) for n in items):
            problems.append(_problem((*path, "lower_precision_safe_modules"), "`torch_autocast."
                                     f"lower_precision_safe_modules`={names!r}: DeepSpeed takes a list of "
                                     f"module class names", "give a list of strings such as torch.nn.Linear"))


def _aio(cfg: Mapping[str, Any], problems: list[Problem]) -> None:
    """get_aio_config: null is the defaults, anything else is read with ``.get``."""
    block = cfg.get("aio")
    if block is not None and not isinstance(block, Mapping):
        problems.append(_shape(("aio",), block))


def check(cfg: Mapping[str, Any]) -> list[Problem]:
    """Every problem DeepSpeedConfig raises on in the sections described here."""
    problems: list[Problem] = []
    _monitors(cfg, problems)
    if "comms_logger" in cfg:
        _model("comms_logger", cfg["comms_logger"], ("comms_logger",), problems)
    _timers(cfg, problems)
    _leaf_module(cfg, problems)
    _checkpoint(cfg, problems)
    _torch_autocast(cfg, problems)
    _aio(cfg, problems)
    return problems


#: What each loosely read value is used as later (DeepSpeed does not check it at parse): (kind, what it does).
LOOSE_VALUES: dict[Path, str] = {
    ("checkpoint", "load_universal"): "bool", ("checkpoint", "use_node_local_storage"): "bool",
    ("checkpoint", "checkpoint_serialization"): "bool", ("checkpoint", "writer", "io_buffer_size"): "int",
    ("checkpoint", "writer", "io_buffer_double"): "bool", ("checkpoint", "writer", "show_statistics"): "bool",
    ("checkpoint", "writer", "decoupled"): "bool", ("checkpoint", "writer", "io_multiplier"): "int",
    ("torch_autocast", "enabled"): "bool",
    ("flops_profiler", "recompute_fwd_factor"): "number", ("flops_profiler", "profile_step"): "int",
    ("flops_profiler", "module_depth"): "int", ("flops_profiler", "top_modules"): "int",
    ("flops_profiler", "detailed"): "bool", ("flops_profiler", "output_file"): "text",
    ("aio", "block_size"): "int", ("aio", "queue_depth"): "int", ("aio", "intra_op_parallelism"): "int",
    ("aio", "single_submit"): "bool", ("aio", "overlap_events"): "bool", ("aio", "use_gds"): "bool",
}

_LOOSE_OK = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: type(v) is int,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "text": lambda v: v is None or isinstance(v, str),
}
_LOOSE_WANT = {"bool": "true or false", "int": "a whole number", "number": "a number", "text": "a file path"}


def loose(cfg: Mapping[str, Any]) -> list[Problem]:
    """Values DeepSpeed's parse accepts without looking at them, whose type is not the one it uses them as."""
    out: list[Problem] = []
    for path, kind in LOOSE_VALUES.items():
        node: Any = cfg
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping) or path[-1] not in node:
            continue
        value = node[path[-1]]
        if not _LOOSE_OK[kind](value):
            where = ".".join(str(p) for p in path)
            out.append(_problem(path, f"`{where}`={value!r}: DeepSpeed takes it without checking and uses it "
                                f"as {_LOOSE_WANT[kind]}", f"give {_LOOSE_WANT[kind]}"))
    return out

