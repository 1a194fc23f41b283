"""Distributed training strategies (see :mod:`sparkdl.strategies.base` for the plug-in point)."""

from sparkdl.strategies._outer import OuterSGD
from sparkdl.strategies.allreduce import AllReduce
from sparkdl.strategies.averaging import ElasticAveraging, ModelAveraging
from sparkdl.strategies.base import Strategy, StrategyRuntime, registered_strategies, strategy_from_name
from sparkdl.strategies.parameter_server import ParameterServer
from sparkdl.strategies.sharded import ShardedDataParallel

__all__ = [
    "AllReduce",
    "ElasticAveraging",
    "ModelAveraging",
    "OuterSGD",
    "ParameterServer",
    "ShardedDataParallel",
    "Strategy",
    "StrategyRuntime",
    "registered_strategies",
    "strategy_from_name",
]
