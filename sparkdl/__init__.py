"""sparkdl: train PyTorch models across a Spark cluster, on Parquet streamed through Petastorm.

Public surface::

    sparkdl.TorchEstimator / sparkdl.TorchModel   Spark ML estimator and model
    sparkdl.run                                    custom training loops on barrier tasks
    sparkdl.AllReduce, ParameterServer, ...        strategies
    sparkdl.TrainContext                           what a custom loop receives
    sparkdl.TrainingError, ...                     errors
"""

__version__ = "0.1.0"

from sparkdl.api import run
from sparkdl.context import TrainContext
from sparkdl.data.cache import clear_cache
from sparkdl.errors import (
    ConfigError,
    DataError,
    InsufficientSlotsError,
    NonFiniteLossError,
    SparkdlError,
    TrainingError,
)
from sparkdl.estimator import TorchEstimator, TorchModel
from sparkdl.strategies import AllReduce, ElasticAveraging, ModelAveraging, ParameterServer, Strategy

__all__ = [
    "AllReduce",
    "ConfigError",
    "DataError",
    "ElasticAveraging",
    "InsufficientSlotsError",
    "ModelAveraging",
    "NonFiniteLossError",
    "ParameterServer",
    "SparkdlError",
    "Strategy",
    "TorchEstimator",
    "TorchModel",
    "TrainContext",
    "TrainingError",
    "clear_cache",
    "run",
]
