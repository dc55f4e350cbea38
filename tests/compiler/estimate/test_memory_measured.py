"""The memory estimate against real runs: DeepSpeed engines and autograd's saved tensors on 2 CPU ranks.

One launcher run (tests/dist/measure_memory.py) measures every configuration; the tests compare. The
test GPT uses explicit ops (the `EAGER` kernel profile); dsforge's own HF models are measured too,
against the default `HF_SDPA` profile.
Tolerances are the issue's: model states within 2 % (they are exact byte counts of the buffers
DeepSpeed keeps; what remains is alignment padding and the few parameters of straddling tensors
that ZeRO-2 copies whole), activations within 10 % (the count is exact on this model; 10 % leaves
room for kernel choices of other torch versions).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dsforge.compiler.estimate import activations as act
from dsforge.compiler.estimate.model_states import model_states
from dsforge.compiler.estimate.shares import stage_share
from dsforge.compiler.estimate.zero_config import zero_settings
from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.frontend.presets import presets
from dsforge.compiler.model.params import is_moe_layer
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.plan.plan import Plan, build_plan
from dsforge.compiler.spec.schema import ModelSpec

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "dist" / "measure_memory.py"

def _script() -> Any:
    """tests/dist/measure_memory.py as a module (it holds the measured job's text)."""
    spec = importlib.util.spec_from_file_location("measure_memory", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MEASURE = _script()


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("mem") / "measured.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29613",
           str(SCRIPT), str(out)]
    # ~3 min on an idle 2-core machine; 8.5 min measured with the cores shared by several test suites
    run = subprocess.run(cmd, check=False, env=env, cwd=out.parent, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def plan_for(tmp_path: Path, *, tp: int = 1, zero: int = 0, precision: str = "fp32",
             recompute: str = "none") -> Plan:
    path = tmp_path / "job.yaml"
    path.write_text(MEASURE.job_yaml(zero, precision, tp, recompute))
    job, diags = load_job(path)
    assert job is not None, diags
    return build_plan(job.spec)


def estimated_states(plan: Plan) -> dict[str, float]:
    """Estimated model-state bytes (all device components) at the two moments, keyed by moment."""
    assert plan.degrees is not None
    z = zero_settings(plan)
    states = model_states(stage_share(plan, 0, z.persistence_threshold), z, plan.degrees.dp, 1, 2)
    return {"backward": sum(states.backward.values()), "update": sum(states.update.values()),
            "step": sum(states.step.values())}


def measured_states(snaps: dict[str, dict[str, int]]) -> dict[str, int]:
    """Engine tensor bytes (everything live but the module's registered buffers) at the measured moments:
    the backward snapshot, and the largest of those after autograd (collectives, partition copies, step)."""
    totals = {name: sum(v for k, v in c.items() if k != "module_buffers") for name, c in snaps.items()}
    return {"backward": totals["backward"], "update": max(v for k, v in totals.items() if k != "backward"),
            "step": totals["step"]}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_states_within_2_percent(measured: dict[str, Any], tmp_path: Path, zero: int,
                                       precision: str) -> None:
    est = estimated_states(plan_for(tmp_path, zero=zero, precision=precision))
    got = measured_states(measured["states"][f"zero{zero}-{precision}"])
    peak = ("backward", "update")
    assert max(est[k] for k in peak) == pytest.approx(max(got[k] for k in peak), rel=0.02), (est, got)
    assert est["update"] == pytest.approx(got["update"], rel=0.02), (est, got)
    assert est["step"] == pytest.approx(got["step"], rel=0.02), (est, got)  # inside the optimizer step
    # the backward snapshot is one instant of backward, not its peak: the estimate of that moment's
    # peak may exceed it (by the in-flight bucket of ZeRO-2, ZeRO-3's gathered weights) but not fall short
    assert est["backward"] >= 0.98 * got["backward"], (est, got)


@pytest.mark.parametrize("key", ["tp1-none-fp32", "tp1-full-fp32", "tp1-none-bf16", "tp1-full-bf16",
                                 "tp2-none-fp32", "tp2-full-fp32"])
def test_activations_within_10_percent(measured: dict[str, Any], tmp_path: Path, key: str) -> None:
    tp_s, recompute, precision = key.split("-")
    tp = int(tp_s[2:])
    plan = plan_for(tmp_path, tp=tp, precision=precision, recompute=recompute)
    from dsforge.compiler.estimate.memory import activation_shape

    shape = dataclasses.replace(activation_shape(plan), kernels=act.EAGER)  # the test GPT's explicit ops
    model = plan.model
    got = measured["activations"][key]
    blocks = model.layers * act.layer_bytes(model, shape, False, recompute)
    assert blocks == pytest.approx(got["blocks"], rel=0.10), (blocks, got)
    if tp == 1:  # the test model's embedding and head are replicated, so compare them unsplit only
        assert act.embedding_bytes(model, shape) == pytest.approx(got["embed"], rel=0.10), got
        head = act.head_bytes(model, shape) + act.logits_bytes(model, shape, model.vocab)[0]
        assert head == pytest.approx(got["head"], rel=0.10), (head, got)


@pytest.mark.parametrize("key",
                         [f"{m}-{p}" for m in ("tiny-llama", "tiny-gpt2",
                                               "tiny-mixtral") for p in ("fp32", "bf16")])
def test_runtime_model_activations_within_10_percent(measured: dict[str, Any], key: str) -> None:
    # the HF models dsforge's runtime builds (SDPA attention, HF norms and activations): the estimate's
    # default kernel profile, the one `estimate_memory` uses for every job
    preset, precision = key.rsplit("-", 1)
    model = resolve_model(ModelSpec(**presets("models")[preset].spec))
    shape = act.ActivationShape(2, model.seq_len, 1, 1, False, 4 if precision == "fp32" else 2,
                                kernels=act.HF_SDPA)
    got = measured["hf"][key]
    blocks = sum(act.layer_bytes(model, shape, is_moe_layer(model, i), "none") for i in range(model.layers))
    outside = (act.embedding_bytes(model, shape) + act.head_bytes(model, shape)
               + act.logits_bytes(model, shape, model.vocab)[0])
    assert blocks == pytest.approx(got["blocks"], rel=0.10), (blocks, got)
    assert outside == pytest.approx(got["outside"], rel=0.10), (outside, got)


def runtime_plan(**kwargs: Any) -> Plan:
    """The plan of one runtime-model measurement (tests/dist/measure_memory.py `runtime_job_yaml`)."""
    plan: Plan = MEASURE._plan(MEASURE.runtime_job_yaml(**kwargs))
    return plan


def estimated_blocks(plan: Plan) -> float:
    """Bytes the decoder layers keep for one micro-batch under the plan's recompute (the default HF_SDPA
    kernels, with the emitted ds_config's checkpoint partitioning)."""
    from dsforge.compiler.estimate.memory import activation_shape

    shape, model = activation_shape(plan), plan.model
    return sum(act.layer_bytes(model, shape, is_moe_layer(model, i), plan.spec.training.recompute)
               for i in range(model.layers))


RUNTIME_KEYS = [f"tp{tp}-{r}" for tp in (1, 2) for r in ("none", "selective", "full")]
# Under sequence parallelism the runtime's sequence regions gather the sequence before the attention and
# MLP blocks; their column-parallel layers save this rank's shard of it (as Megatron's do) and gather it
# again in backward (dsforge/runtime/layers/gathered_input.py). They used to save the gathered input:
# 1,259,520 bytes measured against 1,120,256 estimated (+12 %); now 1,128,448 (the 8,192 over the estimate
# are RoPE's cos/sin, saved once for all layers and counted with the first).


@pytest.mark.parametrize("key", [*RUNTIME_KEYS, "tp2-sp-full", "tp2-sp-none", "tp2-sp-selective"])
def test_runtime_recompute_activations_within_10_percent(measured: dict[str, Any], key: str) -> None:
    # The model the runtime trains (build_parallel_model and the engine's recompute), per rank.
    parts = key.split("-")
    plan = runtime_plan(tp=int(parts[0][2:]), recompute=parts[-1], sp="sp" in parts)
    got = measured["runtime"][key]["blocks"]
    assert estimated_blocks(plan) == pytest.approx(got, rel=0.10), (estimated_blocks(plan), got)


def estimated_outside(plan: Plan) -> float:
    """Bytes the embedding, final norm, LM head and loss keep for one micro-batch (the plan's kernels)."""
    from dsforge.compiler.estimate.memory import activation_shape
    from dsforge.compiler.model.params import padded_vocab

    shape, model = activation_shape(plan), plan.model
    assert plan.degrees is not None
    return (act.embedding_bytes(model, shape) + act.head_bytes(model, shape)
            + act.logits_bytes(model, shape, padded_vocab(model, plan.degrees.tp))[0])


@pytest.mark.parametrize("key", ["tp1-none", "tp2-none", "tp2-sp-none"])
def test_lean_loss_and_head_within_10_percent(measured: dict[str, Any], key: str) -> None:
    # The fused, chunked loss keeps the head's input, the fp32 row maximum and sum of exponentials and the
    # target per token: what the estimate's `chunked_loss` prices (the plain loss kept tokens x vocab/tp fp32
    # probabilities besides)
    parts = key.split("-")
    plan = runtime_plan(tp=int(parts[0][2:]), sp="sp" in parts)
    got = measured["runtime"][key]["outside"]
    assert estimated_outside(plan) == pytest.approx(got, rel=0.10), (estimated_outside(plan), got)


PLAIN_KEYS = [f"{k}-{p}" for k in ("tp1-none", "tp2-sp-none") for p in ("fp32", "bf16")]


@pytest.mark.parametrize("key", PLAIN_KEYS)
def test_plain_kernels_within_10_percent(measured: dict[str, Any], key: str) -> None:
    # training.kernels all false: the HF modules and the unfused loss, as the estimate's HF_SDPA prices them
    parts = key.split("-")
    plan = runtime_plan(tp=int(parts[0][2:]), sp="sp" in parts, precision=parts[-1], plain=True)
    got = measured["plain"][key]
    assert estimated_blocks(plan) == pytest.approx(got["blocks"], rel=0.10), (estimated_blocks(plan), got)
    assert estimated_outside(plan) == pytest.approx(got["outside"], rel=0.10), (estimated_outside(plan), got)


@pytest.mark.parametrize("key", PLAIN_KEYS)
def test_lean_kernels_cut_activations_by_the_estimated_factor(measured: dict[str, Any], key: str) -> None:
    # The measured run: tiny Llama at tp=2 with SP (and tp=1), fp32 and bf16; the bytes one
    # micro-batch keeps (layers, embedding, head and loss) fall by the factor the estimate predicts, within 10
    # %
    parts = key.split("-")
    tp, sp, precision = int(parts[0][2:]), "sp" in parts, parts[-1]
    plain, lean = (runtime_plan(tp=tp, sp=sp, precision=precision, plain=p) for p in (True, False))
    lean_key = "-".join(parts[:-1])
    got_lean = measured["runtime"][lean_key] if precision == "fp32" else measured["lean-bf16"][lean_key]
    before = measured["plain"][key]["blocks"] + measured["plain"][key]["outside"]
    after = got_lean["blocks"] + got_lean["outside"]
    est = (estimated_blocks(plain) + estimated_outside(plain)) / (
        estimated_blocks(lean) + estimated_outside(lean)
    )
    assert before / after >= 0.9 * est, (before, after, est)
    assert before / after == pytest.approx(est, rel=0.10), (before / after, est)
    assert est > 1.2, est  # the cut is real, not a rounding


@pytest.mark.parametrize("tp", [1, 2])
def test_recompute_is_applied(measured: dict[str, Any], tp: int) -> None:
    # full keeps one layer input per layer (1/tp of it under partition_activations); selective keeps what
    # none keeps, because SDPA already drops the attention scores (dsforge/runtime/recompute.py)
    got = {r: measured["runtime"][f"tp{tp}-{r}"]["blocks"] for r in ("none", "selective", "full")}
    model = runtime_plan(tp=tp).model
    assert got["full"] == model.layers * 2 * model.seq_len * model.hidden * 4 // tp, got
    assert got["selective"] == got["none"] > 10 * got["full"], got


def test_ring_attention_saved_bytes_within_10_percent_and_below_full_sequence_sdpa(
    measured: dict[str, Any],
) -> None:
    # S=1024, cp 2: ring attention keeps q, k, v, output and log-sum-exp of the local half (the old
    # implementation kept every block's probabilities, O(S^2/cp)); SDPA on the whole sequence on one rank
    ring, sdpa = measured["ring"]["cp2-ring"]["blocks"], measured["ring"]["cp1-sdpa"]["blocks"]
    est = estimated_blocks(runtime_plan(cp=2, seq=1024))
    assert est == pytest.approx(ring, rel=0.10), (est, ring)
    assert ring < sdpa, (ring, sdpa)
    assert estimated_blocks(runtime_plan(seq=1024)) == pytest.approx(sdpa, rel=0.10), sdpa


@pytest.mark.parametrize("key", ["bf16-zero1", "fp32-zero1", "bf16-zero3", "fp32-zero3"])
def test_weights_that_arrive_in_bf16_train_in_the_jobs_precision(measured: dict[str, Any], key: str) -> None:
    # A bf16 checkpoint in a bf16 job: bf16 parameters, fp32 master weights in the optimizer, model states as
    # estimated; in an fp32 job the runtime casts the weights to fp32 first (DeepSpeed would train them in
    # bf16). Under ZeRO-3 the report once read 0 gradients and 2/3 of the optimizer (the torch optimizer's
    # groups are empty outside ZeRO-3's step, and its reduced gradients live in one flat buffer).
    from dsforge.runtime.measure import predicted

    precision, zero = key.split("-zero")
    got = measured["weights16"][key]
    assert got["module"] == [f"torch.{'bfloat16' if precision == 'bf16' else 'float32'}"], got
    assert got["master"] == ["torch.float32"], got
    want = predicted(runtime_plan(precision=precision, zero=int(zero)), 0)
    for part in ("parameters", "gradients", "optimizer"):
        assert got["states"][part] == pytest.approx(want[part], rel=0.02), (part, got, want)


def _saved_by_first_layer(spec_model: dict[str, Any], tmp_path: Path) -> tuple[int, Any]:
    """Bytes autograd saves inside decoder layer 0 of a family's dense HF model (fp32, one process), and its
    plan."""
    import torch

    sys.path.insert(0, str(SCRIPT.parent))
    from storage import SavedTensors  # tests/dist/storage.py, as measure_memory.py imports it

    from dsforge.runtime.models import build_model
    from tests.runtime_rewrite.conftest import make_job

    plan = build_plan(make_job(tmp_path, spec_model))
    model = build_model(plan.model, "cpu", 1, seed=0).train()
    saved = SavedTensors(model.parameters())
    region = saved.record("layer")
    layer = model.model.layers[0]

    def enter(*_: Any) -> None:  # a hook's return value would replace the layer's input or output
        region.__enter__()

    def leave(*_: Any) -> None:
        region.__exit__(None, None, None)

    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(leave)
    ids = torch.randint(0, plan.model.vocab, (2, plan.model.seq_len),
                        generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    return saved.by_region()["layer"], plan


def test_shared_expert_activations_are_counted(tmp_path: Path) -> None:
    # Qwen2-MoE's shared expert (48 wide, with its sigmoid gate) beside 4 routed experts: the shared MLP's
    # inner tensors, its output and the gate value are a fifth of the layer; without them the estimate of
    # the layer is 20 % short, with them within 10 % (measured 177,808 bytes, estimated 174,208)
    pytest.importorskip("transformers")
    from tests.runtime_rewrite.families import FAMILY_JOBS

    got, plan = _saved_by_first_layer(FAMILY_JOBS["qwen2_moe"], tmp_path)
    model = plan.model
    shape = act.ActivationShape(2, model.seq_len, 1, 1, False, 4, kernels=act.HF_SDPA)
    terms = act.layer_terms(model, shape, True)
    assert sum(terms.values()) == pytest.approx(got, rel=0.10), (terms, got)
    without = sum(v for k, v in terms.items() if k != "mlp.shared_experts")
    assert without < 0.9 * got, (without, got)
    assert terms["mlp.shared_experts"] == 2 * model.seq_len * act.shared_expert_bytes(model, shape)


def test_what_sequence_parallelism_saves_in_an_moe_model_is_the_estimates(measured: dict[str, Any]) -> None:
    # tiny-mixtral at tp 2: SP splits the norms and the attention block's saved input over the TP ranks, but
    # the MoE block's replicated router reads the whole gathered sequence and saves it. The bytes SP saves,
    # measured, are the estimate's exactly (82,432 per layer; counting the router's input split would say
    # 98,816).
    got = {k: measured["moe"][k]["blocks"] for k in ("tp2-none", "tp2-sp-none")}
    plans = {k: runtime_plan(tp=2, sp="sp" in k, preset="tiny-mixtral") for k in got}
    est = {k: estimated_blocks(p) for k, p in plans.items()}
    assert got["tp2-none"] - got["tp2-sp-none"] == est["tp2-none"] - est["tp2-sp-none"], (got, est)
    assert est["tp2-sp-none"] == pytest.approx(got["tp2-sp-none"], rel=0.10), (est, got)
