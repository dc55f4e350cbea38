"""The HF zoo's export round trip (`benchmarks/hf_zoo.py --mode export`): pretrained in at tp=2, HF out.

One type's tiny random model is saved by `save_pretrained`; a job with `model.pretrained` set to that
directory is planned at tp=2 (ep=2 where the type states an ep plan) and two gloo ranks build their
shards the way `dsforge run` does (rank_skeleton: the parameters on meta, each rank reading only its
slices from the safetensors file), then gather the slices by their checkpoint tags (what `dsforge
export` assembles from a checkpoint) and rank 0 writes them with dsforge's HF export. Exact means the
export holds the same tensor names, dtypes, shapes and bytes as the `save_pretrained` directory, and the
same config.json.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml


def job_file(tmp: Path, name: str, pretrained: Path, degrees: dict[str, int]) -> Path:
    """A job reading ``pretrained`` under ``degrees`` on exactly their ranks, in fp32, written in ``tmp``."""
    ranks = degrees.get("tp", 1) * degrees.get("dp", 1)  # ep divides dp
    doc = {"version": 1, "model": {"pretrained": str(pretrained), "seq_len": 16},
           "parallel": {"pp": 1, **degrees}, "hardware": {"preset": "cpu-local", "gpus_per_node": ranks},
           "training": {"precision": "fp32"}}  # the zoo's models are float32: no conversion on the way
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def _plan(job_path: str) -> Any:
    from dsforge.compiler.frontend.parse import load_job
    from dsforge.compiler.plan.plan import build_plan

    job, diags = load_job(Path(job_path))
    if job is None:
        raise ValueError("; ".join(f"{d.rule}: {d.message}" for d in diags))
    return build_plan(job.spec)


def worker(rank: int, world: int, jobs: list[tuple[str, str]]) -> None:
    """On each rank: every (job file, export directory) in turn, in one world."""
    for job_path, out in jobs:
        _export(rank, world, job_path, out)


def _export(rank: int, world: int, job_path: str, out: str) -> None:
    import torch.distributed as dist

    from dsforge.runtime.engine import parallelize
    from dsforge.runtime.export_hf import save_hf
    from dsforge.runtime.groups import create_groups
    from dsforge.runtime.models import model_config
    from dsforge.runtime.rank_build import rank_skeleton
    from dsforge.runtime.weights_io import SliceTag, assemble, tagged

    plan = _plan(job_path)
    groups = create_groups(plan)
    skeleton, source = rank_skeleton(plan, plan.spec.training.seed)
    model = parallelize(skeleton, plan, groups, source=source)
    # each rank's slices against transformers' own load of the same directory
    Path(f"{out}.rank{rank}.slices").parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.rank{rank}.slices").write_text("\n".join(_wrong_slices(model, plan.model.pretrained)))
    keep = groups.index("dp") == 0  # dp ranks of one tp group hold the same slices
    mine = [(t.to_json(), p.detach().clone()) for p, t in tagged(model)
            if keep or not getattr(p, "allreduce", True)]
    everyone: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, everyone if rank == 0 else None, dst=0)
    if rank == 0:
        dense = assemble([(SliceTag.from_json(t), v) for part in everyone for t, v in part])
        cfg = model_config(plan.model, plan.degrees.tp)
        dtypes = sorted({str(v.dtype).replace("torch.", "") for v in dense.values()})
        if len(dtypes) == 1:
            cfg.dtype = dtypes[0]
        cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
        save_hf(Path(out), cfg, dense, plan.model.pretrained)
    dist.barrier()


def _wrong_slices(model: Any, pretrained: Any) -> list[str]:
    """The rank's parameters that are not their tagged slice of ``from_pretrained``'s (empty: all are)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dsforge.runtime.weights_io import tagged

    ref = AutoModelForCausalLM.from_pretrained(str(pretrained), dtype=torch.float32).state_dict()
    wrong = []
    for p, t in tagged(model):
        want = ref.get(t.dense)
        if want is None:
            wrong.append(f"{t.dense}: not a tensor of from_pretrained's model")
            continue
        if t.dim is not None:
            want = torch.cat([want.narrow(t.dim, a, n) for a, n in t.ranges], dim=t.dim)
            if p.dim() + 1 == want.dim():  # one expert of a stack
                want = want.squeeze(t.dim)
        if t.transpose:
            want = want.t()
        if tuple(p.shape) != tuple(want.shape) or not torch.equal(p.detach(), want):
            where = list(t.ranges) if t.dim is not None else ""
            wrong.append(f"{t.dense}{where}: not from_pretrained's values")
    return wrong


def differences(pre: Path, out: Path) -> list[str]:
    """What the export holds otherwise than save_pretrained's directory (empty: the same)."""
    from tests.runtime.test_export_hf import tensors

    found = [line for f in sorted(out.parent.glob(f"{out.name}.rank*.slices"))
             for line in f.read_text().splitlines() if line]
    want, got = tensors(pre), tensors(out)
    found += [f"missing {k}" for k in sorted(set(want) - set(got))]
    found += [f"extra {k}" for k in sorted(set(got) - set(want))]
    found += [f"{k}: {got[k][:2]} != {want[k][:2]}" if got[k][:2] != want[k][:2] else f"{k}: other values"
              for k in sorted(set(want) & set(got)) if got[k] != want[k]]
    # the config as transformers itself reads and writes it back (a Qwen3-MoE config read without
    # use_sliding_window drops its sliding_window, in from_pretrained as in dsforge)
    from transformers import AutoConfig

    reread = out.with_name(out.name + "-config")
    AutoConfig.from_pretrained(str(pre)).save_pretrained(str(reread))
    configs = [json.loads((d / "config.json").read_text()) for d in (reread, out)]
    found += [f"config.json {k}: {configs[1].get(k)!r} != {configs[0].get(k)!r}"
              for k in sorted(set(configs[0]) | set(configs[1])) if configs[0].get(k) != configs[1].get(k)]
    return found


def _layout(tmp: Path, degrees: dict[str, int]) -> dict[str, Any]:
    """Read ``tmp/pre`` under ``degrees`` on gloo ranks, export it to ``tmp/out-<layout>`` and compare: the
    result, with the rule of a refusal (compile's: the plan, then the rewrite on the meta device)."""
    from dsforge.runtime.models import build_skeleton
    from dsforge.runtime.rewrite import plan_rewrite
    from dsforge.runtime.rewrite.planner import RewriteError
    from tests.runtime.launcher import run

    name = "-".join(f"{k}{v}" for k, v in degrees.items())
    job = job_file(tmp, name, tmp / "pre", degrees)
    try:
        plan = _plan(str(job))
        plan_rewrite(build_skeleton(plan.model, plan.degrees.tp), plan)
    except (ValueError, RewriteError) as exc:
        text = "; ".join(exc.problems) if isinstance(exc, RewriteError) else str(exc)
        rule = "DSF607" if isinstance(exc, RewriteError) else next(
            (w.strip(":,") for w in text.split() if w.startswith("DSF")), None)
        return {"result": "refused", **({"rule": rule} if rule else {}), "why": text[:300]}
    out = tmp / f"out-{name}"
    try:
        run(worker, plan.world_size, [(str(job), str(out))])
    except Exception as exc:  # noqa: BLE001 - a failure once compile accepted the job is a crash, but for
        # the start-up refusal of a tensor transformers converts on load (a clear DSF640, yet not at compile)
        last = [ln for ln in str(exc).strip().splitlines() if ln.strip()][-1:] or [type(exc).__name__]
        if "DSF640" in last[0] and "conversion mapping" in last[0]:
            return {"result": "refused", "rule": "DSF640 (at start)", "why": last[0][:300]}
        return {"result": "crash", "why": last[0][:300]}
    found = differences(tmp / "pre", out)
    return {"result": "differs", "why": "; ".join(found)[:300]} if found else {"result": "exact"}


def built(model_type: str, factory: Any) -> tuple[Any, dict[str, Any] | None]:
    """The type's tiny model from ``factory`` (seed 0), or None and its "no build" row."""
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        torch.manual_seed(0)
        return factory(), None
    except Exception as exc:  # noqa: BLE001 - a type that does not build tiny is a row of the table
        return None, {"type": model_type, "result": "no build", "why": f"{type(exc).__name__}: {exc}"[:200]}


def run_one_export(model_type: str, factory: Any, has_ep: bool) -> dict[str, Any]:
    """Save one type's tiny model, read it back at tp=2 (and at ep=2 x dp=2 with an ep plan) and export it;
    the row (its result is tp=2's, ``ep2`` says what ep=2 gave)."""
    import tempfile

    t0 = time.perf_counter()
    model, no_build = built(model_type, factory)
    if no_build is not None:
        return no_build
    tmp = Path(tempfile.mkdtemp(prefix="hf-zoo-export-"))
    try:  # a tiny config transformers cannot write or read back (a per-layer list the zoo's 2 layers cut)
        from transformers import AutoModelForCausalLM

        model.save_pretrained(tmp / "pre")
        AutoModelForCausalLM.from_pretrained(str(tmp / "pre"))
    except Exception as exc:  # noqa: BLE001 - transformers' own failure is the row's reason
        return {"type": model_type, "result": "no build",
                "why": f"save_pretrained, then from_pretrained: {type(exc).__name__}: {exc}"[:200]}
    row = {"type": model_type, **_layout(tmp, {"tp": 2})}
    if has_ep:
        ep = _layout(tmp, {"ep": 2, "dp": 2})
        row["ep2"] = " ".join(str(ep[k]) for k in ("result", "rule", "why") if ep.get(k))[:300]
    return {**row, "seconds": round(time.perf_counter() - t0, 1)}
