"""The optimizer and LR-schedule sections of ds_config.json, in DeepSpeed's own names and parameters.

Sources (deepspeed 0.19.8): runtime/engine.py ``_configure_basic_optimizer`` and
``get_optimizer_configuration`` (optimizer types and their parameters), runtime/lr_schedules.py
(``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``).
"""

from __future__ import annotations

from typing import Any

from dsforge.compiler.deepspeed.ds_settings import DS_OPTIMIZER, scheduler_type
from dsforge.compiler.spec.schema import OptimizerSpec, SchedulerSpec


def optimizer_section(opt: OptimizerSpec, torch_adam: bool = False) -> dict[str, Any]:
    """The ``optimizer`` block: DeepSpeed's type and the parameters its constructor takes."""
    params: dict[str, Any] = {"lr": opt.lr, "weight_decay": opt.weight_decay}
    if opt.name in ("adamw", "adam", "lamb"):
        params.update(betas=list(opt.betas), eps=opt.eps)
    elif opt.name == "lion":  # Lion has no epsilon (deepspeed/ops/lion)
        params["betas"] = list(opt.betas)
    if opt.name == "adam":
        # DeepSpeed's "Adam" runs AdamW (decoupled decay) unless adam_w_mode is false
        # (ADAM_W_MODE_DEFAULT = True in runtime/config.py); the job file asked for L2-coupled Adam.
        params["adam_w_mode"] = False
    if torch_adam and opt.name in ("adamw", "adam"):
        # torch.optim.AdamW instead of FusedAdam, whose first use JIT-compiles a C++ op (~65 s on 2 CPU cores,
        # research doc section 3a); on a CPU accelerator the fused kernel buys nothing.
        params["torch_adam"] = True
    return {"type": DS_OPTIMIZER[opt.name], "params": params}


def scheduler_section(sched: SchedulerSpec, lr: float, steps: int) -> dict[str, Any] | None:
    """The ``scheduler`` block for linear warm-up then cosine/linear decay or a constant rate; None for no
    schedule.

    DeepSpeed's warm-up schedulers refuse ``warmup_num_steps <= 0`` and stretch shorter warm-ups to
    2 steps (``max(2, warmup_num_steps)``), so a job without warm-up is expressed without one:
    cosine starts its warm-up at ratio 1.0 (a flat start) and a constant rate needs no scheduler at
    all; only linear decay cannot avoid DeepSpeed's 2-step warm-up (see below). The engine steps the
    scheduler after each optimizer step, so DeepSpeed's first step runs at the pre-start value
    (0 for WarmupCosineLR, warmup_min_lr otherwise) and decays reach their floor at iteration
    total_num_steps = training.steps (tests/compiler/emit/test_ds_config_deepspeed.py measures this).
    """
    warm = sched.warmup_steps
    if sched.name == "constant":
        if not warm:
            return None
        params: dict[str, Any] = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": warm,
                                  "warmup_type": "linear"}
        return {"type": scheduler_type(sched.name, warm), "params": params}
    if sched.name == "cosine":
        # WarmupCosineLR works in ratios of the optimizer's lr: the decay ends at cos_min_ratio * lr.
        params = {"total_num_steps": steps, "warmup_num_steps": max(1, warm),
                  "warmup_min_ratio": 0.0 if warm else 1.0, "cos_min_ratio": sched.min_lr / lr,
                  "warmup_type": "linear"}
        return {"type": scheduler_type(sched.name, warm), "params": params}
    # WarmupDecayLR uses one floor for both ends (WarmupLR.get_lr: min_lr + delta * gamma): warm-up starts
    # at warmup_min_lr and the linear decay ends there, so no ratio trick gives a flat start; without a
    # warm-up the job gets DeepSpeed's shortest one, 2 steps up from min_lr.
    params = {"total_num_steps": steps, "warmup_num_steps": max(1, warm),
              "warmup_min_lr": sched.min_lr, "warmup_max_lr": lr, "warmup_type": "linear"}
    return {"type": scheduler_type(sched.name, warm), "params": params}
