"""`dsforge init`: a commented starter job file for a model preset on a hardware preset.

The layout is the cheapest one (by a fixed order of what each change costs a step: ZeRO-1/2 and
selective recomputation before tensor parallelism, tensor parallelism inside a node before pipeline
stages, offload last) that passes every validate rule and leaves the busiest rank at most 90 % of its
memory (DSF301's warning threshold). It is a starting point that validates clean, not a search for the
fastest layout. Every written key carries its description from dsforge/compiler/spec/schema.py as a
comment, so the file documents itself and stays in step with the schema.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from dsforge.compiler.estimate.memory import estimate_memory
from dsforge.compiler.frontend.parse import LoadedJob, parse_job
from dsforge.compiler.frontend.presets import presets
from dsforge.compiler.frontend.source import SourceMap, load_yaml
from dsforge.compiler.launch_targets import BUILTIN_LAUNCHERS, SINGLE_MACHINE_LAUNCHERS, launch_target_names
from dsforge.compiler.model.params import total_params
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.plan.plan import Plan, build_plan
from dsforge.compiler.rules.memory import WARN_ABOVE
from dsforge.compiler.rules.registry import Context, Rule, checks, run_rules
from dsforge.compiler.spec.schema import JobSpec, ModelSpec
from dsforge.compiler.spec.spec_types import Nested, Section
from dsforge.compiler.validate import check
from dsforge.diagnostics import Diagnostic, Severity

DEFAULT_MODEL = "tiny-llama"
DEFAULT_HARDWARE = "cpu-local"
#: Node counts tried, in order, when none is given (a GPU model too large for one node).
NODE_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128)
#: Where the layout search stops: the busiest rank may use this much of its memory (DSF301 warns above).
MEMORY_TARGET = WARN_ABOVE
DISPLAY = "<dsforge init>"
#: Launch settings only the site knows (rule id -> launch key): init leaves them for the user to fill in.
SITE_KEYS = {"DSF602": "hosts", "DSF603": "master_addr", "DSF605": "image"}

# What each change costs a training step, roughly (the ordering is what matters): ZeRO-3 gathers every
# weight twice per step, full recomputation repeats the forward pass (~+33 %), offload moves optimizer
# states over PCIe.
_ZERO_COST = {0: 0.0, 1: 0.0, 2: 0.25, 3: 1.5}
_RECOMPUTE_COST = {"none": 0.0, "selective": 0.5, "full": 2.5}
_OFFLOAD_COST = {"none": 0.0, "cpu": 6.0}


class InitError(Exception):
    """`dsforge init` cannot write a starter job for these choices; ``code`` is the CLI exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Layout:
    """The choices the starter job makes: degrees, ZeRO stage, recomputation and optimizer offload."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    offload: str = "none"

    @property
    def cost(self) -> float:
        """The ordering key of the search: lower is cheaper per step."""
        return (
            math.log2(self.tp)
            + 1.5 * math.log2(self.pp)
            + 0.5 * math.log2(self.ep)
            + _ZERO_COST[self.zero]
            + _RECOMPUTE_COST[self.recompute]
            + _OFFLOAD_COST[self.offload]
            + (0.25 if self.tp > 1 and not self.sequence_parallel else 0.0)
        )


@dataclass(frozen=True)
class Choices:
    """What the user asked for (after defaults): presets, node count, launcher and job name."""

    model: str = DEFAULT_MODEL
    hardware: str = DEFAULT_HARDWARE
    nodes: int | None = None
    launcher: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class Starter:
    """A written starter job: its text, the data it holds, and what validate says about it."""

    text: str
    data: dict[str, Any]
    layout: Layout
    nodes: int
    diagnostics: list[Diagnostic]
    notes: list[str]


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(1, limit))) + 1)]


def _launcher(choices: Choices, nodes: int) -> str:
    # A single node runs here; several need a scheduler, and slurm needs nothing site-specific to validate.
    return choices.launcher or ("local" if nodes == 1 else "slurm")


def _world(hardware: dict[str, Any], nodes: int) -> int:
    return int(hardware["gpus_per_node"]) * nodes


def _precision(accelerator: dict[str, Any]) -> str:
    return "bf16" if float(accelerator.get("bf16_tflops") or 0) > 0 else "fp16"


def _on_cpu(hardware_name: str, accelerator: dict[str, Any]) -> bool:
    return hardware_name == "cpu-local" or str(accelerator.get("name", "")).lower() == "cpu"


def _batch(layout: Layout, dp: int) -> tuple[int, int]:
    """(global_batch, micro_batch): enough micro-batches to keep a pipeline's bubble small, at least 8."""
    accum = 1 if layout.pp == 1 else 4 * layout.pp  # bubble (p-1)/(m+p-1) < 1/5 (DSF204 warns above 1/4)
    while dp * accum < 8:
        accum *= 2
    return dp * accum, 1


def job_data(choices: Choices, nodes: int, layout: Layout, hardware: dict[str, Any]) -> dict[str, Any]:
    """The starter job as plain data, in the order it is written."""
    accel = hardware["accelerator"]
    cpu = _on_cpu(choices.hardware, accel)
    dp = _world(hardware, nodes) // (layout.tp * layout.pp)
    global_batch, micro = _batch(layout, dp)
    steps = 20 if cpu else 1000  # a CPU run trains in about a minute
    parallel: dict[str, Any] = {"tp": layout.tp, "pp": layout.pp, "dp": "auto", "cp": 1, "ep": layout.ep,
                                "zero": layout.zero, "sequence_parallel": layout.sequence_parallel}
    if layout.pp > 1:
        parallel["pipeline"] = {"schedule": "1f1b", "partition": "parameters"}
    return {
        "version": 1,
        "name": choices.name or f"{choices.model}-{choices.hardware}",
        "model": {"preset": choices.model},
        "hardware": {"preset": choices.hardware, "nodes": nodes},
        "parallel": parallel,
        "training": {
            "global_batch": global_batch, "micro_batch": micro,
            "precision": "fp32" if cpu else _precision(accel), "recompute": layout.recompute,
            "optimizer": {"name": "adamw", "lr": 3.0e-4, "weight_decay": 0.1, "offload": layout.offload},
            "scheduler": {"name": "cosine", "warmup_steps": max(1, steps // 10)},
            "grad_clip": 1.0, "steps": steps, "seed": 1234,
            "data": {"kind": "synthetic"},
            "checkpoint": {"every": 0, "resume": "auto"},
        },
        "launch": {"launcher": _launcher(choices, nodes)},
    }


def _candidates(model: ModelSpec, world: int, gpus_per_node: int, offload: bool) -> list[Layout]:
    """Every layout worth trying, cheapest first (with ``offload``: also those that offload the optimizer)."""
    out: list[Layout] = []
    experts = model.moe.experts if model.moe is not None else 1
    for tp in _powers_of_two(gpus_per_node):
        for pp in _powers_of_two(min(model.layers, world // tp)):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            for ep in [e for e in _powers_of_two(min(experts, dp)) if experts % e == 0 and dp % e == 0]:
                for sp in ([True, False] if tp > 1 else [False]):
                    for zero in ([0] if dp == 1 else [1, 2, 3]):
                        for recompute in _RECOMPUTE_COST:
                            out.append(Layout(tp, pp, ep, zero, sp, recompute))
                    for zero in (2, 3) if offload else ():  # ZeRO-Offload: optimizer states in host memory
                        out.append(Layout(tp, pp, ep, zero, sp, "full", "cpu"))
    return sorted(out, key=lambda c: (c.cost, c.tp * c.pp, c.tp, c.ep, c.zero))


class _Judge:
    """Decides whether a candidate job is clean: no error or warning of any validate rule, memory within
    target."""

    def __init__(self) -> None:
        # Memory is judged by the estimate directly (DSF301's fix search would only slow the search down);
        # the site's launch settings are the user's to fill in, whatever the layout.
        self.rules: list[Rule] = [r for r in checks("validate")
                                  if not r.id.startswith(("DSF3", "DSF9")) and r.id not in SITE_KEYS]
        self.smap = SourceMap(DISPLAY)

    def spec(self, data: dict[str, Any]) -> JobSpec | None:
        """The typed job, or None where the data does not parse."""
        return parse_job(data, self.smap)[0]

    def _plan(self, data: dict[str, Any]) -> Plan | None:
        spec = self.spec(data)
        if spec is None:
            return None
        plan = build_plan(spec)
        return plan if plan.layout_ok and plan.placement is not None and plan.stage_layers else None

    def memory_ok(self, data: dict[str, Any]) -> bool:
        """The busiest rank stays within MEMORY_TARGET (the rules aside)."""
        plan = self._plan(data)
        try:
            return plan is not None and estimate_memory(plan.priced()).utilization <= MEMORY_TARGET
        except ValueError:
            return False

    def fits(self, data: dict[str, Any]) -> bool:
        """Memory within target and no error or warning from any other validate rule."""
        if not self.memory_ok(data):  # first: it rejects most candidates and costs about what the rules do
            return False
        plan = self._plan(data)
        if plan is None:  # memory_ok found one: never taken
            return False
        found = run_rules(Context(plan.spec, plan, self.smap, data), self.rules)
        return not any(d.severity in (Severity.ERROR, Severity.WARNING) for d in found)


def _base(choices: Choices) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chosen presets' data (model, hardware), or InitError naming the known ones."""
    found = []
    for kind, name in (("models", choices.model), ("hardware", choices.hardware)):
        known = presets(kind)
        if name not in known:
            raise InitError(f"unknown {'model' if kind == 'models' else kind} preset {name!r}; use one of: "
                            f"{', '.join(sorted(known))} (`dsforge presets`)")
        found.append(dict(known[name].spec))
    return found[0], found[1]


def _states_floor(spec: JobSpec, world: int) -> float:
    """Bytes per rank no layout goes below without offload: Adam's fp32 master weights, momentum and
    variance (12 bytes a parameter), sharded over every rank as ZeRO-3 at best does (Rajbhandari et al.
    2020 sec. 5); weights, gradients and activations only add to it."""
    return 12 * total_params(resolve_model(spec.model)) / world


def _search(choices: Choices, nodes: int, hardware: dict[str, Any], judge: _Judge,
            offload: bool) -> Layout | None:
    probe = job_data(choices, nodes, Layout(), hardware)
    spec = judge.spec(probe)
    if spec is None:
        return None
    world = _world(hardware, nodes)
    if not offload and _states_floor(spec, world) > MEMORY_TARGET * spec.hardware.accelerator.memory_gb * 1e9:
        return None
    # A degree choice whose lightest variant (sequence parallel, full recomputation, ZeRO-2 or -3) does not
    # fit cannot fit with any heavier one: ruling it out once skips its ~20 variants.
    hopeless: dict[tuple[int, int, int, str], bool] = {}
    for layout in _candidates(spec.model, world, int(hardware["gpus_per_node"]), offload):
        key = (layout.tp, layout.pp, layout.ep, layout.offload)
        if key not in hopeless:
            dp = world // (layout.tp * layout.pp)
            light = [replace(layout, zero=z, recompute="full", sequence_parallel=layout.tp > 1)
                     for z in ((0,) if dp == 1 else (2, 3))]
            hopeless[key] = not any(judge.memory_ok(job_data(choices, nodes, c, hardware)) for c in light)
        if not hopeless[key] and judge.fits(job_data(choices, nodes, layout, hardware)):
            return layout
    return None


def _hardware(choices: Choices) -> dict[str, Any]:
    _, hardware = _base(choices)
    hardware.setdefault("nodes", 1)
    return hardware


def _check_launcher(choices: Choices) -> None:
    name = choices.launcher
    if name is None:
        return
    if name not in BUILTIN_LAUNCHERS and name not in launch_target_names():
        raise InitError(f"unknown launcher {name!r}; use one of: {', '.join(BUILTIN_LAUNCHERS)} "
                        "(or an installed plugin's launch target, `dsforge plugins`)")
    if name in SINGLE_MACHINE_LAUNCHERS and (choices.nodes or 1) > 1:
        raise InitError(f"the {name} launcher starts every rank on this machine; for --nodes {choices.nodes} "
                        "choose slurm, torchrun, deepspeed, kubernetes or accelerate")


def _check_name(choices: Choices, hardware: dict[str, Any], judge: _Judge) -> None:
    """Refuse a name the rules refuse whatever the layout (so the search does not blame the layout)."""
    if choices.name is None:
        return
    if not choices.name:
        raise InitError("--name must not be empty")
    data = job_data(choices, 1, Layout(), hardware)
    spec = judge.spec(data)
    plan = build_plan(spec) if spec is not None else None
    found = run_rules(Context(spec, plan, judge.smap, data), judge.rules) if spec is not None and plan else []
    for d in found:
        if d.path[:1] == ("name",) and d.severity is Severity.ERROR:
            raise InitError(f"--name {choices.name!r}: {d.message} ({d.fix})")


def starter(choices: Choices) -> Starter:
    """The starter job for ``choices``: the cheapest clean layout, on the fewest nodes when none is given.

    Raises InitError for an unknown preset or launcher (code 2) and when no layout fits (code 1, naming
    a node count that does where there is one).
    """
    hardware = _hardware(choices)
    _check_launcher(choices)
    judge = _Judge()
    _check_name(choices, hardware, judge)
    cpu = _on_cpu(choices.hardware, hardware["accelerator"])
    counts = [choices.nodes] if choices.nodes is not None else [1] if cpu else list(NODE_COUNTS)
    # Without a node count, more nodes beat offloading the optimizer (CPU Adam is the slowest step there is).
    for offload in (False, True):
        for nodes in counts:
            layout = _search(choices, nodes, hardware, judge, offload)
            if layout is not None:
                return _finish(choices, nodes, layout, hardware)
    hint = ""
    if choices.nodes is not None:
        more = next(
            (n for n in NODE_COUNTS if n > choices.nodes and _search(choices, n, hardware, judge, True)), None
        )
        hint = f"; {more} nodes fit (--nodes {more})" if more else ""
    elif cpu:
        hint = "; a tiny-* model preset fits, or choose a GPU hardware preset"
    accel = hardware["accelerator"]
    where = (f"{counts[-1]} node(s) of {choices.hardware} ({hardware['gpus_per_node']} x "
             f"{accel['memory_gb']} GB per node)")
    raise InitError(f"no layout of {choices.model} fits {where} within {MEMORY_TARGET:.0%} of each rank's "
                    f"memory and passes every check{hint}", code=1)


def _validated(text: str) -> list[Diagnostic]:
    raw, smap = load_yaml(text, DISPLAY)
    spec, diags = parse_job(raw, smap)
    return check(LoadedJob(spec, smap, raw))[1] if spec is not None else diags


def _finish(choices: Choices, nodes: int, layout: Layout, hardware: dict[str, Any]) -> Starter:
    data = job_data(choices, nodes, layout, hardware)
    hardware_note = presets("hardware")[choices.hardware].description
    model_note = presets("models")[choices.model].description
    text = render(data, hardware_note, model_note)
    diags = _validated(text)
    # What only the site knows comes back from the rules themselves, so init never restates their conditions.
    site = [d for d in diags if d.rule in SITE_KEYS]
    if site:
        todo = {SITE_KEYS[d.rule]: f"{d.fix} ({d.rule})" for d in site}
        text = render(data, hardware_note, model_note, todo)
    return Starter(text, data, layout, nodes, diags, [f"{d.rule}: {d.message}; {d.fix}" for d in site])


# ---- rendering: block YAML with the schema's description above every key ----

def _field(section: type[Section], key: str) -> Any:
    return next((f for f in section.model_fields.values() if f.key == key), None)


#: Characters YAML reads as line breaks (they would also shift the line numbers of every later key).
_BREAKS = set("\n\r\x85\u2028\u2029")


def _scalar(value: Any) -> str:
    """One value as YAML reads it back (PyYAML quotes a string that would read as a number, a bool, ...)."""
    # Plain or quoted as PyYAML chooses, unless that spans lines or does not read back (YAML folds NEL,
    # LS and PS): then double-quoted with every unusual character escaped, on one line.
    for style, readable in ((None, True), ('"', False)):
        text = yaml.safe_dump(value, default_flow_style=True, default_style=style, allow_unicode=readable,
                              width=2**30).removesuffix("\n").removesuffix("\n...").strip()
        if not set(text) & _BREAKS and yaml.safe_load(f"k: {text}") == {"k": value}:
            break
    return text


def _lines(section: type[Section], data: dict[str, Any], indent: int, notes: dict[str, str]) -> Iterator[str]:
    pad = " " * indent
    for key, value in data.items():
        f = _field(section, key)
        if f is not None and f.description:
            yield f"{pad}# {' '.join(f.description.split())}"
        if isinstance(value, dict):
            yield f"{pad}{key}:"
            inner = f.kind.section if f is not None and isinstance(f.kind, Nested) else Section
            yield from _lines(inner, value, indent + 2, {})
        else:
            tail = f"  # {notes[key]}" if key in notes else ""
            yield f"{pad}{key}: {_scalar(value)}{tail}"


def _todo_lines(section: type[Section], todo: dict[str, str], indent: int) -> Iterator[str]:
    """Keys the user must add, commented out (so the file still says what it holds) with why."""
    pad = " " * indent
    for key, why in todo.items():
        f = _field(section, key)
        if f is not None and f.description:
            yield f"{pad}# {' '.join(f.description.split())}"
        yield f"{pad}# {key}: ...   <- TODO: {why}, then uncomment"


def render(data: dict[str, Any], hardware_note: str = "", model_note: str = "",
           todo: dict[str, str] | None = None) -> str:
    """The job data as a commented YAML job file (the comments are YAML comments: the data is unchanged).

    Every key gets its schema description on the line above it; ``todo`` lists launch keys left for the
    user (written commented out); the notes follow the model and hardware presets' values.
    """
    out = ["# dsforge job file (format version 1), written by `dsforge init`.",
           ("# Check it: `dsforge validate FILE`; what it costs: "
            "`dsforge explain FILE`; train it: `dsforge run FILE`."),
           ("# The layout is the cheapest that validates clean "
            "here; every key: docs/job-file.md; completion in an"),
           "# editor: docs/editor.md (`dsforge schema`).", ""]
    for key, value in data.items():
        f = _field(JobSpec, key)
        if isinstance(value, dict):
            assert f is not None and isinstance(f.kind, Nested)
            out += [f"# {' '.join(f.description.split())}", f"{key}:"]
            note = {"model": model_note, "hardware": hardware_note}.get(key, "")
            out += list(_lines(f.kind.section, value, 2, {"preset": note} if note else {}))
            if key == "launch" and todo:
                out += list(_todo_lines(f.kind.section, todo, 2))
            out.append("")
        else:
            out += list(_lines(JobSpec, {key: value}, 0, {}))
            if key == "name":
                out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def write_starter(text: str, output: str | None, force: bool) -> str | None:
    """Write ``text`` to ``output`` (None or `-`: the caller prints it) and return where it went.

    An existing file is kept unless ``force``: a starter never replaces a job someone has edited.
    """
    if output is None or output == "-":
        return None
    path = Path(output)
    if path.is_dir():
        raise InitError(f"{output} is a directory; name the job file to write")
    if path.exists() and not force:
        raise InitError(f"{output} exists; pass --force to overwrite it or choose another -o")
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise InitError(f"cannot write {output}: {exc.strerror or exc}") from None
    return output


def command(model: str | None, hardware: str | None, nodes: int | None, launcher: str | None,
            name: str | None, output: str | None, force: bool, interactive: bool) -> None:
    """`dsforge init`: ask for what is missing at a terminal, write or print the starter, say what it
    chose."""
    import sys

    import click

    if interactive:
        model = model or click.prompt("Model preset", type=click.Choice(list(presets("models"))),
                                      default=DEFAULT_MODEL)
        hardware = hardware or click.prompt("Hardware preset", type=click.Choice(list(presets("hardware"))),
                                            default=DEFAULT_HARDWARE)
    try:
        job = starter(Choices(model or DEFAULT_MODEL, hardware or DEFAULT_HARDWARE,
                              nodes, launcher, name))
        where = write_starter(job.text, output, force)
    except InitError as exc:
        click.echo(f"dsforge init: {exc}", err=True)
        sys.exit(exc.code)
    if where is None:
        click.echo(job.text, nl=False)
    lay = job.layout
    click.echo(f"dsforge init: {'wrote ' + where if where else 'job file above'}: "
               f"{job.data['model']['preset']} on {job.nodes} node(s) of {job.data['hardware']['preset']}, "
               f"tp={lay.tp} pp={lay.pp} ep={lay.ep} zero={lay.zero} recompute={lay.recompute} "
               f"offload={lay.offload}", err=True)
    for note in job.notes:
        click.echo(f"dsforge init: note: {note}", err=True)
