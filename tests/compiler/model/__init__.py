"""Model facts: resolved model, parameter counts, built-in families."""
