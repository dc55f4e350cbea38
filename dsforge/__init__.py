"""dsforge: compile one declarative YAML job file into a checked, explained, runnable DeepSpeed job."""

__version__ = "0.1.0"
