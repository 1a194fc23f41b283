"""Distributed training strategies (see :mod:`sparkdl.strategies.base` for the plug-in point).

Importing this package registers the built-in strategies by name (``allreduce``,
``model_averaging``, ``elastic_averaging``, ``parameter_server``, ``sharded``) and one alias:
``diloco``, which is ``model_averaging`` with DiLoCo's outer optimizer (:class:`OuterSGD`'s
defaults), so ``--strategy diloco --strategy-arg sync_every=64`` and ``--strategies
diloco:sync_every=64`` build ``ModelAveraging(sync_every=64, outer_optimizer=OuterSGD())``.
"""

from sparkdl.strategies._outer import OuterSGD
from sparkdl.strategies.allreduce import AllReduce
from sparkdl.strategies.averaging import ElasticAveraging, ModelAveraging
from sparkdl.strategies.base import (
    Strategy,
    StrategyRuntime,
    register_alias,
    registered_strategies,
    strategy_class,
    strategy_from_name,
    strategy_names,
)
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
    "register_alias",
    "registered_strategies",
    "strategy_class",
    "strategy_from_name",
    "strategy_names",
]

# DiLoCo is model averaging with an outer optimizer, not a strategy of its own: a name for it.
register_alias("diloco", "model_averaging", outer_optimizer=OuterSGD())
