"""What a stack profile states (the fields of `StackProfile`); the profiles themselves are its sibling
modules."""

from __future__ import annotations

from dataclasses import dataclass

from dsforge.compiler.estimate.activations import Kernels


@dataclass(frozen=True)
class StackProfile:
    """One implementation's memory and time characteristics (see the module doc; sources in `sources`)."""

    name: str
    kernels: Kernels
    pipeline_output_buffers: bool  # the pipeline engine keeps each in-flight chunk's output until its
                                   # backward
    experts_split_over_tp: bool  # expert matrices split over the tensor-parallel group (else whole per TP
                                 # rank)
    distributed_optimizer: bool  # fp32 master weights and moments sharded over data parallelism at any zero
    fp32_main_grads: bool  # gradients accumulate and reduce in an fp32 buffer next to the 16-bit weights
    # bytes one token moves through memory-bound kernels per layer forward: (h_bytes x e + h_fp32_bytes) x h
    # + f_bytes x e x ffn, e the activations' element bytes; the backward moves twice as much
    h_bytes: float
    h_fp32_bytes: float
    f_bytes: float
    ce_bytes: float  # bytes per logit cell (token x vocab/tp) the loss moves, forward and backward together
    ops_forward: int  # framework operations one layer's forward dispatches
    ops_backward: int  # and its backward
    sources: tuple[str, ...]
    #: whose optimizer keeps the model states: "deepspeed" (DeepSpeed's engine and ZeRO, model_states.py) or
    #: "megatron" (Megatron-Core's DDP buffer and distributed optimizer, model_states.megatron_states)
    optimizer: str = "deepspeed"
    #: the pipeline's sends block the sending rank until the receiver has taken the tensor (DeepSpeed's
    #: PipelineEngine: deepspeed/runtime/pipe/engine.py:1043 and :1094 call p2p.send, a synchronous
    #: dist.send, p2p.py:46-60), so each send costs its transfer on the sender too; False: the transfer only
    #: delays the receiver (Megatron-Core batches each send with the opposite receive)
    blocking_p2p: bool = False
