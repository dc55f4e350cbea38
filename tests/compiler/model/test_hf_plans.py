"""The HF plan table and the mapping of every HF parallel style to a dsforge placement (no torch here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsforge.compiler.model.hf_plans import (
    KEEP_HANDWRITTEN,
    NO_PLAN,
    STYLE_REFUSED,
    STYLES,
    HfPlans,
    PlanRefusal,
    derive_policy,
    known_types,
    path_regex,
    placements,
    plans_for_type,
)
from dsforge.compiler.model.rewrite_policies import POLICIES
from dsforge.compiler.rules.registry import all_rules

ROOT = Path(__file__).resolve().parents[3]
#: The styles transformers 5.24 registers (transformers/distributed/tensor_parallel.py, expert_parallel.py).
HF_STYLES = {"colwise", "rowwise", "colwise_gather_output", "colwise_rep", "rowwise_split_input",
             "rowwise_rep", "packed_colwise", "packed_rowwise", "embedding_rowwise", "embedding_colwise",
             "replicated_with_grad_allreduce", "sequence_parallel", "mla_kv_a_proj", "all_reduce",
             "moe_tp_experts", "moe_identity_expert", "local_params", "replicate", "grouped_gemm",
             "ep_dispatch_experts"}


def _with_plans() -> list[str]:
    return [t for t in known_types() if (p := plans_for_type(t)) is not None and (p.tp or p.ep)]


def test_every_style_the_table_uses_is_placed_or_refused_with_a_reason():
    used = {s for t in known_types() for p in [plans_for_type(t)] if p
            for s in (*p.tp.values(), *p.ep.values(), *p.head_tp.values())}
    assert used <= HF_STYLES
    for path, style, placed in (row for t in known_types() for row in placements(plans_for_type(t))):
        assert placed.split(":")[0].split(" ")[0] in {"column", "row", "vocab", "head_norm", "norm",
                                                      "replicate",
                                                       "expert", "folded", "refused"}, (path, style, placed)


@pytest.mark.parametrize("mtype", _with_plans())
def test_each_plan_derives_a_policy_or_a_refusal_naming_module_and_style(mtype):
    plans = plans_for_type(mtype)
    try:
        derived = derive_policy(plans)
    except PlanRefusal as exc:
        assert exc.rule == STYLE_REFUSED
        assert any(path in exc.message and repr(style) in exc.message
                   for path, style in {**plans.tp, **plans.ep}.items())
        return
    rows = derived.policy.rows
    for path, style in {**plans.tp, **plans.ep}.items():
        name = path.replace("*", "0")
        # every entry is placed by a row of its own, or folded into an owner that is (and says so)
        hit = any(re.fullmatch(r.match, "model." + name) for r in rows)
        assert hit or any(f.startswith(f"{path}: {style} (") for f in derived.folded), (path, style)
    for r in rows:
        re.compile(r.match)
        assert r.why


def test_plan_paths_become_whole_name_regexes():
    rx = path_regex("layers.*.mlp.up_proj")
    assert re.fullmatch(rx, "model.layers.12.mlp.up_proj") and re.fullmatch(rx, "layers.0.mlp.up_proj")
    assert not re.fullmatch(rx, "model.layers.x.mlp.up_proj") and not re.fullmatch(
        rx, "model.layers.0.mlp.up_projx"
    )


def test_a_model_without_plans_and_an_unplaceable_style_are_refused_with_their_rules():
    with pytest.raises(PlanRefusal) as exc:
        derive_policy(HfPlans("toy"))
    assert exc.value.rule == NO_PLAN and "'toy'" in exc.value.message
    with pytest.raises(PlanRefusal) as exc:
        derive_policy(HfPlans("toy", tp={"layers.*.mlp.experts": "moe_tp_experts",
                                         "layers.*.mlp.zero": "moe_identity_expert"}))
    assert exc.value.rule == STYLE_REFUSED and "layers.*.mlp.zero" in exc.value.message
    assert "'moe_identity_expert'" in exc.value.message
    with pytest.raises(PlanRefusal) as exc:
        derive_policy(HfPlans("toy", tp={"layers.*.x": "made_up"}))
    assert exc.value.rule == STYLE_REFUSED and "'made_up'" in exc.value.message


def test_derived_rows_carry_the_head_kinds_and_mla_keeps_its_attention_whole():
    llama = derive_policy(plans_for_type("llama")).policy
    by_name = {r.match: r for r in llama.rows}
    assert by_name[path_regex("layers.*.self_attn.q_proj")].heads == "q"
    assert by_name[path_regex("layers.*.self_attn.k_proj")].heads == "kv"
    assert by_name[path_regex("layers.*.self_attn.o_proj")].heads == "q"
    assert by_name[path_regex("embed_tokens")].variant == "vocab"
    assert by_name[r"lm_head"].variant == "vocab"
    mla = [t for t in _with_plans() if "mla_kv_a_proj" in plans_for_type(t).tp.values()]
    assert mla
    for t in mla:
        try:
            d = derive_policy(plans_for_type(t))
        except PlanRefusal:
            continue
        assert any(r.variant == "replicate" and "MLA" in r.why for r in d.policy.rows), t


def test_the_kept_hand_written_families_exist_and_the_new_rules_are_registered():
    for mtype, (arch, modules, why) in KEEP_HANDWRITTEN.items():
        assert arch in POLICIES and plans_for_type(mtype) is not None and modules and why
    ids = {r.id for r in all_rules()}
    assert {STYLE_REFUSED, NO_PLAN} <= ids
    assert set(STYLES) <= HF_STYLES


@pytest.mark.slow
def test_the_table_matches_the_installed_transformers():
    pytest.importorskip("transformers")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "update_hf_plans.py"), "--check"],
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, ("stale: run python "
                                 "scripts/update_hf_plans.py\n") + out.stdout[-3000:] + out.stderr[-2000:]
