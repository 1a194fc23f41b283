"""The connectors' import path of earlier releases: ``import connectors`` is ``sparkdl.connectors``.

Kept for one release so jobs written against it run unchanged; new code imports
``from sparkdl import connectors``. Each old submodule (``connectors.delta``...) is the new one.
"""

import sys
import warnings

from sparkdl import connectors as _connectors
from sparkdl.connectors import DeltaSource, ParquetSource, Source, SparkTable, base, delta, parquet, spark_table

for _name, _module in {"base": base, "delta": delta, "parquet": parquet, "spark_table": spark_table}.items():
    sys.modules[f"{__name__}.{_name}"] = _module

warnings.warn(
    "the top-level 'connectors' package is now sparkdl.connectors: 'from sparkdl import connectors' "
    "(the old import path goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = list(_connectors.__all__)
