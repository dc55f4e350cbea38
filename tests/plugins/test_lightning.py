"""Lightning integration: the strategy and the Trainer are built from the plan, the config Lightning formats
for deepspeed.initialize is the compiled one, and the dsforge strategy trains on CPU processes (gloo) like one
process."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
import lightning.pytorch as pl
import torch

from dsforge.commands.compile import compile_file
from dsforge.plugins.job import PlanMismatchError
from dsforge.plugins.lightning import check_trainer, strategy_config, trainer_kwargs
from tests.plugins.conftest import ROOT
from tests.plugins.saved_dirs import CAPTURE, assert_gradients_match

EXAMPLE = ROOT / "examples" / "trainers" / "lightning"
JOB = EXAMPLE / "job.yaml"


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).sum()


@pytest.fixture(scope="module")
def compiled_config(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("lightning") / "job-dir"
    assert compile_file(JOB, out).written
    return json.loads((out / "ds_config.json").read_text())


def test_strategy_config_is_compiled_config_less_the_key_lightning_owns(compiled_config: dict) -> None:
    assert strategy_config(JOB) == {k: v for k,
                                    v in compiled_config.items() if k != "gradient_accumulation_steps"}


def test_trainer_from_the_plan_formats_the_compiled_config_for_deepspeed(compiled_config: dict) -> None:
    kwargs = trainer_kwargs(JOB)
    assert {k: v for k, v in kwargs.items() if k != "strategy"} == {
        "accelerator": "cpu", "devices": 2, "num_nodes": 1, "precision": "32-true",
        "accumulate_grad_batches": 2, "max_steps": 4}
    trainer = pl.Trainer(**kwargs, logger=False, enable_checkpointing=False)
    assert (trainer.world_size, trainer.accumulate_grad_batches) == (2, 2)
    check_trainer(JOB, trainer)
    # The step fit() cannot reach on a CPU: Lightning formats the config it hands deepspeed.initialize
    # (accumulation from the Trainer, precision sections); it comes out as the compiled ds_config again.
    model = Tiny()
    trainer.strategy.connect(model)
    model.trainer = trainer
    trainer.strategy._format_config()
    assert trainer.strategy.config == compiled_config


def test_a_trainer_that_differs_from_the_plan_is_named(compiled_config: dict) -> None:
    kwargs = {**trainer_kwargs(JOB), "accumulate_grad_batches": 4, "precision": "bf16-mixed", "devices": 1}
    trainer = pl.Trainer(**kwargs, logger=False, enable_checkpointing=False)
    with pytest.raises(PlanMismatchError) as err:
        check_trainer(JOB, trainer)
    text = str(err.value)
    assert "world size: the Lightning Trainer has 1, the job file plans 2" in text
    assert "gradient accumulation steps: the Lightning Trainer has 4, the job file plans 2" in text
    assert "precision: the Lightning Trainer has bf16, the job file plans fp32" in text


def _run(script_args: list[str], nproc: int, cwd: Path, port: int, capture: Path | None = None,
         **env_extra: str) -> tuple[dict[int, float], str]:
    """Run the example (torchrun for nproc > 1; with ``capture``, through the gradient-recording harness
    CAPTURE, which runs it unchanged); the mean loss of each optimizer step over every rank's
    micro-batches."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "LOSS_LOG": "1", **env_extra}
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(port)] if nproc > 1 else [sys.executable])
    harness = [str(CAPTURE), str(capture)] if capture is not None else []
    proc = subprocess.run([*launch, *harness, str(EXAMPLE / "train_lightning.py"), *script_args], check=False,
                          env=env,
                          cwd=cwd, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Signal 6" not in out and "terminate called" not in out  # no rank aborts at exit
    losses: dict[int, list[float]] = {}
    for step, loss in re.findall(r"^step (\d+) micro \d+ loss (\d+\.\d{8})$", proc.stdout, re.MULTILINE):
        losses.setdefault(int(step), []).append(float(loss))
    # The ranks' lines interleave in any order; fsum's correctly rounded sum does not depend on it (a plain
    # sum differed in the last bit between two runs of equal losses).
    return {k: math.fsum(v) / len(v) for k, v in sorted(losses.items())}, out


def assert_resume_is_uninterrupted(job: Path, tmp_path: Path, name: str, first: dict[int, float], ranks: int,
                                   port: int) -> None:
    """The example resumed by Lightning's ``fit(ckpt_path=...)`` from the epoch-end checkpoint the run in
    ``tmp_path/name`` (per-step losses ``first``) wrote after 2 of 4 steps: steps 2 and 3 have its losses and
    the end has its weights, bit for bit."""
    from safetensors.torch import load_file

    resumed, out = _run([str(job), str(tmp_path / f"{name}-resumed"), "--resume",
                         str(tmp_path / name / "epoch=0-step=2.ckpt")], ranks, tmp_path, port)
    assert list(resumed) == [2, 3], out[-3000:]
    assert resumed == {k: first[k] for k in (2, 3)}, (resumed, first)
    ends = [load_file(tmp_path / n / "epoch=1-step=4.ckpt" / "hf" / "model.safetensors")
            for n in (name, f"{name}-resumed")]
    assert ends[0].keys() == ends[1].keys()
    for key, value in ends[0].items():
        assert torch.equal(ends[1][key], value), key


@pytest.mark.slow
def test_lightning_on_cpu_equals_one_process_and_saves_hf(tmp_path: Path) -> None:
    """The example (a LightningModule plus the two documented dsforge lines) on 2 CPU ranks, dp=2 ZeRO-2: the
    loss of every step equals one process's over the same global batch, no rank aborts at exit, the HF
    directory in Lightning's checkpoint loads with from_pretrained and gives the one-process model's logits,
    and Lightning's resume from the epoch-end checkpoint is the uninterrupted run."""
    import transformers

    one = tmp_path / "one.yaml"
    one.write_text(JOB.read_text().replace("gpus_per_node: 2", "gpus_per_node: 1"))
    two, _ = _run([str(JOB), str(tmp_path / "two")], 2, tmp_path, 29741)
    ref, _ = _run([str(one), str(tmp_path / "ref")], 1, tmp_path, 0)
    assert list(two) == [0, 1, 2, 3] == list(ref)
    for step in two:
        assert two[step] == pytest.approx(ref[step], rel=1e-5, abs=1e-6), (step, two, ref)
    assert two[3] != two[0]  # it trained
    assert_resume_is_uninterrupted(JOB, tmp_path, "two", two, 2, 29742)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name in ("two", "ref"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / name / "epoch=1-step=4.ckpt" / "hf"
        )
        with torch.no_grad():
            logits[name] = model(input_ids=tokens).logits
    torch.testing.assert_close(logits["two"], logits["ref"], rtol=1e-4, atol=1e-5)

def _variant(tmp_path: Path, parallel: str) -> Path:
    path = tmp_path / "variant.yaml"
    path.write_text(JOB.read_text().replace("parallel:\n  zero: 2", f"parallel:\n{parallel}"))
    return path


@pytest.mark.parametrize(("parallel", "rule", "key"), [
    ("  zero: 1\n  pp: 2", "DSF702", "parallel.pp=2"),
    ("  zero: 1\n  cp: 2", "DSF703", "parallel.cp=2"),
])
def test_what_lightning_cannot_feed_is_refused_before_start(tmp_path: Path, parallel: str, rule: str,
                                                            key: str) -> None:
    from dsforge.plugins.job import PluginError
    from dsforge.plugins.lightning import prepare_model

    job = _variant(tmp_path, parallel)
    for build in (trainer_kwargs, prepare_model):
        with pytest.raises(PluginError) as err:
            build(job)
        text = str(err.value)
        assert text.startswith(f"{rule} {job}: {key} (at {job}:")
        assert "`dsforge compile`" in text


def _loops(name: str) -> dict:
    """The ``loops`` entry of a checkpoint the example's Lightning 2.6 run wrote (dp=2 ZeRO-2): ``epoch_end``
    from ModelCheckpoint(save_on_train_epoch_end=True) after epoch 0, ``mid_epoch`` from
    every_n_train_steps=1 after step 1."""
    return json.loads((Path(__file__).parent / "fixtures" / f"lightning_loops_{name}.json").read_text())


def test_an_epoch_end_checkpoint_resumes_at_the_next_epochs_start() -> None:
    from dsforge.plugins.lightning_resume import at_epoch_end, finish_epoch

    loops = _loops("epoch_end")
    assert at_epoch_end(loops) and not at_epoch_end(_loops("mid_epoch"))
    finish_epoch(loops)
    fit = loops["fit_loop"]
    assert fit["epoch_progress"]["total"] == {"ready": 1, "started": 1, "processed": 1, "completed": 1}
    assert fit["epoch_progress"]["current"]["completed"] == 1  # current_epoch is 1: the sampler's epoch
    batches = fit["epoch_loop.batch_progress"]
    assert batches["current"] == {"ready": 0, "started": 0, "processed": 0, "completed": 0}
    assert batches["total"]["completed"] == 4 and batches["is_last_batch"] is False
    step = fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]
    assert step["total"]["completed"] == 2 and step["current"]["completed"] == 0
    assert not at_epoch_end(loops)  # a second pass would not finish another epoch
    assert not at_epoch_end({}) and not at_epoch_end({"fit_loop": {"epoch_progress": None}})


def test_a_resume_from_inside_an_epoch_is_refused_not_trained_differently(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    # Lightning calls the strategy's load_checkpoint for fit(ckpt_path=...); from inside an epoch a plain
    # DataLoader restarts at the epoch's first batch, so the run would train on other data
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from dsforge.plugins.job import PluginError

    strategy = trainer_kwargs(JOB)["strategy"]
    monkeypatch.setattr(DeepSpeedStrategy, "load_checkpoint",
                        lambda self, path, weights_only=None: {"loops": _loops("mid_epoch")})
    with pytest.raises(PluginError) as err:
        strategy.load_checkpoint(tmp_path / "epoch=0-step=1.ckpt")
    assert str(err.value).startswith(f"DSF716 {JOB}: resuming through Lightning's ckpt_path")
    assert "not saved at an epoch's end" in str(err.value) and "`dsforge compile`" in str(err.value)
    monkeypatch.setattr(DeepSpeedStrategy, "load_checkpoint",
                        lambda self, path, weights_only=None: {"loops": _loops("epoch_end")})
    loops = strategy.load_checkpoint(tmp_path / "epoch=0-step=2.ckpt")["loops"]
    assert loops["fit_loop"]["epoch_progress"]["total"]["completed"] == 1
    import lightning  # another release's loops may restart differently: refused, not rewritten on trust

    monkeypatch.setattr(lightning, "__version__", "2.7.0")
    with pytest.raises(PluginError) as err:
        strategy.load_checkpoint(tmp_path / "epoch=0-step=2.ckpt")
    assert "measured exact on Lightning 2.6 only, and this is Lightning 2.7.0" in str(err.value)


def test_a_loader_that_differs_from_the_plan_is_named_before_the_first_step() -> None:
    from torch.utils.data import DataLoader, DistributedSampler

    from dsforge.plugins.job import load_job
    from dsforge.plugins.lightning_strategy import check_loader

    job = load_job(JOB)
    data = torch.zeros(16, 4)
    check_loader(job, DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, 1)), (1, 2))
    with pytest.raises(PlanMismatchError) as err:
        check_loader(job, DataLoader(data, batch_size=3, sampler=DistributedSampler(data, 4, 3)), (1, 2))
    text = str(err.value)
    assert ("micro-batch per rank: the DataLoader has batch_size=3, the job file plans 2 "
            "(training.micro_batch at") in text
    assert ("data shards: the sampler splits the data 4 ways (this "
            "rank reads part 3), the job file plans 2") in text


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_lightning_tp2_sequence_parallel_zero1_equals_one_process(tmp_path: Path, ranks: int) -> None:
    """The same example at tp=2 with sequence parallelism and ZeRO-1 on 2 CPU ranks, and at tp=2 x dp=2 on 4
    (prepare_model's rewrite, the strategy's mpu, the sampler over dp): every step's loss and the whole
    gradient of every parameter equal one process's over the same global batch, and the HF directory gathered
    from the slices gives the one-process model's logits."""
    pytest.importorskip("dsforge.plugins.parallel_model")
    import transformers

    from tests.runtime.launcher import free_port

    one = tmp_path / "one.yaml"
    one.write_text(JOB.read_text().replace("gpus_per_node: 2", "gpus_per_node: 1"))
    tp = _variant(tmp_path, "  tp: 2\n  sequence_parallel: true\n  zero: 1")
    tp.write_text(tp.read_text().replace("gpus_per_node: 2", f"gpus_per_node: {ranks}"))
    two, _ = _run([str(tp), str(tmp_path / "tp")], ranks, tmp_path, free_port(), tmp_path / "tp-grads")
    ref, _ = _run([str(one), str(tmp_path / "ref")], 1, tmp_path, 0, tmp_path / "ref-grads")
    # every gradient equals one process's although one process accumulates 4 micro-batches and each of the
    # tp=2 x dp=2 ranks 2: DsforgeStrategy.backward keeps DeepSpeed from dividing Lightning's already divided
    # loss a second time (it measured exactly 2x before)
    assert_gradients_match(tmp_path / "tp-grads", tmp_path / "ref-grads", f"lightning {ranks} ranks")
    if ranks == 2:
        assert_resume_is_uninterrupted(tp, tmp_path, "tp", two, ranks, free_port())
    assert list(two) == [0, 1, 2, 3] == list(ref)
    for step in two:
        assert two[step] == pytest.approx(ref[step], rel=1e-5, abs=1e-6), (step, two, ref)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name in ("tp", "ref"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / name / "epoch=1-step=4.ckpt" / "hf"
        )
        with torch.no_grad():
            logits[name] = model(input_ids=tokens).logits
    torch.testing.assert_close(logits["tp"], logits["ref"], rtol=1e-4, atol=1e-5)
