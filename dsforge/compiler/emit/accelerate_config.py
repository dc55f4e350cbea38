"""The `accelerate launch` config file of a plan (torch-free: `dsforge compile` writes it).

Keys are those of accelerate's ``ClusterConfig`` (accelerate/commands/config/config_args.py) for
``distributed_type: DEEPSPEED``. The DeepSpeed settings live only in ``ds_config.json``: accelerate
refuses a config that sets zero_stage, gradient accumulation, clipping, offload or mixed precision
next to a ``deepspeed_config_file`` (utils/dataclasses.py ``DeepSpeedPlugin._deepspeed_config_checks``),
so none of them appear here. Several nodes use the ``standard`` multi-node launcher (torchrun on each
node, static rendezvous at the job's master address), so no pdsh or hostfile is needed; each node
passes its own ``--machine_rank``.
"""

from __future__ import annotations

from typing import Any

from dsforge.compiler.plan.plan import ResolvedPlan

#: Where the config points DeepSpeed: the job directory's ds_config.json (relative to the working
#: directory of `accelerate launch`, which the emitted launch.sh sets to the job directory).
DS_CONFIG_FILE = "ds_config.json"


def accelerate_config(plan: ResolvedPlan, ds_config_file: str = DS_CONFIG_FILE) -> dict[str, Any]:
    """The accelerate config (a dict for YAML) that launches the plan's ranks with DeepSpeed."""
    launch = plan.spec.launch
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": {
            "deepspeed_config_file": ds_config_file,
            "deepspeed_multinode_launcher": "standard",
            # ZeRO-3 builds the model partitioned from the start (deepspeed.zero.Init) instead of whole per
            # rank.
            "zero3_init_flag": plan.zero == 3,
        },
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "num_machines": plan.nodes,
        "num_processes": plan.world_size,
        "main_process_port": launch.master_port,
        "rdzv_backend": "static",
        "same_network": True,
        # use_cpu would make accelerate skip DeepSpeed; DS_ACCELERATOR=cpu (launch.sh) selects the CPU
        # instead.
        "use_cpu": False,
    }
    if plan.nodes > 1:
        cfg["main_process_ip"] = launch.master_addr
    return cfg


def accelerate_config_yaml(plan: ResolvedPlan, ds_config_file: str = DS_CONFIG_FILE) -> str:
    """The config as YAML text, keys sorted (the same plan gives the same bytes)."""
    import yaml

    return yaml.safe_dump(accelerate_config(plan, ds_config_file), sort_keys=True, default_flow_style=False)
