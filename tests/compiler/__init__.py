"""The compiler, package by package (frontend, spec, model, plan, deepspeed, rules, estimate, search,
emit)."""
