"""Exact solvers (dynamic programming, MILP). Every module in this package registers its searchers on
import."""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
