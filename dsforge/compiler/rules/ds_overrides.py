"""DSF510-DSF519: `deepspeed:` overrides that DeepSpeed accepts at parse but refuses once every rank runs.

Each check reads the raw override values, which may hold anything a person typed, so every value is
type-checked before any arithmetic (a string where a number belongs is DeepSpeed's parse error, not
an internal error here).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

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
        if _get(ctx, section, key) is True and ctx.plan.zero == 0:
            yield Finding(f"deepspeed.{section}.{key} needs ZeRO stage 1-3, but parallel.zero=0",
                          f"set parallel.zero: 1 (or 2, 3), or remove {key}", ("deepspeed", section, key))
    if _get(ctx, "bf16", "bf16_optimizer_states") is True and _get(ctx, "bf16", "bf16_master_weights_and_grads") \
            is not True:
        yield Finding("deepspeed.bf16.bf16_optimizer_states needs bf16_master_weights_and_grads: true",
                      "add bf16_master_weights_and_grads: true, or remove bf16_optimizer_states",
                      ("deepspeed", "bf16", "bf16_optimizer_states"))


@rule("DSF511", "LAMB needs dynamic loss scaling", source=DS + "runtime/engine.py DeepSpeedEngine._do_sanity_check")
def lamb_dynamic_loss_scale(ctx: Context) -> Iterator[Finding]:
    """DeepSpeed's LAMB asserts dynamic loss scaling at initialize; a fixed `fp16.loss_scale` (any value
    other than 0) turns dynamic scaling off."""
    scale = _get(ctx, "fp16", "loss_scale")
    if ctx.spec.training.optimizer.name == "lamb" and isinstance(scale, (int, float)) and scale != 0:
        yield Finding(f"optimizer lamb with deepspeed.fp16.loss_scale={scale}: DeepSpeed's LAMB needs dynamic "
                      "loss scaling", "set fp16.loss_scale: 0 (dynamic), or use adamw",
                      ("deepspeed", "fp16", "loss_scale"))


@rule("DSF512", "managed_gradient_accumulation: false fits the layout",
      source=DS + "runtime/engine.py DeepSpeedEngine._do_sanity_check")
def unmanaged_accumulation(ctx: Context) -> Iterator[Finding]:
    """With `managed_gradient_accumulation: false` DeepSpeed refuses pipeline parallelism and supports
    ZeRO's overlap_comm only when gradients are partitioned (ZeRO-2 or 3); both are asserted at
    initialize, after every rank has started."""
    if _get(ctx, "managed_gradient_accumulation") is not False:
        return
    d, path = ctx.plan.degrees, ("deepspeed", "managed_gradient_accumulation")
    if d is not None and d.pp > 1:
        yield Finding(f"managed_gradient_accumulation=false is refused with pipeline parallelism (pp={d.pp})",
                      "remove managed_gradient_accumulation, or use pp: 1", path)
    if _get(ctx, "zero_optimization", "overlap_comm") is True and ctx.plan.zero < 2:
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
        yield Finding(f"autoep_size={size} does not divide moe.experts={moe.experts}: each rank must own whole "
                      "experts", f"use autoep_size in {choices(divisors(moe.experts))}", path)


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
        yield Finding(f"compile pass autosp with zero={ctx.plan.zero}: DeepSpeed silently falls back to plain "
                      "torch.compile", "use zero: 0 or 1 with autosp, or drop the pass", path)
    if "autotp" in passes and ({"autosp", "z1", "z3"} & set(passes)):
        yield Finding("compile pass autotp cannot be combined with autosp or the ZeRO passes (NotImplementedError "
                      "at the first compile)", "run autotp on its own", path, Severity.ERROR)


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
