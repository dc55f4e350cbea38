"""Every family's dense HF model with the lean kernels installed, on one process: the kernels the table
(compiler/lean_kernels.py) turns on really replace modules of that family, the loss and every gradient equal
the plain model's (fused loss included), and the saved bytes fall. The 2-rank parity world
(tests/runtime_rewrite/test_family_parity.py) checks the same under tp 2, ep 2 and cp 2."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
import torch
import torch.nn.functional as F

from dsforge.compiler.model.lean_kernels import lean_kernels
from dsforge.compiler.plan.plan import build_plan
from dsforge.runtime.kernels.install import install_lean_kernels
from dsforge.runtime.kernels.loss import check_fused_head, fused_token_loss_sum
from dsforge.runtime.models import build_model
from tests.runtime_rewrite.conftest import make_job
from tests.runtime_rewrite.families import BASE, FAMILY_JOBS

JOBS: dict[str, dict[str, Any]] = {**FAMILY_JOBS, "gpt2": {"arch": "gpt2", **BASE, "kv_heads": 4},
                                   "llama": {"arch": "llama", **BASE}}
#: module replacements each family must show (2 layers: per layer two norms, OLMo2 and the q/k-norm families
#: four, and the final norm; one SwiGLU MLP per layer where the layer has a dense MLP or a shared expert)
WANT = {"qwen3": {"norm": 9, "swiglu": 2}, "olmo2": {"norm": 9, "swiglu": 2},
        "phi3": {"norm": 5, "swiglu": 2}, "mistral": {"norm": 5, "swiglu": 2},
        "qwen2": {"norm": 5, "swiglu": 2}, "llama": {"norm": 5, "swiglu": 2},
        "qwen2_moe": {"norm": 5, "swiglu": 2}, "qwen3_moe": {"norm": 9}, "mixtral": {"norm": 5},
        "deepseek_v3": {"norm": 9, "swiglu": 2}, "gpt2": {"gelu": 2}, "gpt_neox": {}, "gemma2": {},
        "gemma3": {}}


def saved_bytes(fn: Any, params: Any) -> int:
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key and key not in skip:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("name", sorted(JOBS))
def test_lean_model_equals_plain_model(name: str, tmp_path: Path) -> None:
    plan = build_plan(make_job(tmp_path, JOBS[name]))
    plain = build_model(plan.model, "cpu", 1, seed=3).train()
    lean = copy.deepcopy(plain)
    on = lean_kernels(plan.model, {}, 1)
    counts = install_lean_kernels(lean, on)
    assert {k: v for k, v in counts.items() if v} == WANT[name], (on, counts)
    ids = torch.randint(0, plan.model.vocab, (2, plan.model.seq_len),
                        generator=torch.Generator().manual_seed(5))
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    count = (targets != -100).sum()

    def plain_loss() -> torch.Tensor:
        logits = plain(input_ids=ids).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / count

    def lean_loss() -> torch.Tensor:
        if "fused_loss" in on:
            check_fused_head(lean)
            hidden = lean.base_model(input_ids=ids).last_hidden_state
            return fused_token_loss_sum(hidden, targets, lean.lm_head, -100) / count
        logits = lean(input_ids=ids).logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / count

    results: dict[str, torch.Tensor] = {}
    kept = {"plain": saved_bytes(lambda: results.setdefault("plain", plain_loss()).backward(),
                                 plain.parameters()),
            "lean": saved_bytes(lambda: results.setdefault("lean", lean_loss()).backward(),
                                lean.parameters())}
    assert float(results["lean"].detach()) == pytest.approx(float(results["plain"].detach()), rel=1e-5)
    ref = dict(plain.named_parameters())
    for pname, p in lean.named_parameters():
        want = ref[pname].grad
        if want is None:
            assert p.grad is None, pname
            continue
        scale = float(want.abs().max()) or 1.0
        assert float((p.grad - want).abs().max()) <= 1e-5 * scale, pname
    if on - {"norm", "gelu"} or counts["norm"] or counts["gelu"]:
        assert kept["lean"] < kept["plain"], kept
    else:
        assert kept["lean"] == kept["plain"], kept
