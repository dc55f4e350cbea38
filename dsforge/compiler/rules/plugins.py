"""DSF701: installed plugins that failed to load.

Registered whether or not any plugin failed, so the rule set, and docs/rules.md generated from it, do not
depend on the installation.
"""

from __future__ import annotations

from collections.abc import Iterator

from dsforge import extensions
from dsforge.compiler.rules.registry import Context, Finding, report_id, rule
from dsforge.diagnostics import Severity


@rule("DSF701", "an installed dsforge plugin failed to load", severity=Severity.WARNING,
      source="dsforge/extensions.py")
def _broken_plugins(ctx: Context) -> Iterator[Finding]:
    """A plugin that fails to load is skipped: its presets, rules, policies or launchers are missing.

    Reported with every job so a broken installation does not pass unnoticed (`dsforge plugins`
    lists every plugin and its state).
    """
    for rec in extensions.failures():
        yield Finding(f"plugin {rec.entry.name!r} from {rec.entry.label} failed to load and was skipped: "
                      f"{rec.error}", "fix or uninstall the plugin (`dsforge plugins` lists every plugin)")


_TRAINERS = "dsforge/plugins/parallel_model.py"
report_id("DSF702", "a trainer plugin cannot run pipeline parallelism",
          "Raised by the HF Trainer, Accelerate and Lightning plugins before start when parallel.pp > 1: a "
          "trainer runs one forward and backward per micro-batch over the whole module, and no trainer "
          "drives DeepSpeed's pipeline engine; `dsforge compile` and its launcher run the job.", _TRAINERS)
report_id("DSF703", "a trainer plugin cannot feed context parallelism",
          "Raised before start when parallel.cp > 1: the trainer's collator gives every rank whole sequences "
          "and its loss averages each rank's own tokens, while context parallelism needs each rank's slice, "
          "its global positions and a loss over the whole micro-batch; `dsforge compile` runs the job.",
          _TRAINERS)
report_id("DSF704", "a trainer plugin cannot run expert parallelism",
          "Raised before start when parallel.ep > 1: the trainer's optimizer puts the expert parameters in "
          "the dense group, while they must be reduced over their "
          "expert-data-parallel group; `dsforge compile` runs the job.",
          _TRAINERS)
report_id("DSF705", "the trainer's deepspeed.initialize gets no mpu, so tensor parallelism is refused",
          "Raised by dsforge.plugins.parallel_model.refuse_without_mpu when parallel.tp > 1, for a trainer "
          "whose deepspeed.initialize receives no mpu by any documented way: DeepSpeed would average the TP "
          "ranks' slices as replicas; dsforge patches no trainer code. No built-in plugin raises it now: the "
          "HF Trainer and (since 0.2.0) Accelerate run tp > 1 through DeepSpeed's tensor_parallel section "
          "(parallel_model.autotp_config; DSF706, DSF707 and DSF708 refuse what that cannot run). "
          "dsforge.plugins.parallel_model.mpu(job) serves a script that calls deepspeed.initialize itself.",
          _TRAINERS)
report_id("DSF706", "DeepSpeed's own tensor-parallel groups would not be the plan's",
          "Raised by the HF Trainer and Accelerate plugins before start when parallel.tp > 1 and the plan's "
          "tp or dp groups are not the ones DeepSpeed builds from tensor_parallel.autotp_size (neither "
          "passes an mpu, so DeepSpeed's engine makes a (dp, tp) mesh with TP groups on consecutive ranks): "
          "the model would be reduced over other ranks than it is split across. Keep tp the fastest-varying "
          "axis of parallel.order, followed by dp, or run the job with `dsforge compile`.",
          _TRAINERS)
report_id("DSF707", "ZeRO-3 with tensor parallelism through the HF Trainer is refused",
          "Raised by the HF Trainer plugin before start when parallel.tp > 1 and parallel.zero is 3: "
          "with the tensor_parallel section in HF's DeepSpeed config, transformers' from_pretrained "
          "refuses the load under zero.Init (its weight conversions are not implemented for DeepSpeed "
          "TP), and no exact run of the rank's shard under ZeRO-3 with that section was seen; ZeRO-1 "
          "and ZeRO-2 with tp were tested equal to one process (ZeRO-3 at tp 1 too). Use zero 1 or 2, or "
          "run the job with `dsforge compile`. Accelerate gets the same refusal (its zero3_init_flag builds "
          "the model under the same HfDeepSpeedConfig; not run through Accelerate).", _TRAINERS)
report_id("DSF708", "Accelerate's own ParallelismConfig next to the job's plan is refused",
          "Raised by dsforge.plugins.accelerate.accelerator when the Accelerator has a ParallelismConfig "
          "with a size above 1 (tp_size, sp_size, cp_size, dp_shard_size, dp_replicate_size; passed in, or "
          "built from accelerate's PARALLELISM_CONFIG_* environment): accelerate would split the model or "
          "the data by its own device mesh (transformers' tp_plan, Ulysses sequence parallelism) next to the"
          " job's plan. Set the degrees in the job's parallel section; at tp > 1 the plugin's DeepSpeed "
          "config carries tensor_parallel.autotp_size, and no ParallelismConfig is needed.",
          "dsforge/plugins/accelerate.py")
report_id("DSF716", "Lightning's resume from a checkpoint not saved at an epoch's end is refused",
          "Raised by DsforgeStrategy.load_checkpoint when the checkpoint's loop state is not the one saved "
          "at an epoch's end (ModelCheckpoint(save_on_train_epoch_end=True)): from inside an epoch "
          "(every_n_train_steps, even at the epoch's last batch) Lightning restarts a DataLoader that does "
          "not keep its own position at the epoch's first batch, so the run would see other data than the "
          "uninterrupted one. Epoch-end checkpoints resume exactly (the loop state is set to the next "
          "epoch's start), on the Lightning release that was measured (2.6); another release is refused. "
          "Resume from an epoch-end checkpoint, start a new run from the checkpoint's plain "
          "HF directory as model.pretrained, or resume under `dsforge compile`.",
          "dsforge/plugins/lightning_strategy.py")
