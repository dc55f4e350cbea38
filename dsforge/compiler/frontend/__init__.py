"""The front end: a job file loaded with line:col, its `extends:` chain, presets, paths, project settings and
inline `# dsforge: ignore[...]` comments, parsed into the typed spec."""
