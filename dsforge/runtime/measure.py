"""Measured memory per rank, written beside the cost model's prediction (``memory_report.json``) and printed.

Three measurements, each on the real engine of the run:
* model states: the distinct storages of every live tensor at the optimizer step of one training
  step (a step pre-hook on the torch optimizer inside DeepSpeed), classified as parameters (the
  module's, or ZeRO-3's partitions), gradients (the module's and the optimizer's fp32 partition
  gradients) and optimizer (its state and the fp32 master partitions ZeRO keeps);
* activations: bytes autograd saves for backward during one forward of the engine's module (one
  micro-batch; ``torch.autograd.graph.saved_tensors_hooks``), parameters excluded, each storage once;
* peak: the process's peak resident set size on the CPU, ``max_memory_allocated`` on a GPU.
"""

from __future__ import annotations

import gc
import resource
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from dsforge.compiler.plan.plan import ResolvedPlan

MiB = 1024 * 1024


def storage_key(t: Tensor) -> int:
    """Address of a tensor's storage (0 for an empty one)."""
    return t.untyped_storage().data_ptr()


def tensors_in(obj: Any, out: list[Tensor], max_depth: int = 5, depth: int = 0) -> None:
    """Append the tensors in ``obj`` and its dicts, lists and tuples (``max_depth`` levels down) to
    ``out``."""
    if torch.is_tensor(obj):
        out.append(obj)
    elif depth < max_depth and isinstance(obj, dict):
        for v in obj.values():
            tensors_in(v, out, max_depth, depth + 1)
    elif depth < max_depth and isinstance(obj, (list, tuple)):
        for v in obj:
            tensors_in(v, out, max_depth, depth + 1)


class ActivationProbe:
    """Bytes of the distinct non-parameter storages autograd saves during the next forward of ``module``."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.bytes, self.armed, self.done = module, 0, False, False
        self._seen: set[int] = set()
        self._ctx: Any = None
        self._params = list(module.parameters())
        self._handles = [module.register_forward_pre_hook(self._enter),
                         module.register_forward_hook(self._exit)]

    def arm(self) -> None:
        """Record the next forward call."""
        self.armed = True

    def _pack(self, t: Tensor) -> Tensor:
        key = storage_key(t)
        # ZeRO-3 gathers parameters just before use, so their storages are looked up now, not at arm time.
        if (key and key not in self._seen and not isinstance(t, nn.Parameter)
                and all(storage_key(p) != key for p in self._params)):
            self._seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def _enter(self, *args: Any) -> None:
        if self.armed and self._ctx is None:
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._ctx.__enter__()

    def _exit(self, *args: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx, self.armed, self.done = None, False, True
            self.remove()

    def remove(self) -> None:
        """Detach the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []


def inner_optimizer(engine: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer DeepSpeed steps (inside a ZeRO wrapper when there is one)."""
    opt = getattr(engine, "basic_optimizer", None) or getattr(engine, "optimizer", None)
    inner = getattr(opt, "optimizer", opt)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def classify(module: nn.Module, inner: torch.optim.Optimizer | None, groups: list[Tensor] | None = None,
             pending_grads: Any = None) -> dict[str, int]:
    """Bytes of distinct live storages: parameters, gradients, optimizer (first class that holds a storage
    wins).

    ``groups`` are the optimizer's parameters (default: those of its param groups now; ZeRO steps one
    group at a time with the others swapped out, so the probe passes the list it saw before the step);
    ``pending_grads`` are reduced gradients ZeRO keeps outside ``.grad`` until their group steps.
    """
    params = list(module.parameters())
    if groups is None:
        groups = [q for g in inner.param_groups for q in g["params"]] if inner is not None else []
    classes: list[tuple[str, Callable[[], list[Any]]]] = [
        ("parameters", lambda: [params, [getattr(p, "ds_tensor", None) for p in params]]),
        ("gradients", lambda: [[p.grad for p in params], [getattr(p, "grad_accum", None) for p in params],
                               [q.grad for q in groups], pending_grads]),
        ("optimizer", lambda: [list(inner.state.values()) if inner is not None else [], groups]),
    ]
    owner: dict[int, str] = {}
    for name, members in classes:
        found: list[Tensor] = []
        tensors_in(members(), found)
        for t in found:
            if t.device.type != "meta":
                owner.setdefault(storage_key(t), name)
    gc.collect()
    live = [o for o in gc.get_objects() if torch.is_tensor(o)]
    live += [p.grad for p in params if p.grad is not None] + [q.grad for q in groups if q.grad is not None]
    tensors_in(pending_grads, live)  # lists held by the ZeRO wrapper: not found among gc's tracked objects
    out = {name: 0 for name, _ in classes}
    done: set[int] = set()
    for t in live:
        key = storage_key(t)
        if key and key not in done and key in owner and t.device.type != "meta":
            done.add(key)
            out[owner[key]] += t.untyped_storage().nbytes()
    return out


def optimizer_params(engine: Any, inner: torch.optim.Optimizer) -> list[Tensor]:
    """The parameters the torch optimizer steps: ZeRO-3's fp32 partitions, else those of its param groups."""
    # ZeRO-3 hands the torch optimizer one fp32 partition at a time (stage3.py `_optimizer_step` sets a
    # group's params to [fp32_param] and back to []), so outside its step the groups are empty and the
    # fp32 master partitions, and the gradients attached to them, would go uncounted.
    flats = getattr(getattr(engine, "optimizer", None), "fp32_partitioned_groups_flat", None)
    if flats:
        return [t for t in flats if torch.is_tensor(t)]
    return [q for g in inner.param_groups for q in g["params"]]


def zero3_gradient_buffers(zero_opt: Any) -> list[Tensor]:
    """The gradient buffers ZeRO-3 keeps allocated: its flat partition buffer and its reduce buckets."""
    # stage3.py reduces every gradient into `grad_partitions_flat_buffer` (`averaged_gradients` are views of
    # it; the sub group stepping holds a flattened fp32 copy besides) through one `ipg_buckets` buffer per
    # dtype, both allocated for the engine's life; neither is reachable from a parameter's .grad
    flat = getattr(zero_opt, "grad_partitions_flat_buffer", None)
    if not torch.is_tensor(flat):
        return []
    buckets = getattr(zero_opt, "ipg_buckets", {})
    return [flat, *(b.buffer for b in buckets.values() if torch.is_tensor(getattr(b, "buffer", None)))]


class StateProbe:
    """Model-state bytes at the next optimizer step of the engine (taken inside the torch optimizer's
    step)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.inner = engine, inner_optimizer(engine)
        self.states: dict[str, int] | None = None
        self._handle: Any = None
        self._groups: list[Tensor] = []

    def arm(self) -> None:
        """Measure at the next optimizer step."""
        if self.inner is not None and self._handle is None:
            self._groups = optimizer_params(self.engine, self.inner)
            self._handle = self.inner.register_step_pre_hook(self._snap)

    def _snap(self, *args: Any) -> None:
        # DeepSpeed's ZeRO 1/2 `step` runs the torch optimizer once per group with the other groups
        # swapped out (`_optimizer_step`); MoE jobs have a dense and an expert group, so the groups seen
        # now would miss the expert group's fp32 master, and its reduced gradients wait in
        # `averaged_gradients` rather than in `.grad`.
        zero_opt = getattr(self.engine, "optimizer", None)
        pending = [getattr(zero_opt, "averaged_gradients", None), *zero3_gradient_buffers(zero_opt)]
        self.states = classify(self.engine.module, self.inner, self._groups, pending)
        self._handle.remove()
        self._handle = None


def _on_gpu() -> bool:
    """True when this process has started CUDA (so its allocator's peaks mean something)."""
    # torch leaves torch.cuda.is_initialized unannotated (torch 2.13).
    return torch.cuda.is_available() and bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def peak_bytes() -> int:
    """Peak device memory of this process: max allocated on a GPU, peak resident set size on the CPU."""
    if _on_gpu():
        return int(torch.cuda.max_memory_allocated())
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def gather_rows(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's row on every rank, in rank order (a single process gives its own)."""
    if not dist.is_initialized():
        return [row]
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


def mib(n: float | None) -> str:
    """Bytes as MiB with precision that suits tiny and large models alike."""
    if n is None:
        return "-"
    v = n / MiB
    return f"{v:.3f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


COLUMNS = (("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer"),
           ("activations_per_micro_batch", "act/µbatch"), ("peak", "peak"))


def render_table(rows: Iterable[dict[str, Any]]) -> str:
    """The predicted-vs-measured table, one line per rank, in MiB."""
    head = f"{'rank':>4} {'stage':>5}  " + "  ".join(f"{label:>21}" for _, label in COLUMNS)
    lines = ["memory per rank, predicted / measured (MiB)", head]
    for r in rows:
        cells = [f"{mib(r['predicted'].get(k)):>9} / {mib(r['measured'].get(k)):<9}" for k, _ in COLUMNS]
        lines.append(f"{r['rank']:>4} {r['stage']:>5}  " + "  ".join(cells))
    return "\n".join(lines)


def predicted(plan: ResolvedPlan, stage: int) -> dict[str, Any]:
    """The cost model's bytes for one rank of ``stage`` (dsforge.compiler.estimate.memory), in the table's
    terms.

    Model states are the model's "step" moment, the one the probe measures (inside the optimizer step,
    where ZeRO has already reduced the gradients into its fp32 partitions); ``at_peak`` keeps the states
    of the stage's peak moment, which the peak column totals. Its activations cover every micro-batch
    the schedule keeps in flight; the per-micro-batch figure divides by that count (1 without a
    pipeline) so it compares with the one measured forward.
    """
    from dsforge.compiler.estimate.activations import in_flight
    from dsforge.compiler.estimate.memory import estimate_memory
    from dsforge.compiler.estimate.shares import stage_chunks

    est = estimate_memory(plan)
    row = est.stages[stage]
    c = row.components
    flight = in_flight(plan.spec.parallel.pipeline.schedule, plan.degrees.pp, stage, est.micro_batches,
                       len(stage_chunks(plan, stage)))
    step = row.moments.get("step", c)
    # activations live during backward: read them there, since the peak moment (``c``) may be the optimizer
    # step, which holds none (full recompute made this read 0 per micro-batch; issue 24 item 6)
    live = row.moments.get("backward", c)
    # the probe counts what autograd saves; the logits alive only while the loss is formed (the logits
    # themselves, their fp32 copy) are part of the peak but saved by nothing, so the per-micro-batch figure
    # leaves them out: on tiny-3d's last stage they were the +11 % (0.471 against 0.424 MiB measured)
    transient = transient_logits(plan) if live["logits"] else 0.0
    return {
        "parameters": step["parameters"],
        "gradients": step["gradients"],
        "optimizer": step["optimizer"],
        "at_peak": {
            "phase": row.phase,
            **{k: c[k] for k in ("parameters", "gradients", "optimizer", "buffers")},
        },
        "activations": live["activations"],
        "logits": live["logits"],
        "in_flight_micro_batches": flight,
        "activations_per_micro_batch": (live["activations"] + live["logits"] - transient) / max(1, flight),
        "peak": row.device_bytes,
    }


def transient_logits(plan: ResolvedPlan) -> float:
    """Bytes of the last stage's logits that live only while the loss is formed (not saved for backward)."""
    from dsforge.compiler.estimate.activations import logits_bytes
    from dsforge.compiler.estimate.memory import activation_shape
    from dsforge.compiler.model.params import padded_vocab

    return logits_bytes(plan.model, activation_shape(plan), padded_vocab(plan.model, plan.degrees.tp))[1]


def rank_row(plan: ResolvedPlan, rank: int, states: dict[str, int] | None,
             activations: int | None) -> dict[str, Any]:
    """This rank's report row: coordinates, prediction and measurement."""
    coords = plan.placement.coordinates(rank)
    measured: dict[str, Any] = dict(states or {})
    measured["activations_per_micro_batch"] = activations
    measured["peak"] = peak_bytes()
    on_gpu = _on_gpu()
    measured["peak_kind"] = "max_allocated" if on_gpu else "peak_rss"
    if on_gpu:  # what the caching allocator held: closer to what nvidia-smi shows, context excluded
        measured["max_reserved"] = int(torch.cuda.max_memory_reserved())
    return {"rank": rank, "stage": coords["pp"], "coordinates": coords,
            "predicted": predicted(plan, coords["pp"]), "measured": measured}
