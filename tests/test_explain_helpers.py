"""Helpers for the estimate and explain tests: build a plan from a job dict (no test functions here)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from dsforge.compiler.plan.plan import Plan
from dsforge.compiler.validate import validate_file
from dsforge.diagnostics import Severity


def make_plan(job: dict[str, Any], tmp: Path, name: str = "job.yaml", allow: tuple[str, ...] = ()) -> Plan:
    """Write ``job`` as a job file, validate it and return its plan (failing the test on any error whose
    rule is not in ``allow``)."""
    path = tmp / name
    path.write_text(yaml.safe_dump(job), encoding="utf-8")
    result = validate_file(path)
    errors = [d for d in result.diagnostics if d.severity == Severity.ERROR and d.rule not in allow]
    assert not errors and result.plan is not None, "\n".join(f"{d.rule} {d.message}" for d in errors)
    return result.plan


def with_changes(job: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of ``job`` with the given sections' keys replaced (one level deep)."""
    out = copy.deepcopy(job)
    for section, keys in sections.items():
        out.setdefault(section, {}).update(keys)
    return out


#: GPT-3 175B on 128 DGX A100 nodes as Narayanan et al. 2021 ran it (sec. 5.1): TP 8, PP 16, DP 8, batch
#: 1,536, full activation recomputation, no sequence parallelism (it came in 2022).
GPT3_2021 = {
    "version": 1, "name": "gpt3-2021", "stack": "megatron-te",
    "model": {"preset": "gpt3-175b", "vocab_multiple_of": 128},
    "hardware": {"preset": "dgx-a100-80gb", "nodes": 128},
    "launch": {"launcher": "slurm"},
    "parallel": {"tp": 8, "pp": 16, "dp": "auto", "zero": 1, "sequence_parallel": False,
                 "pipeline": {"schedule": "1f1b", "partition": "uniform"}},
    "training": {"global_batch": 1536, "micro_batch": 1, "precision": "bf16", "recompute": "full",
                 "attention": "unfused"},
}

#: Llama 3 405B as in Dubey et al. 2024, Table 4 (8,192 H100s: TP 8, CP 1, PP 16, DP 64, seq 8,192, 16M-token
#: batches = 2,048 sequences). The paper balances the pipeline by giving the first and last stage one layer
#: less; the interleaved depth v=4 and full recomputation are our assumptions (chunks of 2 layers, 1 on the
#: ends), as in benchmarks/published/llama3-405b-8k-8192gpu.yaml.
LLAMA3_405B_8K = {
    "version": 1, "name": "llama3-405b-8k", "stack": "megatron-te",
    "model": {"preset": "llama3-405b"},
    "hardware": {"preset": "dgx-h100", "nodes": 1024},
    "launch": {"launcher": "slurm"},
    "parallel": {"tp": 8, "pp": 16, "dp": "auto", "zero": 1, "sequence_parallel": True,
                 "pipeline": {"schedule": "interleaved", "virtual_stages": 4,
                              "partition": [1] + [2] * 62 + [1]}},
    "training": {"global_batch": 2048, "micro_batch": 1, "precision": "bf16", "recompute": "full"},
}

#: A small dense Llama on one 8-GPU H100 node, the base most unit tests vary.
SMALL = {
    "version": 1, "name": "small",
    "model": {"preset": "llama2-7b"},
    "hardware": {"preset": "dgx-h100", "nodes": 1},
    "parallel": {"tp": 2, "pp": 2, "dp": "auto", "zero": 1},
    "training": {"global_batch": 32, "micro_batch": 1, "precision": "bf16"},
}
