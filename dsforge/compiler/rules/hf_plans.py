"""DSF170-DSF172: rewrite policies derived from an HF model's own parallel plans
(dsforge.compiler.model.hf_plans).

Both are reported where the policy is derived: the rewrite (compile's meta build, and the runtime) of an HF
model whose family has no hand-written policy.
"""

from __future__ import annotations

from dsforge.compiler.model.hf_plans import NO_PLAN, SPLIT_NEIGHBOUR, STYLE_REFUSED
from dsforge.compiler.rules.registry import report_id

_SRC = "transformers base_model_tp_plan / base_model_ep_plan (transformers/distributed/tensor_parallel.py)"
report_id(STYLE_REFUSED, "every HF parallel style of the model has an exact dsforge placement",
          "Each style of the model's tp and ep plans maps to the dsforge variant with the same mathematics "
          "(colwise: column, rowwise: row, packed_colwise: column of two fused blocks, embedding_rowwise: "
          "vocab, replicated_with_grad_allreduce: head_norm, moe_tp_experts / ep_dispatch_experts / "
          "grouped_gemm: expert; the gathered styles colwise_gather_output, colwise_rep, "
          "rowwise_split_input, rowwise_rep and embedding_colwise: replicate, since HF computes them whole "
          "on every rank). A style without one (moe_identity_expert: an identity expert the expert "
          "all-to-all cannot route exactly; a style dsforge does not "
          "know) is refused, naming the module and the style.", _SRC)
report_id(NO_PLAN, "an HF model without a hand-written policy states a parallel plan",
          "A model family dsforge has no hand-written rewrite policy for is placed by its HF tensor- and "
          "expert-parallel plans; a model_type whose transformers classes state none cannot be split exactly "
          "by name alone, so tp > 1 or ep > 1 is refused (tp = ep = 1, or `rewrite:` rules with model.arch: "
          "custom).", _SRC)
report_id(SPLIT_NEIGHBOUR, "what the HF plan leaves unlisted does not sit beside what it splits",
          "HF replicates every module its plan does not name. A parameter owner beside a module the plan "
          "splits would see this rank's part of the activations, and its gradient would cover those channels "
          "only. Learnt scalars of an elementwise function there (Apertus' xIELU alpha_p and alpha_n between "
          "up_proj and down_proj) are placed as `scalars`: replicated, their gradient summed over TP. Any "
          "other such owner is refused, naming the module and its split neighbour, rather than train with a "
          "partial gradient.", _SRC)
