"""What DeepSpeed 0.19.8 accepts in a ds_config, written down so validation never imports it.

`tests/test_ds_keys.py` compares these lists with the installed DeepSpeed when it is present.
"""

from __future__ import annotations

#: zero_optimization sub-keys (field names and aliases of deepspeed/runtime/zero/config.py
#: DeepSpeedZeroConfig, a pydantic model with extra="forbid": anything else fails at parse).
ZERO_KEYS = frozenset("""
allgather_bucket_size allgather_partitions allgather_sequential compute_grad_norm contiguous_gradients cpu_offload
cpu_offload_param cpu_offload_use_pin_memory elastic_checkpoint enable_sanity_checks
gather_16bit_weights_on_model_save ignore_unused_parameters leaf_module legacy_stage1 load_from_fp32_weights
log_trace_cache_warnings max_live_parameters max_reuse_distance memory_efficient_linear model_persistence_threshold
module_granularity_threshold offload_optimizer offload_param overlap_comm override_module_apply
param_persistence_threshold parameter_alignment pipeline_loading_checkpoint prefetch_bucket_size reduce_bucket_size
reduce_scatter round_robin_gradients save_muon_momentum_buffer_in_memory stage stage3_allgather_sequential
stage3_gather_16bit_weights_on_model_save stage3_gather_fp16_weights_on_model_save stage3_max_live_parameters
stage3_max_reuse_distance stage3_model_persistence_threshold stage3_module_granularity_threshold
stage3_param_persistence_threshold stage3_prefetch_bucket_size stage3_use_all_reduce_for_fetch_params sub_group_size
use_all_reduce_for_fetch_params use_multi_rank_bucket_allreduce zenflow zero_hpz_partition_size
zero_quantized_gradients zero_quantized_nontrainable_weights zero_quantized_weights
""".split())  # noqa: E501

#: Top-level keys DeepSpeed reads (deepspeed/runtime/config.py and the feature configs it delegates to).
#: Unknown top-level keys are ignored silently by DeepSpeed, which is why dsforge warns about them.
TOP_LEVEL_KEYS = frozenset("""
train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps managed_gradient_accumulation
steps_per_print dump_state optimizer scheduler zero_optimization zero_allow_untested_optimizer
zero_force_ds_cpu_optimizer bf16 fp16 torch_autocast data_types gradient_clipping communication_data_type
seq_parallel_communication_data_type gradient_allreduce_op prescale_gradients gradient_predivide_factor pipeline
activation_checkpointing tensor_parallel expert_parallel sequence_parallel_size data_parallel_size compile
checkpoint hybrid_engine data_efficiency flops_profiler autotuning comms_logger tensorboard wandb csv_monitor comet
wall_clock_breakdown memory_breakdown vocabulary_size dataloader_drop_last disable_allgather disable_python_gc
log_level use_data_before_expert_parallelism aio timers weight_quantization zenflow
""".split())  # noqa: E501

#: Top-level keys removed from DeepSpeed: `_reject_removed_config_keys` raises at parse.
REMOVED_TOP_LEVEL_KEYS = frozenset("""
nebula compression_training amp quantize_training sparse_gradients eigenvalue sparse_attention elasticity
graph_harvesting curriculum_learning
""".split())

REMOVED_ZERO_KEYS = frozenset({"mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"})

#: communication_data_type values accepted by runtime/config.py get_communication_data_type.
COMM_DTYPES = frozenset({"fp16", "bf16", "fp32"})

#: bf16 / fp16 sub-keys (deepspeed/runtime/precision_config.py DeepSpeedBF16Config, DeepSpeedFP16Config; both
#: pydantic models with extra="forbid", so a misspelt key fails at parse).
BF16_KEYS = frozenset({"enabled", "immediate_grad_update", "check_grad_overflow",
                       "bf16_master_weights_and_grads", "bf16_optimizer_states"})
FP16_KEYS = frozenset({"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                       "hysteresis", "consecutive_hysteresis", "min_loss_scale",
                       "fp16_master_weights_and_grads"})

#: tensor_parallel sub-keys (deepspeed/runtime/tensor_parallel/config.py TPTrainingConfig, extra="forbid";
#: `tp` is the alias of `tensor_parallel`, `kernel_inject` of `replace_with_kernel_inject`).
TENSOR_PARALLEL_KEYS = frozenset({"dtype", "autotp_size", "tp_overlap_comm", "vocab_parallel_lm_head",
                                  "vocab_parallel_ce_backend", "tensor_parallel", "tp",
                                  "injection_policy_tuple", "partition_config", "preset_model",
                                  "keep_module_on_host", "replace_with_kernel_inject", "kernel_inject"})

#: pipeline sub-keys DeepSpeed reads (runtime/config.py get_pipeline_config defaults; runtime/pipe/engine.py
#: and module.py read `use_reentrant`). The block is a plain dict, so DeepSpeed ignores misspelt keys
#: silently.
PIPELINE_KEYS = frozenset({"stages", "partition", "seed_layers", "activation_checkpoint_interval",
                           "pipe_partitioned", "grad_partitioned", "use_reentrant"})

#: Legacy spelling of the bf16 section that DeepSpeed still reads (runtime/precision_config.py BFLOAT16_OLD).
LEGACY_TOP_LEVEL_KEYS = frozenset({"bfloat16"})

#: tensor_parallel.tp sub-keys (runtime/tensor_parallel/config.py TPConfig, extra="forbid").
TP_CONFIG_KEYS = frozenset({"tp_size", "tp_grain_size", "mpu", "tp_group"})
