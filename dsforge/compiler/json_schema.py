"""The JSON Schema of job files, for editors with a YAML language server (`dsforge schema`)."""

from __future__ import annotations

from typing import Any

from dsforge.compiler.schema import JobSpec

SCHEMA_ID = "https://dsforge.dev/schema/job-v1.json"


def _relax(node: Any, top: bool) -> None:
    """Drop `required` below the top level: presets and `extends` may supply any section key."""
    if isinstance(node, dict):
        if not top and "required" in node:
            del node["required"]
        for value in node.values():
            _relax(value, top=False)
    elif isinstance(node, list):
        for item in node:
            _relax(item, top=False)


def job_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) for a version-1 job file."""
    schema = JobSpec.model_json_schema(by_alias=True, mode="validation")
    _relax(schema.get("$defs", {}), top=False)
    schema["required"] = ["version"]
    schema["properties"]["extends"] = {
        "description": "Base job file(s) merged underneath this one (relative path; mappings merge, lists replace).",
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
    }
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = SCHEMA_ID
    schema["title"] = "dsforge job file"
    return schema
