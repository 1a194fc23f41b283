"""Asynchronous parameter server with bounded staleness, hosted inside the barrier stage.

The centralized asynchronous strategy of DistBelief's Downpour SGD (Dean et al., NIPS 2012), the
parameter server of Li et al. (OSDI 2014) and Project Adam (Chilimbi et al., OSDI 2014), with the
stale-synchronous-parallel bound of Ho et al. (NeurIPS 2013):

* every barrier task hosts one **shard** of the parameters (a server thread beside its trainer);
  the shard's values and the optimizer state for them live only there;
* a worker's optimizer ``step()`` **pushes** its gradients to every shard, each server applies
  them at once with a copy of the user's optimizer, and the worker **pulls** the fresh values
  back; workers never wait for each other...
* ...except to respect ``max_staleness`` *s*: a worker that has finished *c* steps may only read
  parameters once every worker has finished at least *c - s* steps (SSP). ``None`` never waits
  (fully asynchronous), ``0`` is bulk-synchronous.

Layout: the optimizer's parameters (per dtype) are flattened in a fixed order and cut into
``world_size`` near-equal contiguous ranges (``layout="balanced"``, the default: every server
gets the same number of bytes to receive, apply and send, whatever the tensor sizes), or whole
tensors are bin-packed greedily (``layout="tensors"``, for optimizers that need whole tensors).
See ``docs/parameter_server.md`` for the measurements behind the default.

Modules, each one concern, none importing this package's ``__init__``:

* :mod:`~sparkdl.strategies.parameter_server.config` — the :class:`ParameterServer` strategy;
* :mod:`~sparkdl.strategies.parameter_server.layout` — how tables are cut into shards (pure);
* :mod:`~sparkdl.strategies.parameter_server.clock` — the SSP read rule (pure);
* :mod:`~sparkdl.strategies.parameter_server.shard` — the server side: shards and their optimizers;
* :mod:`~sparkdl.strategies.parameter_server.worker` — the worker's tables and optimizer wrapper;
* :mod:`~sparkdl.strategies.parameter_server.runtime` — one rank's server, clients and step;
* :mod:`~sparkdl.strategies.parameter_server.wire` — the wire protocol and its security;
* :mod:`~sparkdl.strategies.parameter_server.transport` — the server and client connections;
* :mod:`~sparkdl.strategies.parameter_server.reshard` — shards re-laid out for an elastic resume;
* :mod:`~sparkdl.strategies.parameter_server.rows` — sparse tables' row owners, initial rows and
  row-wise optimizers (pure);
* :mod:`~sparkdl.strategies.parameter_server.embedding` — :class:`ShardedEmbedding`, the module
  whose rows live on the servers;
* :mod:`~sparkdl.strategies.parameter_server.sparse_shard` — the server side of a sparse table;
* :mod:`~sparkdl.strategies.parameter_server.sparse_worker` — a worker's pulls and pushes of rows.

Layers, each importing only the ones before it (also inside functions and under
``TYPE_CHECKING``)::

    layout, wire, rows < clock, transport, reshard, worker, embedding < shard < sparse_shard
        < sparse_worker < runtime < config

The runtime reads the strategy's settings through its ``Settings`` protocol and the worker's
optimizer wrapper calls the runtime through its ``WorkerRuntime`` protocol, so neither imports
the module above it.
"""

from sparkdl.strategies.parameter_server.clock import SSPClock
from sparkdl.strategies.parameter_server.config import ParameterServer
from sparkdl.strategies.parameter_server.embedding import ShardedEmbedding

# Public names of the former single module that __all__ never listed; still importable from here.
from sparkdl.strategies.parameter_server.layout import (
    LAYOUTS,  # noqa: F401
    Layout,
    Segment,
    balanced_layout,
    make_layout,
    shard_segments,
    tensor_layout,
)
from sparkdl.strategies.parameter_server.runtime import PEER_LOSS_GRACE_S  # noqa: F401
from sparkdl.strategies.parameter_server.shard import build_server_optimizer  # noqa: F401
from sparkdl.strategies.parameter_server.wire import ParameterServerError
from sparkdl.strategies.parameter_server.worker import ParameterServerOptimizer

__all__ = [
    "Layout",
    "ParameterServer",
    "ParameterServerError",
    "ParameterServerOptimizer",
    "SSPClock",
    "Segment",
    "ShardedEmbedding",
    "balanced_layout",
    "make_layout",
    "shard_segments",
    "tensor_layout",
]
