"""From a job file on disk to a typed, preset-resolved JobSpec, or diagnostics that say why not."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from dsforge.compiler.extends import deep_merge, load_document
from dsforge.compiler.presets import presets
from dsforge.compiler.schema import JobSpec, ModelSpec
from dsforge.compiler.source import SourceMap
from dsforge.diagnostics import Diagnostic, InputError, Severity, dotted

_PRESET_SECTIONS = {"model": "models", "hardware": "hardware"}


@dataclass(frozen=True)
class LoadedJob:
    """A parsed job: the typed spec, where each key was written, and the raw merged data."""

    spec: JobSpec
    source: SourceMap
    raw: dict[str, Any]


def suggest(word: str, options: list[str]) -> str:
    """A " did you mean `x`?" suffix when a close match exists, else ""."""
    import difflib  # only needed when something is misspelled; keeps start-up lean

    match = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f"; did you mean `{match[0]}`?" if match else ""


def _expand_presets(raw: dict[str, Any], smap: SourceMap) -> tuple[dict[str, Any], list[Diagnostic]]:
    diags: list[Diagnostic] = []
    out = dict(raw)
    for section, kind in _PRESET_SECTIONS.items():
        body = raw.get(section)
        if not isinstance(body, dict) or "preset" not in body:
            continue
        name = body["preset"]
        known = presets(kind)
        if not isinstance(name, str) or name not in known:
            path = (section, "preset")
            names = sorted(known)
            diags.append(Diagnostic(
                "DSF025", Severity.ERROR, f"unknown {section} preset {name!r}{suggest(str(name), names)}",
                smap.locate(path, value=True), f"use one of: {', '.join(names)} (`dsforge presets`)", path))
            continue
        out[section] = deep_merge(known[name].spec, body)
    return out, diags


def _fields(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def _model_at(path: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the mapping at ``path`` (to list its keys in a suggestion)."""
    model: Any = JobSpec
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return None
        model = _unwrap(field.annotation)
        if model is None:
            return None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _unwrap(arg)
        if found is not None:
            return found
    return None


def _schema_diagnostic(err: dict[str, Any], smap: SourceMap) -> Diagnostic:
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
    path = tuple(p for p in loc)
    where = dotted(path)
    kind = err["type"]
    if kind == "extra_forbidden":
        key = str(path[-1])
        owner = _model_at(path[:-1])
        options = _fields(owner) if owner else []
        hint = suggest(key, options)
        section = dotted(path[:-1]) or "the top level"
        return Diagnostic("DSF020", Severity.ERROR, f"unknown key `{key}` in {section}{hint}",
                          smap.locate(path), f"remove it, or use one of: {', '.join(options)}" if options
                          else "remove it", path)
    if kind == "missing":
        section, key = path[:-1], path[-1]
        preset_hint = " or choose a preset that supplies it" if section and section[0] in _PRESET_SECTIONS else ""
        return Diagnostic("DSF024", Severity.ERROR, f"required key `{where}` is missing",
                          smap.locate(section), f"add `{key}:`{preset_hint}", path)
    value = err.get("input")
    shown = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    msg = err["msg"].replace("Input should be", "must be").replace("String should", "must")
    msg = msg[0].lower() + msg[1:]
    if kind == "literal_error":
        expected = err.get("ctx", {}).get("expected", "")
        options = [o.strip().strip("'") for o in expected.replace(" or ", ", ").split(",") if o.strip()]
        hint = suggest(str(value), options)
        return Diagnostic("DSF023", Severity.ERROR, f"`{where}` is {shown}: {msg}{hint}",
                          smap.locate(path, value=True), f"use one of: {', '.join(options)}", path)
    if kind in {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "degree",
                "string_too_short", "string_pattern_mismatch"}:
        return Diagnostic("DSF022", Severity.ERROR, f"`{where}` is {shown}: {msg}",
                          smap.locate(path, value=True), f"change `{where}`: it {msg}", path)
    return Diagnostic("DSF021", Severity.ERROR, f"`{where}` has the wrong type ({shown}): {msg}",
                      smap.locate(path, value=True), f"give `{where}` a value of the expected type", path)


def _fill_defaults(spec: JobSpec) -> JobSpec:
    """Fill model values that follow from others (kv_heads = heads, ffn = 4h, MLP type by arch)."""
    m: ModelSpec = spec.model
    gated = m.arch in {"llama", "mixtral"}
    update: dict[str, Any] = {
        "kv_heads": m.kv_heads or m.heads,
        "ffn_hidden": m.ffn_hidden or 4 * m.hidden,
        "activation": m.activation or ("swiglu" if gated else "gelu"),
        "position": m.position or ("rope" if gated else "learned"),
    }
    if m.moe is not None and m.moe.ffn_hidden is None:
        update["moe"] = m.moe.model_copy(update={"ffn_hidden": update["ffn_hidden"]})
    return spec.model_copy(update={"model": m.model_copy(update=update)})


def parse_job(raw: dict[str, Any], smap: SourceMap) -> tuple[JobSpec | None, list[Diagnostic]]:
    """Validate merged job data against the schema; returns the spec or the schema findings."""
    data, diags = _expand_presets(raw, smap)
    if diags:
        return None, diags
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        found = [_schema_diagnostic(e, smap) for e in exc.errors(include_url=False)]
        return None, sorted(set(found), key=lambda d: (d.location.line, d.location.column, d.rule))
    return _fill_defaults(spec), []


def load_job(path: str | Path) -> tuple[LoadedJob | None, list[Diagnostic]]:
    """Load, merge and validate a job file; raises InputError when the file is unusable."""
    raw, smap = load_document(path)
    spec, diags = parse_job(raw, smap)
    if spec is None:
        return None, diags
    return LoadedJob(spec, smap, raw), []


__all__ = ["LoadedJob", "InputError", "load_job", "parse_job", "suggest"]
