"""The HF zoo's expert-parallel run (`benchmarks/hf_zoo.py --mode ep`): one MoE type at ep=2 x dp=2.

`arch: auto` plans the type's tiny model at ep=2 on two ranks (compile's meta check: a router DeepSpeed's gate
has no exact twin of, or a block it cannot be built from, is refused with DSF607); a planned one trains 2 SGD
steps on two gloo ranks, each on its own tokens, against plain HF on one process fed both ranks' tokens
(tests/runtime_rewrite/test_family_parity.py's ep_parity: the loss of every step, every replicated gradient,
the router's and each local expert's).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

LAYOUT = {"dp": 2, "ep": 2}


def _worker(rank: int, world: int, keys: dict[str, Any], tmp: str) -> None:
    import contextlib
    import io

    from tests.runtime_rewrite.conftest import make_job
    from tests.runtime_rewrite.test_family_parity import ep_parity

    mine = Path(tmp) / f"rank{rank}"  # each rank writes its own job file (one shared name races)
    mine.mkdir(exist_ok=True)
    from benchmarks.float64_everywhere import float64_everywhere

    # float64: the models' own float32 casts promoted too (both sides), as the tp zoo re-checks
    wide = float64_everywhere() if os.environ.get("HF_ZOO_DTYPE") == "float64" else contextlib.nullcontext()
    with contextlib.redirect_stdout(io.StringIO()), wide:
        ep_parity(rank, make_job(mine, keys, LAYOUT), formula=False)  # the zoo's keys do not describe experts


def run_one_ep(model_type: str, factory: Any, keys_of: Any) -> dict[str, Any]:
    """Plan one MoE type at ep=2 x dp=2 and (when planned) run it against one process; the row."""
    from benchmarks.zoo_export import built
    from dsforge.compiler.plan.plan import build_plan
    from dsforge.runtime.rewrite import plan_rewrite
    from dsforge.runtime.rewrite.planner import RewriteError
    from tests.runtime.launcher import run
    from tests.runtime_rewrite.conftest import make_job

    t0 = time.perf_counter()
    model, no_build = built(model_type, factory)
    if no_build is not None:
        return no_build
    tmp = tempfile.mkdtemp(prefix="hf-zoo-ep-")
    keys = keys_of(model, model_type, os.environ.get("HF_ZOO_DTYPE"))
    try:
        plan_rewrite(model, build_plan(make_job(Path(tmp), keys, LAYOUT)))
    except RewriteError as exc:
        return {"type": model_type, "result": "refused", "rule": "DSF607",
                "why": "; ".join(exc.problems)[:300], "seconds": round(time.perf_counter() - t0, 1)}
    try:
        run(_worker, 2, keys, tmp)
    except Exception as exc:  # noqa: BLE001 - classified below
        text = str(exc)
        last = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [type(exc).__name__]
        return {"type": model_type, "result": "differs" if "of the reference's scale" in text else "crash",
                "why": last[0][:300], "seconds": round(time.perf_counter() - t0, 1)}
    return {"type": model_type, "result": "exact", "seconds": round(time.perf_counter() - t0, 1)}
