#!/usr/bin/env python3
"""Forward + backward time of one process's model with dsforge's lean kernels against the plain HF modules.

Two copies of the same HF model (same weights), one with `install_lean_kernels` and the fused loss, one plain
with HF's logits and `F.cross_entropy` on their fp32 copy, run alternately on the same tokens; per model the
median and best CPU time (`time.process_time`, less sensitive than wall clock to other processes on a shared
machine) of one forward + backward are printed, with their ratio, and the load average.

Run: ``python benchmarks/lean_kernels_speed.py [--reps 30]`` (needs the runtime extra).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (name, model keys): the tiny test Llama and GPT-2, and a wider Llama whose vocabulary makes the loss count
MODELS = [
    ("tiny-llama", {"preset": "tiny-llama"}),
    ("tiny-gpt2", {"preset": "tiny-gpt2"}),
    ("llama h256 f688 v32000 s256", {"arch": "llama", "layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2,
                                     "ffn_hidden": 688, "vocab": 32000, "seq_len": 256}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30, help="forward + backward passes of each model")
    ap.add_argument("--each", action="store_true", help="also time each kernel alone")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    from dsforge.compiler.model.lean_kernels import lean_kernels
    from dsforge.compiler.model.resolved import resolve_model
    from dsforge.compiler.spec.schema import ModelSpec
    from dsforge.runtime.models import build_model

    torch.set_num_threads(1)
    print(f"load average before: {os.getloadavg()[0]:.2f}; 1 thread; micro-batch 2; {args.reps} passes each")
    for name, keys in MODELS:
        if "preset" in keys:
            from dsforge.compiler.frontend.presets import presets

            keys = presets("models")[keys["preset"]].spec
        model_spec = resolve_model(ModelSpec(**keys))
        plain = build_model(model_spec, "cpu", 1, seed=0).train()
        every = lean_kernels(model_spec, {}, 1)
        for on in [every, *([frozenset({k}) for k in sorted(every)] if args.each else [])]:
            run(name, model_spec, plain, on, args.reps)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def run(name: str, model_spec: Any, plain: Any, on: frozenset[str], reps: int) -> None:
    """Time ``reps`` alternating forward + backward passes of ``plain`` and of a copy running the kernels
    ``on``."""
    import torch
    import torch.nn.functional as F

    from dsforge.runtime.kernels.install import install_lean_kernels
    from dsforge.runtime.kernels.loss import fused_token_loss_sum

    lean = copy.deepcopy(plain)
    install_lean_kernels(lean, on)
    ids = torch.randint(0, model_spec.vocab, (2, model_spec.seq_len),
                        generator=torch.Generator().manual_seed(0))
    targets = torch.roll(ids, -1, dims=1)

    def step_plain() -> None:
        logits = plain(input_ids=ids).logits
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()

    def step_lean() -> None:
        if "fused_loss" not in on:
            logits = lean(input_ids=ids).logits
            F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
            return
        hidden = lean.base_model(input_ids=ids).last_hidden_state
        (fused_token_loss_sum(hidden, targets, lean.lm_head, -100) / targets.numel()).backward()

    times: dict[str, list[float]] = {"lean": [], "plain": []}
    for rep in range(reps + 2):
        for what, fn in (("lean", step_lean), ("plain", step_plain)):
            c = time.process_time()
            fn()
            if rep >= 2:  # two warm-up passes each
                times[what].append(time.process_time() - c)
    for m in (plain, lean):
        m.zero_grad(set_to_none=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    print(f"{name:>28} ({', '.join(sorted(on))}): median lean {med['lean'] * 1e3:7.2f} ms, plain "
          f"{med['plain'] * 1e3:7.2f} ms, ratio {med['lean'] / med['plain']:.3f}; best lean "
          f"{best['lean'] * 1e3:7.2f} ms, plain {best['plain'] * 1e3:7.2f} ms, ratio "
          f"{best['lean'] / best['plain']:.3f}", flush=True)


if __name__ == "__main__":
    main()
