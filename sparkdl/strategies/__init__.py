"""Distributed training strategies (see :mod:`sparkdl.strategies.base` for the plug-in point)."""

from sparkdl.strategies.allreduce import AllReduce
from sparkdl.strategies.averaging import ElasticAveraging, ModelAveraging
from sparkdl.strategies.base import Strategy, StrategyRuntime, registered_strategies, strategy_from_name
from sparkdl.strategies.parameter_server import ParameterServer

__all__ = [
    "AllReduce",
    "ElasticAveraging",
    "ModelAveraging",
    "ParameterServer",
    "Strategy",
    "StrategyRuntime",
    "registered_strategies",
    "strategy_from_name",
]
