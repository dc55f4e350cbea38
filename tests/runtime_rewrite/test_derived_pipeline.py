"""Pipeline stages of HF families placed by their own plans (base_model_pp_plan) against one process.

Tiny random models of three families with no hand-written policy: OLMo 2 (Llama-shaped, untied head),
SmolLM3 with a tied head and NoPE layers, and Gemma 3 text with a tied head, its embedding scale (inside
the embedding module) and one sliding-window layer whose window (4) is shorter than the sequence (12).
Each runs at pp=2 on 2 gloo ranks in DeepSpeed's PipelineEngine for 2 SGD steps, and OLMo 2 also at
tp=2 x pp=2 on 4 ranks; every step's loss and every gradient this rank's stage holds (its slice under
TP) is compared with plain HF trained the same way on one process. The tied embedding's gradient is
DeepSpeed's all-reduce of the first and last stage's parts, so a stage boundary or a tie that broke
would show there. Tolerance 1e-5 of the reference's scale (fp32 re-association, as
test_family_parity.py).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch

RTOL = 1e-5
LR = 0.5
STEPS = 2


def _tiny(model_type: str, **overrides: Any) -> Any:
    from transformers import AutoModelForCausalLM

    from benchmarks.hf_zoo import _nontrivial_buffers, tiny_config

    cfg = tiny_config(model_type)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return _nontrivial_buffers(AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float())


def olmo2() -> Any:
    """OLMo 2: Llama-shaped with q/k norms over the whole projection, untied head."""
    return _tiny("olmo2")


def smollm3_tied() -> Any:
    """SmolLM3 with a tied head; its second layer has no rotary embedding (NoPE)."""
    return _tiny("smollm3", tie_word_embeddings=True, no_rope_layers=[1, 0])


def gemma3_tied() -> Any:
    """Gemma 3 text: tied head, sqrt(hidden) embedding scale, a sliding layer then a full one."""
    return _tiny("gemma3_text", tie_word_embeddings=True, sliding_window=4,
                 layer_types=["sliding_attention", "full_attention"])


FAMILIES = {"olmo2": "olmo2", "smollm3": "smollm3_tied", "gemma3_text": "gemma3_tied"}


def llama_eager() -> Any:
    """Llama (a hand-written family's stages) with eager attention, which attends everywhere unless masked."""
    return _tiny("llama")


def mixtral_sliding() -> Any:
    """Mixtral with a 4-token sliding window on 12 tokens: every layer slides, as Mistral-style configs do."""
    return _tiny("mixtral", sliding_window=4)


def gpt2_eager() -> Any:
    """GPT-2 (Conv1D layers, learned positions) with eager attention."""
    return _tiny("gpt2")


#: hand-written families' stages (dsforge.runtime.stage_structures), each given HF's mask for its layers
HAND_WRITTEN = {"llama": "llama_eager", "mixtral": "mixtral_sliding", "gpt2": "gpt2_eager"}


def _keys(name: str) -> dict[str, Any]:
    from benchmarks.hf_zoo import _job_keys

    fn = {**FAMILIES, **HAND_WRITTEN}[name]
    model = globals()[fn]()
    return {**_job_keys(model, name), "factory": f"tests.runtime_rewrite.test_derived_pipeline:{fn}",
            "seq_len": 64}


class _KeepGradSGD(torch.optim.SGD):
    """SGD that keeps each step's gradients (before updating) so the test can compare them."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, lr=LR)
        self.seen: dict[int, torch.Tensor] = {}

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        self.seen = {id(p): p.grad.detach().clone() for g in self.param_groups for p in g["params"]
                     if p.grad is not None}
        return super().step(closure)


def _parity(rank: int, keys: dict[str, Any], parallel: dict[str, Any], tmp: str) -> None:
    import deepspeed

    from dsforge.compiler.plan.plan import build_plan
    from dsforge.runtime.groups import create_groups
    from dsforge.runtime.models import build_model
    from dsforge.runtime.pipeline_stages import build_pipeline, ds_pipeline_config
    from dsforge.runtime.rewrite import plan_rewrite
    from tests.runtime.launcher import report
    from tests.runtime_rewrite.conftest import make_job

    mine = Path(tmp) / f"{keys['factory'].rpartition(':')[2]}-{parallel.get('tp', 1)}-rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    spec = make_job(mine, keys, parallel)
    plan = build_plan(spec)
    groups = create_groups(plan)
    dense = build_model(spec.model, "cpu", seed=11)
    model = copy.deepcopy(dense)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 128, (2, 12), generator=gen) for _ in range(STEPS)]
    ref_losses, ref_grads = [], []
    for ids in batches:
        dense.zero_grad()
        loss = dense(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_losses.append(loss.detach())
        # a parameter the loss does not reach (a router's correction bias) has no gradient
        ref_grads.append({n: None if p.grad is None else p.grad.detach().clone()
                          for n, p in dense.named_parameters(remove_duplicate=False)})
        with torch.no_grad():
            for p in dense.parameters():
                if p.grad is not None:
                    p -= LR * p.grad

    rp = plan_rewrite(model, plan)
    pipe = build_pipeline(model, rp, plan, groups)
    stage, tp_rank = groups.index("pp"), groups.index("tp")
    held = sum(p.numel() for p in pipe.parameters())
    if held != rp.stage_params()[stage]:
        raise AssertionError(f"stage {stage} holds {held} parameters, "
                             f"the plan says {rp.stage_params()[stage]}")
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**6, "gradient_clipping": 0.0, "pipeline": ds_pipeline_config(rp)}
    opt = _KeepGradSGD(list(pipe.parameters()))
    engine, *_ = deepspeed.initialize(model=pipe, config=config, optimizer=opt)
    tag = f"{keys['factory'].rpartition(':')[2]} {parallel}"
    for step, ids in enumerate(batches):
        loss = engine.train_batch(iter([(ids, ids)]))
        report(f"{tag} step {step} loss", loss.reshape(()), ref_losses[step], RTOL)
        compared = 0
        for p in pipe.parameters():
            name = names[id(p)]
            grad, want = opt.seen.get(id(p)), ref_grads[step][name]
            if want is None or grad is None:  # no gradient on one side: none (or zeros) on the other
                other = grad if want is None else want
                if other is not None and bool(other.abs().max() > 0):
                    raise AssertionError(f"{tag} step {step} grad {name}: a gradient on one side only")
                continue
            owner = name.rpartition(".")[0]
            if (name.endswith(".weight") and type(dense.get_submodule(owner)).__name__ == "Conv1D"
                    and type(model.get_submodule(owner)).__name__ != "Conv1D"):
                want = want.t()  # GPT-2's Conv1D keeps [in, out]; the rewritten layer is a Linear [out, in]
            if grad.shape != want.shape:  # a TP shard: this rank's slice of the dense gradient
                dim = next(d for d in range(want.dim()) if grad.shape[d] != want.shape[d])
                want = want.narrow(dim, tp_rank * grad.shape[dim], grad.shape[dim])
            report(f"{tag} step {step} grad {name}", grad, want, RTOL)
            compared += 1
        if compared == 0:
            raise AssertionError(f"stage {stage} compared no gradient")


def _worker(rank: int, world: int, cases: list[tuple[dict[str, Any], dict[str, Any]]], tmp: str) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    for keys, parallel in cases:
        _parity(rank, keys, parallel, tmp)


@pytest.mark.slow
def test_derived_pp2_matches_one_process(tmp_path: Path) -> None:
    from tests.runtime.launcher import run

    run(_worker, 2, [(_keys(name), {"pp": 2}) for name in FAMILIES], str(tmp_path))


@pytest.mark.slow
def test_hand_written_stages_mask_as_hf_does(tmp_path: Path) -> None:
    """Stages of gpt2, llama and mixtral models built with eager attention (and a sliding window) at pp=2:
    a stage that called its layer without HF's mask trained a bidirectional (or unwindowed) model."""
    from tests.runtime.launcher import run

    run(_worker, 2, [(_keys(name), {"pp": 2}) for name in HAND_WRITTEN], str(tmp_path))


@pytest.mark.slow
def test_derived_tp2_pp2_matches_one_process(tmp_path: Path) -> None:
    from tests.runtime.launcher import run

    run(_worker, 4, [(_keys("olmo2"), {"tp": 2, "pp": 2})], str(tmp_path))


def test_families_without_a_pp_plan_are_refused_with_the_reason(tmp_path: Path) -> None:
    from dsforge.runtime.hf_pipeline import glue_problem

    assert glue_problem(olmo2()) is None
    assert glue_problem(gemma3_tied()) is None
    cohere = _tiny("cohere")  # logit_scale in CohereForCausalLM.forward, between the norm and the loss
    assert "does not reproduce" in (glue_problem(cohere) or "")
    plain = _tiny("olmo2")
    plain.config.base_model_pp_plan = None
    type_plan = type(plain.config).base_model_pp_plan
    try:
        type(plain.config).base_model_pp_plan = None
        assert "states no base_model_pp_plan" in (glue_problem(plain) or "")
    finally:
        type(plain.config).base_model_pp_plan = type_plan


def test_parameters_outside_the_pp_plan_pieces_are_named():
    """phi4_multimodal keeps audio and image embedders beside embed_tokens: stages would drop them, so pp is
    refused naming the module (it failed at build before: a stage held 39,104 of 63,104,480 parameters)."""
    from torch import nn

    import benchmarks.hf_zoo as zoo
    from dsforge.runtime.hf_pipeline import _outside_pieces

    model = zoo._factory("olmo2")()
    assert _outside_pieces(model) is None
    model.model.extra = nn.Linear(2, 2)
    assert "outside its base_model_pp_plan pieces (embed_tokens, layers, norm, lm_head): model.extra;" in (
        _outside_pieces(model) or "")
