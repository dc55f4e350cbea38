"""DeepSpeed 0.19.8 as the oracle for `deepspeed:` overrides: does `validate` accept exactly what DeepSpeed accepts?

A case is an example job (or a tiny one-rank CPU job) with one to three changes: `deepspeed:` overrides of the
ZeRO stage and knobs, offload blocks, precision sections, batch keys, optimizer and scheduler types and
parameters, pipeline and activation-checkpointing sections, top-level values, unknown keys and wrong types,
every other section of DeepSpeed's config (`SECTIONS`: the monitors, comms_logger, timers, checkpoint,
torch_autocast, flops_profiler, aio, leaf_module, and the ones dsforge refuses), or job settings
(parallel.zero, training.precision, optimizer, offload, recompute). Each case goes through
`validate` and, whatever validate says, through DeepSpeed's own parse: the ds_config compile would write
(`build_ds_config`, written and read back as JSON, as the runtime reads ds_config.json) is given to
`DeepSpeedConfig` with an mpu whose data-parallel size is the plan's dp. With ``--init N`` the first N cases
of the one-rank job also run `deepspeed.initialize` on a small model and one training step on one CPU process.

Classes (counted and printed):

* ``both accept`` / ``both refuse``: agreement;
* ``MISSED``: validate is clean and DeepSpeed refuses (at parse, or at initialize / the first step): target 0;
* ``FALSE ALARM``: validate refuses only with rules that claim DeepSpeed's parse refuses (`PARSE_RULES`), and
  DeepSpeed parses the config (and, when run, trains);
* ``refused by design``: validate refuses with rules for what DeepSpeed accepts at parse but fails on
  later, or for an override that would change what the job says (the job's values are authoritative);
* ``RUNS SOMETHING ELSE``: both accept, but DeepSpeed's parsed config differs from the job (ZeRO stage,
  precision, batch, optimizer and its lr/betas/eps/weight decay, scheduler type and parameters, gradient
  clipping, autocast, offload) or drops an override's value (a ZeRO setting another spelling hides);
* ``not emitted``: validate refuses and the plan cannot be emitted (a layout or batch error), so there is
  nothing to give DeepSpeed (a validate-clean job that cannot be emitted counts as MISSED).

    python benchmarks/ds_differential.py --n 3000 [--seed 0] [--init 200] [--show 5]

exits 1 when MISSED, FALSE ALARM or RUNS SOMETHING ELSE is not 0.
tests/compiler/deepspeed/test_ds_differential.py draws the same changes from hypothesis for a bounded number
of cases in CI, and runs a small initialize sample (slow).
"""  # noqa: E501

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import yaml

AGREE_OK, AGREE_NO, MISSED, FALSE_ALARM = "both accept", "both refuse", "MISSED", "FALSE ALARM"
BY_DESIGN, ELSE, NOT_EMITTED = "refused by design", "RUNS SOMETHING ELSE", "not emitted"
CLASSES = (AGREE_OK, AGREE_NO, MISSED, FALSE_ALARM, BY_DESIGN, ELSE, NOT_EMITTED)
FAILURES = (MISSED, FALSE_ALARM, ELSE)
#: Rules that say "DeepSpeed's config parse refuses this": if DeepSpeed parses it, they raised a false alarm.
PARSE_RULES = {"DSF507", "DSF509", "DSF510", "DSF516", "DSF517", "DSF518", "DSF519", "DSF530"}

TINY_ONE_RANK = {
    "version": 1, "name": "oracle-one-rank", "model": {"preset": "tiny-gpt2"},
    "hardware": {"preset": "cpu-local", "gpus_per_node": 1}, "parallel": {"zero": 1},
    "training": {"global_batch": 4, "micro_batch": 2, "precision": "fp32", "steps": 4,
                 "optimizer": {"name": "adamw", "lr": 1.0e-3},
                 "scheduler": {"name": "cosine", "warmup_steps": 1}},
}


def seed_jobs() -> dict[str, dict[str, Any]]:
    """The examples (their `extends:` chains merged) that validate clean, and the one-rank CPU job."""
    from dsforge.compiler.frontend.extends import load_document
    from dsforge.compiler.validate import validate_file
    from dsforge.diagnostics import has_errors

    seeds = {"one-rank": TINY_ONE_RANK}
    with tempfile.TemporaryDirectory() as tmp:
        for path in sorted((ROOT / "examples").glob("*.yaml")):
            result = validate_file(path)
            if result.job is None or has_errors(result.diagnostics):
                continue
            raw, _ = load_document(path)
            raw.pop("extends", None)
            # kept only when it still validates clean and emits from elsewhere (no relative paths, no `auto`)
            judged = judge(Case(path.stem, [], raw), Path(tmp))
            if judged.config is not None and not judged.errors:
                seeds[path.stem] = raw
    return seeds


# --- the changes -----------------------------------------------------------------------------------------

INTS = [0, -1, 1, 1.5, 5.0e8, "5e8", "500000000", None, "auto", True, "yes", 2**70, 200_000_000]
BOOLS = [True, False, "true", "false", "yes", "no", "on", 1, 0, 2, None, "maybe", 1.0, "auto"]
ZERO_INT_KEYS = ["reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size",
                 "stage3_prefetch_bucket_size", "sub_group_size", "param_persistence_threshold",
                 "stage3_param_persistence_threshold", "stage3_max_live_parameters", "max_live_parameters",
                 "zero_hpz_partition_size", "stage3_model_persistence_threshold",
                 "module_granularity_threshold"]
ZERO_BOOL_KEYS = ["overlap_comm", "contiguous_gradients", "reduce_scatter", "allgather_partitions",
                  "compute_grad_norm", "round_robin_gradients", "cpu_offload", "cpu_offload_param",
                  "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                  "stage3_gather_fp16_weights_on_model_save", "elastic_checkpoint",
                  "use_multi_rank_bucket_allreduce"]
DEVICES = ["cpu", "nvme", "none", "gpu", "CPU", None, 1]
FP16_KEYS = {"loss_scale": [0, 128, -1, 0.5, ".inf", "12", True, None, "auto"],
             "initial_scale_power": [16, 12.5, 12.0, "12", -3, None],
             "loss_scale_window": [1000, 0, -5, 2.5, True, "100"], "min_loss_scale": [1, 0, 0.5, True],
             "hysteresis": [2, 0, "2", 2.5], "enabled": BOOLS, "fp16_master_weights_and_grads": BOOLS,
             "consecutive_hysteresis": BOOLS, "auto_cast": BOOLS}
BF16_KEYS = {"enabled": BOOLS, "bf16_master_weights_and_grads": BOOLS, "bf16_optimizer_states": BOOLS,
             "immediate_grad_update": BOOLS, "check_grad_overflow": BOOLS}
TOP = {"wall_clock_breakdown": [True, False, "on", 1, 1.5, None, "yes"],
       "steps_per_print": [1, 10, "10", 0, None], "gradient_clipping": [0.0, 1.0, "1.0", None, -1],
       "communication_data_type": ["fp16", "FP16", "fp32", "Bf16", "fp8", 1, None],
       "seq_parallel_communication_data_type": ["fp32", "FP32", "int8"],
       "gradient_allreduce_op": ["sum", "SUM", "mean", "Mean", "avg", 1, None],
       "prescale_gradients": [True, False], "gradient_predivide_factor": [1.0, 2.0, 1, "2"],
       "managed_gradient_accumulation": [False, True],
       "zero_optimization": [False, True, None, 1, "stage2", []],
       "zero_allow_untested_optimizer": [True, False], "memory_breakdown": [True, False],
       "dump_state": [True], "unknown_key_xyz": [1], "bfloat16": [{"enabled": False}, None],
       "fp16": [None, True, {}, {"enabled": False}], "bf16": [None, True, {}, {"enabled": False}],
       "optimizer": [None, "adamw", {}, {"type": None}], "scheduler": [None, "cosine", {}],
       "pipeline": ["1f1b", None, {}, {"activation_checkpoint_interval": 1}, {"stagez": 2}],
       "activation_checkpointing": [None, {}, {"partition_activations": True}, "full"],
       "hybrid_engine": [{"enabled": False}, {"max_out_tokens": 0}, None],
       "data_types": [{"keep_in_fp32_modules": ["norm"]}, {"keep_in_fp32_modules": "norm"},
                      {"grad_accum_dtype": "fp32"}, {"grad_accum_dtype": "bf17"}, {"param_dtype": "bf16"},
                      {"param_dtype": "float32"}, {"buffer_dtype": "fp32"}, {"param_dtype": None},
                      {"grad_acum_dtype": "fp32"}]}
BATCH = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"]
OPT_TYPES = ["AdamW", "adamw", "ADAM", "Adam", "SGD", "Lion", "Lamb", "Adagrad", 3]
SCHED_TYPES = ["WarmupCosineLR", "WarmupLR", "WarmupDecayLR", "OneCycle", None, "warmupcosinelr"]
JOB = {("parallel", "zero"): [0, 1, 2, 3], ("training", "precision"): ["fp32", "bf16", "fp16"],
       ("training", "optimizer", "name"): ["adamw", "adam", "lion", "lamb", "sgd"],
       ("training", "optimizer", "offload"): ["none", "cpu", "nvme"],
       ("training", "recompute"): ["none", "selective", "full"], ("training", "grad_clip"): [0.0, 1.0]}
#: Whole sections (or ZeRO sub-sections), drawn for every section of DeepSpeed 0.19.8's config that the other
#: kinds do not draw: modelled ones (valid values, wrong types, misspelt keys, null) and the ones dsforge
#: refuses (DSF528). Values that need what this oracle machine lacks are left out: a monitor's `enabled: true`
#: (the tensorboard/wandb/comet packages) and `aio.use_gds: true` on the GPU examples (GDS needs CUDA; the
#: oracle runs on CPU; tests/compiler/deepspeed/test_ds_sections.py checks it).
SECTIONS: dict[str, list[Any]] = {
    "torch_autocast": [{"dtype": "bf17"}, {"dtype": "bf16"}, {"dtype": "BF16"},
                       {"enabled": False, "dtype": "fp16"}, {"enabled": True}, {"enabled": "no"},
                       {"lower_precision_safe_modules": ["torch.nn.Linear"]},
                       {"lower_precision_safe_modules": [1]}, {"lower_precision_safe_modules": None}, None,
                       {"dtype": None}, {"enabled": False}, {"dtyp": "bf16"}],
    "checkpoint": [{"tag_validation": "bogus"}, {"tag_validation": "fail"}, {"tag_validation": "Ignore"},
                   {"tag_validation": None}, {"tag_validation": 1}, None, [], {"load_universal": "yes"},
                   {"load_universal": False}, {"parallel_write": {"pipeline_stage": 1}},
                   {"parallel_write": {"pipeline_stage": "yes"}}, {"parallel_write": None}, {"writer": "x"},
                   {"writer": {"type": "slow"}}, {"writer": {"data_parallel": "rack"}}, {"writer": None},
                   {"writer": {"type": "fast"}},
                   {"use_node_local_storage": True}, {"tag_validaton": "warn"},
                   {"checkpoint_serialization": False}],
    "flops_profiler": [{"enabled": True}, {"enabled": "yes"}, {"detailed": "maybe"}, {"profile_step": "1"},
                       {"enabled": False, "top_modules": 3}, None, [], {"output_file": 3}, {"enabledd": True},
                       {"enabled": True, "profile_step": "1"}, {"enabled": True, "module_depth": "x"},
                       {"enabled": True, "detailed": "maybe", "profile_step": 1}],
    "aio": [{"block_size": 1048576}, {"block_size": "x"}, None, [], {"use_gds": False}, {"queue_depth": 0},
            {"single_submit": "no"}, {"overlap_events": True, "intra_op_parallelism": 2}],
    "timers": [{"throughput": {"enabled": False}}, {"throughput": {"enabled": "maybe"}}, {"throughput": None},
               None, [], "abc", {"throughput": {"synchronized": "no"}}, {"throughput": {"x": 1}},
               {"other": 1}, {"throughput": "auto"}],
    "comms_logger": [{"enabled": True}, {"enabled": "maybe"}, None, {"prof_ops": "all_reduce"},
                     {"prof_ops": ["all_reduce"]}, {"verbos": True}, {"enabled": "auto"}, {"debug": 1}],
    "tensorboard": [{"enabled": False}, {"enabled": "maybe"}, None, {"output_path": None}, {"job_name": 3},
                    {"enabled": "auto"}, "auto", {"enabeld": True},
                    {"output_path": "/tmp/tb", "job_name": "j"}],
    "csv_monitor": [{"enabled": False}, {"enabled": "no"}, None, {"output_path": 3}, {"enabled": 2}],
    "wandb": [{"group": 1}, {"group": "g"}, {"enabled": False, "project": "p"}, None, {"team": None},
              {"project": None}],
    "comet": [{"samples_log_interval": "5"}, {"samples_log_interval": 1.5}, {"online": "maybe"},
              {"mode": "get"}, None, {"api_key": 3}, {"online": None}],
    "zero_optimization.leaf_module": [{"classes": "A"}, {"classes": ["A", 1]}, None, "x", {"names": "auto"},
                                      {"bad": 1}, {"name_suffixes": ["mlp"]}, {"names": ["model.layers.0"]}],
    "zero_optimization.zenflow": [{}, None, {"topk_ratio": 0.1}],
    "tensor_parallel": [{"autotp_size": 0}, {}, {"dtype": "bf16"}, {"autotp_sise": 2}, None,
                        {"autotp_size": 1}],
    "expert_parallel": [{"enabled": False}, {"autoep_sise": 2}, {}, None],
    "compile": [{"deepcompile": False}, {}, {"passes": ["bogus"]}, None],
    "autotuning": [{"enabled": False}, {}, {"enabled": "x"}, None],
    "data_efficiency": [{"enabled": False}, {}, {"data_sampling": {"enabled": "x"}}, None],
    "weight_quantization": [{}, {"enabled": "x"}, None],
    "zenflow": [{}, {"topk_ratio": 0.1}, None],
    "checkpoint.writer": [{"type": "fast"}, {"type": "python", "decoupled": True}, None, "x",
                          {"type": "slow"}],
}
#: scheduler parameters drawn by the `sched` kind (the job states them through training.scheduler and steps).
SCHED_PARAMS = {"warmup_num_steps": [0, 1, 5, -2, 2.5, "3"], "total_num_steps": [4, 8, 100000, 4.0, "4"],
                "warmup_type": ["linear", "log", "Linear", 1], "cos_min_ratio": [0.0, 0.1, 1, "0.1"],
                "warmup_min_ratio": [0.0, 1.0, 0.5], "warmup_min_lr": [0.0, 1e-5],
                "warmup_max_lr": [1e-3, 3e-4], "last_batch_iteration": [-1, 3], "bogus_param": [1]}
#: Sections the other kinds draw (and one change that sets each): with SECTIONS, every section of the config.
OTHER_SECTIONS: dict[str, tuple[str, int, int]] = {
    "zero_optimization": ("zero_int", 0, 12), "zero_optimization.offload_optimizer": ("offload", 0, 0),
    "zero_optimization.offload_param": ("offload", 1, 0), "fp16": ("fp16", 1, 1), "bf16": ("bf16", 0, 1),
    "optimizer": ("opt_params", 0, 0), "scheduler": ("sched", 1, 0),
    **{key: ("top", sorted(TOP).index(key), 0) for key in ("bfloat16", "hybrid_engine", "pipeline",
                                                             "activation_checkpointing", "data_types")},
}


def one_per_section() -> dict[str, list[tuple[str, int, int]]]:
    """For every section drawn, the changes of one case that sets it (the CI sample runs each)."""
    out = {name: [op] for name, op in OTHER_SECTIONS.items()}
    for name in SECTIONS:
        out[name] = [("section", sorted(SECTIONS).index(name), 0)]
    return out


KINDS = ("zero_int", "zero_bool", "zero_stage", "offload", "fp16", "bf16", "top", "batch", "opt_type",
         "opt_params", "sched", "job", "misspelt", "section")


def _ds(job: dict[str, Any]) -> dict[str, Any]:
    ds = job.get("deepspeed")
    if not isinstance(ds, dict):
        ds = job["deepspeed"] = {}
    return ds


def _zero(job: dict[str, Any]) -> dict[str, Any]:
    ds = _ds(job)
    if not isinstance(ds.get("zero_optimization"), dict):
        ds["zero_optimization"] = {}
    return ds["zero_optimization"]


def _value(v: Any) -> Any:
    return float("inf") if v == ".inf" else v


def apply_change(job: dict[str, Any], kind: str, a: int, b: int) -> str:
    """Apply one change of ``kind`` (chosen by the integers ``a`` and ``b``) to ``job``; returns its label."""
    pick = lambda pool, n: pool[n % len(pool)]
    if kind == "zero_int":
        key, v = pick(ZERO_INT_KEYS, a), pick(INTS, b)
        _zero(job)[key] = v
    elif kind == "zero_bool":
        key, v = pick(ZERO_BOOL_KEYS, a), pick(BOOLS, b)
        _zero(job)[key] = v
    elif kind == "zero_stage":
        key, v = "stage", pick([0, 1, 2, 3, 4, None, "2", 1.0, True, "auto"], b)
        _zero(job)[key] = v
    elif kind == "offload":
        section = pick(["offload_optimizer", "offload_param"], a)
        block = pick([{"device": pick(DEVICES, b)}, {"device": "cpu", "pin_memory": pick(BOOLS, b)},
                      {"device": "cpu", "ratio": pick([0.5, 1.0, 1.5, "0.3"], b)},
                      {"device": "cpu", "pin_memry": 1}, {"device": "nvme", "nvme_path": "/local_nvme"}, None,
                      "cpu"], a // 2)
        key, v = section, block
        _zero(job)[key] = v
    elif kind in ("fp16", "bf16"):
        keys = FP16_KEYS if kind == "fp16" else BF16_KEYS
        key = pick(sorted(keys), a)
        v = _value(pick(keys[key], b))
        ds = _ds(job)
        if not isinstance(ds.get(kind), dict):
            ds[kind] = {}
        ds[kind][key] = v
    elif kind == "top":
        key = pick(sorted(TOP), a)
        v = copy.deepcopy(pick(TOP[key], b))
        _ds(job)[key] = v
    elif kind == "batch":
        key = pick(BATCH, a)
        v = pick([4, 8.0, 4.0, True, "4", None, 2, 0], b)
        _ds(job)[key] = v
    elif kind == "opt_type":
        key, v = "optimizer.type", pick(OPT_TYPES, b)
        ds = _ds(job)
        ds["optimizer"] = {**(ds["optimizer"] if isinstance(ds.get("optimizer"), dict) else {}), "type": v}
    elif kind == "opt_params":
        name = pick(["lr", "betas", "eps", "weight_decay", "torch_adam", "amsgrad", "max_grad_norm",
                     "adam_w_mode"],
                    a)
        v = pick({"lr": [1e-4, -1e-3, "1e-3", 0], "betas": [[0.9, 0.95], [0.9], [0.9, 1.5], "0.9"],
                  "eps": [1e-8, -1.0], "weight_decay": [0.0, 0.1, -0.1], "torch_adam": [True],
                  "amsgrad": [True, False], "max_grad_norm": [1.0, "x"],
                  "adam_w_mode": [False, True]}[name], b)
        key = f"optimizer.params.{name}"
        ds = _ds(job)
        opt = ds["optimizer"] if isinstance(ds.get("optimizer"), dict) else {}
        opt["params"] = {**(opt["params"] if isinstance(opt.get("params"), dict) else {}), name: v}
        ds["optimizer"] = opt
    elif kind == "sched":
        ds = _ds(job)
        if a % 2:
            key, v = "scheduler.type", pick(SCHED_TYPES, b)
            ds["scheduler"] = {"type": v}
        else:
            name = pick(list(SCHED_PARAMS), a // 2)
            key, v = f"scheduler.params.{name}", pick(SCHED_PARAMS[name], b)
            block = ds["scheduler"] if isinstance(ds.get("scheduler"), dict) else {}
            block["params"] = {**(block["params"] if isinstance(block.get("params"), dict) else {}), name: v}
            ds["scheduler"] = block
    elif kind == "section":
        key = pick(sorted(SECTIONS), a)
        v = copy.deepcopy(pick(SECTIONS[key], b))  # a later change may edit it in place: never the pool's own
        if key.startswith("zero_optimization."):
            _zero(job)[key.split(".", 1)[1]] = v
        elif "." in key:  # a sub-section: inside its section (made a mapping when it is not one)
            outer, inner = key.split(".", 1)
            ds = _ds(job)
            ds[outer] = {**(ds[outer] if isinstance(ds.get(outer), dict) else {}), inner: v}
        else:
            _ds(job)[key] = v
    elif kind == "job":
        path = pick(sorted(JOB), a)
        v = pick(JOB[path], b)
        node = job
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = v
        key = ".".join(path)
    else:  # misspelt keys in the sections DeepSpeed checks
        where = pick(["zero", "fp16", "bf16", "offload"], a)
        key = pick(["reduce_bucket_sise", "stage3_prefetch_bucket", "enable", "loss_scael"], b)
        v = 1
        if where == "zero":
            _zero(job)[key] = v
        elif where == "offload":
            _zero(job)["offload_optimizer"] = {"device": "cpu", key: v}
        else:
            _ds(job)[where] = {key: v}
    return f"{kind}:{key}={v!r}"


@dataclass
class Case:
    """One generated job: its seed, the changes applied, and the job document."""

    seed: str
    changes: list[str]
    job: dict[str, Any]


def make_case(seeds: dict[str, dict[str, Any]], seed: str, ops: list[tuple[str, int, int]]) -> Case:
    """A copy of ``seeds[seed]`` with the changes ``ops`` (kind, a, b) applied."""
    job = json.loads(json.dumps(seeds[seed]))
    return Case(seed, [apply_change(job, kind, a, b) for kind, a, b in ops], job)


def random_cases(seeds: dict[str, dict[str, Any]], n: int, rng: random.Random) -> Iterator[Case]:
    """``n`` cases with one to three random changes each."""
    names = sorted(seeds)
    for _ in range(n):
        ops = [(rng.choice(KINDS), rng.randrange(10**6),
                rng.randrange(10**6)) for _ in range(rng.randint(1, 3))]
        yield make_case(seeds, rng.choice(names), ops)


# --- dsforge's side ----------------------------------------------------------------------------------------

@dataclass
class Judged:
    """What dsforge says about a case: its error ids, and the ds_config compile would write (None: none)."""

    errors: list[str]
    config: dict[str, Any] | None
    dp: int
    expect: dict[str, Any] = field(default_factory=dict)


def judge(case: Case, folder: Path) -> Judged:
    """Validate the case's job file and build the ds_config compile would emit for its plan."""
    from dsforge.compiler.emit.ds_config import build_ds_config
    from dsforge.compiler.validate import validate_file
    from dsforge.diagnostics import Severity

    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(case.job, sort_keys=False), encoding="utf-8")
    result = validate_file(path)
    errors = sorted({d.rule for d in result.diagnostics if d.severity is Severity.ERROR})
    plan = result.plan
    if plan is None or plan.degrees is None or plan.grad_accum is None:
        return Judged(errors, None, 0, {"emit": "no plan"})
    try:
        config = json.loads(json.dumps(build_ds_config(plan), allow_nan=False))
    except Exception as exc:  # noqa: BLE001 - an unemittable plan is a class of its own
        return Judged(errors, None, 0, {"emit": f"{type(exc).__name__}: {exc}"})
    from dsforge.compiler.emit.optim import optimizer_section, scheduler_section

    t = plan.spec.training
    # what the job states, as dsforge writes it without any override (json: as DeepSpeed reads the file)
    opt = json.loads(json.dumps(optimizer_section(t.optimizer)["params"]))
    sched = json.loads(json.dumps(scheduler_section(t.scheduler, t.optimizer.lr, t.steps)))
    expect = {"stage": plan.zero, "fp16": t.precision == "fp16", "bf16": t.precision == "bf16",
              "batch": [t.global_batch, t.micro_batch, plan.grad_accum], "optimizer": t.optimizer.name,
              "offload": t.optimizer.offload if plan.zero else "none",
              "opt_params": {k: v for k, v in opt.items() if k in STATED_OPTIMIZER_PARAMS},
              "scheduler": [sched["type"], sched["params"]] if sched else [None, None],
              "clip": t.grad_clip, "autocast": False}
    if plan.degrees.pp > 1:  # dsforge.runtime reads the interval from ds_config.json (pp = 1: no pipeline
                             # engine)
        expect["pipeline"] = [plan.degrees.pp, 1 if t.recompute == "full" else 0]
    return Judged(errors, config, plan.degrees.dp, expect)


def classify(judged: Judged, oracle: dict[str, Any] | None) -> str:
    """The class of one case from dsforge's verdict and DeepSpeed's (None: nothing was emitted)."""
    if judged.config is None or oracle is None:
        return NOT_EMITTED if judged.errors else MISSED  # validate-clean, yet compile could not write it
    clean, accepted = not judged.errors, oracle["ok"]
    if clean and not accepted:
        return MISSED
    if not clean and accepted:
        return FALSE_ALARM if set(judged.errors) <= PARSE_RULES else BY_DESIGN
    if not clean:
        return AGREE_NO
    got = oracle.get("summary", {})
    if any(_differs(k, got.get(k), v) for k, v in judged.expect.items()) or oracle.get("dropped"):
        return ELSE
    return AGREE_OK


#: The optimizer parameters a job states (training.optimizer): DeepSpeed must end up with dsforge's values.
STATED_OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode")


def _differs(key: str, got: Any, want: Any) -> bool:
    """True when DeepSpeed's parsed value of ``key`` is not the job's (optimizer params: the stated ones)."""
    if key == "opt_params":
        return not isinstance(got, dict) or any(k not in got or got[k] != v or isinstance(got[k], bool) !=
                                                isinstance(v, bool) for k, v in want.items())
    return bool(got != want)


# --- DeepSpeed's side: a worker process that imports it once ----------------------------------------------

MARK = "@@oracle "  # DeepSpeed prints to stdout too: the worker's answers carry this prefix
WORKER = f"MARK = {MARK!r}\n" + r'''
import json, os, socket, sys, logging
os.environ.setdefault("DS_ACCELERATOR", "cpu")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.utils import logger
logger.setLevel(logging.ERROR)
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)

class Mpu:
    def __init__(self, dp): self.dp = dp
    def get_data_parallel_world_size(self): return self.dp

def summary(c):
    off = c.zero_config.offload_optimizer
    name = c.optimizer_name.lower() if isinstance(c.optimizer_name, str) else c.optimizer_name
    return {"stage": int(c.zero_optimization_stage), "fp16": bool(c.float16_config.enabled),
            "bf16": bool(c.bfloat16_config.enabled),
            "batch": [c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps],
            "optimizer": name, "offload": getattr(off.device, "value", off.device) if off else "none",
            "opt_params": c.optimizer_params, "scheduler": [c.scheduler_name, c.scheduler_params],
            "clip": c.gradient_clipping, "autocast": bool(c.torch_autocast_enabled),
            "pipeline": [c.pipeline.get("stages"), c.pipeline.get("activation_checkpoint_interval")]}

def dropped(cfg, c, overrides):
    """ZeRO override values DeepSpeed does not end up with (another spelling of the setting won)."""
    z = overrides.get("zero_optimization")
    out = []
    if not isinstance(z, dict):
        return out
    for key, value in z.items():
        try:
            alone = DeepSpeedZeroConfig(**{key: value})
        except Exception:
            continue
        fields = DeepSpeedZeroConfig.model_fields
        name = next((n for n, f in fields.items() if f.alias == key), key)
        if name not in fields or (fields[name].json_schema_extra or {}).get("deprecated"):
            continue  # DeepSpeed moves a deprecated field onto its replacement and deletes it
        if name in alone.model_fields_set and getattr(alone, name) != getattr(c.zero_config, name):
            out.append(key)
    return out

def train_one_step(cfg):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    mb = cfg["train_micro_batch_size_per_gpu"]
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32
    for _ in range(engine.gradient_accumulation_steps()):
        x = torch.randn(mb, 16, dtype=dtype)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.destroy()

for line in sys.stdin:
    req = json.loads(line)
    cfg = req["config"]
    out = {"ok": True}
    try:
        c = DeepSpeedConfig(json.loads(json.dumps(cfg)), mpu=Mpu(req["dp"]))
    except BaseException as exc:
        out = {"ok": False, "stage": "parse", "error": f"{type(exc).__name__}: {exc}"[:300]}
    else:
        try:
            out["summary"] = summary(c)
            out["dropped"] = dropped(cfg, c, req.get("overrides") or {})
        except BaseException as exc:  # the oracle's own reading failed: shown, never counted as agreement
            out["summary"] = {"oracle error": f"{type(exc).__name__}: {exc}"[:300]}
    if out["ok"] and req.get("init"):
        try:
            train_one_step(json.loads(json.dumps(cfg)))
        except BaseException as exc:
            out = {**out, "ok": False, "stage": "initialize", "error": f"{type(exc).__name__}: {exc}"[:300]}
    sys.stdout.write(MARK + json.dumps(out) + "\n")
    sys.stdout.flush()
'''  # noqa: E501


class Oracle:
    """DeepSpeed 0.19.8 in a worker process: `ask` parses a config (and optionally trains one step)."""

    def __init__(self, python: str = sys.executable) -> None:
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        # in a folder of its own: what a config makes DeepSpeed write (profiler or monitor output) stays there
        self.folder = tempfile.TemporaryDirectory(prefix="dsforge-oracle-")
        self.proc = subprocess.Popen([python, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env, cwd=self.folder.name)

    def ask(self, config: dict[str, Any], dp: int, overrides: Any = None,
            init: bool = False) -> dict[str, Any]:
        """DeepSpeed's verdict on one config: {"ok", "error", "stage", "summary", "dropped"}."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"config": config, "dp": dp, "overrides": overrides,
                                          "init": init}) + "\n")
        self.proc.stdin.flush()
        line = ""
        while not line.startswith(MARK):
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the DeepSpeed worker died")
        verdict: dict[str, Any] = json.loads(line[len(MARK):])
        return verdict

    def close(self) -> None:
        """Stop the worker."""
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.folder.cleanup()


def run_case(case: Case, oracle: Oracle, folder: Path,
             init: bool = False) -> tuple[str, Judged, dict[str, Any] | None]:
    """Judge one case on both sides and classify it."""
    judged = judge(case, folder)
    if judged.config is None:
        return NOT_EMITTED, judged, None
    verdict = oracle.ask(judged.config, judged.dp, case.job.get("deepspeed"), init)
    return classify(judged, verdict), judged, verdict


def main(argv: list[str] | None = None) -> int:
    """Run a campaign and print the count of each class (exit 1 when a failure class is not 0)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", type=int, default=0, help="one-rank cases that also initialize and train")
    parser.add_argument("--show", type=int, default=5)
    args = parser.parse_args(argv)
    rng, seeds = random.Random(args.seed), seed_jobs()
    counts: Counter[str] = Counter()
    init_counts: Counter[str] = Counter()
    shown: dict[str, list[str]] = {}
    design: Counter[str] = Counter()  # the rules behind "refused by design"
    oracle, start = Oracle(), time.time()
    with tempfile.TemporaryDirectory() as tmp:
        cases = list(random_cases(seeds, args.n, rng))
        one_rank = [c for c in random_cases({"one-rank": seeds["one-rank"]}, args.init, rng)]
        for case, init in [(c, False) for c in cases] + [(c, True) for c in one_rank]:
            cls, judged, verdict = run_case(case, oracle, Path(tmp), init)
            (init_counts if init else counts)[cls] += 1
            if cls == BY_DESIGN:
                design.update(judged.errors)
            done = sum(counts.values()) + sum(init_counts.values())
            if done % 250 == 0:
                print(f"  {done} cases, {time.time() - start:.0f} s: {dict(counts)} {dict(init_counts)}",
                      flush=True)
            if (cls in FAILURES or cls == NOT_EMITTED) and len(shown.setdefault(cls, [])) < args.show:
                shown[cls].append(f"{case.seed} {case.changes} validate={judged.errors} "
                                  f"deepspeed={verdict or judged.expect.get('emit')}")
    oracle.close()
    print(f"{args.n} parse cases, {args.init} initialize cases, "
          f"{len(seeds)} seeds, {time.time() - start:.0f} s")
    for title, table in (("DeepSpeedConfig", counts), ("deepspeed.initialize + one step", init_counts)):
        print(f"-- {title}")
        for cls in CLASSES:
            print(f"  {cls:24s} {table[cls]}")
    print("-- refused by design, by rule: " + ", ".join(f"{r} {n}" for r, n in sorted(design.items())))
    for cls, lines in shown.items():
        print(f"== {cls}")
        for line in lines:
            print("  " + line)
    return 1 if any(counts[c] or init_counts[c] for c in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
