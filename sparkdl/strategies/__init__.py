"""Distributed training strategies (see :mod:`sparkdl.strategies.base` for the plug-in point)."""

from sparkdl.strategies.allreduce import AllReduce
from sparkdl.strategies.averaging import ElasticAveraging, ModelAveraging
from sparkdl.strategies.base import Strategy, StrategyRuntime, registered_strategies, strategy_from_name

__all__ = [
    "AllReduce",
    "ElasticAveraging",
    "ModelAveraging",
    "Strategy",
    "StrategyRuntime",
    "registered_strategies",
    "strategy_from_name",
]
