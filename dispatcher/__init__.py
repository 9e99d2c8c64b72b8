"""Batchyard: a multi-process inference dispatcher for AMX CPUs and GPUs.

``from batchyard import Client, AsyncClient`` is the SDK; errors live in ``batchyard.errors``.
The names are resolved on first use (PEP 562), so a dispatcher or worker process that imports
``batchyard.protocol`` does not also import the client and its threads.
"""

__version__ = "0.2.0"

_LAZY = {"Client": "batchyard.client", "AsyncClient": "batchyard.client",
         "BatchyardError": "batchyard.errors"}
__all__ = ["Client", "AsyncClient", "BatchyardError", "__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'batchyard' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
