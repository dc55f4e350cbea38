"""Measure activation and model-state bytes on 2 CPU ranks (gloo) with real DeepSpeed.

Run: DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/dist/measure_memory.py OUT.json
Rank 0 writes a JSON with, per configuration, what tests/test_memory_measured.py compares with
dsforge's estimate:

* "activations": bytes autograd saves for backward over one micro-batch (distinct storages, no
  parameters), by region (embed, blocks, head), for tp 1 and 2 and recompute none/full;
* "hf": the same for the HF models dsforge's runtime builds (tiny-llama, tiny-gpt2; tp 1);
* "states": model-state bytes of a DeepSpeed engine (ZeRO 0-3, fp32 and bf16), summed over the
  distinct storages of every live tensor, classified as parameters / gradients / optimizer / other,
  at three moments of the second optimizer step: "backward" (inside backward, when the gradient
  of the embedding output arrives: reduction buckets are live), "boundary" (after the last
  backward of the step) and "step" (inside the torch optimizer's step, fp32 gradients live).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from storage import SavedTensors, classify, live_tensors, storage_key
from tiny_gpt import GPTConfig, TinyGPT

CFG = GPTConfig()
MICRO = 2
BUCKET = 20_000  # elements: smaller than the model so buckets are exercised, larger than any tensor
PERSIST = 1_000
COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn",
               "all_gather", "all_gather_into_tensor", "allgather_fn", "broadcast")  # ZeRO-3: biases and norms stay whole, matrices are partitioned


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, CFG.vocab, (MICRO, CFG.seq_len), generator=g)
    return idx, torch.roll(idx, -1, dims=1)


def measure_activations(tp: int, recompute: str, dtype: torch.dtype) -> dict[str, int]:
    """Saved bytes of one forward pass, by region; blocks are tensor-parallel over WORLD when tp = 2."""
    torch.manual_seed(0)
    group = dist.group.WORLD if tp > 1 else None
    model = TinyGPT(CFG, tp, group, recompute).to(dtype).train()
    idx, targets = batch(1)
    saved = SavedTensors(model.parameters())
    with saved.record("embed"):
        x = model.embed(idx)
    with saved.record("blocks"):
        x = model.run_blocks(x)
    with saved.record("head"):
        loss = model.loss(x, targets)
    loss.backward()
    return saved.by_region()


def measure_hf(preset: str, dtype: torch.dtype) -> dict[str, int]:
    """Saved bytes of one forward of the HF model dsforge's runtime builds for a preset (tp 1), split into
    the decoder layers ("blocks") and everything else ("outside": embedding, final norm, head, loss)."""
    from dsforge.compiler.presets import presets
    from dsforge.compiler.schema import ModelSpec
    from dsforge.runtime.models import build_model

    spec = ModelSpec(**presets("models")[preset].spec)
    model = build_model(spec, device="cpu", seed=0).to(dtype).train()
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    saved = SavedTensors(model.parameters())
    blocks = saved.record("blocks")

    def enter(*_: Any) -> None:  # hooks must return None (a forward hook's value replaces the output)
        blocks.__enter__()

    def leave(*_: Any) -> None:
        blocks.__exit__(None, None, None)

    layers[0].register_forward_pre_hook(enter)
    layers[-1].register_forward_hook(leave)
    idx, _ = batch(2)
    with saved.record("outside"):
        loss = model(idx, labels=idx).loss
    loss.backward()
    return saved.by_region()


def ds_config(zero: int, bf16: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": zero, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET,
                              "stage3_prefetch_bucket_size": BUCKET,
                              "stage3_param_persistence_threshold": PERSIST},
        "bf16": {"enabled": bf16}, "steps_per_print": 10**9,
    }


def measure_states(zero: int, bf16: bool) -> dict[str, dict[str, int]]:
    """Model-state bytes of a DeepSpeed engine at three moments of its second step (see module doc)."""
    import deepspeed

    # everything alive before this engine is frozen out of the garbage collector's view (and stays
    # alive, so no new tensor can reuse its address); snapshots then see only what this engine made
    gc.collect()
    gc.freeze()
    skip: set[int] = set()
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(zero, bf16))
    inner = engine.basic_optimizer if hasattr(engine, "basic_optimizer") else engine.optimizer
    params = list(model.parameters())

    def classes() -> list[tuple[str, Any]]:
        return [("module_buffers", lambda: list(model.buffers())),
                ("optimizer", lambda: [list(inner.state.values()), [g["params"] for g in inner.param_groups]]),
                ("parameters", lambda: [params, [getattr(p, "ds_tensor", None) for p in params]]),
                ("gradients", lambda: [[p.grad for p in params], [getattr(p, "grad_accum", None) for p in params],
                                       [q.grad for g in inner.param_groups for q in g["params"]]])]

    snaps: dict[str, dict[str, int]] = {}
    batches: list[torch.Tensor] = []

    def snap(name: str, also_skip: tuple[torch.Tensor, ...] = ()) -> None:
        extra = [p.grad for p in params if p.grad is not None]
        skipped = skip | {storage_key(t) for t in (*batches, *also_skip)}
        snaps[name] = classify(live_tensors(extra), classes(), skipped)

    import deepspeed.comm as ds_comm

    real = {name: getattr(ds_comm, name) for name in COLLECTIVES if hasattr(ds_comm, name)}
    watch = False
    count = [0]

    def watched(name: str) -> Any:
        def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            # after autograd has reached the embedding (activations freed), every collective of the
            # engine is a moment where its reduction copies are live: snapshot there
            if watch and isinstance(tensor, torch.Tensor) and tensor.numel() >= 1000:
                count[0] += 1
                snap(f"collective{count[0]}")
            return real[name](tensor, *args, **kwargs)
        return call

    for name in real:
        setattr(ds_comm, name, watched(name))

    zero_opt = engine.optimizer
    if hasattr(zero_opt, "copy_grads_in_partition"):  # ZeRO 1/2: allocates the partition buffer on first use
        copy = zero_opt.copy_grads_in_partition

        def copy_and_snap(*args: Any, **kwargs: Any) -> Any:
            out = copy(*args, **kwargs)
            if watch and count[0] < 40:
                count[0] += 1
                snap(f"copy{count[0]}")
            return out

        zero_opt.copy_grads_in_partition = copy_and_snap

    def on_embed_grad(g: torch.Tensor) -> None:
        nonlocal watch
        snap("backward", (g,))
        watch = True

    watch = False
    for step in range(2):
        for micro in range(2):
            idx, targets = batch(10 * step + micro)
            batches[:] = [idx, targets]
            last = step == 1 and micro == 1
            model.embed_grad_hook = on_embed_grad if last else None
            engine.backward(engine(idx, targets))
            if last:
                snap("boundary")
                hook = inner.register_step_pre_hook(lambda *_: snap("step"))
            engine.step()
            watch = False
    hook.remove()
    for name, fn in real.items():
        setattr(ds_comm, name, fn)
    gc.unfreeze()
    return snaps


def main() -> None:
    start = time.perf_counter()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    out: dict[str, Any] = {"config": CFG.__dict__, "micro_batch": MICRO, "bucket": BUCKET, "persist": PERSIST,
                           "activations": {}, "states": {}}
    for tp in (1, 2):
        for recompute in ("none", "full"):
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                if tp == 2 and name == "bf16":
                    continue
                out["activations"][f"tp{tp}-{recompute}-{name}"] = measure_activations(tp, recompute, dtype)
    out["hf"] = {f"{preset}-{name}": measure_hf(preset, dtype) for preset in ("tiny-llama", "tiny-gpt2")
                 for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    for bf16 in (False, True):
        for zero in (0, 1, 2, 3):
            out["states"][f"zero{zero}-{'bf16' if bf16 else 'fp32'}"] = measure_states(zero, bf16)
            print(f"zero{zero} bf16={bf16} done at {time.perf_counter() - start:.1f} s", flush=True)
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
