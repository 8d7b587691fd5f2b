"""reshard: convert, merge, split and reshard MindSpore distributed checkpoints without MindSpore.

The package is layered one way: ``formats`` (bytes <-> tensor index) -> ``layout`` (which box of
the full tensor each rank holds) -> ``plan`` (plain-data copy lists) -> ``execute`` (moves bytes)
-> faces (``api``, ``cli``, ``mindspore``).
"""

from reshard.errors import ReshardError

__version__ = "0.1.0"
__all__ = ["ReshardError", "__version__", "auto_transform"]


def __getattr__(name: str) -> object:
    """``reshard.auto_transform`` (``reshard.auto``), imported when first used: the package stays light."""
    if name == "auto_transform":
        import importlib

        return importlib.import_module("reshard.auto").auto_transform
    raise AttributeError(f"module 'reshard' has no attribute {name!r}")
