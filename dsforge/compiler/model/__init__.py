"""Model facts: the resolved model, parameter counts, the built-in families and the rewrite policies."""
