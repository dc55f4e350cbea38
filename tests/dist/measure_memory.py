"""Measure activation and model-state bytes on 2 CPU ranks (gloo) with real DeepSpeed.

Run: DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/dist/measure_memory.py OUT.json
Rank 0 writes a JSON with, per configuration, what tests/compiler/estimate/test_memory_measured.py compares with
dsforge's estimate:

* "activations": bytes autograd saves for backward over one micro-batch (distinct storages, no
  parameters), by region (embed, blocks, head), for the test GPT at tp 1 and 2, recompute none/full;
* "hf": the same for the HF models dsforge's runtime builds (tiny-llama, tiny-gpt2, tiny-mixtral; tp 1);
* "runtime": the same for the model dsforge's runtime trains (build_parallel_model, then the job's
  recompute as the engine applies it) for `runtime_job_yaml(tp, recompute)`: tiny-llama at tp 1 and 2
  (tp 2 once without and once with sequence parallelism), recompute none/selective/full;
* "weights16": model states of the runtime's engine for a job whose weights arrive in bf16 (bf16 and fp32,
  ZeRO 1 and 3), and the dtypes of its parameters and of the optimizer's master weights;
* "ring": the decoder layers of tiny-llama at S=1024 with ring attention over cp=2 (per rank), and the
  same model on the whole sequence with SDPA on one rank (cp=1);
* "states": model-state bytes of a DeepSpeed engine (ZeRO 0-3, fp32 and bf16) started with the
  ds_config `dsforge compile` emits for `job_yaml(...)`, summed over the distinct storages of every
  live tensor and classified (parameters / gradients / optimizer / module_buffers / other), at the
  moments of the second optimizer step where memory can peak: "backward" (when the gradient of the
  embedding output arrives: every block's gradients and the reduction buckets are live),
  "collectiveN" and "copyN" (each collective and ZeRO partition copy after that), "boundary" (after
  the last backward) and "step" (inside the torch optimizer's step).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from storage import SavedTensors, classify, live_tensors, storage_key
from tiny_gpt import GPTConfig, TinyGPT

from dsforge.runtime.teardown import before_init, leave, release_engine

CFG = GPTConfig()
MICRO = 2
COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_fn",
               "all_gather", "all_gather_into_tensor", "allgather_fn", "broadcast")

#: The dsforge job of the measured engines: the test GPT on 2 CPU ranks, two micro-batches per step.
#: Buckets below the model size so they are exercised; ZeRO-3 keeps biases and norms whole.
JOB = """\
version: 1
model: {{arch: gpt2, layers: 2, hidden: 64, heads: 4, ffn_hidden: 256, vocab: 256, seq_len: 64,
         tied_embeddings: false}}
hardware: {{preset: cpu-local, gpus_per_node: 2}}
parallel: {{tp: {tp}, dp: auto, zero: {zero}}}
training: {{global_batch: {gb}, micro_batch: 2, precision: {precision}, recompute: {recompute}}}
deepspeed:
  zero_optimization: {{reduce_bucket_size: 20000, allgather_bucket_size: 20000,
                      stage3_prefetch_bucket_size: 20000, stage3_param_persistence_threshold: 1000}}
  activation_checkpointing: {{partition_activations: false}}  # the test GPT checkpoints with torch
"""


def job_yaml(zero: int = 0, precision: str = "fp32", tp: int = 1, recompute: str = "none") -> str:
    """The job file text for one measured configuration (global batch: 2 micro-batches per dp rank)."""
    return JOB.format(tp=tp, zero=zero, precision=precision, recompute=recompute, gb=8 // tp)


def emitted_ds_config(zero: int, precision: str) -> dict[str, Any]:
    """The ds_config `dsforge compile` would write for the job (dsforge.compiler.emit)."""
    from dsforge.compiler.emit.ds_config import build_ds_config
    from dsforge.compiler.frontend.parse import load_job
    from dsforge.compiler.plan.plan import build_plan

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(job_yaml(zero, precision))
        job, diags = load_job(path)
    assert job is not None, diags
    return {**build_ds_config(build_plan(job.spec)), "steps_per_print": 10**9}


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


def record_blocks(saved: SavedTensors, layers: Any) -> None:
    """Count what the decoder layers save as region "blocks": entered before the first layer's forward, left
    after the last's."""
    blocks = saved.record("blocks")

    def enter(*_: Any) -> None:  # hooks must return None (a forward hook's value replaces the output)
        blocks.__enter__()

    def leave(*_: Any) -> None:
        blocks.__exit__(None, None, None)

    layers[0].register_forward_pre_hook(enter)
    layers[-1].register_forward_hook(leave)


def measure_hf(preset: str, dtype: torch.dtype) -> dict[str, int]:
    """Saved bytes of one forward of the HF model dsforge's runtime builds for a preset (tp 1), split into
    the decoder layers ("blocks") and everything else ("outside": embedding, final norm, head, loss)."""
    from dsforge.compiler.frontend.presets import presets
    from dsforge.compiler.spec.schema import ModelSpec
    from dsforge.runtime.models import build_model

    spec = ModelSpec(**presets("models")[preset].spec)
    model = build_model(spec, device="cpu", seed=0).to(dtype).train()
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    saved = SavedTensors(model.parameters())
    record_blocks(saved, layers)
    idx, _ = batch(2)
    with saved.record("outside"):
        loss = model(idx, labels=idx).loss
    loss.backward()
    return saved.by_region()


#: The jobs of the "runtime" and "ring" measurements: tiny-llama as dsforge's runtime trains it.
RUNTIME_JOB = """\
version: 1
model: {{preset: {preset}, seq_len: {seq}}}
hardware: {{preset: cpu-local, gpus_per_node: 2}}
parallel: {{tp: {tp}, cp: {cp}, dp: auto, zero: {zero}, sequence_parallel: {sp}, context_parallel: {{kind: ring}}}}
training: {{global_batch: 8, micro_batch: 2, precision: {precision}, recompute: {recompute}{kernels}}}
"""
#: training.kernels with every lean kernel off: the plain HF modules and loss (the "before" of the lean runtime)
PLAIN_KERNELS = ", kernels: {fused_loss: false, swiglu: false, gelu: false, norm: false}"


def runtime_job_yaml(tp: int = 1, recompute: str = "none", sp: bool = False, cp: int = 1, seq: int = 64,
                     precision: str = "fp32", zero: int = 0, preset: str = "tiny-llama", plain: bool = False) -> str:
    """The job file text of one runtime-model measurement (``plain``: every lean kernel off)."""
    return RUNTIME_JOB.format(tp=tp, recompute=recompute, sp=str(sp).lower(), cp=cp, seq=seq, precision=precision,
                              zero=zero, preset=preset, kernels=PLAIN_KERNELS if plain else "")


def _plan(text: str) -> Any:
    from dsforge.compiler.frontend.parse import load_job
    from dsforge.compiler.plan.plan import build_plan

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(text)
        job, diags = load_job(path)
    assert job is not None, diags
    return build_plan(job.spec)


def measure_runtime(text: str) -> dict[str, int]:
    """Saved bytes of one forward and loss of the runtime's model for a job (this rank), split into the
    decoder layers ("blocks") and the rest ("outside": embedding, final norm, head, loss)."""
    from dsforge.compiler.emit.ds_config import build_ds_config
    from dsforge.runtime.attention import positions, shard_sequence
    from dsforge.runtime.engine import CausalLMLoss, apply_job_recompute, build_parallel_model
    from dsforge.runtime.groups import create_groups

    plan = _plan(text)
    groups = create_groups(plan)
    model = build_parallel_model(plan, groups, seed=0).train()
    if plan.spec.training.precision == "bf16":  # as DeepSpeed's bf16 engine holds the module
        model = model.to(torch.bfloat16)
    apply_job_recompute(model, plan, groups, build_ds_config(plan))
    cp, me = groups.size("cp"), groups.index("cp")
    task = CausalLMLoss(model, cp)
    g = torch.Generator().manual_seed(3)
    seq = plan.model.seq_len
    idx = torch.randint(0, plan.model.vocab, (MICRO, seq), generator=g)
    targets = torch.roll(idx, -1, dims=1)
    pos = positions(seq, me, cp).unsqueeze(0).expand(MICRO, -1) if cp > 1 else torch.arange(seq).expand(MICRO, -1)
    if cp > 1:
        idx, targets = shard_sequence(idx, me, cp), shard_sequence(targets, me, cp)
    layers = model.model.layers
    saved = SavedTensors(model.parameters())
    record_blocks(saved, layers)
    with saved.record("outside"):
        loss = task(idx, targets, pos)
    loss.backward()
    return saved.by_region()


def measure_16bit_weights(zero: int, precision: str = "bf16") -> dict[str, Any]:
    """The runtime's engine for a job whose weights arrive in bf16 (as a bf16 checkpoint gives them):
    model states at its second optimizer step (dsforge.runtime.measure's probe, the run's memory report;
    the first step creates the Adam moments)
    and the dtypes of the module's parameters and of the optimizer's (master) parameters."""
    from dsforge.compiler.emit.ds_config import build_ds_config
    from dsforge.runtime.engine import CausalLMLoss, build_parallel_model, initialize_engine
    from dsforge.runtime.groups import create_groups
    from dsforge.runtime.measure import StateProbe as RuntimeProbe
    from dsforge.runtime.measure import inner_optimizer, optimizer_params

    plan = _plan(runtime_job_yaml(precision=precision, zero=zero))
    groups = create_groups(plan)
    model = build_parallel_model(plan, groups, seed=0).to(torch.bfloat16)
    engine = initialize_engine(CausalLMLoss(model), {**build_ds_config(plan), "steps_per_print": 10**9}, groups)
    try:
        probe = RuntimeProbe(engine)
        for step in range(2):
            if step:
                probe.arm()
            for m in range(engine.gradient_accumulation_steps()):
                idx, targets = batch(20 + 10 * step + m)
                engine.backward(engine(idx, targets, torch.arange(CFG.seq_len).expand(MICRO, -1)))
                engine.step()
        inner = inner_optimizer(engine)
        assert inner is not None
        return {"states": probe.states,
                "module": sorted({str(p.dtype) for p in engine.module.parameters()}),
                "master": sorted({str(q.dtype) for q in optimizer_params(engine, inner)})}
    finally:
        release_engine(engine)


class StateProbe:
    """Snapshots of an engine's live tensors, classified, at the moments named in the module doc."""

    def __init__(self, engine: Any, model: TinyGPT) -> None:
        self.engine, self.model = engine, model
        self.inner = engine.basic_optimizer if hasattr(engine, "basic_optimizer") else engine.optimizer
        self.params = list(model.parameters())
        self.snaps: dict[str, dict[str, int]] = {}
        self.batch: tuple[torch.Tensor, ...] = ()
        self.watch = False  # set once autograd has reached the embedding of the step's last micro-batch
        self.count = 0

    def classes(self) -> list[tuple[str, Any]]:
        inner, params = self.inner, self.params
        return [("module_buffers", lambda: list(self.model.buffers())),
                ("optimizer", lambda: [list(inner.state.values()), [g["params"] for g in inner.param_groups]]),
                ("parameters", lambda: [params, [getattr(p, "ds_tensor", None) for p in params]]),
                ("gradients", lambda: [[p.grad for p in params], [getattr(p, "grad_accum", None) for p in params],
                                       [q.grad for g in inner.param_groups for q in g["params"]]])]

    def snap(self, name: str, skip: tuple[torch.Tensor, ...] = ()) -> None:
        extra = [p.grad for p in self.params if p.grad is not None]  # .grad may exist only in C++
        skipped = {storage_key(t) for t in (*self.batch, *skip)}
        self.snaps[name] = classify(live_tensors(extra), self.classes(), skipped)

    def snap_after_backward(self, kind: str) -> None:
        if self.watch and self.count < 60:
            self.count += 1
            self.snap(f"{kind}{self.count}")

    def on_embed_grad(self, grad: torch.Tensor) -> None:
        self.snap("backward", (grad,))
        self.watch = True

    def patch(self) -> dict[str, Any]:
        """Wrap DeepSpeed's collectives and ZeRO's partition copy to snapshot after backward; returns
        the originals of the collectives (the copy is patched on this engine's optimizer only)."""
        import deepspeed.comm as ds_comm

        real = {name: getattr(ds_comm, name) for name in COLLECTIVES if hasattr(ds_comm, name)}
        for name, fn in real.items():
            def call(tensor: Any, *args: Any, _fn: Any = fn, **kwargs: Any) -> Any:
                if isinstance(tensor, torch.Tensor) and tensor.numel() >= 1000:
                    self.snap_after_backward("collective")
                return _fn(tensor, *args, **kwargs)
            setattr(ds_comm, name, call)
        zero_opt = self.engine.optimizer
        if hasattr(zero_opt, "copy_grads_in_partition"):  # ZeRO 1/2 allocate the partition buffer here
            copy = zero_opt.copy_grads_in_partition

            def copy_and_snap(*args: Any, **kwargs: Any) -> Any:
                out = copy(*args, **kwargs)
                self.snap_after_backward("copy")
                return out

            zero_opt.copy_grads_in_partition = copy_and_snap
        return real

    def run(self, steps: int = 2, micro: int = 2) -> None:
        """Train ``steps`` steps of ``micro`` micro-batches, snapshotting during the last step."""
        for step in range(steps):
            for m in range(micro):
                idx, targets = batch(10 * step + m)
                self.batch = (idx, targets)
                last = step == steps - 1 and m == micro - 1
                self.model.embed_grad_hook = self.on_embed_grad if last else None
                self.engine.backward(self.engine(idx, targets))
                if last:
                    self.snap("boundary")
                    hook = self.inner.register_step_pre_hook(lambda *_: self.snap("step"))
                self.engine.step()
                self.watch = False
        hook.remove()


def measure_states(zero: int, bf16: bool) -> dict[str, dict[str, int]]:
    """Model-state bytes of a DeepSpeed engine at the moments of its second step (see module doc)."""
    import deepspeed
    import deepspeed.comm as ds_comm

    # everything alive before this engine is frozen out of the garbage collector's view (and stays
    # alive, so no new tensor can reuse its address); snapshots then see only what this engine made
    gc.collect()
    gc.freeze()
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    config = emitted_ds_config(zero, "bf16" if bf16 else "fp32")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    probe = StateProbe(engine, model)
    real = probe.patch()
    try:
        probe.run()
    finally:
        for name, fn in real.items():
            setattr(ds_comm, name, fn)
        gc.unfreeze()
        release_engine(engine)  # ZeRO's hooks would keep this engine and its groups' threads alive until exit
    return probe.snaps


def main() -> None:
    start = time.perf_counter()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed

    before_init()  # see dsforge.runtime.teardown: no gloo thread may outlive the interpreter
    deepspeed.init_distributed(dist_backend="gloo")
    out: dict[str, Any] = {"config": CFG.__dict__, "micro_batch": MICRO, "activations": {}, "states": {}}
    for tp in (1, 2):
        for recompute in ("none", "full"):
            for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                if tp == 2 and name == "bf16":
                    continue
                out["activations"][f"tp{tp}-{recompute}-{name}"] = measure_activations(tp, recompute, dtype)
    out["runtime"] = {f"tp{tp}{'-sp' if sp else ''}-{recompute}": measure_runtime(runtime_job_yaml(tp, recompute, sp))
                      for tp, sp in ((1, False), (2, False), (2, True)) for recompute in ("none", "selective", "full")}
    # the lean kernels' before/after on the runtime's model: every kernel off, tp 1 and tp 2 with SP, and bf16
    out["plain"] = {f"tp{tp}{'-sp' if tp > 1 else ''}-none-{p}": measure_runtime(
        runtime_job_yaml(tp, "none", tp > 1, precision=p, plain=True)) for tp in (1, 2) for p in ("fp32", "bf16")}
    out["lean-bf16"] = {f"tp{tp}{'-sp' if tp > 1 else ''}-none": measure_runtime(
        runtime_job_yaml(tp, "none", tp > 1, precision="bf16")) for tp in (1, 2)}
    out["moe"] = {f"tp2{'-sp' if sp else ''}-none": measure_runtime(runtime_job_yaml(2, sp=sp, preset="tiny-mixtral"))
                  for sp in (False, True)}
    out["ring"] = {"cp2-ring": measure_runtime(runtime_job_yaml(cp=2, seq=1024)),
                   "cp1-sdpa": measure_runtime(runtime_job_yaml(seq=1024))}
    out["weights16"] = {f"{p}-zero{z}": measure_16bit_weights(z, p) for p, z in (("bf16", 1), ("fp32", 1),
                                                                                    ("bf16", 3), ("fp32", 3))}
    print(f"runtime, ring and 16-bit weights done at {time.perf_counter() - start:.1f} s", flush=True)
    out["hf"] = {f"{preset}-{name}": measure_hf(preset, dtype) for preset in ("tiny-llama", "tiny-gpt2", "tiny-mixtral")
                 for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    for bf16 in (False, True):
        for zero in (0, 1, 2, 3):
            out["states"][f"zero{zero}-{'bf16' if bf16 else 'fp32'}"] = measure_states(zero, bf16)
            print(f"zero{zero} bf16={bf16} done at {time.perf_counter() - start:.1f} s", flush=True)
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    leave(synchronize=True)  # the same teardown as dsforge's runtime: barrier, groups destroyed, threads joined


if __name__ == "__main__":
    main()
