"""The layout search."""
