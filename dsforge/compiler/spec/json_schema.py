"""The JSON Schema of job files, for editors with a YAML language server (`dsforge schema`).

It is written in draft-07, the dialect yaml-language-server (and so VS Code's YAML extension)
implements; 2020-12 keywords such as `prefixItems` would be ignored there and let wrong tuples pass.
"""

from __future__ import annotations

from typing import Any

from dsforge.compiler.spec.schema import JobSpec

SCHEMA_ID = "https://dsforge.dev/schema/job-v1.json"
DRAFT_07 = "http://json-schema.org/draft-07/schema#"

EXTENDS = {
    "description": "Base job file(s) merged underneath this one "
                   "(relative path; mappings merge, lists replace).",
    "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
}


def spec_schema() -> dict[str, Any]:
    """The schema as declared: every section's own required keys kept (what docs/job-file.md shows)."""
    schema = JobSpec.model_json_schema()
    schema["properties"]["extends"] = dict(EXTENDS)
    return schema


def job_schema() -> dict[str, Any]:
    """JSON Schema (draft-07) for a version-1 job file."""
    schema = spec_schema()
    for section in schema["definitions"].values():  # presets and `extends` may supply any section key
        section.pop("required", None)
    schema["required"] = ["version"]
    return {"$schema": DRAFT_07, "$id": SCHEMA_ID,
            "title": "dsforge job file", **schema}
