"""Resuming under another layout, decided without torch: which compiles may continue a checkpoint, and why
not.

The documents are a real compile's (tests/golden/tiny-3d: tiny-llama, tp2 x pp2 x dp2, ZeRO-1, fp32
AdamW), changed as a second compile of the job would change them. `dsforge run`'s decision
(dsforge.commands.run._continue) is exercised on two job directories holding them.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsforge.commands.run import RunError, _continue
from dsforge.compiler.model.params import padded_vocab
from dsforge.compiler.plan.resume_layout import (
    padded_vocab_of,
    resume_refusals,
    same_layout,
    training_meaning,
)
from tests.conftest import ROOT

GOLDEN = ROOT / "tests" / "golden" / "tiny-3d"
PLAN: dict[str, Any] = json.loads((GOLDEN / "plan.json").read_text(encoding="utf-8"))
DS: dict[str, Any] = json.loads((GOLDEN / "ds_config.json").read_text(encoding="utf-8"))


def relaid(tp: int = 1, pp: int = 1, dp: int = 2, zero: int = 1, micro: int = 1,
           **job: Any) -> dict[str, Any]:
    """The golden plan as a compile under another layout would write it (``job``: dotted job keys to
    change)."""
    doc = copy.deepcopy(PLAN)
    doc["degrees"].update(tp=tp, pp=pp, dp=dp)
    doc["zero"], doc["world_size"] = zero, tp * pp * dp
    doc["stage_layers"] = [4 // pp] * pp
    doc["job"]["parallel"].update(tp=tp, pp=pp, zero=zero)
    doc["job"]["hardware"]["gpus_per_node"] = tp * pp * dp
    doc["job"]["training"]["micro_batch"] = micro
    for dotted, value in job.items():
        node = doc["job"]
        *parents, last = dotted.split("__")
        for part in parents:
            node = node[part]
        node[last] = value
    return doc


def test_a_layout_change_alone_resumes() -> None:
    new = relaid(tp=1, pp=1, dp=2, zero=3, micro=2, training__steps=60, training__recompute="full",
                  training__checkpoint={"dir": "/elsewhere", "every": 5, "resume": "auto"})
    assert not same_layout(PLAN, new)
    assert resume_refusals(PLAN, new, DS, DS) == []
    assert same_layout(PLAN, copy.deepcopy(PLAN))


@pytest.mark.parametrize(("key", "value", "shown"), [
    ("training__optimizer__lr", 0.1, "training.optimizer.lr 0.003 -> 0.1"),
    ("training__global_batch", 16, "training.global_batch 8 -> 16"),
    ("training__seed", 8, "training.seed 7 -> 8"),
    ("training__precision", "bf16", "training.precision \"fp32\" -> \"bf16\""),
    ("model__layers", 8, "model.layers 4 -> 8"),
    ("training__data__kind", "tokens", "training.data.kind"),
])
def test_what_a_checkpoint_holds_must_stay(key: str, value: Any, shown: str) -> None:
    refusals = resume_refusals(PLAN, relaid(**{key: value}), DS, DS)
    assert [r.rule for r in refusals][:1] == ["DSF164"]
    assert shown in refusals[0].message and "fix:" in str(refusals[0])


def test_fp16_and_another_optimizer_implementation_are_refused() -> None:
    fp16 = relaid(training__precision="fp16")
    assert "DSF166" in [r.rule for r in resume_refusals(fp16,
                                                        fp16 | {"degrees": PLAN["degrees"]} | {"zero": 3})]
    other = copy.deepcopy(DS)
    other["optimizer"]["type"] = "FusedAdam"
    refusals = resume_refusals(PLAN, relaid(), DS, other)
    assert [r.rule for r in refusals] == ["DSF167"] and "FusedAdam" in refusals[0].message


@given(vocab=st.integers(1, 300_000), multiple=st.sampled_from([None, 1, 8, 64, 128]),
       tp=st.sampled_from([1, 2, 3, 4, 8]), tp2=st.sampled_from([1, 2, 4, 8]))
def test_padding_refusal_follows_the_compilers_padding(vocab: int, multiple: int | None, tp: int,
                                                       tp2: int) -> None:
    from types import SimpleNamespace

    old = relaid(tp=tp, model__vocab=vocab, model__vocab_multiple_of=multiple)
    new = relaid(tp=tp2, model__vocab=vocab, model__vocab_multiple_of=multiple)
    model = SimpleNamespace(vocab=vocab, vocab_multiple_of=multiple)
    assert padded_vocab_of(old) == padded_vocab(model, tp)  # type: ignore[arg-type]
    refused = "DSF165" in [r.rule for r in resume_refusals(old, new, DS, DS)]
    assert refused == (padded_vocab(model, tp) != padded_vocab(model, tp2))  # type: ignore[arg-type]


def test_the_meaning_ignores_exactly_the_layout_keys() -> None:
    a, b = training_meaning(PLAN["job"]), training_meaning(relaid(tp=4, micro=4)["job"])
    assert a == b and "parallel" not in a and "hardware" not in a and "steps" not in a["training"]
    assert a["training"]["global_batch"] == 8 and a["model"] == PLAN["job"]["model"]


def _job_dir(path: Path, plan: dict[str, Any]) -> Path:
    shutil.copytree(GOLDEN, path)
    (path / "plan.json").write_text(json.dumps(plan), encoding="utf-8")
    return path


def test_run_continues_a_relaid_job_and_refuses_a_changed_one(tmp_path: Path) -> None:
    """`dsforge run`'s decision on a job directory: re-write its files for a layout change, refuse DSF164."""
    target = _job_dir(tmp_path / "run", PLAN)
    (target / "checkpoints").mkdir()
    (target / "checkpoints" / "latest").write_text("step2")
    prepared = _continue(target, _job_dir(tmp_path / "new", relaid(tp=1, pp=1, dp=2)), "")
    assert prepared.reused and any("parallel.tp 2 -> 1" in c for c in prepared.continued)
    assert "tp2 x pp2 x dp2 ZeRO-1 -> dp2 ZeRO-1" in prepared.notes[0]
    assert json.loads((target / "plan.json").read_text())["degrees"]["tp"] == 1
    assert (target / "checkpoints" / "latest").read_text() == "step2"  # the checkpoints stay
    with pytest.raises(RunError, match=r"error\[DSF164\].*training.optimizer.lr 0.003 -> 0.1"):
        _continue(target, _job_dir(tmp_path / "lr", relaid(tp=2, pp=2, dp=1, training__optimizer__lr=0.1)),
                  "")
