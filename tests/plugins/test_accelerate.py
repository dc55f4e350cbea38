"""Accelerate integration: the plugin holds the compiled ds_config, `dsforge compile` writes an accelerate
launch config that accelerate's own parser accepts, and the compiled launch.sh trains on 2 CPU processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

pytest.importorskip("accelerate")
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType

from dsforge.commands.compile import compile_file
from dsforge.plugins.accelerate import check_accelerator, deepspeed_plugin
from dsforge.plugins.job import PlanMismatchError
from tests.plugins.conftest import ROOT
from tests.plugins.saved_dirs import (
    CAPTURE,
    assert_gradients_match,
    assert_same_as_save_hf,
    assert_saved_dirs_match,
)

EXAMPLE = ROOT / "examples" / "trainers" / "accelerate"


def compiled(tmp: Path, job: Path = EXAMPLE / "job.yaml") -> Path:
    out = tmp / "job-dir"
    result = compile_file(job, out)
    assert result.written, [d.message for d in result.diagnostics]
    return out


def test_plugin_config_is_the_compiled_ds_config_key_for_key(tmp_path: Path) -> None:
    plugin = deepspeed_plugin(EXAMPLE / "job.yaml")
    assert plugin.deepspeed_config == json.loads((compiled(tmp_path) / "ds_config.json").read_text())
    assert (
        plugin.zero_stage == 1 and plugin.gradient_accumulation_steps == 2 and plugin.zero3_init_flag is False
    )


def dry_run(launch: Path, *args: str) -> list[str]:
    """The command the compiled launch.sh would run (its DSFORGE_DRY_RUN mode), after the `--`."""
    out = subprocess.run([str(launch), *args], env={**os.environ, "DSFORGE_DRY_RUN": "1", "NODE_RANK": "1"},
                         capture_output=True, check=True).stdout.decode().split("\0")
    return [w for w in out[out.index("--") + 1:] if w]


def test_compiled_launcher_is_accepted_by_accelerate_launch(tmp_path: Path) -> None:
    out = compiled(tmp_path)
    cmd = dry_run(out / "launch.sh", "my_train.py", "--lr", "3")
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"] and cmd[-3:] == ["my_train.py", "--lr", "3"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(cmd[3:]))
    assert args.use_deepspeed and args.num_processes == 2 and args.num_machines == 1
    assert args.deepspeed_config_file == str(out / "ds_config.json") and args.main_process_port == 29500
    assert dry_run(out / "launch.sh")[-1] == str(out / "train.py")  # no script: dsforge's own entry point


def test_multi_node_config_names_the_master_and_each_node_its_rank(tmp_path: Path) -> None:
    doc = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    doc["hardware"]["nodes"] = 2
    doc["launch"].update(master_addr="node0", master_port=6000)
    job = tmp_path / "multi.yaml"
    job.write_text(yaml.safe_dump(doc))
    out = compiled(tmp_path, job)
    cmd = dry_run(out / "launch.sh", "t.py")
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(cmd[3:]))
    assert (args.num_processes, args.num_machines, args.machine_rank) == (4, 2, 1)
    assert (args.main_process_ip, args.main_process_port,
            args.deepspeed_multinode_launcher) == ("node0", 6000,
                                                                                                  "standard")


def test_check_names_a_world_accelerate_got_wrong(tmp_path: Path) -> None:
    """accelerate's own CPU default: one process per world and no DeepSpeed; the check says so."""
    acc = SimpleNamespace(num_processes=1, distributed_type=DistributedType.NO, state=None)
    with pytest.raises(PlanMismatchError, match=r"(?s)world size: the Accelerator has 1, the job file plans "
                                                r"2.*ZeRO stage: the Accelerator has none \(accelerate runs"):
        check_accelerator(EXAMPLE / "job.yaml", acc)


def _tp_job(tmp: Path, ranks: int = 2, zero: int = 1, order: str = "") -> Path:
    path = tmp / f"tp{ranks}-z{zero}{order.replace('-', '')}.yaml"
    extra = f", order: {order}" if order else ""
    path.write_text("version: 1\nmodel: {preset: tiny-llama}\n"
                    f"hardware: {{preset: cpu-local, gpus_per_node: {ranks}}}\n"
                    f"parallel: {{tp: 2, sequence_parallel: true, zero: {zero}{extra}}}\n"
                    "training: {global_batch: 8, micro_batch: 2, precision: fp32, steps: 2}\n",
                    encoding="utf-8")
    return path


def test_tensor_parallel_gets_deepspeeds_tp_section_and_its_batch_rule(tmp_path: Path) -> None:
    """At tp=2 the Accelerator's deepspeed.initialize (no mpu) gets tensor_parallel.autotp_size, as the HF
    Trainer's does; train_batch_size counts every rank (accelerate's own fill-in: micro x accum x processes),
    and check_accelerator divides the TP ranks out before comparing the global batch with the plan."""
    from dsforge.plugins.job import load_job

    path = _tp_job(tmp_path, ranks=4)
    cfg = deepspeed_plugin(path).deepspeed_config
    assert cfg["tensor_parallel"] == {"autotp_size": 2}
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 2)  # dp = 2
    assert cfg["train_batch_size"] == 2 * 2 * 4
    compiled_cfg = load_job(path).ds_config()
    # DeepSpeed consolidates the slices for accelerate's get_state_dict only with the gather flag set.
    zero = {**compiled_cfg["zero_optimization"], "stage3_gather_16bit_weights_on_model_save": True}
    assert cfg == {**compiled_cfg, "tensor_parallel": {"autotp_size": 2}, "train_batch_size": 16,
                   "zero_optimization": zero}
    acc = SimpleNamespace(num_processes=4, distributed_type=DistributedType.DEEPSPEED,
                          state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=cfg)))
    check_accelerator(path, acc)  # global batch 16 / tp 2 = the plan's 8
    cfg["train_batch_size"] = 32
    with pytest.raises(PlanMismatchError, match="global batch: the Accelerator has 16, the job file plans 8"):
        check_accelerator(path, acc)


def test_tp_layouts_deepspeed_cannot_run_are_refused_before_start(tmp_path: Path) -> None:
    from dsforge.plugins.accelerate import prepare_model
    from dsforge.plugins.job import PluginError

    order = _tp_job(tmp_path, ranks=4, order="dp-tp-cp-ep-pp")
    zero3 = _tp_job(tmp_path, zero=3)
    for call in (deepspeed_plugin, prepare_model):
        with pytest.raises(PluginError, match=r"^DSF706: .*Accelerate gives deepspeed.initialize no mpu.*tp "
                                              r"groups \[\[0, 1\], \[2, 3\]\], while the plan's are "
                                              r"\[\[0, 2\], \[1, 3\]\]"):
            call(order)
        with pytest.raises(PluginError, match=r"^DSF707: .*parallel.zero=3 with tp=2 .*through Accelerate"):
            call(zero3)


def test_accelerates_own_parallelism_config_is_refused(tmp_path: Path) -> None:
    from accelerate.parallelism_config import ParallelismConfig

    from dsforge.plugins.accelerate import refuse_parallelism_config
    from dsforge.plugins.job import PluginError

    path = _tp_job(tmp_path)
    refuse_parallelism_config(path, None)
    refuse_parallelism_config(path, ParallelismConfig())  # every size 1: no split of its own
    with pytest.raises(PluginError, match=r"^DSF708: .*ParallelismConfig with tp_size=2: accelerate would "
                                          r"split .*parallel at .*:4:"):
        refuse_parallelism_config(path, ParallelismConfig(tp_size=2))


def test_a_whole_model_or_a_world_sharded_loader_is_named_before_the_first_step(tmp_path: Path) -> None:
    """At tp=2 x dp=2 rank 3 is dp rank 1 of 2: a model prepare_model did not split, a loader split 4 ways
    (prepared before accelerate had its TP mesh) and a dispatching loader are each named."""
    import torch
    from accelerate.data_loader import DataLoaderDispatcher

    from dsforge.plugins.accelerate import check_dataloader, check_model
    from dsforge.plugins.hf import check_data_shard
    from dsforge.plugins.job import load_job

    job = load_job(_tp_job(tmp_path, ranks=4))
    with pytest.raises(PlanMismatchError, match=r"model: the model given to accelerator.prepare was not "
                                                r"made by dsforge.plugins.accelerate.prepare_model, while "
                                                r"parallel.tp=2"):
        check_model(job, torch.nn.Linear(2, 2))
    check_model(load_job(EXAMPLE / "job.yaml"), torch.nn.Linear(2, 2))  # tp 1: any model
    world_split = SimpleNamespace(batch_size=2,
                                  batch_sampler=SimpleNamespace(process_index=3, num_processes=4))
    with pytest.raises(PlanMismatchError, match=r"(?s)reads part 3 of 4 on rank 3.*fix: pass the DataLoader"):
        check_data_shard(job, world_split, 3, fix="pass the DataLoader")
    # This process (no world: rank 0, dp rank 0 of 2) given dp rank 1's shard, through the plugin's check.
    other = SimpleNamespace(batch_size=2, batch_sampler=SimpleNamespace(process_index=1, num_processes=2))
    with pytest.raises(PlanMismatchError, match=r"(?s)reads part 1 of 2 on rank 0.*fix: pass the DataLoader "
                                                r"\(map-style data set\) to accelerator.prepare"):
        check_dataloader(job, other)
    check_dataloader(job, SimpleNamespace(batch_size=2, batch_sampler=SimpleNamespace(process_index=0,
                                                                                      num_processes=2)))
    with pytest.raises(PlanMismatchError, match="micro-batch per rank: the data loader has 4"):
        check_dataloader(job, SimpleNamespace(batch_size=4))
    dispatcher = DataLoaderDispatcher.__new__(DataLoaderDispatcher)
    dispatcher.__dict__["batch_size"] = 2
    with pytest.raises(PlanMismatchError, match=r"dispatches one batch from rank 0 to every rank.*the 2 "
                                                r"data-parallel ranks of parallel.tp=2"):
        check_dataloader(job, dispatcher)


@pytest.mark.slow
def test_compiled_launch_sh_trains_the_example_on_two_processes(tmp_path: Path) -> None:
    out = compiled(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # launch.sh exports DS_ACCELERATOR=cpu itself
    # launch.sh runs `python` (launch.python): make it this interpreter, which has accelerate, as CI does not
    # activate the virtualenv.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    summary = tmp_path / "summary.json"
    proc = subprocess.run([str(out / "launch.sh"), str(EXAMPLE / "train_accelerate.py"),
                           str(EXAMPLE / "job.yaml"), "--summary",
                           str(summary)], check=False, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(summary.read_text())
    assert got["world"] == 2 and got["optimizer_steps"] == 4 and len(got["losses"]) == 8  # 4 steps x 2 micro
    assert all(5.0 < loss < 6.0 for loss in got["losses"])
    # What accelerate handed deepspeed.initialize: the compiled config, plus the disabled dtype sections
    # accelerate's set_mixed_precision writes for every dtype a config does not mention.
    expected = json.loads((out / "ds_config.json").read_text())
    assert got["ds_config"] == {**expected, "fp16": {"enabled": False}, "bf16": {"enabled": False}}


def _launch(job: Path, tmp: Path, *args: str, capture: Path | None = None) -> subprocess.CompletedProcess:
    """The example script through the job's compiled launch.sh (`accelerate launch`), as the docs run it;
    with ``capture``, through the gradient-recording harness (CAPTURE), which runs the example unchanged."""
    (tmp / job.stem).mkdir()
    out = compiled(tmp / job.stem, job)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    harness = [str(CAPTURE), str(capture)] if capture is not None else []
    return subprocess.run([str(out / "launch.sh"), *harness, str(EXAMPLE / "train_accelerate.py"), str(job),
                           *args],
                          check=False, env=env, cwd=tmp, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4], ids=["tp2", "tp2xdp2"])
def test_accelerate_tp2_sequence_parallel_zero1_equals_one_process(tmp_path: Path, ranks: int) -> None:
    """The example (a standard Accelerator loop plus the documented dsforge lines: accelerator,
    prepare_model(job, model), optimizer_and_scheduler, check_model, check_dataloader; accelerate's own
    get_state_dict and save_pretrained) at tp=2 with sequence parallelism and ZeRO-1 on 2 CPU ranks (and tp=2
    x dp=2 on 4), from an HF model directory, against the same script on one process at tp=1: every optimizer
    step's loss, DeepSpeed's gradient norm and whole gradient of every parameter agree, the save wrote what
    parallel_model.save_hf writes, and that plain HF directory gives the one-process model's weights and
    logits."""

    from dsforge.plugins.job import load_job
    from dsforge.runtime.models import build_model
    from tests.runtime_e2e.harness import compare

    def port(text: str, number: int) -> str:  # a port of its own, as the HF tests' torchrun runs have
        return text.replace("  launcher: accelerate\n", f"  launcher: accelerate\n  master_port: {number}\n")

    example = (EXAMPLE / "job_tp.yaml").read_text()
    tp_job = tmp_path / f"tp{ranks}.yaml"  # at 4 ranks the same global batch over dp = 2
    tp_job.write_text(port(example.replace("gpus_per_node: 2", f"gpus_per_node: {ranks}"), 29671 + ranks),
                      encoding="utf-8")
    one = tmp_path / "one.yaml"
    one.write_text(port(example.replace("gpus_per_node: 2", "gpus_per_node: 1").replace("  tp: 2\n", "")
                        .replace("  sequence_parallel: true\n", ""), 29681 + ranks), encoding="utf-8")
    spec = load_job(one).plan.spec
    build_model(spec.model, "cpu", 1, seed=3).save_pretrained(tmp_path / "init")  # the user's own model
    summaries = {}
    for name, job in (("tp", tp_job), ("ref", one)):
        proc = _launch(job, tmp_path, "--from-pretrained", str(tmp_path / "init"), "--save",
                       str(tmp_path / name), "--summary", str(tmp_path / f"{name}.json"),
                       capture=tmp_path / f"{name}-grads")
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        assert "Signal 6" not in out and "terminate called" not in out  # no rank aborts at exit
        summaries[name] = json.loads((tmp_path / f"{name}.json").read_text())
    tp, ref = summaries["tp"], summaries["ref"]
    assert tp["world"] == ranks and tp["optimizer_steps"] == ref["optimizer_steps"] == 4
    assert tp["ds_config"]["tensor_parallel"] == {"autotp_size": 2}
    assert "tensor_parallel" not in ref["ds_config"]
    assert len(tp["step_losses"]) == len(tp["grad_norms"]) == 4
    compare(f"accelerate tp2 sp zero1 {ranks} ranks", "losses", tp["step_losses"], ref["step_losses"])
    compare(f"accelerate tp2 sp zero1 {ranks} ranks", "grad norms", tp["grad_norms"], ref["grad_norms"])
    assert_gradients_match(tmp_path / "tp-grads", tmp_path / "ref-grads", f"accelerate {ranks} ranks")
    assert tp["step_losses"][3] != tp["step_losses"][0]  # it trained
    assert_same_as_save_hf(tmp_path / "tp", tmp_path / "tp-grads")  # get_state_dict gathered the slices
    assert_saved_dirs_match(tmp_path, spec.model.vocab, f"accelerate {ranks} ranks")


@pytest.mark.slow
def test_accelerate_tp2_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """accelerate's own save_state after 2 of 4 optimizer steps at tp=2 + SP + ZeRO-1 on 2 CPU ranks, then
    load_state and skip_first_batches in a new launch: steps 3 and 4 give the uninterrupted run's losses and
    gradient norms."""
    example = (EXAMPLE / "job_tp.yaml").read_text()
    jobs = {}
    for name, number in (("full", 29691), ("resumed", 29693)):  # a launch.sh of its own for each run
        jobs[name] = tmp_path / f"{name}.yaml"
        jobs[name].write_text(example.replace("  launcher: accelerate\n",
                                              f"  launcher: accelerate\n  master_port: {number}\n"),
                              encoding="utf-8")
    state = tmp_path / "state"
    runs = {"full": ("--save-state", str(state), "--save-state-steps", "2"),
            "resumed": ("--resume", str(state))}
    summaries = {}
    for name, extra in runs.items():
        proc = _launch(jobs[name], tmp_path, "--summary", str(tmp_path / f"{name}.json"), *extra)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-4000:]
        assert "Signal 6" not in out and "terminate called" not in out
        summaries[name] = json.loads((tmp_path / f"{name}.json").read_text())
    full, resumed = summaries["full"], summaries["resumed"]
    assert full["optimizer_steps"] == resumed["optimizer_steps"] == 4
    assert len(full["step_losses"]) == 4 and len(resumed["step_losses"]) == 2
    assert resumed["step_losses"] == full["step_losses"][2:], (resumed, full)
    assert resumed["grad_norms"] == full["grad_norms"][2:], (resumed, full)
