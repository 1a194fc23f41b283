"""sparkdl's version, and the versions of what a run depends on (recorded with its results)."""

from __future__ import annotations

import platform
from typing import Dict

__version__ = "0.1.0"


def versions(pyspark_version: str) -> Dict[str, str]:
    """sparkdl's, torch's, PySpark's (the driver's, as given), Petastorm's, pyarrow's and Python's."""
    import pyarrow
    import torch

    try:
        import petastorm

        petastorm_version = petastorm.__version__
    except ImportError:
        petastorm_version = "not installed"
    return {
        "sparkdl": __version__,
        "torch": torch.__version__,
        "pyspark": pyspark_version,
        "petastorm": petastorm_version,
        "pyarrow": pyarrow.__version__,
        "python": platform.python_version(),
    }
