"""The accelerator's own rates for the calibration: GEMM by size and precision, memory bandwidth,
per-operation cost."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from dsforge.runtime.calibrate.fits import median_seconds

GEMM_SIZES = (32, 64, 128, 256, 512, 1024)


def gemm_rates(dtype: torch.dtype, device: str, sizes: tuple[int, ...] = GEMM_SIZES) -> dict[int, float]:
    """FLOP/s of an n x n x n matmul for each n (2n^3 FLOPs per call)."""
    rates = {}
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        inner = max(1, int(2e7 // n ** 3))
        seconds = median_seconds(lambda a=a, b=b: torch.matmul(a, b), 5, inner)
        rates[n] = 2.0 * n ** 3 / seconds
    return rates


def memory_bandwidth(device: str, size_bytes: int = 64 << 20) -> float:
    """Bytes per second of a tensor copy (bytes read plus bytes written)."""
    src = torch.empty(size_bytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), 7)
    return 2.0 * size_bytes / seconds


def op_overhead(device: str, ops: int = 200) -> float:
    """Seconds per dispatched operation: a chain of tiny elementwise ops, forward and backward."""
    x = torch.ones(4, 4, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()

    # forward ops (multiplications and the sum) plus their backward ops, as a profile counts them
    return median_seconds(chain, 5) / (2 * ops + 2)


def layer_op_overhead(ops_per_layer: int = 73 + 138) -> float:
    """Seconds per operation of dsforge's own HF layer: the forward and backward time one more layer of the
    tiny Llama adds (4 layers against 2, hidden 64, one sequence of 64 tokens) over the aten operations it
    dispatches (73 forward, 138 backward, counted with a TorchDispatchMode). This prices what the runtime
    really pays per operation (module calls, hooks, autograd), which a bare op loop underestimates."""

    return layer_op_overhead_spread(ops_per_layer)[0]


def layer_op_overhead_spread(ops_per_layer: int = 73 + 138, repeats: int = 15) -> tuple[float, float]:
    """(`layer_op_overhead`, the spread (max - min) / median of its repeats): the 2- and 4-layer steps are
    timed in alternation and each pair's difference is one repeat, so a change of the machine's load during
    the measurement shifts both members of a pair alike instead of one depth's median."""
    from dsforge.compiler.frontend.presets import presets
    from dsforge.compiler.model.resolved import resolve_model
    from dsforge.compiler.spec.schema import ModelSpec
    from dsforge.runtime.models import build_model

    spec = dict(presets("models")["tiny-llama"].spec)
    steps = {}
    for layers in (2, 4):
        model = build_model(resolve_model(ModelSpec(**{**spec, "layers": layers})), device="cpu")
        ids = torch.randint(0, spec["vocab"], (1, spec["seq_len"]))

        def step(model: Any = model, ids: torch.Tensor = ids) -> None:
            model(input_ids=ids, labels=ids).loss.backward()

        step()  # warm-up
        steps[layers] = step
    diffs = [median_seconds(steps[4], 3) - median_seconds(steps[2], 3) for _ in range(repeats)]
    per_op = [max(0.0, d) / 2 / ops_per_layer for d in diffs]
    median = statistics.median(per_op)
    return median, (max(per_op) - min(per_op)) / median if median > 0 else 0.0
