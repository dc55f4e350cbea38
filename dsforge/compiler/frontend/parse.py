"""From a job file on disk to a typed, preset-resolved JobSpec, or diagnostics that say why not."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsforge.compiler.frontend.extends import deep_merge, load_document
from dsforge.compiler.frontend.job_paths import resolve_job_paths
from dsforge.compiler.frontend.preset_files import is_preset_file, load_preset_file
from dsforge.compiler.frontend.presets import presets
from dsforge.compiler.frontend.pretrained import expand_pretrained
from dsforge.compiler.frontend.schema_errors import schema_diagnostics, suggest
from dsforge.compiler.frontend.source import SourceMap
from dsforge.compiler.model.resolved import resolve_model
from dsforge.compiler.spec.schema import JobSpec, ModelSpec
from dsforge.compiler.spec.spec_types import SpecError
from dsforge.diagnostics import Diagnostic, InputError, Severity

_PRESET_SECTIONS = {"model": "models", "hardware": "hardware"}


@dataclass(frozen=True)
class LoadedJob:
    """A parsed job: the typed spec, where each key was written, and the raw merged data."""

    spec: JobSpec
    source: SourceMap
    raw: dict[str, Any]


def _expand_presets(raw: dict[str, Any], smap: SourceMap) -> tuple[dict[str, Any], list[Diagnostic]]:
    diags: list[Diagnostic] = []
    out = dict(raw)
    for section, kind in _PRESET_SECTIONS.items():
        body = raw.get(section)
        if not isinstance(body, dict) or "preset" not in body:
            continue
        name = body["preset"]
        if kind == "hardware" and is_preset_file(name):  # `hardware.preset: ./calibrated.yaml`
            keys, absolute, found = load_preset_file(name, smap)
            diags += found
            if keys is not None:
                out[section] = deep_merge(keys, {**body, "preset": absolute})
            continue
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


def _fill_defaults(spec: JobSpec) -> JobSpec:
    """Write the model values that follow from others (``resolve_model``) into the spec, so plan.json states
    them."""
    m: ModelSpec = spec.model
    r = resolve_model(m)
    update: dict[str, Any] = {"kv_heads": r.kv_heads, "ffn_hidden": r.ffn_hidden, "activation": r.activation,
                              "position": r.position}
    if m.moe is not None and r.moe is not None and m.moe.ffn_hidden is None:
        update["moe"] = m.moe.model_copy(update={"ffn_hidden": r.moe.ffn_hidden})
    filled: JobSpec = spec.model_copy(update={"model": m.model_copy(update=update)})
    return filled


def parse_job(raw: dict[str, Any], smap: SourceMap) -> tuple[JobSpec | None, list[Diagnostic]]:
    """Validate merged job data against the schema; returns the spec or the schema findings."""
    data, diags = _expand_presets(raw, smap)
    if diags:
        return None, diags
    data, diags = expand_pretrained(data, raw, smap)  # after presets: a preset value may contradict
                                                      # config.json
    if diags:
        return None, diags
    try:
        spec = JobSpec.model_validate(data)
    except SpecError as exc:
        return None, schema_diagnostics(exc.issues, smap)
    return _fill_defaults(spec), []


def load_job(path: str | Path) -> tuple[LoadedJob | None, list[Diagnostic]]:
    """Load, merge and validate a job file, its relative paths made absolute against the job file's directory;
    raises InputError when the file is unusable."""
    raw, smap = load_document(path)
    spec, diags = parse_job(raw, smap)
    if spec is None:
        return None, diags
    return LoadedJob(resolve_job_paths(spec, raw, smap), smap, raw), []


__all__ = ["InputError", "LoadedJob", "load_job", "parse_job", "suggest"]
