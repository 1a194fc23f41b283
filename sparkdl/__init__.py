"""sparkdl: train PyTorch models across a Spark cluster, on Parquet each task streams itself (Arrow or Petastorm).

Public surface::

    sparkdl.TorchEstimator / sparkdl.TorchModel   Spark ML estimator and model
    sparkdl.predict, PredictResult                 a model's predictions for a Parquet dataset, resumable
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

from typing import TYPE_CHECKING

from sparkdl._lazy import lazy_attributes
from sparkdl._spark import quiet_pandas3_warning
from sparkdl._version import __version__

# At import, before the user's own session starts: PySpark warns about pandas 3 the first time it
# imports its test helpers (getOrCreate, createDataFrame...), which precedes sparkdl's first call.
quiet_pandas3_warning()

# Each public name and the module that defines it; imported on first use (sparkdl._lazy says why).
_PUBLIC = {
    "AllReduce": "sparkdl.strategies",
    "Comparison": "sparkdl.comparison",
    "ConfigError": "sparkdl.errors",
    "DataError": "sparkdl.errors",
    "ElasticAveraging": "sparkdl.strategies",
    "Image": "sparkdl.data.inputs",
    "InsufficientSlotsError": "sparkdl.errors",
    "ModelAveraging": "sparkdl.strategies",
    "NonFiniteLossError": "sparkdl.errors",
    "OuterSGD": "sparkdl.strategies",
    "ParameterServer": "sparkdl.strategies",
    "PeerLostError": "sparkdl.errors",
    "PredictResult": "sparkdl.inference.predict_job",
    "Resources": "sparkdl.resources",
    "ScriptResult": "sparkdl.launching",
    "Sequence": "sparkdl.data.inputs",
    "ShardDataset": "sparkdl._runtime.shard_dataset",
    "ShardedDataParallel": "sparkdl.strategies",
    "ShardedEmbedding": "sparkdl.strategies.parameter_server",
    "SparkdlError": "sparkdl.errors",
    "Strategy": "sparkdl.strategies",
    "TorchEstimator": "sparkdl.estimator",
    "TorchModel": "sparkdl.model",
    "TrainContext": "sparkdl.context",
    "TrainingError": "sparkdl.errors",
    "clear_cache": "sparkdl.data.cache",
    "compare": "sparkdl.comparison",
    "launch": "sparkdl.launching",
    "plan": "sparkdl.planning",
    "plot_history": "sparkdl.plotting",
    "predict": "sparkdl.inference.predict_job",
    "report": "sparkdl.reporting",
    "run": "sparkdl.custom_loop",
    "shard_dataset": "sparkdl._runtime.shard_dataset",
    "warm_up": "sparkdl._driver.warmup",
}
__getattr__, __dir__ = lazy_attributes(__name__, _PUBLIC)

if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from sparkdl._driver.warmup import warm_up
    from sparkdl._runtime.shard_dataset import ShardDataset, shard_dataset
    from sparkdl.comparison import Comparison, compare
    from sparkdl.context import TrainContext
    from sparkdl.custom_loop import run
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
    from sparkdl.estimator import TorchEstimator
    from sparkdl.inference.predict_job import PredictResult, predict
    from sparkdl.launching import ScriptResult, launch
    from sparkdl.model import TorchModel
    from sparkdl.planning import plan
    from sparkdl.plotting import plot_history
    from sparkdl.reporting import report
    from sparkdl.resources import Resources
    from sparkdl.strategies import (
        AllReduce,
        ElasticAveraging,
        ModelAveraging,
        OuterSGD,
        ParameterServer,
        ShardedDataParallel,
        Strategy,
    )
    from sparkdl.strategies.parameter_server import ShardedEmbedding

__all__ = sorted(_PUBLIC)
