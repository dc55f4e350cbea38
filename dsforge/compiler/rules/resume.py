"""DSF164-DSF167 and DSF641-DSF643: resuming a checkpoint under another layout, or why it cannot.

No job file alone can produce these: they compare a new compile with the one that wrote the
checkpoint. `dsforge run` reports DSF164-DSF167 before any rank starts (dsforge.commands.run, from
dsforge.compiler.plan.resume_layout), every rank reports the same at start-up for a job started another
way, and DSF641-DSF643 come from a rank reading the checkpoint's layout-free state
(dsforge.runtime.train_state).
"""

from __future__ import annotations

from dsforge.compiler.rules.registry import report_id

_SRC = "dsforge (layout-free checkpoint state: dsforge/runtime/train_state.py; docs/runtime.md)"

report_id("DSF164", "only the layout changes when a checkpoint resumes under another layout",
          "A checkpoint carries the fp32 weights and the optimizer state of one training run. It resumes "
          "under other degrees, another ZeRO stage, other hardware, micro-batch or recomputation exactly, "
          "because each step still reads the same global batch; a changed model, optimizer, schedule, "
          "precision, global batch, seed or data would silently train something "
          "else, so the run is refused naming the changed keys.",
          _SRC)
report_id("DSF165", "the dense tensors have the same shapes under both layouts",
          "model.vocab_multiple_of pads the vocabulary to a multiple of itself x tp: another tp can change "
          "the embedding's rows, and the saved tensors then fit no parameter of the new layout.", _SRC)
report_id("DSF166", "fp16 runs resume under their own layout only",
          "DeepSpeed's fp16 optimizers keep a dynamic loss scale and fp32 copies outside the fragment "
          "mapping dsforge reads and sets; rather than restart the loss scale, the layout change is refused.",
          _SRC)
report_id("DSF167", "the new layout builds the same DeepSpeed optimizer and schedule",
          "The optimizer DeepSpeed builds can follow the hardware (torch's AdamW on CPU ranks, the fused "
          "kernel on GPUs): its state under another implementation would not mean the same.", _SRC)
report_id("DSF641", "a checkpoint resumed under another layout holds layout-free state",
          "Checkpoints of an older dsforge, or of a model dsforge did not build (model.factory, "
          "dsforge.initialize), hold only DeepSpeed's files, which "
          "load under the layout that wrote them only.", _SRC)
report_id("DSF642", "the layout-free state covers every parameter of the new layout",
          "Each rank of the new layout assembles its slices from the pieces the old ranks wrote; a piece "
          "missing (a rank's file deleted) or shaped otherwise stops the rank naming the tensor.", _SRC)
report_id("DSF643", "the optimizer keeps its state where dsforge can read and set it",
          "dsforge reads and sets DeepSpeed's fp32 master weights and optimizer state through its "
          "tensor-fragment mapping (ZeRO 1-3, bf16) or, at ZeRO-0 in fp32, on the torch optimizer itself; an "
          "optimizer whose state lives elsewhere (NVMe offload, fp16's "
          "own copies) resumes under its own layout only.", _SRC)
