"""The runtime: process groups, module rewrites, pipeline stages and engine start-up (imports torch).

Importing this package is free: it imports neither torch nor DeepSpeed. Its submodules do, so
``import dsforge.runtime.groups`` (or any other) fails with ``No module named 'torch'`` where the
``runtime`` extra (``pip install dsforge[runtime]``) is missing.

Which parallel building blocks come from DeepSpeed, and which are dsforge's own
-------------------------------------------------------------------------------

From DeepSpeed (used as they are; dsforge only wires the plan's groups into them):
  * Expert parallelism: ``deepspeed.moe.layer.MoE`` (gating, token all-to-all, expert-data-parallel
    gradient reduction in the engine). ``dsforge.runtime.moe`` installs the plan's ep / edp groups
    into DeepSpeed's expert-group registry first, because DeepSpeed's own rank arithmetic agrees
    with the plan only for some orders.
  * Ulysses context parallelism: ``deepspeed.sequence.layer.DistributedAttention``
    (``dsforge.runtime.attention.ulysses`` fixes the layout and the default local attention).
  * Pipeline parallelism: ``deepspeed.pipe.PipelineModule`` and its ``PipelineParallelGrid``;
    ``dsforge.runtime.groups.pipe_topology`` gives it a ``ProcessTopology`` whose groups are
    checked, group by group, against the plan's.
  * ZeRO and the data-parallel reduction: the DeepSpeed engine, told the plan's groups through the
    ``mpu`` adapter ``dsforge.runtime.groups.DeepSpeedMPU``.

dsforge's own (no DeepSpeed building block fits):
  * ``groups``: every torch.distributed group built exactly as the plan placed the ranks, handed
    out explicitly as a ``ParallelGroups`` object (no module globals), plus the launch check.
  * ``layers``: column/row-parallel linear layers usable inside pipeline stages (fused blocks such
    as a GQA QKV split per block), vocabulary-parallel embedding, LM head and cross entropy, and
    the tensor/sequence-parallel autograd collectives. DeepSpeed's AutoTP rewrites a whole model
    in ``deepspeed.initialize`` and does not combine with its PipelineModule, so it does not fit.
  * ``attention.ring``: ring attention with the load-balanced 2·cp chunk layout (DeepSpeed has no
    ring attention).
"""
