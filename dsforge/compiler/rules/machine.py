"""DSF612-DSF617: faults of the machine a run meets: a busy job directory, the disk, a damaged checkpoint.

None of these can come from a job file alone (DSF613 compares the job files validated together): `dsforge run`
reports DSF612, DSF614 and DSF617 before any rank starts (dsforge.commands.preflight,
dsforge.runtime.run_lock), a rank reports DSF615 when it resumes (dsforge.runtime.resume_check) and DSF616
when a save runs out of space (dsforge.runtime.disk_space); `dsforge export` reports DSF615 too.
"""

from __future__ import annotations

from dsforge.compiler.rules.registry import report_id

_SRC = "dsforge (docs/runtime.md, 'Faults of the machine')"

report_id("DSF612", "one run per job directory and per checkpoint directory",
          "Two runs in one job directory append to the same train_log.jsonl and write the same checkpoints, "
          "and both report success. `dsforge run` and `dsforge compile --force` hold an OS lock (flock) "
          "beside the job directory, and `dsforge run` one in a checkpoint directory outside it; a second "
          "command is refused naming the holder's pid, host and "
          "start time. A lock whose holder died is free again.",
          _SRC)
report_id("DSF613", "two jobs do not share one checkpoint directory",
          "Two jobs writing one training.checkpoint.dir resume from and write over each other's checkpoints. "
          "`dsforge validate` refuses two job files given together that name the same directory "
          "(dsforge/compiler/shared_checkpoints.py); `dsforge run` refuses a second job on a checkpoint "
          "directory in use (its lock, DSF612) in any case.", _SRC)
report_id("DSF614", "the checkpoint file system holds what the retention needs",
          "A save that finds the disk full loses the interval of training since the previous one. With "
          "training.checkpoint.keep: N, the N complete checkpoints and the one being saved must fit in the "
          "free space at start (explain's `checkpoint on disk`); with keep: all the shortfall is a warning.",
          _SRC)
report_id("DSF615", "a checkpoint's files match its manifest",
          "A flipped byte in a checkpoint loads silently and trains from damaged weights (the loss jumps by "
          "orders of magnitude). Every committed checkpoint carries each file's size and digest (XXH3-128); "
          "a resume and an export check them first and refuse naming the file, or, with "
          "training.checkpoint.if_damaged: fall_back, resume from the newest intact checkpoint.", _SRC)
report_id("DSF616", "a save that runs out of disk space says so",
          "torch.save reports a full disk as `unexpected pos N vs M`; the rank's one line names the "
          "checkpoint, the bytes it needed and the free space, the partial checkpoint is removed and "
          "`latest` stays on the last complete one.", _SRC)
report_id("DSF617", "no stale torch_extensions build lock",
          "torch's JIT build of a DeepSpeed op leaves `<build dir>/lock` when it is killed, and every later "
          "start on the machine waits for it forever; one that no process works beside is refused at start "
          "naming the file to remove.", _SRC)
