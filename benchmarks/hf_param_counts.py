"""config.json's parameter count (dsforge.compiler.model.hf_params, no torch) against HF's `num_parameters()`.

For every type of benchmarks/hf_zoo.py (transformers' causal LMs with a tp or ep plan), the zoo's tiny
config is built on the meta device and counted by HF; the same config, as the dict `save_pretrained`
writes to config.json, is counted by dsforge's formula. It prints one line per type (exact, or the
difference and its share) and the totals; `--json` writes the rows.

    python benchmarks/hf_param_counts.py [--only t1,t2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(model_type: str) -> dict[str, Any]:
    """HF's count and dsforge's for one zoo type (``hf`` None when the type does not build)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.hf_zoo import tiny_config
    from dsforge.compiler.model.hf_params import hf_param_count

    try:
        cfg = tiny_config(model_type)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        hf = int(model.num_parameters())
    except Exception as exc:  # noqa: BLE001 - a type that does not build is listed with its reason
        return {"type": model_type, "hf": None, "why": f"{type(exc).__name__}: {str(exc)[:160]}"}
    # config.json as save_pretrained writes it (a diff against the base defaults, the class's own keys kept)
    data = json.loads(model.config.to_json_string(use_diff=False))
    est = hf_param_count(data)
    return {"type": model_type, "hf": hf, "dsforge": est.total, "diff": est.total - hf,
            "share": (est.total - hf) / hf if hf else 0.0, "unpriced": est.unpriced}


def main() -> int:
    """Count every zoo type (or --only) and print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--json")
    args = ap.parse_args()
    from benchmarks.hf_zoo import zoo_types

    rows = [measure(t) for t in ([t for t in args.only.split(",") if t] or zoo_types())]
    for r in rows:
        if r["hf"] is None:
            print(f"{r['type']:28s} does not build: {r['why']}")
        elif r["diff"] == 0:
            print(f"{r['type']:28s} exact {r['hf']:>10,}")
        else:
            print(f"{r['type']:28s} differs {r['diff']:+,} ({r['share']:+.2%}) of {r['hf']:,}")
    built = [r for r in rows if r["hf"] is not None]
    exact = sum(1 for r in built if r["diff"] == 0)
    worst = max((abs(r["share"]) for r in built), default=0.0)
    print(f"{len(rows)} types, {len(built)} build: {exact} exact, {len(built) - exact} approximate "
          f"(largest difference {worst:.2%})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
