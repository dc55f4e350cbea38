"""The HF zoo: every causal-LM type of the installed transformers with a tp plan, tiny and random, under dsforge tp=2.

For each model type of dsforge/compiler/model/hf_plans_table.py whose plans state a tensor- or
expert-parallel plan, a tiny config is made from the type's defaults (2 layers, hidden 64, 4 query
and 2 key/value heads of 16 channels, vocabulary 128, 4 experts of top-2; every other width left as
the config derives it), built on CPU with a fixed seed and run through one forward and backward
("builds"). Then `arch: auto` plans it at tp=2 on the meta device (refusals carry their rule id), and
two gloo ranks train the rewritten model for 2 SGD steps against plain HF trained the same way on one
process: the loss of every step and the gradient of every parameter (each rank's slice of the dense
gradient), with tests/runtime_rewrite/test_family_parity.py's tolerance (1e-5 of the reference's scale).
A type that differs in float32 runs again in float64 (MoE experts by HF's eager loop, which is the same
sum as its grouped matmul), with every float32 the model itself asks for (norms, softmax, routers, gated
delta rules, hyper-connections) promoted to float64 on both sides (benchmarks/float64_everywhere.py): exact
there means float32's summation order made the difference, and the row counts exact with `dtype: float64`
and the float32 figure kept; otherwise it stays `differs` with what float64 gave. The tolerance is the same
in both; `worst` is the largest error of the run, relative to the reference's scale.

`--mode pp` runs the types with a base_model_pp_plan at pp=2 against one process; `--mode export` saves
each type with save_pretrained, reads it back at tp=2 (tp=2 x ep=2 x dp=2 for a type with an ep plan) and
compares dsforge's export with the saved directory, tensor for tensor (benchmarks/zoo_export.py). Not
covered here (yet): ep=2 training parity.

    python benchmarks/hf_zoo.py [--only t1,t2] [--timeout 300] [--json out.json] [--dtype float64]

Each type runs in its own processes (a crash or a hang in one cannot stop the others; a hang is cut at
--timeout). It prints one line per type and the table: exact / refused (rule) / crash / differs /
does not build, with the run time.
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE: dict[str, Any] = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 96, "vocab": 128,
                        "seq_len": 16}
#: Config attributes set on every tiny model where the config has them (names differ between families).
_SIZES: dict[str, Any] = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
    "n_inner": 96, "ffn_hidden_size": 96, "vocab_size": 128, "max_position_embeddings": 64, "n_positions": 64,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "top_k": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32, "kv_lora_rank": 16,
    "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1,
    "topk_group": 1, "first_k_dense_replace": 1, "sliding_window": 64, "use_cache": False,
    "output_router_logits": False, "router_jitter_noise": 0.0, "tie_word_embeddings": False,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "rotary_dim": 8,
    # Mamba-2 layers: heads x head width = expand (2) x hidden; the default head width was derived from the
    # default hidden size
    "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128,
}


def tiny_config(model_type: str) -> Any:
    """The type's default config shrunk to the zoo's widths (dropouts 0), eager attention."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    text = getattr(cfg, "text_config", None)
    if text is not None and text is not cfg:  # a composite config (Llama 4): its causal LM is built from the
                                              # text part
        _shrink(text)
    for key, depth in (("vision_config", "num_hidden_layers"), ("audio_config", "num_blocks")):
        encoder = getattr(cfg, key, None)  # an encoder the causal LM carries and token batches never run
        if encoder is not None and isinstance(getattr(encoder, depth, None), int):
            setattr(encoder, depth, 1)  # one layer: phi4_multimodal's were 870M parameters (pp ran out)
    return _shrink(cfg)


def _settable(cfg: Any, key: str) -> bool:
    """False for a config attribute that is a property without a setter (derived from other fields)."""
    prop = getattr(type(cfg), getattr(cfg, "attribute_map", {}).get(key, key), None)
    return not isinstance(prop, property) or prop.fset is not None


def _shrink(cfg: Any) -> Any:
    """One config shrunk in place to the zoo's widths (see tiny_config)."""
    for key, value in _SIZES.items():
        if hasattr(cfg, key) or key in cfg.to_dict():
            try:
                setattr(cfg, key, value)
            except Exception:  # noqa: BLE001, S110 - a config that refuses the value keeps its own
                pass
    for key in list(cfg.to_dict()):
        if "dropout" in key or key.endswith("_pdrop"):
            try:
                setattr(cfg, key, 0.0)
            except Exception:  # noqa: BLE001, S110 - a config that refuses the value keeps its own
                pass
    if isinstance(getattr(cfg, "qk_rope_head_dim", None), int):  # MLA: head_dim is the rotary part's width
        try:
            cfg.head_dim = cfg.qk_rope_head_dim
            # MLA expands its compressed keys and values to every query head (its configs state kv heads =
            # heads); fewer would repeat them again, which the attention cannot take
            if getattr(cfg, "kv_lora_rank", None) and hasattr(cfg, "num_key_value_heads"):
                cfg.num_key_value_heads = cfg.num_attention_heads
        except Exception:  # noqa: BLE001, S110 - a config that refuses the value keeps its own
            pass
    layers = getattr(cfg, "num_hidden_layers", 2)
    for key in ("layer_types", "mlp_layer_types", "layers_block_type"):
        value = getattr(cfg, key, None)
        if isinstance(value, list) and value and _settable(cfg, key):  # a read-only one derives from others
            setattr(cfg, key, (value * layers)[:layers])
    cfg._attn_implementation = "eager"
    return cfg


def _factory(model_type: str, dtype: str | None = None) -> Any:
    """The tiny model's builder, in ``dtype`` (None: $HF_ZOO_DTYPE, float32 when unset)."""
    def build(_model: Any = None) -> Any:
        from transformers import AutoModelForCausalLM

        wide = (dtype or os.environ.get("HF_ZOO_DTYPE")) == "float64"
        cfg = tiny_config(model_type)
        # torch's grouped matmul takes no float64; the eager expert loop is the same sum
        extra = {"experts_implementation": "eager"} if wide else {}
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", **extra)
        # --dtype float64: the same check with rounding a billion times smaller (summation order is not
        # mathematics)
        model = model.double() if wide else model.float()
        return _nontrivial_buffers(model)
    return build


def _nontrivial_buffers(model: Any) -> Any:
    """Fill the routing tables HF initialises to zeros (DeepSeek-V4's hash router ``tid2eid``) with fixed,
    seeded distinct experts per token: all-zero tables send every token to expert 0 twice, which makes the
    router's gradient zero and the comparison one of rounding noise."""
    import torch

    gen = torch.Generator().manual_seed(11)
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        experts = getattr(module, "num_experts", None)
        if isinstance(table, torch.Tensor) and isinstance(experts, int) and table.dim() == 2:
            picks = torch.rand(table.shape[0], experts, generator=gen).argsort(dim=-1)[:, :table.shape[1]]
            with torch.no_grad():
                table.copy_(picks.to(table.dtype))
    return model


def __getattr__(name: str) -> Any:
    """`model.factory: benchmarks.hf_zoo:zoo_<model_type>` builds that type's tiny model
    (`zoo64_<model_type>`: in float64)."""
    if name.startswith("zoo64_"):
        return _factory(name[6:], "float64")
    if name.startswith("zoo_"):
        return _factory(name[4:])
    raise AttributeError(name)


def _job_keys(model: Any, model_type: str, dtype: str | None = None) -> dict[str, Any]:
    cfg = model.config
    prefix = "zoo64_" if dtype == "float64" else "zoo_"
    keys = {**BASE, "arch": "auto", "factory": f"benchmarks.hf_zoo:{prefix}{model_type}",
            "tied_embeddings": bool(getattr(cfg, "tie_word_embeddings", False))}
    heads = getattr(cfg, "num_attention_heads", None)
    if isinstance(heads, int):
        keys["heads"] = heads
        kv = getattr(cfg, "num_key_value_heads", None)
        keys["kv_heads"] = kv if isinstance(kv, int) and kv > 0 else heads
    hidden = getattr(cfg, "hidden_size", None)
    if isinstance(hidden, int):
        keys["hidden"] = hidden
    layers = getattr(cfg, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > 0:  # a hybrid pattern (Nemotron-H) may set more than the zoo's 2
        keys["layers"] = layers
    hd = getattr(cfg, "head_dim", None)
    if isinstance(hd, int) and hd > 0:
        keys["head_dim"] = hd
    return keys


def _parity_worker(rank: int, world: int, keys: dict[str, Any], tmp: str) -> None:
    import contextlib
    import io

    from benchmarks.float64_everywhere import float64_everywhere
    from tests.runtime_rewrite.conftest import make_job
    from tests.runtime_rewrite.test_family_parity import tp_parity

    mine = Path(tmp) / f"rank{rank}"  # each rank writes its own job file (one shared name races)
    mine.mkdir(exist_ok=True)
    spec = make_job(mine, keys, {"tp": 2})
    # float64: the models' own float32 casts promoted too (both sides), so no float32 rounding is left
    wide = float64_everywhere() if os.environ.get("HF_ZOO_DTYPE") == "float64" else contextlib.nullcontext()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), wide:
        tp_parity(rank, spec, tag=keys["factory"])
    (Path(tmp) / f"worst{rank}").write_text(str(_worst(printed.getvalue())))
    if os.environ.get("HF_ZOO_DEBUG"):
        Path(f"/tmp/zoo-printed{rank}").write_text(printed.getvalue())


def _worst(printed: str) -> float:
    """The largest error relative to the reference's scale among the PARITY lines a rank printed."""
    import re

    return max((float(v) for v in re.findall(r"^PARITY .*, rel (\S+)$", printed, re.MULTILINE)), default=0.0)


def run_one(model_type: str) -> dict[str, Any]:
    """Build, plan and (when planned) run one type; the result as a dict."""
    import tempfile

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    t0 = time.perf_counter()
    try:
        torch.manual_seed(0)
        model = _factory(model_type)()
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
    except Exception as exc:  # noqa: BLE001 - any failure to build tiny is a row of the table
        return {"type": model_type, "result": "no build", "why": f"{type(exc).__name__}: {exc}"[:200]}
    from dsforge.compiler.plan.plan import build_plan
    from dsforge.runtime.rewrite import plan_rewrite
    from dsforge.runtime.rewrite.planner import RewriteError
    from tests.runtime_rewrite.conftest import make_job

    tmp = tempfile.mkdtemp(prefix="hf-zoo-")
    keys = _job_keys(model, model_type, os.environ.get("HF_ZOO_DTYPE"))
    try:
        spec = make_job(Path(tmp), keys, {"tp": 2})
        rp = plan_rewrite(spec.model, build_plan(spec))
    except RewriteError as exc:
        # the problem naming a rule (the type's own policy) first: the families auto tried are context
        text = "; ".join(sorted(exc.problems, key=lambda p: "DSF" not in p))
        inner = next((w for w in text.replace(":", " ").split() if w.startswith("DSF")), None)
        rule = "DSF607" + (f"/{inner}" if inner else "")  # compile reports a RewriteError as DSF607
        return {"type": model_type, "result": "refused", "rule": rule, "why": text[:300],
                "seconds": round(time.perf_counter() - t0, 1)}
    except Exception as exc:  # noqa: BLE001 - a planner crash is a row too
        return {"type": model_type, "result": "crash", "why": f"plan: {type(exc).__name__}: {exc}"[:300],
                "seconds": round(time.perf_counter() - t0, 1)}
    from tests.runtime.launcher import run

    try:
        run(_parity_worker, 2, keys, tmp)
    except Exception as exc:  # noqa: BLE001 - classified below
        text = str(exc)
        result = (
            "differs" if "of the reference's scale" in text or "does not hold its slice" in text else "crash"
        )
        last = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [type(exc).__name__]
        return {"type": model_type, "result": result, "arch": rp.arch, "why": last[0][:300],
                "seconds": round(time.perf_counter() - t0, 1)}
    worst = max(float((Path(tmp) / f"worst{r}").read_text()) for r in range(2))
    return {"type": model_type, "result": "exact", "arch": rp.arch, "worst": f"{worst:.1e}",
            "seconds": round(time.perf_counter() - t0, 1)}


def _pp_worker(rank: int, world: int, keys: dict[str, Any], tmp: str) -> None:
    import contextlib
    import io

    import deepspeed

    from tests.runtime_rewrite.test_derived_pipeline import _parity

    deepspeed.init_distributed(dist_backend="gloo")
    with contextlib.redirect_stdout(io.StringIO()):
        _parity(rank, keys, {"pp": 2}, tmp)


def run_one_pp(model_type: str) -> dict[str, Any]:
    """`--mode pp`: plan one type at pp=2 (the glue check refuses with DSF607) and run it on 2 gloo ranks
    for 2 SGD steps against one process (tests/runtime_rewrite/test_derived_pipeline.py's comparison)."""
    import tempfile

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    t0 = time.perf_counter()
    try:
        torch.manual_seed(0)
        model = _factory(model_type)()
    except Exception as exc:  # noqa: BLE001 - any failure to build tiny is a row of the table
        return {"type": model_type, "result": "no build", "why": f"{type(exc).__name__}: {exc}"[:200]}
    from dsforge.compiler.plan.plan import build_plan
    from dsforge.runtime.rewrite import plan_rewrite
    from dsforge.runtime.rewrite.planner import RewriteError
    from tests.runtime.launcher import run
    from tests.runtime_rewrite.conftest import make_job

    tmp = tempfile.mkdtemp(prefix="hf-zoo-pp-")
    keys = {**_job_keys(model, model_type), "seq_len": 64}
    try:
        rp = plan_rewrite(make_job(Path(tmp), keys, {"pp": 2}).model,
                          build_plan(make_job(Path(tmp), keys, {"pp": 2})))
        run(_pp_worker, 2, keys, tmp)
    except RewriteError as exc:
        return {"type": model_type, "result": "refused", "rule": "DSF607",
                "why": "; ".join(exc.problems)[:300], "seconds": round(time.perf_counter() - t0, 1)}
    except Exception as exc:  # noqa: BLE001 - classified below
        text = str(exc)
        last = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [type(exc).__name__]
        return {"type": model_type, "result": "differs" if "of the reference's scale" in text else "crash",
                "why": last[0][:300], "seconds": round(time.perf_counter() - t0, 1)}
    return {"type": model_type, "result": "exact", "arch": rp.arch,
            "seconds": round(time.perf_counter() - t0, 1)}


def run_one_export(model_type: str) -> dict[str, Any]:
    """`--mode export`: the type's tiny model through save_pretrained, a tp=2 (ep=2) read and dsforge's
    export (benchmarks/zoo_export.py)."""
    from benchmarks.zoo_export import run_one_export as export_one
    from dsforge.compiler.model.hf_plans import plans_for_type

    plans = plans_for_type(model_type)
    return export_one(model_type, _factory(model_type), bool(plans and plans.ep))


def run_one_ep(model_type: str) -> dict[str, Any]:
    """`--mode ep`: one MoE type at ep=2 x dp=2 against one process (benchmarks/zoo_ep.py)."""
    from benchmarks.zoo_ep import run_one_ep as ep_one

    return ep_one(model_type, _factory(model_type), _job_keys)


def zoo_types() -> list[str]:
    """The model types whose transformers plans state a tp or ep plan."""
    from dsforge.compiler.model.hf_plans import known_types, plans_for_type

    return [t for t in known_types() if (p := plans_for_type(t)) is not None and (p.tp or p.ep)]


def _write(path: Path, rows: list[dict[str, Any]], dtype: str, seconds: float, mode: str = "tp") -> None:
    """The result file scripts/families_table.py reads: the mode, transformers' version, run time and rows."""
    import transformers

    data = {"mode": f"{mode}=2, {dtype}", "transformers": transformers.__version__, "seconds": round(seconds),
            "rows": rows}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def _run_type(model_type: str, mode: str, env: dict[str, str], timeout: int) -> dict[str, Any]:
    """One type's row, from its own processes (a crash or a hang cannot stop the zoo)."""
    try:
        out = subprocess.run([sys.executable, __file__, "--one", model_type, "--mode", mode],
                             capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)
    except subprocess.TimeoutExpired:
        return {"type": model_type, "result": "crash", "why": f"timed out after {timeout} s"}
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ZOO ")), None)
    if line:
        row: dict[str, Any] = json.loads(line[4:])
        return row
    last = (out.stderr.strip().splitlines() or ["?"])[-1]
    return {"type": model_type, "result": "crash", "why": last[:300]}


def _wide_check(row: dict[str, Any], wide: dict[str, Any]) -> dict[str, Any]:
    """A float32 difference re-checked in float64: exact there means float32's summation order made it (the
    row counts exact, with dtype float64 and the float32 figure kept); otherwise the row keeps its
    difference and says what float64 gave."""
    if wide["result"] == "exact":
        kept = {k: v for k, v in row.items() if k != "why"}
        worst = {"worst": wide["worst"]} if "worst" in wide else {}
        return {**kept, "result": "exact", "dtype": "float64", **worst,
                "float32": row.get("why", ""),
                "seconds": round(row.get("seconds", 0) + wide.get("seconds", 0), 1)}
    return {**row, "float64": f"{wide['result']}: {wide.get('why', '')}"[:300]}


def main() -> int:
    """Run the zoo (or one type with --one) and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one")
    ap.add_argument("--only", default="")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--json")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                    help="the models' dtype, reference and rewritten "
                         "alike (float64: rounding out of the way)")
    ap.add_argument("--mode", choices=("tp", "pp", "export", "ep"), default="tp",
                    help="tp: tp=2 against one rank; pp: pp=2 (types with a base_model_pp_plan); export: "
                         "save_pretrained, read back at tp=2 (ep=2 with an ep plan), export, compare; ep: "
                         "ep=2 x dp=2 against one process (types with an ep plan)")
    args = ap.parse_args()
    if args.one:
        one = {"pp": run_one_pp, "export": run_one_export, "ep": run_one_ep}.get(args.mode, run_one)
        print("ZOO " + json.dumps(one(args.one)), flush=True)
        return 0
    types = [t for t in args.only.split(",") if t] or zoo_types()
    if args.mode in ("pp", "ep") and not args.only:
        from dsforge.compiler.model.hf_plans import plans_for_type

        types = [t for t in types if (p := plans_for_type(t)) is not None and getattr(p, args.mode)]
    rows = []
    start = time.perf_counter()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "HF_ZOO_DTYPE": args.dtype}
    for t in types:
        t0 = time.perf_counter()
        row = _run_type(t, args.mode, env, args.timeout)
        if row["result"] == "differs" and args.mode in ("tp", "ep") and args.dtype == "float32":
            row = _wide_check(row, _run_type(t, args.mode, {**env, "HF_ZOO_DTYPE": "float64"}, args.timeout))
        row.setdefault("seconds", round(time.perf_counter() - t0, 1))
        rows.append(row)
        print(f"{t:<28} {row['result']:<9} {row.get('rule', '')} {row.get('arch', '')} {row.get('seconds')} "
              f"s  {('worst ' + row['worst']) if 'worst' in row else ''}{row.get('why', '')}"
              f"{('  ep2: ' + row['ep2']) if 'ep2' in row else ''}",
              flush=True)
        if args.json:  # rewritten after every type: an interrupted run keeps what it measured
            _write(Path(args.json), rows, args.dtype, time.perf_counter() - start, args.mode)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    built = len(rows) - counts.get("no build", 0)
    print(f"\n{len(rows)} types with a tp/ep plan; {built} build tiny on CPU; "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
          + f"; {time.perf_counter() - start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
