"""The renderings of a diagnostics list."""
