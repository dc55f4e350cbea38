"""The sections `dsforge.compiler.deepspeed.ds_sections` describes, the ones it refuses, and the override
policy (DSF527-DSF530).

The fast tests check `ds_schema.parse` and the rules offline; the slow ones compare the section models with
the installed DeepSpeed 0.19.8's pydantic models field by field, and `parse` with `DeepSpeedConfig` on
sections hypothesis draws (accept or refuse, case by case).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsforge.compiler.deepspeed.ds_keys import TOP_LEVEL_KEYS
from dsforge.compiler.deepspeed.ds_schema import MODELS, UNMODELLED, parse
from dsforge.compiler.deepspeed.ds_sections import LOOSE_KEYS, REFUSED, SECTION_MODELS, SECTION_NAMES, loose
from dsforge.compiler.emit.optim import optimizer_section, scheduler_section
from dsforge.compiler.rules.ds_job_values import optimizer_params, pipeline_values, same, scheduler_params
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import Severity
from tests.conftest import EXAMPLES

BASE: dict[str, Any] = {
    "version": 1, "name": "sections", "model": {"preset": "tiny-gpt2"},
    "hardware": {"preset": "cpu-local", "gpus_per_node": 1}, "parallel": {"zero": 1},
    "training": {"global_batch": 4, "micro_batch": 2, "precision": "fp32", "steps": 4,
                 "optimizer": {"name": "adamw", "lr": 1.0e-3},
                 "scheduler": {"name": "cosine", "warmup_steps": 1}},
}
CONFIG: dict[str, Any] = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
                          "gradient_accumulation_steps": 2}


def _rules(tmp_path: Path, deepspeed: dict[str, Any], **training: Any) -> dict[str, Severity]:
    job = {**BASE, "deepspeed": deepspeed, "training": {**BASE["training"], **training}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    return {d.rule: d.severity for d in validate_file(path).diagnostics}


def test_every_unmodelled_section_is_refused_with_a_rule(tmp_path: Path) -> None:
    assert set(UNMODELLED) == set(REFUSED)
    for name in UNMODELLED:
        parts = name.split(".")
        ds: dict[str, Any] = {parts[0]: {}} if len(parts) == 1 else {parts[0]: {parts[1]: {}}}
        assert _rules(tmp_path, ds).get("DSF528") is Severity.ERROR, name
        if len(parts) == 2:  # a null sub-section is DeepSpeed's default (nothing set); a null section is not
            assert "DSF528" not in _rules(tmp_path, {parts[0]: {parts[1]: None}}), name
        else:
            assert "DSF528" in _rules(tmp_path, {parts[0]: None}), name


def test_every_top_level_section_is_described_or_refused() -> None:
    """A section is a pydantic model (MODELS), parsed by ds_schema or ds_sections, or refused."""
    roots = {name.split(".")[0] for name in SECTION_NAMES}
    assert roots <= TOP_LEVEL_KEYS | {"bfloat16"}
    assert {m for m in SECTION_MODELS} <= set(MODELS)
    assert {path[0] for path in LOOSE_KEYS} <= roots


@pytest.mark.parametrize(("section", "path"), [
    ({"torch_autocast": {"dtype": "bf17"}}, ("torch_autocast", "dtype")),
    ({"torch_autocast": {"dtype": "BF16"}}, ("torch_autocast", "dtype")),
    ({"torch_autocast": None}, ("torch_autocast",)),
    ({"torch_autocast": {"lower_precision_safe_modules": [1]}},
     ("torch_autocast", "lower_precision_safe_modules")),
    ({"checkpoint": {"tag_validation": "bogus"}}, ("checkpoint", "tag_validation")),
    ({"checkpoint": {"tag_validation": None}}, ("checkpoint", "tag_validation")),
    ({"checkpoint": None}, ("checkpoint",)),
    ({"checkpoint": {"parallel_write": {"pipeline_stage": "yes"}}}, ("checkpoint", "parallel_write",
                                                                      "pipeline_stage")),
    ({"checkpoint": {"writer": {"type": "slow"}}}, ("checkpoint", "writer", "type")),
    ({"checkpoint": {"writer": "x"}}, ("checkpoint", "writer")),
    ({"tensorboard": None}, ("tensorboard",)),
    ({"tensorboard": {"output_path": None}}, ("tensorboard", "output_path")),
    ({"wandb": {"group": 1}}, ("wandb", "group")), ({"comet": {"samples_log_interval": 1.5}},
                                                     ("comet", "samples_log_interval")),
    ({"comms_logger": None}, ("comms_logger",)),
    ({"comms_logger": {"prof_ops": "x"}}, ("comms_logger", "prof_ops")), ({"timers": None}, ("timers",)),
    ({"timers": {"throughput": "auto"}}, ("timers", "throughput")),
    ({"timers": {"throughput": {"enabled": "maybe"}}}, ("timers", "throughput", "enabled")),
    ({"aio": []}, ("aio",)),
    ({"zero_optimization": {"leaf_module": "x"}}, ("zero_optimization", "leaf_module")),
    ({"zero_optimization": {"leaf_module": {"classes": ["A", 1]}}},
     ("zero_optimization", "leaf_module", "classes")),
    ({"zero_optimization": {"leaf_module": {"bad": 1}}}, ("zero_optimization", "leaf_module", "bad")),
])
def test_parse_names_what_deepspeed_refuses_in_the_sections(section: dict[str, Any],
                                                            path: tuple[str, ...]) -> None:
    assert path in [p.path for p in parse({**CONFIG, **section}, 1)]


@pytest.mark.parametrize("section", [
    {"tensorboard": {"enabled": "auto"}}, {"tensorboard": "auto"}, {"comms_logger": {"prof_ops": ["x", 1]}},
    {"timers": []}, {"timers": "abc"}, {"timers": {"throughput": {"enabled": "auto", "synchronized": "no"}}},
    {"torch_autocast": {"lower_precision_safe_modules": "torch.nn.Linear"}},
    {"torch_autocast": {"dtype": "bf16"}}, {"checkpoint": {"parallel_write": {"pipeline_stage": 1}}},
    {"checkpoint": {"writer": {"type": None}}},
    {"checkpoint": {"writer": {"type": "fast", "data_parallel": "socket"}}}, {"checkpoint": {"writer": None}},
    {"checkpoint": {"tag_validation": "fail", "load_universal": "yes"}},
    {"zero_optimization": {"leaf_module": None}}, {"zero_optimization": {"leaf_module": {"classes": "A"}}},
    {"zero_optimization": {"leaf_module": {"names": "auto"}}}, {"aio": None}, {"aio": {"block_size": "x"}},
    {"flops_profiler": {"detailed": "maybe"}}, {"comet": {"samples_log_interval": "5"}},
    {"csv_monitor": {"enabled": 1.0}},
])
def test_parse_accepts_what_deepspeed_accepts_in_the_sections(section: dict[str, Any]) -> None:
    assert parse({**CONFIG, **section}, 1) == []


def test_loosely_read_values_warn_and_do_not_refuse(tmp_path: Path) -> None:
    """DeepSpeed takes flops_profiler.detailed: "maybe": validate warns (DSF529), as DeepSpeed runs it."""
    assert _rules(tmp_path, {"flops_profiler": {"detailed": "maybe"}}) == {"DSF529": Severity.WARNING}
    assert _rules(tmp_path, {"checkpoint": {"load_universal": "yes", "tag_valdation": "warn"}}) == {
        "DSF529": Severity.WARNING, "DSF507": Severity.WARNING}
    assert _rules(tmp_path,
                  {"flops_profiler": {"detailed": False, "profile_step": 2}, "aio": {"block_size": 4096}}) \
        == {}
    assert [p.path for p in loose({"aio": {"single_submit": "no",
                                           "queue_depth": 8}})] == [("aio", "single_submit")]


def test_loose_values_deepspeed_computes_with_are_errors_where_it_does(tmp_path: Path) -> None:
    """With the profiler on, text for profile_step fails in the training step (DSF531); off, it is unused."""
    assert _rules(tmp_path,
                  {"flops_profiler": {"enabled": True, "profile_step": "1"}}) == {"DSF531": Severity.ERROR}
    assert _rules(tmp_path, {"flops_profiler": {"enabled": False, "profile_step": "1"}}) == {
        "DSF529": Severity.WARNING}
    assert _rules(tmp_path, {"flops_profiler": {"enabled": True, "detailed": "maybe"}}) == {
        "DSF529": Severity.WARNING}  # a flag: only tested for truth
    assert _rules(tmp_path, {"aio": {"block_size": "x"}}) == {"DSF529": Severity.WARNING}  # no NVMe offload


def test_an_enabled_monitor_warns_about_its_package(tmp_path: Path) -> None:
    assert _rules(tmp_path, {"wandb": {"enabled": "yes"}}) == {"DSF532": Severity.WARNING}  # pydantic: true
    assert _rules(tmp_path, {"tensorboard": {"enabled": False}, "csv_monitor": {"enabled": True}}) == {}


def test_amsgrad_only_where_torch_s_adamw_runs(tmp_path: Path) -> None:
    amsgrad = {"optimizer": {"params": {"amsgrad": True}}}
    assert _rules(tmp_path, amsgrad) == {}  # CPU ranks without offload: dsforge writes torch_adam
    offload = {"name": "adamw", "lr": 1.0e-3, "offload": "cpu"}
    assert _rules(tmp_path, amsgrad, optimizer=offload) == {"DSF533": Severity.ERROR}  # DeepSpeedCPUAdam
    assert _rules(tmp_path, {"optimizer": {"params": {"amsgrad": True, "torch_adam": True}}},
                  optimizer=offload) == {}


def test_section_problems_are_errors_of_the_parse_rules(tmp_path: Path) -> None:
    assert _rules(tmp_path, {"torch_autocast": {"dtype": "bf17"}}) == {"DSF517": Severity.ERROR}
    assert _rules(tmp_path, {"checkpoint": {"tag_validation": "bogus"}}) == {"DSF517": Severity.ERROR}
    assert _rules(tmp_path, {"checkpoint": None}) == {"DSF518": Severity.ERROR}
    assert _rules(tmp_path, {"wandb": {"grup": "g"}}) == {"DSF507": Severity.ERROR}
    assert _rules(tmp_path, {"aio": {"use_gds": True}}) == {"DSF530": Severity.ERROR}
    assert _rules(tmp_path, {"aio": {"use_gds": False}}) == {}


@pytest.mark.parametrize(("deepspeed", "place"), [
    ({"optimizer": {"params": {"lr": 2.0e-3}}}, "training.optimizer.lr"),
    ({"optimizer": {"params": {"betas": [0.8, 0.9]}}}, "training.optimizer.betas"),
    ({"optimizer": {"params": {"eps": 1.0e-6}}}, "training.optimizer.eps"),
    ({"optimizer": {"params": {"weight_decay": 0.1}}}, "training.optimizer.weight_decay"),
    ({"optimizer": {"params": {"adam_w_mode": False}}}, "training.optimizer.name"),
    ({"optimizer": {"params": {"max_grad_norm": 1.0}}}, "gradient_clipping"),  # a ValueError at initialize
    ({"scheduler": {"params": {"total_num_steps": 8}}}, "training.steps"),
    ({"scheduler": {"params": {"total_num_steps": 4.0}}}, "training.steps"),
    ({"scheduler": {"params": {"warmup_num_steps": 3}}}, "training.scheduler.warmup_steps"),
    ({"scheduler": {"params": {"warmup_type": "log"}}}, "training.scheduler.name"),
    ({"scheduler": {"params": {"cos_min_ratio": 0.1}}}, "training.scheduler.min_lr"),
    ({"scheduler": {"params": {"warmup_min_ratio": 0.5}}}, "training.scheduler.warmup_steps"),
    ({"scheduler": {"params": {"last_batch_iteration": 3}}}, "it writes"),
    ({"torch_autocast": {"enabled": True}}, "training.precision"),
    ({"torch_autocast": {"enabled": "false"}}, "training.precision"),  # text: true to DeepSpeed
    ({"pipeline": {"stages": 2}}, "parallel.pp"),
    ({"data_types": {"param_dtype": "bf16"}}, "training.precision"),
    ({"data_types": {"grad_accum_dtype": "bf17"}}, "training.precision"),  # fails at initialize, not at parse
    ({"data_types": {"buffer_dtype": "half"}}, "training.precision"),
])
def test_an_override_of_a_value_the_job_states_is_refused_naming_both(tmp_path: Path,
                                                                      deepspeed: dict[str, Any],
                                                                       place: str) -> None:
    job = {**BASE, "deepspeed": deepspeed}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    found = [d for d in validate_file(path).diagnostics if d.rule == "DSF527"]
    assert found and found[0].severity is Severity.ERROR
    assert place in found[0].message and "deepspeed." in found[0].message


def test_restating_the_job_s_values_passes(tmp_path: Path) -> None:
    same_values = {"optimizer": {"params": {"lr": 1.0e-3, "betas": [0.9, 0.95], "eps": 1.0e-8,
                                            "weight_decay": 0, "adam_w_mode": True, "torch_adam": True}},
                   "scheduler": {"params": {"total_num_steps": 4, "warmup_num_steps": 1,
                                            "warmup_type": "linear", "cos_min_ratio": 0.0,
                                            "warmup_min_ratio": 0.0}},
                   "torch_autocast": {"enabled": False},
                   "data_types": {"param_dtype": "float", "grad_accum_dtype": "fp32", "buffer_dtype": None}}
    assert _rules(tmp_path, same_values) == {}
    # an argument the job does not state is the override's own (the e2e tests give SGD a momentum this way)
    assert _rules(tmp_path,
                  {"optimizer": {"params": {"momentum": 0.9}}, "zero_allow_untested_optimizer": True},
                  optimizer={"name": "sgd", "lr": 1.0e-3}) == {}
    # a job without a schedule (constant, no warm-up) has nothing for scheduler.params to shape
    assert "DSF527" in _rules(tmp_path, {"scheduler": {"params": {"warmup_num_steps": 2}}},
                              scheduler={"name": "constant"})


def test_same_compares_what_deepspeed_would_run() -> None:
    assert same(0, 0.0) and same(1.0e-3, 0.001) and same([0.9, 0.95], [0.9, 0.95]) and same(4, 4)
    assert not same(4.0, 4) and not same(True, 1) and not same(1, True) and not same("linear", "Linear")
    assert not same([0.9], [0.9, 0.95]) and not same(float("nan"), 1.0)


def _spec(example: Path, optimizer: str, scheduler: str, warmup: int) -> Any:
    from dsforge.compiler.validate import validate_file as vf

    result = vf(example)
    if result.plan is None:
        return None
    spec = result.plan.spec
    t = spec.training
    training = t.model_copy(update={"optimizer": t.optimizer.model_copy(update={"name": optimizer}),
                                    "scheduler": t.scheduler.model_copy(update={"name": scheduler,
                                                                                "warmup_steps": warmup})})
    return spec.model_copy(update={"training": training})


@pytest.mark.parametrize("example", EXAMPLES[:4], ids=lambda p: p.stem)
@pytest.mark.parametrize("optimizer", ["adamw", "adam", "lion", "lamb", "sgd"])
@pytest.mark.parametrize(("scheduler", "warmup"),
                         [("cosine", 0), ("cosine", 10), ("linear", 0), ("constant", 0),
                                                   ("constant", 5)])
def test_the_stated_values_are_the_ones_the_emitter_writes(example: Path, optimizer: str, scheduler: str,
                                                           warmup: int) -> None:
    """DSF527 knows what dsforge writes without importing the emitter: the two agree key by key."""
    spec = _spec(example, optimizer, scheduler, warmup)
    if spec is None:
        pytest.skip("the example has no plan")
    t = spec.training
    written = optimizer_section(t.optimizer)["params"]
    stated = optimizer_params(spec)
    assert {k: v for k, v in written.items() if k in stated} == {k: v for k, (v, _) in stated.items()
                                                                  if k in written}
    assert set(written) - {"adam_w_mode"} <= set(stated)
    sched = scheduler_section(t.scheduler, t.optimizer.lr, t.steps)
    stated_sched = scheduler_params(spec)
    assert (sched is None) == (stated_sched is None)
    if sched is not None and stated_sched is not None:
        assert sched["params"] == {k: v for k, (v, _) in stated_sched.items()}


@pytest.mark.parametrize("example", ["tiny-3d", "llama3-70b-multinode", "tiny-pp2-dp2", "tiny-tp2-dp2"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_stated_pipeline_keys_are_the_ones_the_emitter_writes(tmp_path: Path, example: str,
                                                                 recompute: str) -> None:
    from dsforge.compiler.emit.ds_config import build_ds_config
    from tests.test_compile_support import variant_plan

    plan = variant_plan(tmp_path, example, {"training": {"recompute": recompute}})
    stated = {k: v for k, (v, _) in pipeline_values(plan).items()}
    pipe = build_ds_config(plan).get("pipeline", {"stages": 1})
    assert {k: pipe[k] for k in stated} == stated


# --- against the installed DeepSpeed
# -------------------------------------------------------------------------

def _deepspeed_models() -> dict[str, Any]:
    pytest.importorskip("deepspeed")
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

    return {"tensorboard": TensorBoardConfig, "wandb": WandbConfig, "csv_monitor": CSVConfig,
            "comet": CometConfig, "comms_logger": CommsLoggerConfig,
            "timers_throughput": DeepSpeedThroughputTimerConfig, "leaf_module": DeepSpeedZeroLeafModuleConfig}


_KIND_OF = {bool: "bool", int: "int", str: "str", list: "list"}


@pytest.mark.slow
def test_section_models_match_the_installed_deepspeed() -> None:
    """Every field of the section models, with its kind, default and optionality, is DeepSpeed's."""
    import typing

    for name, model in _deepspeed_models().items():
        assert model.model_config.get("extra") == "forbid", name
        assert set(model.model_fields) == set(SECTION_MODELS[name]), name
        for key, info in model.model_fields.items():
            ours, ann = SECTION_MODELS[name][key], info.annotation
            args = typing.get_args(ann)
            optional = type(None) in args
            base = next((a for a in args if a is not type(None)), ann) if optional else ann
            kind = "strs" if typing.get_origin(base) is list and typing.get_args(base) == (str,) else \
                _KIND_OF.get(typing.get_origin(base) or base)
            assert (kind, optional) == (ours.kind, ours.optional), (name, key, ann)
            default = info.get_default(call_default_factory=True)
            if name != "leaf_module":  # its defaults are DeepSpeed's lists of known leaf classes
                assert default == ours.default, (name, key)


TEXT = st.sampled_from(["auto", "yes", "no", "maybe", "fp16", "bf16", "BF16", "bf17", "float", "half", "warn",
                        "FAIL", "Ignore", "bogus", "fast", "MOCK", "slow", "socket", "rack", "", "5", "1.5",
                        "throughput", "torch.nn.Linear"])
SCALAR = st.one_of(st.booleans(), st.integers(-3, 3), st.sampled_from([0.0, 1.0, 1.5]), TEXT, st.none())
VALUE = st.one_of(SCALAR, st.lists(st.one_of(TEXT, st.integers(0, 2)), max_size=2))
KEYS = {"tensorboard": ["enabled", "output_path", "job_name"], "csv_monitor": ["enabled", "output_path"],
        "wandb": ["enabled", "group", "team", "project"],
        "comet": ["enabled", "samples_log_interval", "online", "mode", "api_key"],
        "comms_logger": ["enabled", "prof_all", "prof_ops", "verbose", "debug"],
        "torch_autocast": ["enabled", "dtype", "lower_precision_safe_modules", "dtyp"],
        "checkpoint": ["tag_validation", "load_universal", "use_node_local_storage",
                       "checkpoint_serialization"],
        "flops_profiler": ["enabled", "detailed", "profile_step", "module_depth", "output_file"],
        "aio": ["block_size", "queue_depth", "single_submit", "overlap_events"]}
NESTED = {"timers": ("throughput", ["enabled", "synchronized", "x"]),
          "zero_optimization": ("leaf_module", ["classes", "names", "name_suffixes", "bad"]),
          "checkpoint": ("parallel_write", ["pipeline_stage"]),
          "checkpoint_writer": ("writer", ["type", "data_parallel", "decoupled"])}


#: Values that sit on the edge of what a key takes (the rest come from VALUE).
EDGES: dict[str, list[Any]] = {
    "dtype": ["bf16", "BF16", "bfloat16", "torch.float16", "half", "float", "int8", "bf17", None, 1],
    "tag_validation": ["WARN", "warn", "Fail", "IGNORE", "bogus", None, 1, ""],
    "type": ["fast", "MOCK", "Python", "slow", None, 1],
    "data_parallel": ["socket", "REPLICA", "Machine", "rack"],
    "pipeline_stage": [True, False, 1, 0, 1.0, "yes", None, 2],
    "lower_precision_safe_modules": [["torch.nn.Linear"], "torch.nn.Linear", [1], None, {"a": 1}, 3],
    "prof_ops": [["all_reduce"], "all_reduce", [], None], "samples_log_interval": ["5", 5, 1.5, "x", True],
    "classes": ["A", ["A"], ["A", 1], None, "auto"], "online": [None, True, "maybe", "no"],
}


@st.composite
def sections(draw: Any) -> dict[str, Any]:
    """One section, as a mapping of some of its keys, a nested block, or not a mapping at all."""
    name = draw(st.sampled_from(sorted(set(KEYS) | set(NESTED))))
    shape = draw(st.sampled_from(["keys", "keys", "nested", "scalar"]))

    def value(key: str) -> Any:
        return draw(st.sampled_from(EDGES[key])) if key in EDGES and draw(st.integers(0, 3)) else draw(VALUE)

    def block_of(keys: list[str]) -> dict[str, Any]:
        chosen = draw(st.lists(st.sampled_from(keys), unique=True, max_size=2))
        return {key: value(key) for key in chosen}

    if shape == "scalar":
        block: Any = draw(VALUE)
    elif shape == "nested" and name in NESTED:
        inner, keys = NESTED[name]
        block = {inner: block_of(keys) if draw(st.integers(0, 3)) else draw(SCALAR)}
    else:
        block = block_of(KEYS.get(name, ["x"]))
    return {"checkpoint" if name == "checkpoint_writer" else name: block}


@pytest.fixture(scope="module")
def deepspeed_config() -> Any:
    import logging
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")

    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    return DeepSpeedConfig


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(section=sections())
def test_parse_refuses_exactly_what_deepspeed_refuses_in_the_sections(deepspeed_config: Any,
                                                                       section: dict[str, Any]) -> None:
    config = {**CONFIG, "gradient_accumulation_steps": 2, "train_batch_size": 4, **section}
    try:
        deepspeed_config(dict(config))
        accepted = True
    except Exception as exc:  # noqa: BLE001 - any refusal (ValidationError, TypeError, AttributeError, ...)
        accepted, error = False, exc
    ours = parse(config, 1)
    assert (ours == []) == accepted, (section, ours, None if accepted else f"{type(error).__name__}: {error}")


def test_enum_of_kinds_is_closed() -> None:
    """Every field kind of the section models is one `coerce` knows."""
    assert {f.kind for m in SECTION_MODELS.values() for f in m.values()} <= {
        "bool",
        "int",
        "str",
        "list",
        "strs",
    }
