"""The version of dsforge (a module of its own, so that the compiler reads it without the package's lazy
hooks)."""

__version__ = "0.2.0"
