"""dsforge.compiler.deepspeed.ds_schema against what it describes: pydantic's coercions, DeepSpeed's models,
the merge.

The coercion tests compare `coerce` with pydantic 2 itself (installed with DeepSpeed) on generated values;
the model test reads the installed DeepSpeed 0.19.8's pydantic models field by field (slow: it imports it).
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.compiler.deepspeed.ds_fields import Field, Invalid, coerce
from dsforge.compiler.deepspeed.ds_schema import MODELS, merge_overrides, merge_zero, parse

pydantic = pytest.importorskip("pydantic")

TEXT = st.sampled_from(["5", "5e8", "5.0", " 5 ", "1_000", "-1", "0", "1", "true", "FALSE", "yes", "No", "on",
                        "off", "t", "f", "y", "n", "cpu", "CPU", "none", "nvme", "auto", "inf", "nan", "",
                        "2", " yes", "1.5", "+3", "0x10", "١"])
VALUES = st.one_of(st.booleans(), st.integers(-(2**70), 2**70),
                   st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, 1.0, -0.0, 2.0, 1.5, 5e8, 1e20]), TEXT, st.none(), st.just([]),
                   st.just({}))


class _Stage(int, Enum):
    a, b, c, d = 0, 1, 2, 3


class _Device(str, Enum):
    none, cpu, nvme = "none", "cpu", "nvme"


#: Field kinds and the pydantic annotation DeepSpeed uses for them.
KINDS: dict[str, tuple[Field, Any]] = {
    "bool": (Field("bool"), bool), "int": (Field("int"), int), "float": (Field("float"), float),
    "str": (Field("str"), str), "optional bool": (Field("bool", optional=True), bool | None),
    "stage": (Field("enum", choices=(0, 1, 2, 3)), _Stage),
    "device": (Field("enum", choices=("none", "cpu", "nvme")), _Device),
}


ADAPTERS = {kind: pydantic.TypeAdapter(annotation) for kind, (_, annotation) in KINDS.items()}


def _pydantic(kind: str, value: Any) -> tuple[bool, Any]:
    try:
        out = ADAPTERS[kind].validate_python(value)
    except pydantic.ValidationError:
        return False, None
    return True, out.value if isinstance(out, Enum) else out


def _ours(field: Field, value: Any) -> tuple[bool, Any]:
    try:
        return True, coerce(field, value)
    except Invalid:
        return False, None


@pytest.mark.parametrize("kind", sorted(KINDS))
@settings(max_examples=150, deadline=None)
@given(value=VALUES)
def test_coerce_takes_exactly_what_pydantic_takes(kind: str, value: Any) -> None:
    ok, got = _ours(KINDS[kind][0], value)
    want_ok, want = _pydantic(kind, value)
    assert ok == want_ok, (kind, value, got, want)
    if ok and not (isinstance(want, float) and math.isnan(want)):
        assert got == want and type(got) is type(want), (kind, value, got, want)


def test_bounds_are_applied_after_coercion() -> None:
    bucket = MODELS["zero"]["reduce_bucket_size"]
    assert coerce(bucket, "500000000") == 500_000_000
    for bad in (0, -1, "5e8", 1.5, None, False):
        with pytest.raises(Invalid):
            coerce(bucket, bad)
    assert coerce(MODELS["offload_optimizer"]["ratio"], "0.3") == 0.3
    with pytest.raises(Invalid):
        coerce(MODELS["offload_optimizer"]["ratio"], 1.5)


def _job_config(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                            "gradient_accumulation_steps": 2,
                            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 10,
                                                  "stage3_param_persistence_threshold": 5},
                            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    return merge_overrides(base, over)


def test_an_override_replaces_every_spelling_of_its_setting() -> None:
    cfg = _job_config(zero_optimization={"prefetch_bucket_size": 99, "cpu_offload": True})
    zero = cfg["zero_optimization"]
    assert zero["prefetch_bucket_size"] == 99 and "stage3_prefetch_bucket_size" not in zero
    assert zero["stage3_param_persistence_threshold"] == 5
    assert parse(cfg, 2) == []
    emitted = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert merge_zero(emitted, {"cpu_offload": True}) == {"stage": 2, "cpu_offload": True}
    assert merge_overrides({"bf16": {"enabled": True}}, {"bfloat16": {"immediate_grad_update": True}}) == {
        "bf16": {"enabled": True, "immediate_grad_update": True}}


@pytest.mark.parametrize(("over", "path"), [
    ({"zero_optimization": {"reduce_bucket_size": "5e8"}}, ("zero_optimization", "reduce_bucket_size")),
    ({"zero_optimization": {"stage": None}}, ("zero_optimization", "stage")),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     ("zero_optimization", "offload_optimizer", "device")),
    ({"zero_optimization": {"offload_param": {"device": "cpu", "pin_memry": True}}},
     ("zero_optimization", "offload_param", "pin_memry")),
    ({"optimizer": None}, ("optimizer",)), ({"pipeline": "1f1b"}, ("pipeline",)),
    ({"fp16": {"loss_scale": -1}}, ("fp16", "loss_scale")),
    ({"fp16": {"initial_scale_power": 12.5}}, ("fp16", "initial_scale_power")),
    ({"wall_clock_breakdown": "yes"}, ("wall_clock_breakdown",)),
    ({"gradient_allreduce_op": "avg"}, ("gradient_allreduce_op",)),
    ({"zero_optimization": {"compute_grad_norm": False}}, ("zero_optimization", "compute_grad_norm")),
])
def test_parse_names_what_deepspeed_refuses(over: dict[str, Any], path: tuple[str, ...]) -> None:
    assert path in [p.path for p in parse(_job_config(**over), 2)]


@pytest.mark.parametrize("over", [
    {"communication_data_type": "FP16"}, {"gradient_allreduce_op": "Mean"},
    {"zero_optimization": {"reduce_bucket_size": "auto"}}, {"zero_optimization": {"overlap_comm": "yes"}},
    {"bf16": {"enabled": "true"}}, {"fp16": {"loss_scale": "128", "enabled": False}}, {"bf16": None},
    {"zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": "auto"}}},
])
def test_parse_accepts_what_deepspeed_accepts(over: dict[str, Any]) -> None:
    assert parse(_job_config(**over), 2) == []


@pytest.mark.slow
def test_models_match_the_installed_deepspeed() -> None:
    """Every field of DeepSpeed's pydantic models, with its alias, default, bounds and kind, is in MODELS."""
    config = pytest.importorskip("deepspeed.runtime.config")
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    models = {"zero": DeepSpeedZeroConfig, "offload_param": DeepSpeedZeroOffloadParamConfig,
              "offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig, "fp16": DeepSpeedFP16Config,
              "bf16": DeepSpeedBF16Config, "hybrid_engine": config.HybridEngineConfig}
    for name, model in models.items():
        assert model.model_config.get("extra") == "forbid"
        assert set(model.model_fields) == set(MODELS[name]), name
        for key, info in model.model_fields.items():
            ours = MODELS[name][key]
            assert (info.alias or "") == ours.alias, (name, key)
            bounds = {type(m).__name__.lower(): getattr(m, type(m).__name__.lower()) for m in info.metadata}
            assert bounds == {k: v for k, v in (("ge", ours.ge), ("gt", ours.gt), ("le", ours.le),
                                                ("lt", ours.lt)) if v is not None}, (name, key)
            if ours.kind in ("bool", "int", "float", "enum"):
                default = info.default.value if isinstance(info.default, Enum) else info.default
                assert default == ours.default or (key == "overlap_comm" and default is None), (name, key)
            extra = info.json_schema_extra or {}
            if extra.get("deprecated") and extra.get("set_new_param", True):
                assert ours.replaced_by == extra["new_param"], (name, key)
