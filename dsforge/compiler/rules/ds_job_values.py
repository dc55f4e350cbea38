"""DSF527-DSF533: `deepspeed:` overrides of what the job states elsewhere, of sections dsforge does not model,
and of values DeepSpeed reads loosely.

The override policy (DSF527): a `deepspeed:` override may restate a value the job decides, never change it.
The job's keys are the one source the memory and time estimates, `explain`, plan.json, the search and the
runtime all read; an override that won would have to be taught to each of them, and any one missed would
describe another job than the one that runs. So an override that differs is refused, naming both places, as
DSF508 does for the batch keys, the ZeRO stage and precision.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from dsforge.compiler.deepspeed.ds_fields import Field, Invalid, coerce
from dsforge.compiler.deepspeed.ds_schema import MODELS
from dsforge.compiler.deepspeed.ds_sections import DTYPE_OF, LOOSE_VALUES, REFUSED, loose
from dsforge.compiler.deepspeed.ds_settings import emitted_zero_block, on_cpu, scheduler_type
from dsforge.compiler.plan.plan import Plan
from dsforge.compiler.rules.registry import Context, Finding, rule
from dsforge.compiler.spec.schema import JobSpec
from dsforge.diagnostics import Severity

DS = "deepspeed 0.19.8 "

Stated = dict[str, tuple[Any, str]]


def optimizer_params(spec: JobSpec) -> Stated:
    """The `optimizer.params` dsforge writes from the job, each with the job key that states it.

    The same values as emit/optim.py's optimizer_section (tests/test_ds_job_values.py compares them on every
    example); the rules may not import the emitter.
    """
    opt = spec.training.optimizer
    where = "training.optimizer."
    out: Stated = {"lr": (opt.lr, where + "lr"), "weight_decay": (opt.weight_decay, where + "weight_decay")}
    if opt.name in ("adamw", "adam", "lamb", "lion"):
        out["betas"] = (list(opt.betas), where + "betas")
    if opt.name in ("adamw", "adam", "lamb"):
        out["eps"] = (opt.eps, where + "eps")
    if opt.name in ("adam", "adamw"):  # DeepSpeed's Adam runs AdamW unless adam_w_mode is false
        out["adam_w_mode"] = (opt.name == "adamw", where + "name")
    return out


def scheduler_params(spec: JobSpec) -> Stated | None:
    """The `scheduler.params` dsforge writes from the job (None: it writes no scheduler), as
    scheduler_section."""
    t = spec.training
    sched, lr, steps = t.scheduler, t.optimizer.lr, t.steps
    warm = sched.warmup_steps
    if scheduler_type(sched.name, warm) is None:
        return None
    s, lr_key = "training.scheduler.", "training.optimizer.lr"
    out: Stated = {"warmup_type": ("linear", s + "name (dsforge's warm-up is linear)")}
    if sched.name == "constant":
        out.update(warmup_min_lr=(0.0, s + "name (constant: warm-up from 0)"), warmup_max_lr=(lr, lr_key),
                   warmup_num_steps=(warm, s + "warmup_steps"))
        return out
    out.update(total_num_steps=(steps, "training.steps"), warmup_num_steps=(max(1, warm), s + "warmup_steps"))
    if sched.name == "cosine":
        out.update(warmup_min_ratio=(0.0 if warm else 1.0, s + "warmup_steps"),
                   cos_min_ratio=(sched.min_lr / lr, s + "min_lr (as a ratio of training.optimizer.lr)"))
    else:
        out.update(warmup_min_lr=(sched.min_lr, s + "min_lr"), warmup_max_lr=(lr, lr_key))
    return out


def pipeline_values(plan: Plan) -> Stated:
    """The `pipeline` keys dsforge writes from the plan that something reads (as emit/ds_config.py's
    pipeline_section): dsforge.runtime takes activation_checkpoint_interval from ds_config.json; stages and
    partition, which neither it nor DeepSpeed's engine reads (the PipelineModule is cut from the plan), must
    not claim another layout."""
    d = plan.degrees
    if d is None:
        return {}
    part = plan.spec.parallel.pipeline.partition
    out: Stated = {"stages": (d.pp, "parallel.pp")}
    if d.pp > 1:
        out.update(partition=(part if isinstance(part, str) else list(part), "parallel.pipeline.partition"),
                   activation_checkpoint_interval=(1 if plan.spec.training.recompute == "full" else 0,
                                                   "training.recompute (full: every layer)"))
    return out


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def same(given: Any, want: Any) -> bool:
    """True when an override states exactly the value dsforge writes (8.0 is not the step count 8, true not
    1)."""
    if isinstance(want, bool):
        return given is want
    if isinstance(want, int):
        return type(given) is int and given == want
    if isinstance(want, float):
        return _real(given) and given == want
    if isinstance(want, list):
        return isinstance(given,
                          list) and len(given) == len(want) and all(same(g, w) for g, w in zip(given, want))
    return type(given) is type(want) and given == want


def _dsf521(section: str, key: str, value: Any) -> bool:
    """True when DSF521 already refuses this value (not a value the optimizer or scheduler takes at all)."""
    if section == "optimizer" and key in ("lr", "eps", "weight_decay"):
        return not (_real(value) and value >= 0)
    if section == "optimizer" and key == "betas":
        return not (isinstance(value,
                               list) and len(value) == 2 and all(_real(b) and 0 <= b < 1 for b in value))
    if section == "scheduler" and key == "warmup_num_steps":
        return not (type(value) is int and value > 0)
    return False


def _params(ctx: Context, section: str) -> dict[str, Any]:
    block = ctx.spec.deepspeed.get(section)
    params = block.get("params") if isinstance(block, dict) else None
    return params if isinstance(params, dict) else {}


@rule("DSF527", "deepspeed overrides do not change what the job states elsewhere",
      source="dsforge (the job's keys are authoritative: estimates, explain, plan.json, the search and the "
      "runtime read them); " + DS + "runtime/engine.py _configure_basic_optimizer, _scheduler_from_config "
      "(scheduler(optimizer, **params)), runtime/lr_schedules.py")
def job_stated_overrides(ctx: Context) -> Iterator[Finding]:
    """The override policy: a `deepspeed:` value may restate what the job decides, never change it; one that
    differs is refused, naming both places. The job's keys are what the estimates, explain, plan.json, the
    search and the runtime read, so an override that won would train with values none of them knows (the
    alternative, an override that wins everywhere, would need each of them to read the merged ds_config).

    Covered here: the optimizer's lr, betas, eps, weight decay and Adam's adam_w_mode (training.optimizer;
    arguments the job does not state, such as SGD's momentum or torch_adam, are the override's own, and
    `max_grad_norm` is refused as the ValueError DeepSpeed raises for it at initialize);
    the scheduler's steps, warm-up steps, warm-up type, minimum ratio and learning rates (training.scheduler,
    training.steps), where any other scheduler parameter is refused too (DeepSpeed's schedulers take no
    others: `last_batch_iteration` would shift the whole schedule, an unknown name is a TypeError at
    initialize), as is any scheduler parameter of a job without a schedule (constant, no warm-up); precision,
    as `torch_autocast.enabled` (autocast in another dtype than training.precision) and
    `data_types.param_dtype`, `grad_accum_dtype`, `buffer_dtype`, which must name training.precision's dtype
    (DeepSpeed asserts param_dtype against fp16/bf16 at initialize; a dtype name it does not know fails
    there); and the pipeline's `stages`, `partition` and `activation_checkpoint_interval` (parallel.pp,
    parallel.pipeline.partition, training.recompute; dsforge.runtime reads the interval from ds_config.json).
    The same policy refuses another optimizer or scheduler type (DSF520), batch keys, ZeRO stage and fp16/bf16
    (DSF508), optimizer offload (DSF523) and gradient_clipping (DSF525)."""
    yield from _param_overrides(ctx)
    yield from _pipeline_overrides(ctx)
    yield from _data_types(ctx)
    autocast = ctx.spec.deepspeed.get("torch_autocast")
    if isinstance(autocast, dict) and autocast.get("enabled"):
        yield Finding(f"deepspeed.torch_autocast.enabled={autocast['enabled']!r} runs the forward pass under "
                      f"autocast, contradicting training.precision={ctx.spec.training.precision}",
                      "remove it and set training.precision", ("deepspeed", "torch_autocast", "enabled"))


def _param_overrides(ctx: Context) -> Iterator[Finding]:
    """`optimizer.params` and `scheduler.params` against what dsforge writes from the job."""
    stated = {"optimizer": optimizer_params(ctx.spec), "scheduler": scheduler_params(ctx.spec)}
    for section, values in stated.items():
        for key, value in _params(ctx, section).items():
            path = ("deepspeed", section, "params", key)
            if isinstance(value, float) and not math.isfinite(value) or _dsf521(section, key, value):
                continue  # DSF516's or DSF521's
            if values is None:
                yield Finding(f"deepspeed.scheduler.params.{key} shapes a schedule the job does not have "
                              f"(training.scheduler is constant without warm-up)",
                              "remove it, or give training.scheduler a warm-up or decay", path)
            elif key == "max_grad_norm" and section == "optimizer":
                yield Finding("deepspeed.optimizer.params.max_grad_norm: DeepSpeed refuses it at initialize "
                              "(a ValueError: clipping is gradient_clipping)",
                              "remove it and set training.grad_clip", path)
            elif key not in values:
                if section == "optimizer":
                    continue  # an argument the job does not state (SGD's momentum, amsgrad, torch_adam): its
                              # own
                yield Finding(
                    f"deepspeed.scheduler.params.{key} is not a parameter dsforge writes from the job "
                    "(it writes " + ", ".join(sorted(values)) + "): DeepSpeed's schedulers take no others "
                    "but last_batch_iteration, which would shift the schedule",
                    "remove it",
                    path,
                )
            elif not same(value, values[key][0]):
                want, place = values[key]
                yield Finding(f"deepspeed.{section}.params.{key}={value!r} contradicts {place} (dsforge "
                              f"writes {want!r})", f"remove it and set {place.split(' ')[0]}", path)


def _pipeline_overrides(ctx: Context) -> Iterator[Finding]:
    pipe = ctx.spec.deepspeed.get("pipeline")
    if not isinstance(pipe, dict):
        return
    for key, (want, place) in pipeline_values(ctx.plan).items():
        if key in pipe and not same(pipe[key], want):
            yield Finding(f"deepspeed.pipeline.{key}={pipe[key]!r} contradicts {place} (the plan's {want!r})",
                          f"remove it and set {place.split(' ')[0]}", ("deepspeed", "pipeline", key))


def _data_types(ctx: Context) -> Iterator[Finding]:
    """data_types.param_dtype / grad_accum_dtype / buffer_dtype: DeepSpeed looks them up in DtypeEnum at
    initialize (an unknown name fails there, after parse) and trains with them; training.precision decides."""
    block = ctx.spec.deepspeed.get("data_types")
    if not isinstance(block, dict):
        return
    prec = ctx.spec.training.precision
    want = prec if prec in ("fp16", "bf16") else "fp32"
    for key in ("param_dtype", "grad_accum_dtype", "buffer_dtype"):
        value = block.get(key)
        if value is None:
            continue
        got = DTYPE_OF.get(value) if isinstance(value, str) else None
        if got != want:
            named = f"names {got}" if got else "is not a dtype DeepSpeed knows (it fails at initialize)"
            yield Finding(f"deepspeed.data_types.{key}={value!r} {named}, but training.precision={prec} "
                          f"trains in {want}", "remove it and set training.precision",
                          ("deepspeed", "data_types", key))


@rule("DSF528", "deepspeed sections dsforge does not model are refused as overrides",
      source="dsforge (dsforge/compiler/deepspeed/ds_sections.py REFUSED); " + DS + "runtime/config.py "
      "DeepSpeedConfig._initialize_params")
def refused_sections(ctx: Context) -> Iterator[Finding]:
    """dsforge checks every `deepspeed:` section value by value against what DeepSpeed 0.19.8 accepts (types,
    bounds, aliases, deprecated spellings, the checks of its parse: DSF507, DSF517-DSF519; values it reads
    without checking: DSF529): zero_optimization with its offload blocks and leaf_module, fp16, bf16,
    hybrid_engine, data_types, optimizer and scheduler (DSF520, DSF521, DSF527), pipeline,
    activation_checkpointing, checkpoint, torch_autocast, flops_profiler, aio, comms_logger, timers and the
    monitors (tensorboard, wandb, csv_monitor, comet). These it refuses outright: `zero_optimization.zenflow`
    (ZenFlow's selective, asynchronous updates are another update rule than training.optimizer; a top-level
    `zenflow`, which DeepSpeed ignores, likewise), `tensor_parallel` and `expert_parallel` (AutoTP and AutoEP,
    a second sharding of what dsforge.runtime already shards from parallel.tp and parallel.ep), `compile`
    (dsforge.runtime never calls engine.compile()), `autotuning` (DeepSpeed's autotuner re-chooses what the
    plan fixes; `dsforge search` ranks layouts), `data_efficiency` (needs DeepSpeed's own data loader and
    layer hooks), `checkpoint.writer` (DeepSpeed's fast and decoupled checkpoint writers read CROSS_SIZE and
    CROSS_RANK, which only DeepSpeed's own launcher sets: torch's launchers do not, so it is a KeyError at
    initialize under torchrun, SLURM and the rest) and `weight_quantization` (ZeRO-Inference weight
    quantization, numerics training.precision does not describe). A null `zenflow` or `writer` inside its
    section is DeepSpeed's default and passes. Passing them through unchecked would let a value DeepSpeed
    refuses, or one that changes the training, reach every rank.
    """
    ds = ctx.spec.deepspeed
    for name, why in REFUSED.items():
        parts = name.split(".")
        node: Any = ds
        for part in parts[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        # a null sub-section (zenflow, writer) is DeepSpeed's default; a null section still reaches its parser
        if isinstance(node, dict) and parts[-1] in node and (node[parts[-1]] is not None or len(parts) == 1):
            yield Finding(f"deepspeed.{name} is not an override dsforge takes: {why}", "remove it",
                          ("deepspeed", *parts), at_key=True)


@rule("DSF529", "deepspeed values DeepSpeed reads without checking have the type it uses",
      severity=Severity.WARNING,
      source=DS + "runtime/config.py (torch_autocast, checkpoint), runtime/model_checkpointing/config.py, "
      "profiling/config.py DeepSpeedFlopsProfilerConfig, "
      "runtime/swap_tensor/aio_config.py (get_scalar_param)")
def loosely_read(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed reads checkpoint, torch_autocast, flops_profiler and aio with plain dict lookups and accepts
    any value at parse (`flops_profiler.detailed: "maybe"`, `aio.block_size: "x"`); it uses them later, as a
    flag tested for truth (so the text "false" counts as true) or a number. validate is not stricter than
    DeepSpeed here: a warning, not an error."""
    active = _computing(ctx)
    for p in loose(ctx.spec.deepspeed):
        if not (p.path[0] in active and LOOSE_VALUES[p.path] != "bool"):  # those are DSF531's
            yield Finding(p.message, p.fix, ("deepspeed", *p.path))


def _computing(ctx: Context) -> set[str]:
    """The loosely read sections DeepSpeed computes with in this job: the flops profiler when it is enabled,
    the async-IO settings when ZeRO offloads to NVMe."""
    ds, out = ctx.spec.deepspeed, set()
    flops = ds.get("flops_profiler")
    if isinstance(flops, dict) and flops.get("enabled"):
        out.add("flops_profiler")
    zero = emitted_zero_block(ctx.plan)
    if any(isinstance(zero.get(k), dict) and zero[k].get("device") == "nvme"
           for k in ("offload_param", "offload_optimizer")):
        out.add("aio")
    return out


@rule("DSF531", "deepspeed values DeepSpeed computes with have the type it computes with",
      source=DS + "profiling/flops_profiler/profiler.py (profile_step, module_depth, top_modules, "
      "recompute_fwd_factor, output_file), runtime/swap_tensor "
      "(aio block_size, queue_depth, intra_op_parallelism)")
def loosely_read_computed(ctx: Context) -> Iterator[Finding]:
    """The values DSF529 warns about are errors where DeepSpeed computes with them: with the flops profiler
    enabled, text for `profile_step`, `module_depth`, `top_modules` or `recompute_fwd_factor` and a non-text
    `output_file` fail in the training step (measured: TypeError at the profiled step), and with ZeRO
    offloading to NVMe the aio sizes feed the swapper's buffers. Flags (`detailed`, `single_submit`, ...) are
    only tested for truth and stay warnings."""
    active = _computing(ctx)
    for p in loose(ctx.spec.deepspeed):
        if p.path[0] in active and LOOSE_VALUES[p.path] != "bool":
            message = p.message.replace("takes it without checking and uses it as",
                                        "computes with it here: it needs")
            yield Finding(message, p.fix, ("deepspeed", *p.path))


@rule("DSF530", "aio.use_gds needs a CUDA accelerator",
      source=DS + "runtime/swap_tensor/aio_config.py get_aio_config")
def aio_gds(ctx: Context) -> Iterator[Finding]:
    """GPUDirect Storage exists only for CUDA devices: DeepSpeed asserts it while it parses the config, on
    every rank, when `aio.use_gds` is true on another accelerator (the CPU ranks of `cpu-local`)."""
    aio = ctx.spec.deepspeed.get("aio")
    if isinstance(aio, dict) and aio.get("use_gds") and on_cpu(ctx.plan):
        yield Finding("deepspeed.aio.use_gds needs a CUDA accelerator, and the job runs on CPU ranks",
                      "remove use_gds", ("deepspeed", "aio", "use_gds"))


#: The package each DeepSpeed monitor imports when it is enabled (monitor/utils.py check_*_availability).
MONITOR_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml (>= 3.41.0)"}


@rule("DSF532", "an enabled DeepSpeed monitor needs its package on every rank", severity=Severity.WARNING,
      source=DS + "monitor/utils.py check_tb_availability, "
                  "check_wandb_availability, check_comet_availability")
def monitor_packages(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed's tensorboard, wandb and comet monitors import their package at initialize and fail on every
    rank without it (measured: ModuleNotFoundError for tensorboard). None of them is a dependency of
    dsforge[runtime], and validate cannot see the ranks' environment, so this is a warning (csv_monitor needs
    nothing)."""
    for key, package in MONITOR_PACKAGES.items():
        block = ctx.spec.deepspeed.get(key)
        if isinstance(block, dict) and _enabled(MODELS[key]["enabled"], block.get("enabled", False)):
            yield Finding(f"deepspeed.{key}.enabled needs the {package} package installed where the ranks "
                          f"run (DeepSpeed imports it at initialize)",
                          f"install {package.split(' ')[0]} with dsforge, " f"or remove {key}",
                          ("deepspeed", key, "enabled"))


def _enabled(field: Field, value: Any) -> bool:
    """True when pydantic reads ``value`` as true for ``field`` ("yes" and 1 included)."""
    try:
        return coerce(field, value) is True
    except Invalid:
        return False  # DSF517's


@rule("DSF533", "DeepSpeed's Adam kernels take no AMSGrad",
      source=DS + "ops/adam/fused_adam.py FusedAdam.__init__, ops/adam/cpu_adam.py "
      "DeepSpeedCPUAdam.add_param_group; runtime/engine.py get_optimizer_configuration (torch_adam)")
def adam_amsgrad(ctx: Context) -> Iterator[Finding]:
    """`optimizer.params.amsgrad: true` is passed to the Adam DeepSpeed builds: FusedAdam and DeepSpeedCPUAdam
    (ZeRO optimizer offload) raise "does not support the AMSGrad variant" at initialize on every rank; only
    torch's AdamW (`torch_adam`, which dsforge writes on CPU ranks without offload) has it."""
    t = ctx.spec.training
    params = _params(ctx, "optimizer")
    if t.optimizer.name not in ("adam", "adamw") or not params.get("amsgrad"):
        return
    torch_adam = params.get("torch_adam", on_cpu(ctx.plan) and t.optimizer.offload == "none")
    if not torch_adam:
        yield Finding("deepspeed.optimizer.params.amsgrad: DeepSpeed's FusedAdam and DeepSpeedCPUAdam refuse "
                      "AMSGrad at initialize", "remove amsgrad, or add "
                                       "optimizer.params.torch_adam: true (torch's AdamW)",
                      ("deepspeed", "optimizer", "params", "amsgrad"))
