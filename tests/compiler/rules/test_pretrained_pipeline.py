"""DSF173: validate refuses pp > 1 for a `model.pretrained` family placed by its HF plans when its
transformers classes state no base_model_pp_plan of the shape the derived stages build (from config.json,
no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dsforge.compiler.model.hf_plans import known_types, plans_for_type, pp_plan_problem_of
from dsforge.compiler.validate import validate_file
from tests.conftest import ROOT

PRETRAINED = ROOT / "tests" / "fixtures" / "pretrained"


def _job(tmp: Path, pretrained: Path, parallel: dict[str, int]) -> Path:
    doc = {"version": 1, "name": "ft", "model": {"pretrained": str(pretrained), "seq_len": 32},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "parallel": parallel,
           "training": {"global_batch": 8, "micro_batch": 2, "precision": "bf16"}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def _ours(path: Path) -> list[tuple[str, str, str]]:
    return [(d.rule, d.key_path, d.message) for d in validate_file(path).diagnostics if d.rule == "DSF173"]


def test_a_derived_family_with_a_pp_plan_of_another_shape_is_refused_at_pp2(tmp_path: Path) -> None:
    found = _ours(_job(tmp_path, PRETRAINED / "tiny-phi", {"pp": 2}))
    assert len(found) == 1
    _, key, message = found[0]
    assert key == "parallel.pp"
    assert message.startswith("parallel.pp=2: the base_model_pp_plan of `phi` has the pieces")


@pytest.mark.parametrize("name, parallel", [("tiny-phi", {"pp": 1, "tp": 2}), ("tiny-olmo2", {"pp": 2}),
                                            ("tiny-llama", {"pp": 2})])
def test_a_plan_of_the_stages_shape_a_hand_written_family_or_pp1_passes(tmp_path: Path, name: str,
                                                                       parallel: dict[str, int]) -> None:
    assert _ours(_job(tmp_path, PRETRAINED / name, parallel)) == []


def test_a_derived_family_without_any_pp_plan_says_so(tmp_path: Path) -> None:
    directory = tmp_path / "hunyuan"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "hunyuan_v1_dense", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "intermediate_size": 32, "vocab_size": 128, "max_position_embeddings": 64, "hidden_act": "silu"}))
    (directory / "model.safetensors").write_bytes(b"not read by validate")
    found = _ours(_job(tmp_path, directory, {"pp": 2}))
    assert [m for _, _, m in found] == [
        ("parallel.pp=2: transformers 5.24.0 states no base_model_pp_plan for `hunyuan_v1_dense`, so its "
         "stages (embedding, layers, final norm, head) are not known")]


def test_the_runtime_judges_the_installed_plan_as_validate_judges_the_table() -> None:
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from dsforge.runtime.hf_pipeline import pp_plan_problem

    for mtype in ("phi", "olmo2", "hunyuan_v1_dense"):
        plans = plans_for_type(mtype)
        assert plans is not None
        model = SimpleNamespace(config=SimpleNamespace(model_type=mtype, base_model_pp_plan=dict(plans.pp)))
        assert pp_plan_problem(model) == pp_plan_problem_of(plans)  # type: ignore[arg-type]
    refused = [t for t in known_types() if pp_plan_problem_of(plans_for_type(t))]  # type: ignore[arg-type]
    assert "phi" in refused and "olmo2" not in refused and "llama" not in refused
