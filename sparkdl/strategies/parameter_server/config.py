"""The :class:`ParameterServer` strategy: its settings, checked when it is constructed, and the
runtime it starts on each rank."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import TYPE_CHECKING, Optional

from sparkdl import filesystem
from sparkdl.errors import ConfigError
from sparkdl.strategies.base import Strategy, StrategyRuntime
from sparkdl.strategies.parameter_server.layout import LAYOUTS
from sparkdl.strategies.parameter_server.runtime import ParameterServerRuntime

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl.strategies.base import DistEnv

__all__ = ["LAYOUTS", "ParameterServer"]


@dataclasses.dataclass(frozen=True)
class ParameterServer(Strategy):
    """Asynchronous, sharded parameter server with an optional staleness bound (SSP).

    Every task hosts one shard of the parameters, updated by a server-side copy of the user's
    optimizer. The optimizer that ``prepare_optimizer`` returns does not step locally: its
    ``step()`` sends the gradients to every shard and replaces the local parameters with the
    servers' fresh values. Each worker's gradient is applied as its own update, as soon as it
    arrives (asynchronous SGD): with N workers the servers apply N updates per "step" of each
    worker, each computed from one worker's batch.

    Args:
        max_staleness: how many steps (clocks) the fastest worker may run ahead of the slowest.
            ``None``: never wait (fully asynchronous, Downpour SGD); ``0``: bulk-synchronous —
            every read includes every worker's previous steps; ``s``: stale-synchronous.
        timeout_s: bound on connecting, on each message and on each staleness wait. A worker
            that holds the others back for longer fails the run with an error naming it.
        layout: ``"balanced"`` (default) cuts the flattened parameters into equal contiguous
            ranges, one per rank; ``"tensors"`` keeps tensors whole and bin-packs them
            (largest first onto the least-loaded rank), for optimizers that need each tensor's
            shape (Adafactor, Muon).
        tables_dir: where the fitted ``ShardedEmbedding`` tables go (a local path or a URL that
            every executor and the driver can read: a shared mount or an object store). Each
            rank writes the rows it holds into a new run directory here at the end of the fit,
            and the fitted model reads them memory-mapped: no table passes through rank 0 or
            the driver. ``None`` (default): the tables come back whole inside the fitted model,
            which is refused before launch when they exceed what the driver takes
            (docs/embeddings.md).

    Example::

        est = sparkdl.TorchEstimator(model=make_net, strategy=sparkdl.ParameterServer(max_staleness=2), ...)
    """

    name = "parameter_server"
    cost_model = "parameter_server"
    on_resize_choices = ("none",)
    on_resize_reason = (
        "the servers apply every worker's gradient of batch_size rows as it arrives, so there is no global batch "
        "to keep, and fewer workers mean fewer pushes per second, not larger batches to scale the learning rate for"
    )
    identical_final_weights = True
    # The order in which the servers apply the workers' pushes depends on timing.
    deterministic = False

    max_staleness: Optional[int] = None
    timeout_s: float = 300.0
    layout: str = "balanced"
    tables_dir: Optional[str] = None

    def __post_init__(self) -> None:
        s = self.max_staleness
        if s is not None and (not isinstance(s, numbers.Integral) or isinstance(s, bool) or s < 0):
            raise ConfigError(
                f"ParameterServer.max_staleness={s!r} must be None (fully asynchronous) or an integer >= 0 "
                f"(how many steps the fastest worker may run ahead of the slowest; 0 = bulk-synchronous)"
            )
        t = self.timeout_s
        if not isinstance(t, numbers.Real) or isinstance(t, bool) or not (math.isfinite(t) and t > 0):
            raise ConfigError(f"ParameterServer.timeout_s={t!r} must be a number of seconds > 0")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"ParameterServer.layout={self.layout!r} must be one of {', '.join(map(repr, LAYOUTS))}")
        if self.tables_dir is not None and (not isinstance(self.tables_dir, str) or not self.tables_dir):
            raise ConfigError(
                f"ParameterServer.tables_dir={self.tables_dir!r} must be None or a path or URL (a non-empty string)"
            )
        if self.tables_dir is not None:
            # Absolute now: the ranks write it from their own working directories.
            url = filesystem.normalize_url(self.tables_dir, "ParameterServer(tables_dir=...)")
            if filesystem.is_process_local(url):
                raise ConfigError(
                    f"ParameterServer(tables_dir={self.tables_dir!r}) is in this process's memory, which the "
                    f"executors never see: give a path or URL that every executor and the driver can read"
                )
            object.__setattr__(self, "tables_dir", url)

    def create_runtime(self, env: "DistEnv") -> StrategyRuntime:
        if env.all_gather is None or len(env.peer_addresses) != env.world_size:
            raise RuntimeError(
                "ParameterServer needs the barrier stage's task addresses and an all_gather (DistEnv.peer_addresses "
                f"and DistEnv.all_gather, which the launcher's rendezvous fills in); this one has "
                f"{len(env.peer_addresses)} address(es) for {env.world_size} ranks and all_gather={env.all_gather!r}"
            )
        address = env.peer_addresses[env.rank]
        host = address.rsplit(":", 1)[0].strip("[]")  # "[::1]:port" for IPv6
        # Every rank calls create_runtime at the same point (after rendezvous), so this
        # all_gather (the rendezvous store's) pairs up across ranks.
        return ParameterServerRuntime(self, env, env.all_gather, host)
