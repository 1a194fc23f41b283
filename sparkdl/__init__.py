"""sparkdl: train PyTorch models across a Spark cluster, on Parquet streamed through Petastorm.

Public surface::

    sparkdl.TorchEstimator / sparkdl.TorchModel   Spark ML estimator and model
    sparkdl.run                                    custom training loops on barrier tasks
    sparkdl.launch, report, shard_dataset          an existing script or function, unchanged, on barrier tasks
    sparkdl.warm_up                                start the executors' Python workers ahead of the first fit
    sparkdl.compare, Comparison                    every strategy trained on your model and data, one table (docs/strategies.md)
    sparkdl.plot_history                           loss and validation metrics per epoch (matplotlib)
    sparkdl.Image, sparkdl.Sequence                input specs for inputs= (images as bytes, token ids)
    sparkdl.AllReduce, ParameterServer, ...        strategies
    sparkdl.TrainContext                           what a custom loop receives
    sparkdl.TrainingError, ...                     errors
"""

__version__ = "0.1.0"

from sparkdl._warmup import warm_up
from sparkdl.custom_loop import run
from sparkdl.context import TrainContext
from sparkdl.data.cache import clear_cache
from sparkdl.data.inputs import Image, Sequence
from sparkdl.errors import (
    ConfigError,
    DataError,
    InsufficientSlotsError,
    NonFiniteLossError,
    PeerLostError,
    SparkdlError,
    TrainingError,
)
from sparkdl.comparison import Comparison, compare
from sparkdl.estimator import TorchEstimator
from sparkdl.launching import ScriptResult, launch
from sparkdl.reporting import report
from sparkdl.data.torch_dataset import ShardDataset, shard_dataset
from sparkdl.model import TorchModel
from sparkdl.plotting import plot_history
from sparkdl.strategies import AllReduce, ElasticAveraging, ModelAveraging, OuterSGD, ParameterServer, ShardedDataParallel, Strategy

__all__ = [
    "ScriptResult",
    "ShardDataset",
    "launch",
    "report",
    "shard_dataset",
    "AllReduce",
    "Comparison",
    "ConfigError",
    "DataError",
    "ElasticAveraging",
    "Image",
    "InsufficientSlotsError",
    "ModelAveraging",
    "NonFiniteLossError",
    "OuterSGD",
    "ParameterServer",
    "ShardedDataParallel",
    "PeerLostError",
    "Sequence",
    "SparkdlError",
    "Strategy",
    "TorchEstimator",
    "TorchModel",
    "TrainContext",
    "TrainingError",
    "clear_cache",
    "compare",
    "plot_history",
    "run",
    "warm_up",
]
