"""The one way a module that a login node imports reaches code that imports torch: by name, when it runs.

Modules import at the top. Those that ``hpcdl`` imports to parse flags, check a config, write an sbatch
script or plan a run (the CLI, configs, launch, plan, the benchmark and backend tables) never import torch,
not even inside a function: where they need code that does, they name it here, as ``"module:attribute"``,
and it is imported when called. tests/test_imports.py reads these names as edges of the import graph, so
a cycle through one is found like any other, and checks that torch stays out of the login node's reach.
"""

from __future__ import annotations

import importlib

__all__ = ["deferred"]


def deferred(target: str):
    """``"package.module:attribute"`` (or ``"package.module"``), imported now."""
    module, _, attribute = target.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attribute) if attribute else loaded
