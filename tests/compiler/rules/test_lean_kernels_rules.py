"""training.kernels: which lean kernel runs for which family (compiler/lean_kernels.py), DSF050 for a required
kernel that cannot run exactly, the key's input surface, and the estimate's terms with and without them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsforge.compiler.estimate import activations as act
from dsforge.compiler.estimate.lean import stack_kernels
from dsforge.compiler.estimate.memory import activation_shape
from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.model import lean_kernels as lk
from dsforge.compiler.plan.plan import Plan, build_plan
from dsforge.compiler.validate import validate_file

WriteJob = Callable[..., Path]
FACTORY = "tests.runtime_rewrite.families:{}"
TINY = "layers: 2, hidden: 64, heads: 4, kv_heads: 2, ffn_hidden: 96, vocab: 128, seq_len: 16"
MHA = TINY.replace("kv_heads: 2", "kv_heads: 4")  # GPT-2 and NeoX: no grouped-query attention


def job(model: str, parallel: str = "tp: 2", kernels: str = "", stack: str = "") -> str:
    return (f"version: 1\n{stack}model: {{{model}}}\nhardware: {{preset: cpu-local, gpus_per_node: 4}}\n"
            f"parallel: {{{parallel}}}\ntraining: {{global_batch: "
            f"8{', kernels: ' + kernels if kernels else ''}}}\n")


def family(arch: str) -> str:
    return f"arch: {arch}, factory: \"{FACTORY.format(arch)}\", {TINY}"


def rules(write_job: WriteJob, text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for d in validate_file(write_job(text)).diagnostics:
        out.setdefault(d.rule, []).append(d.message)
    return out


def plan_of(write_job: WriteJob, text: str) -> Plan:
    loaded, diags = load_job(write_job(text))
    assert loaded is not None, [d.message for d in diags]
    return build_plan(loaded.spec)


#: what `auto` runs per family (the runtime's module classes: dsforge/runtime/kernels/install.py)
EXPECTED = {
    "llama": {"fused_loss", "swiglu", "norm"}, "qwen3": {"fused_loss", "swiglu", "norm"},
    "olmo2": {"fused_loss", "swiglu", "norm"}, "phi3": {"fused_loss", "swiglu", "norm"},
    "mixtral": {"fused_loss", "swiglu", "norm"}, "deepseek_v3": {"fused_loss", "swiglu", "norm"},
    "gpt2": {"fused_loss", "gelu", "norm"}, "gpt_neox": {"fused_loss", "gelu", "norm"},
    "gemma2": set(), "gemma3": set(),
}


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_auto_runs_each_kernel_where_it_is_exact(arch: str, write_job: WriteJob) -> None:
    plan = plan_of(write_job, job(f"arch: {arch}, {MHA}" if arch in ("gpt2", "gpt_neox")
                                  else family(arch) if arch not in ("llama",
                                                                    "mixtral") else f"arch: {arch}, {TINY}"
                                  + (", moe: {experts: 4, top_k: 2}" if arch == "mixtral" else "")))
    assert set(lk.lean_kernels(plan.model, {}, 1)) == EXPECTED[arch]
    assert not set(lk.lean_kernels(plan.model, dict.fromkeys(lk.KERNELS, False), 1))


def test_pipeline_keeps_the_unfused_loss_and_custom_models_run_none(write_job: WriteJob) -> None:
    plan = plan_of(write_job, job(f"arch: llama, {TINY}", "tp: 2, pp: 2"))
    assert set(lk.lean_kernels(plan.model, {}, 2)) == {"swiglu", "norm"}
    custom = dataclasses.replace(plan.model, arch="custom")
    assert not lk.lean_kernels(custom, {}, 1)
    assert "run time" in (lk.kernel_problem("norm", custom, 1) or "")


@pytest.mark.parametrize(("model", "parallel", "kernels", "name", "why"), [
    (family("gemma2") + ", tied_embeddings: true", "tp: 2", "{fused_loss: true}", "fused_loss", "soft-caps"),
    (family("gemma2") + ", tied_embeddings: true", "tp: 2", "{norm: true}", "norm", "(1 + weight)"),
    (family("gemma3") + ", tied_embeddings: true", "tp: 2", "{swiglu: true}", "swiglu", "GeGLU"),
    (f"arch: llama, {TINY}", "tp: 2, pp: 2", "{fused_loss: true}", "fused_loss", "pp=2"),
    (f"arch: gpt2, {MHA}", "tp: 2", "{swiglu: true}", "swiglu", "no SwiGLU"),
    (f"arch: llama, {TINY}", "tp: 2", "{gelu: true}", "gelu", "no GELU"),
])
def test_a_required_kernel_that_is_not_exact_is_refused(write_job: WriteJob, model: str, parallel: str,
                                                        kernels: str, name: str, why: str) -> None:
    found = rules(write_job, job(model, parallel, kernels))
    assert "DSF050" in found, found
    assert len(found["DSF050"]) == 1 and f"training.kernels.{name} is true" in found["DSF050"][0], found
    assert why in found["DSF050"][0], found


def test_required_kernels_that_are_exact_pass_and_other_stacks_ignore_the_key(write_job: WriteJob) -> None:
    every = "{fused_loss: true, swiglu: true, norm: true}"
    assert "DSF050" not in rules(write_job, job(f"arch: llama, {TINY}", "tp: 2", every))
    gemma = family("gemma2") + ", tied_embeddings: true"
    assert "DSF050" not in rules(write_job, job(gemma, "tp: 2", "{fused_loss: true}", "stack: megatron-te\n"))
    assert "DSF050" not in rules(write_job, job(gemma, "tp: 2", "{fused_loss: false, norm: auto}"))


@pytest.mark.parametrize("kernels", ["{fused_loss: maybe}", "{fused_los: true}", "{norm: 1}", "true"])
def test_bad_kernel_values_are_input_errors(write_job: WriteJob, kernels: str) -> None:
    found = rules(write_job, job(f"arch: llama, {TINY}", "tp: 2", kernels))
    assert found and all(r.startswith("DSF0") for r in found), found
    assert "DSF050" not in found


def test_the_estimate_prices_each_kernel_term_by_term(write_job: WriteJob) -> None:
    # llama3-8b-shaped at tp 2 with SP, bf16: each kernel changes its own terms, nothing else
    base = ("version: 1\nmodel: {preset: llama3-8b}\nhardware: {preset: dgx-h100}\n"
            "parallel: {tp: 2, dp: auto, sequence_parallel: true}\ntraining: {global_batch: 64, micro_batch: "
            "1, precision: bf16%s}\n")
    lean = plan_of(write_job, base % "")
    plain = plan_of(write_job, base % ", kernels: {fused_loss: false, swiglu: false, norm: false}")
    a, p = activation_shape(lean), activation_shape(plain)
    assert p.kernels == act.HF_SDPA and stack_kernels(plain) == act.HF_SDPA
    m, n, h, f = lean.model, a.tokens, lean.model.hidden, lean.model.ffn_hidden
    lt, pt = act.layer_terms(m, a, False), act.layer_terms(m, p, False)
    assert set(lt) == set(pt)
    changed = {k for k in lt if lt[k] != pt[k]}
    assert changed == {"attn.norm", "mlp.norm", "mlp.mlp_inner"}, changed
    assert pt["mlp.mlp_inner"] - lt["mlp.mlp_inner"] == n * f / 2 * 2  # one f-wide bf16 tensor fewer
    assert pt["attn.norm"] - lt["attn.norm"] == n * h * 4 / 2  # the fp32 copy (bf16 input and rstd stay)
    vocab = 128256
    saved_lean, _ = act.logits_bytes(m, a, vocab)
    saved_plain, _ = act.logits_bytes(m, p, vocab)
    assert saved_lean == n * (2 * 4 + 8)
    assert saved_plain == n * vocab / 2 * 4 + n * 8


@given(vocab=st.integers(1, 10**7))
def test_a_loss_chunk_holds_at_least_one_token_and_at_most_the_cells(vocab: int) -> None:
    tokens = lk.loss_chunk_tokens(vocab)
    assert tokens >= 1
    assert tokens == 1 or tokens * vocab <= lk.LOSS_CHUNK_CELLS
    assert (tokens + 1) * vocab > lk.LOSS_CHUNK_CELLS
