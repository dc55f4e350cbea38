"""DSF60x: what the launcher and the emitted job need, beyond a valid layout (launch.*, deepspeed overrides).

These depend on the launcher and the job's `deepspeed:` overrides, not on the cost model; validate runs
them so that a CI gate built on `dsforge validate` refuses every job `dsforge compile` would refuse.
"""

from __future__ import annotations

from collections.abc import Iterator

from dsforge.compiler.deepspeed.ds_settings import pipeline_partitioning
from dsforge.compiler.launch_targets import (
    DNS_LABEL,
    ENV_KEY,
    PDSH_UNSAFE,
    SBATCH_VALUE,
    SINGLE_MACHINE_LAUNCHERS,
)
from dsforge.compiler.rules.registry import DSFORGE_RUNTIME, Context, Finding, rule

LOOPBACK = ("127.", "localhost", "::1")


@rule("DSF601", "NVMe offload needs an NVMe path",
      source="deepspeed 0.19.8 runtime/zero/offload_config.py nvme_path; runtime/zero/stage3.py")
def _nvme_path(ctx: Context) -> Iterator[Finding]:
    """ZeRO-Infinity swaps optimizer states to files under ``offload_optimizer.nvme_path``
    (runtime/zero/stage3.py joins it unchecked); the path is site-specific, so the job file gives it."""
    if ctx.spec.training.optimizer.offload != "nvme":
        return
    zero = ctx.spec.deepspeed.get("zero_optimization")
    off = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    if not (isinstance(off, dict) and off.get("nvme_path")):
        yield Finding("optimizer offload to nvme needs the NVMe directory, and the job does not give one",
                      "set deepspeed.zero_optimization.offload_optimizer.nvme_path to a local NVMe mount",
                      ("training", "optimizer", "offload"))


@rule("DSF602", "the hostfile lists every node",
      source="deepspeed 0.19.8 launcher/runner.py fetch_hostfile")
def _hosts(ctx: Context) -> Iterator[Finding]:
    """The deepspeed launcher's hostfile lists every node (launcher/runner.py fetch_hostfile)."""
    launch, nodes = ctx.spec.launch, ctx.plan.nodes
    if launch.hosts and len(launch.hosts) != nodes:
        yield Finding(f"launch.hosts names {len(launch.hosts)} hosts but the job has nodes={nodes}",
                      f"list exactly {nodes} host names", ("launch", "hosts"))
    elif launch.launcher == "deepspeed" and nodes > 1 and not launch.hosts:
        yield Finding(f"the deepspeed launcher needs the host names of all {nodes} nodes for its hostfile",
                      f"set launch.hosts to the {nodes} node names (reachable by password-less ssh)",
                      ("launch", "launcher"))


#: Launchers whose nodes meet at launch.master_addr (torchrun's static or c10d endpoint, accelerate's
#: main_process_ip); slurm and the deepspeed launcher find the first node themselves.
RENDEZVOUS_LAUNCHERS = ("torchrun", "accelerate")


@rule("DSF603", "multi-node torchrun and accelerate need a reachable rendezvous host",
      source="torch.distributed.run --rdzv_endpoint; accelerate launch --main_process_ip")
def _rendezvous(ctx: Context) -> Iterator[Finding]:
    """torchrun (and `accelerate launch`, which runs it) on several nodes meets at master_addr:master_port; a
    loopback address never leaves a node, so every other node would wait at start-up until it times out."""
    launch = ctx.spec.launch
    if (
        launch.launcher in RENDEZVOUS_LAUNCHERS
        and ctx.plan.nodes > 1
        and launch.master_addr.startswith(LOOPBACK)
    ):
        yield Finding(f"{launch.launcher} across {ctx.plan.nodes} nodes rendezvouses at "
                      f"{launch.master_addr}, which only the local node can reach",
                      "set launch.master_addr to a host name or address every node can reach",
                      ("launch", "master_addr"))


@rule("DSF604", "launch values fit the emitted scripts and manifests",
      source="deepspeed 0.19.8 launcher/multinode_runner.py add_export; sbatch(1) directives")
def _launch_values(ctx: Context) -> Iterator[Finding]:
    """Values must fit the files they are written into: NUL ends a C string (bash, argv), env keys are
    shell identifiers, sbatch directives are unquoted, namespaces are DNS labels."""
    launch = ctx.spec.launch
    strings = {k: getattr(launch, k) for k in ("master_addr", "image", "python", "partition", "account",
                                                "time_limit")}
    strings["name"] = ctx.spec.name
    for key, value in strings.items():
        if isinstance(value, str) and "\x00" in value:
            path = ("name",) if key == "name" else ("launch", key)
            yield Finding(f"{key} contains a NUL character, which no script or argument can carry",
                          "remove it", path)
    if launch.python is not None and not launch.python.strip():
        yield Finding("launch.python is empty", "name the Python interpreter, e.g. python3",
                      ("launch", "python"))
    for key, value in launch.env.items():
        if not ENV_KEY.match(key):
            yield Finding(f"launch.env key {key!r} is not an environment variable name",
                          "use letters, digits and _ (not starting with a digit)", ("launch", "env", key),
                          at_key=True)
        elif "\x00" in value:
            yield Finding(f"launch.env.{key} contains a NUL character", "remove it", ("launch", "env", key))
        elif launch.launcher == "deepspeed" and ctx.plan.nodes > 1 and PDSH_UNSAFE.search(value):
            yield Finding(f"launch.env.{key}={value!r}: DeepSpeed's pdsh runner passes values in unescaped "
                          f"double quotes, so quotes, $, `, \\, newlines or "
                          "edge spaces would change on the remote nodes",
                          "simplify the value, or use the torchrun/slurm launcher", ("launch", "env", key))
    if launch.launcher == "slurm":
        for key in ("partition", "account", "time_limit"):
            value = getattr(launch, key)
            if value is not None and not SBATCH_VALUE.match(value):
                yield Finding(f"launch.{key}={value!r} cannot be written into an #SBATCH directive",
                              "use letters, digits and _ . : , @ + = / -", ("launch", key))
    if launch.launcher == "kubernetes" and not DNS_LABEL.match(launch.namespace):
        yield Finding(f"launch.namespace={launch.namespace!r} is not "
                      f"a Kubernetes namespace name (DNS-1123 label)",
                      "use lower-case letters, digits and -, at most 63 characters", ("launch", "namespace"))


@rule("DSF605", "the kubernetes launcher needs an image",
      source="Kubeflow PyTorchJob")
def _image(ctx: Context) -> Iterator[Finding]:
    """A PyTorchJob's pods run a container image; dsforge cannot guess the site's one."""
    launch = ctx.spec.launch
    if launch.launcher == "kubernetes" and not (launch.image or "").strip():
        yield Finding("the kubernetes launcher needs a container image",
                      "set launch.image to an image with dsforge[runtime] installed", ("launch", "launcher"))


@rule("DSF606", "DeepSpeed does not re-shard what dsforge.runtime shards",
      source=("deepspeed 0.19.8 runtime/engine.py _apply_autotp_partitioning, _configure_expert_parallel; "
        "deepspeed/__init__.py initialize (mesh_device)"), reads=(), stacks=DSFORGE_RUNTIME)
def _runtime_owned(ctx: Context) -> Iterator[Finding]:
    """dsforge.runtime shards tensor-parallel layers and experts itself and hands DeepSpeed an mpu with the
    plan's groups. AutoTP (runtime/engine.py _apply_autotp_partitioning) or AutoEP
    (_configure_expert_parallel) would shard the model a second time, and `data_parallel_size` with
    `sequence_parallel_size` makes deepspeed.initialize build its own device mesh, which utils/groups.py
    consults before the mpu."""
    ds = ctx.spec.deepspeed
    tp, ep = ds.get("tensor_parallel"), ds.get("expert_parallel")
    owned: list[tuple[tuple[str, ...], str]] = []
    if isinstance(tp, dict) and isinstance(tp.get("autotp_size"), int) and tp["autotp_size"] > 1:
        owned.append((("tensor_parallel", "autotp_size"), "parallel.tp"))
    if isinstance(ep, dict) and ep.get("enabled") is True:
        owned.append((("expert_parallel", "enabled"), "parallel.ep"))
    owned += [((key,), f"parallel.{name}") for key, name in (("sequence_parallel_size", "cp"),
                                                                ("data_parallel_size", "dp")) if key in ds]
    for path, instead in owned:
        yield Finding(f"deepspeed.{'.'.join(path)} makes DeepSpeed lay out ranks or shard the model itself, "
                      f"but dsforge.runtime already does that from the plan",
                      f"remove it; {instead} sets the degree", ("deepspeed", *path))


@rule("DSF608", "pipeline transfers are not partitioned under sequence parallelism",
      source="deepspeed 0.19.8 runtime/pipe/engine.py is_pipe_partitioned, is_grad_partitioned",
      reads=("tp", "pp", "sequence_parallel"))
def _pipe_partitioning(ctx: Context) -> Iterator[Finding]:
    """With sequence parallelism each TP rank's stage activation is its own sequence slice, so compile turns
    DeepSpeed's partitioned pipeline transfers off (they assume the activation is replicated over the TP
    group, runtime/pipe/engine.py); a `deepspeed.pipeline` override turning them back on would all-gather
    slices of different ranks as if they were pieces of one tensor, and the loss would come out wrong."""
    d, pipe = ctx.plan.degrees, ctx.spec.deepspeed.get("pipeline")
    if d is None or d.pp == 1 or not isinstance(pipe, dict):
        return
    for key, want in pipeline_partitioning(ctx.spec.parallel.sequence_parallel, d.tp).items():
        if not want and pipe.get(key) is True:
            yield Finding(f"deepspeed.pipeline.{key}=true with sequence parallelism (tp={d.tp}, pp={d.pp}): "
                          "DeepSpeed would all-gather the TP ranks' different sequence slices as one tensor",
                          "remove it (compile sets it to false)", ("deepspeed", "pipeline", key))


@rule("DSF609", "a single-machine launcher runs a single-node job",
      source="dsforge/templates/launch/local.sh.j2 (torch.distributed.run --standalone)", reads=("nodes",))
def _single_machine(ctx: Context) -> Iterator[Finding]:
    """The `local` launcher starts every rank on the machine it runs on (torchrun --standalone); a job with
    several nodes would put all of their ranks on one machine, oversubscribing it and measuring nothing the
    job file describes."""
    launch, nodes = ctx.spec.launch, ctx.plan.nodes
    if launch.launcher in SINGLE_MACHINE_LAUNCHERS and nodes > 1:
        yield Finding(f"launch.launcher={launch.launcher} starts every rank on one machine, but the job has "
                      f"nodes={nodes} ({ctx.plan.world_size} ranks)",
                      "choose a multi-node launcher (slurm, torchrun, deepspeed, kubernetes or accelerate), "
                      "or set hardware.nodes: 1",
                      ("launch",
                       "launcher") if ctx.written(("launch", "launcher")) else ("hardware", "nodes"))
