"""The rules, their registry and the selection of findings."""
