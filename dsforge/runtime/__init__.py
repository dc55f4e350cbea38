"""The runtime: process groups, module rewrites, pipeline stages and engine start-up (imports torch)."""
