"""dsforge: compile one declarative YAML job file into a checked, explained, runnable DeepSpeed job."""

from dsforge.version import __version__ as __version__


def __getattr__(name: str) -> object:
    """``dsforge.initialize`` loads torch and DeepSpeed on first use only, so ``import dsforge`` stays
    torch-free."""
    if name == "initialize":
        # by name, so that a type check of the torch-free compiler (which imports this package) never reads
        # the runtime
        import importlib

        return importlib.import_module("dsforge.runtime.api").initialize
    raise AttributeError(f"module 'dsforge' has no attribute {name!r}")
