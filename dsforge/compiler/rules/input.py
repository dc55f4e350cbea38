"""The ids of the input stage (DSF0xx): the loader, `extends:` and the schema report them, not check
functions.

A loader error (DSF001-DSF010) makes the file unusable (exit code 2); a schema error (DSF020-DSF025)
stops the checks of that file (exit code 1). DSF026 reports a suppression that cannot apply.
"""

from __future__ import annotations

from dsforge.compiler.rules.registry import report_id
from dsforge.diagnostics import Severity

_YAML = "YAML 1.1 (yaml.org/spec/1.1); PyYAML"
report_id("DSF001", "the job file can be read",
          "A path that does not exist, a directory, a file without read permission, or anything that is not "
          "a regular file (a FIFO, a device such as /dev/zero, a socket: refused from fstat, before a byte "
          "is read; `-` reads a pipe on standard input).", "dsforge", exit_code=2)
report_id("DSF002", "the job file is UTF-8",
          "YAML is Unicode text; bytes that are not UTF-8 (a Latin-1 editor, a UTF-16 export) are reported "
          "at the line and column of the first bad byte instead of being guessed.", _YAML, exit_code=2)
report_id("DSF003", "indentation uses spaces",
          "YAML forbids tabs in indentation; PyYAML's own message for them is obscure, so the tab's position "
          "is named directly.", _YAML + " sec. 5.5", exit_code=2)
report_id("DSF004", "the file is valid YAML",
          "A syntax error (unclosed bracket, bad indentation, a control character) at the position the "
          "parser stopped.", _YAML, exit_code=2)
report_id("DSF005", "no key appears twice in one mapping",
          "YAML parsers silently keep the last of two equal keys, so a job would run with a value its author "
          "did not see; both lines are named.", _YAML + " sec. 3.2.1.3 (keys are unique)", exit_code=2)
report_id("DSF006", "only plain data: no tags, no complex keys",
          "Tags such as !!python/object construct arbitrary objects on load; a job file is configuration and "
          "holds only mappings, lists, strings, numbers, booleans and null. `<<` must merge a mapping. A "
          "core tag whose text does not fit it (`!!int abc`, "
          "`!!bool maybe`, `!!float ''`) is reported at its line.",
          _YAML + "; CVE-2017-18342 (PyYAML full_load)", exit_code=2)
report_id("DSF007", "the document stays small when aliases are expanded",
          "Aliases nested inside aliases expand exponentially (\"billion laughs\") and a recursive alias "
          "never ends; sizes are measured on the alias graph before anything is built, so the check is fast. "
          "A file over 2 MiB (its size read before it is) and an integer literal over 300 characters (Python "
          "refuses 4,301 digits; past 309 a number no longer fits a float) are refused too.",
          "CWE-776 (unrestricted recursive entity references)", exit_code=2)
report_id("DSF008", "the file is not empty",
          "An empty or comment-only file is almost always a wrong path or an unsaved editor buffer.",
          "dsforge", exit_code=2)
report_id("DSF009", "the top level is a mapping of sections",
          "A job file maps section names (model, hardware, parallel, ...) to their keys.", "dsforge",
          exit_code=2)
report_id("DSF010", "`extends:` names existing files without a cycle",
          "Base files are merged underneath the including file; a missing base, a cycle or a chain deeper "
          "than 16 files is reported with the whole chain; so is a name no file can have (a NUL byte, over "
          "4,096 characters) or one that names a directory, a FIFO or a device.", "dsforge", exit_code=2)
report_id("DSF020", "every key is known", "A misspelt key would otherwise be ignored; the message suggests "
          "the closest valid key and lists the section's keys.", "dsforge job-file schema")
report_id("DSF021", "every value has the right type",
          "A string where a number belongs (`global_batch: \"64\"`), a number where a section belongs.",
          "dsforge job-file schema")
report_id("DSF022", "every value is within its range",
          "Degrees and sizes >= 1, ZeRO stage 0-3, learning rate > 0, fixed-length lists complete.",
          "dsforge job-file schema")
report_id("DSF023", "every choice is one of its allowed values",
          "Precision, schedules, optimizer names and other choices; a near miss gets a suggestion.",
          "dsforge job-file schema")
report_id("DSF024", "required keys are present",
          "Model shape keys may come from a model preset and hardware keys from a hardware preset; without "
          "one, they must be written. Missing keys of one section are reported together.",
          "dsforge job-file schema")
report_id("DSF025", "presets exist", "An unknown model or hardware preset name, with the closest known one.",
          "dsforge presets (`dsforge presets`)")
report_id("DSF026", "suppressions name rules that exist and may be silenced",
          "An inline `# dsforge: ignore[...]` comment, `--select`/`--ignore` or a `[tool.dsforge]` table "
          "names a rule id that dsforge does not know (a typo would silence nothing), or asks to silence an "
          "error that would stop the job from starting; such an error stays reported.",
          "dsforge (docs/rules.md, CI section " "of README.md)", severity=Severity.WARNING)
report_id("DSF027", "the project's dsforge settings can be read",
          "A `dsforge.toml`, or a `pyproject.toml` with a `[tool.dsforge]` table, in the job file's "
          "directory or above it sets select, ignore and strict for every job below it; one that is not "
          "valid TOML or has an unknown key or a wrong type is reported instead of being half-applied.",
          "dsforge " "(dsforge/compiler/frontend/project_config.py)", exit_code=2)
