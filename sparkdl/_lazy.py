"""Package attributes imported on first use (PEP 562).

Executors import sparkdl's task side for every barrier task (the stage's closure refers to it),
and Python runs every parent package's ``__init__`` first. Importing the whole public surface
there would pull in pyspark.ml, pandas and the driver-side launcher on each executor's first
task, about half a second of a cold fit's start-up per worker; lazily, only what is used loads.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, Tuple


def lazy_attributes(package: str, names: Dict[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``names`` maps each attribute to the
    module (absolute) that defines it under the same name; the first access imports it and
    caches the value in the package."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> List[str]:
        return sorted(set(importlib.import_module(package).__dict__) | set(names))

    return __getattr__, __dir__
