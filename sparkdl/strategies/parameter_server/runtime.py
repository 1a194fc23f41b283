"""One rank's parameter server runtime: its server, its clients to every other rank's server,
and the worker's push/pull at each optimizer step.

It reads its settings from any object with the fields of :class:`Settings` (the
:class:`~sparkdl.strategies.parameter_server.config.ParameterServer` strategy, which imports
this module to start it), and does not import the strategy's module itself.
"""

from __future__ import annotations

import json
import logging
import secrets
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from sparkdl.errors import ConfigError
from sparkdl.strategies._tensors import broadcast_from_rank0, by_device_and_dtype, flatten, nbytes, unflatten_into
from sparkdl.strategies.base import StrategyRuntime, allreduce_bytes_sent, broadcast_bytes_sent
from sparkdl.strategies.parameter_server.layout import TableSpec, make_layout
from sparkdl.strategies.parameter_server.shard import ServerState, Shard
from sparkdl.strategies.parameter_server.sparse_worker import SparseTables
from sparkdl.strategies.parameter_server.transport import ByteCounter, ShardClient, ShardServer, connect_all, listen
from sparkdl.strategies.parameter_server.wire import (
    DTYPE_CODES,
    MAX_TABLE,
    Header,
    Kind,
    ParameterServerError,
    byte_view,
)
from sparkdl.strategies.parameter_server.worker import ParameterServerOptimizer, WorkerTable

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl.strategies.base import DistEnv

__all__ = ["PEER_LOSS_GRACE_S", "ParameterServerRuntime", "Settings"]

logger = logging.getLogger("sparkdl.parameter_server")

#: Seconds a worker waits before raising that it lost a peer: the peer's own death (or error) is
#: the root cause, which the launcher reports ("WorkerLost") only if no other rank's report came
#: first; the driver then cancels the job, so the wait usually ends with this task killed.
PEER_LOSS_GRACE_S = 5.0


class Settings(Protocol):
    """What the runtime reads of its strategy: the checked fields of
    :class:`~sparkdl.strategies.parameter_server.config.ParameterServer`."""

    @property
    def max_staleness(self) -> Optional[int]: ...

    @property
    def timeout_s(self) -> float: ...

    @property
    def layout(self) -> str: ...


class ParameterServerRuntime(StrategyRuntime):
    def __init__(
        self,
        config: Settings,
        env: "DistEnv",
        all_gather: Callable[[str], Sequence[str]],
        host: str,
    ) -> None:
        """Starts this rank's server and connects to every other rank's.

        Args:
            config: the strategy (a :class:`ParameterServer
                <sparkdl.strategies.parameter_server.config.ParameterServer>`), or anything with its
                :class:`Settings`.
            env: this rank's place in the process group.
            all_gather: ``env.all_gather`` (through the rendezvous store) or an equivalent in tests:
                carries each rank's port and rank 0's secret.
            host: the address this rank's server binds to and the others connect to.
        """
        if sys.byteorder != "little":
            raise ConfigError("ParameterServer sends raw tensor bytes and supports little-endian hosts only")
        # Bytes this rank puts on the wire: its worker's requests, its server's replies, and its
        # share of the start-up broadcasts. Created before the base class assigns comm_bytes.
        self._sent = ByteCounter()
        super().__init__(env)
        self.config = config
        self.max_staleness = config.max_staleness
        self.timeout_s = float(config.timeout_s)
        self.modules: List[torch.nn.Module] = []
        self.tables: List[WorkerTable] = []
        self._optimizers: List[ParameterServerOptimizer] = []
        self._server: Optional[ShardServer] = None
        self._clients: Dict[int, ShardClient] = {}
        self._closed = False
        self._steps = 0
        self._window_steps = 0
        self._window_start = time.monotonic()
        self._window_staleness = 0
        self.peer_loss_grace_s = PEER_LOSS_GRACE_S
        self.state = ServerState(env.rank, env.world_size, self.timeout_s)
        listener = listen(host)
        try:
            own_secret = secrets.token_bytes(32) if env.rank == 0 else b""
            port = listener.getsockname()[1]
            # Hex in JSON: all_gather carries strings. The secret travels only in the rendezvous
            # store's authenticated frames (encrypted when Spark encrypts), never on a command
            # line or in a log line.
            replies = [
                json.loads(m) for m in all_gather(json.dumps({"host": host, "port": port, "secret": own_secret.hex()}))
            ]
            if len(replies) != env.world_size:
                raise RuntimeError(
                    f"ParameterServer: allGather returned {len(replies)} entries for {env.world_size} ranks"
                )
            secret = bytes.fromhex(replies[0]["secret"])
            if len(secret) < 16:
                raise RuntimeError("ParameterServer: rank 0 sent no usable secret")
            # Encrypted when Spark's own traffic is (env.encrypt); integrity-protected either way.
            encrypt = bool(env.encrypt)
            self._server = ShardServer(
                listener, secret, env.rank, env.world_size, self.state, self.timeout_s, self._sent, encrypt=encrypt
            )
            listener = None
            addresses = [(str(r["host"]), int(r["port"])) for r in replies]
            self._clients = connect_all(addresses, secret, env.rank, self.timeout_s, self._sent, encrypt=encrypt)
            self.sparse = SparseTables(
                env.rank, env.world_size, self.state, self._clients, self.max_staleness, self.timeout_s
            )
        except BaseException:
            if listener is not None:
                listener.close()
            self.close()
            raise

    # comm_bytes is read and reset by the training loop; it is backed by the thread-safe counter
    # that the server's threads also add to.
    @property  # type: ignore[override]
    def comm_bytes(self) -> int:
        return self._sent.value

    @comm_bytes.setter
    def comm_bytes(self, value: int) -> None:
        self._sent.set(value)

    # ---- strategy helpers ------------------------------------------------------------------

    def prepare_model(self, module: torch.nn.Module) -> torch.nn.Module:
        if any(m is module for m in self.modules):
            return module
        # Custom loops need not seed: every replica starts from rank 0's weights, like DDP.
        self._sent.add(broadcast_bytes_sent(broadcast_from_rank0(module), self.env.world_size, is_root=True))
        self.modules.append(module)
        # Each ShardedEmbedding becomes a sparse table whose rows the ranks own by hash.
        specs = self.sparse.bind_model(module)
        self._check_same_on_every_rank([spec.fingerprint() for spec in specs], "different ShardedEmbedding tables")
        return module

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if isinstance(optimizer, ParameterServerOptimizer) and optimizer._runtime is self:
            return optimizer
        if not self.modules:
            raise RuntimeError(
                "ParameterServer: call ctx.prepare_model(module) before ctx.prepare_optimizer(...), "
                "and build the optimizer over the prepared module's parameters"
            )
        known = {id(p) for m in self.modules for p in m.parameters()}
        params: List[torch.Tensor] = []
        groups: List[int] = []
        seen: Set[int] = set()
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if id(param) not in known:
                    raise RuntimeError(
                        "ParameterServer: the optimizer updates a parameter that belongs to no module passed to "
                        "ctx.prepare_model; build the optimizer over the prepared model's parameters"
                    )
                if id(param) not in seen:
                    seen.add(id(param))
                    params.append(param)
                    groups.append(index)
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i, param in enumerate(params):
            if param.dtype not in DTYPE_CODES:
                raise ConfigError(
                    f"ParameterServer: parameters of dtype {param.dtype} are not supported (float16/32/64 and bfloat16 are)"
                )
            by_dtype.setdefault(param.dtype, []).append(i)
        specs: List[Tuple[TableSpec, List[torch.Tensor]]] = []
        for dtype, members in by_dtype.items():
            table = len(self.tables) + len(specs)
            if table > MAX_TABLE:
                raise ConfigError("ParameterServer: too many prepared optimizers")
            sizes = [params[i].numel() for i in members]
            spec = TableSpec(
                table=table,
                dtype=dtype,
                shapes=tuple(tuple(params[i].shape) for i in members),
                groups=tuple(groups[i] for i in members),
                num_groups=len(optimizer.param_groups),
                layout=make_layout(self.config.layout, sizes, self.env.world_size),
            )
            specs.append((spec, [params[i] for i in members]))
        self._check_same_on_every_rank([spec.fingerprint() for spec, _ in specs])
        created = []
        for spec, members in specs:
            worker = WorkerTable(spec, members, optimizer)
            with torch.no_grad():
                # The servers start from rank 0's values, and so does every replica.
                flat = flatten(worker.params)
                dist.broadcast(flat, src=0)
                self._sent.add(broadcast_bytes_sent(nbytes(flat), self.env.world_size, self.env.rank == 0))
                unflatten_into(flat, worker.params)
            low, high = spec.shard_bounds(self.env.rank)
            shard = Shard(
                spec, self.env.rank, self.env.world_size, self.max_staleness, self.timeout_s, flat[low:high], optimizer
            )
            self.state.register(spec.table, shard)
            created.append(worker)
        if not self.tables:
            self._window_start = time.monotonic()  # updates_per_sec counts from the first optimizer
        self.tables.extend(created)
        wrapped = ParameterServerOptimizer(optimizer, self, created)
        self._optimizers.append(wrapped)
        return wrapped

    def final_module(self, model: torch.nn.Module) -> torch.nn.Module:
        if not any(m is model for m in self.modules):
            raise RuntimeError("ParameterServer: final_module got a module that ctx.prepare_model did not return")
        if not self.tables:
            raise RuntimeError(
                "ParameterServer updates parameters on the servers at optimizer steps, but no optimizer was "
                "prepared: use optimizer = ctx.prepare_optimizer(optimizer) and call its step()"
            )
        # Every worker's last push was applied before its step returned, so after this barrier
        # the servers hold the final parameters; all ranks pull the same bytes.
        dist.barrier()
        self._pull_all()
        with torch.no_grad():
            # Buffers (BatchNorm statistics) are not on the servers: average the floating ones,
            # take rank 0's integer ones (step counters), so every rank returns the same module.
            for group in by_device_and_dtype(list(model.buffers())):
                flat = flatten(group)
                if flat.is_floating_point() or flat.is_complex():
                    flat.div_(self.env.world_size)
                    dist.all_reduce(flat)
                    self._sent.add(allreduce_bytes_sent(nbytes(flat), self.env.world_size))
                else:
                    dist.broadcast(flat, src=0)
                    self._sent.add(broadcast_bytes_sent(nbytes(flat), self.env.world_size, self.env.rank == 0))
                unflatten_into(flat, group)
        # After the buffers: the sparse tables, written sharded or assembled on rank 0.
        self.sparse.finish(model, getattr(self.config, "tables_dir", None))
        # No server may shut down while another rank is still pulling from it.
        dist.barrier()
        return model

    # ---- the step --------------------------------------------------------------------------

    def _step(self, tables: List[WorkerTable]) -> None:
        if self._closed:
            raise RuntimeError("ParameterServer: optimizer.step() after the strategy was closed")
        staleness = 0
        try:
            self.sparse.push_all()
            for table in tables:
                staleness = max(staleness, self._push_pull(table))
        except ParameterServerError as exc:
            if exc.peer_rank is not None and self.peer_loss_grace_s > 0:
                logger.warning(
                    "rank %d: %s; reporting it in %gs unless the run is cancelled first",
                    self.env.rank,
                    exc,
                    self.peer_loss_grace_s,
                )
                time.sleep(self.peer_loss_grace_s)  # not synchronization: see PEER_LOSS_GRACE_S
            raise
        self._steps += 1
        self._window_steps += 1
        self._window_staleness = max(self._window_staleness, staleness)

    def _push_pull(self, table: WorkerTable) -> int:
        """One push of this worker's gradients to every shard and the pull of the new values."""
        spec = table.spec
        rank = self.env.rank
        code = DTYPE_CODES[spec.dtype]
        table.gather_grads()
        lrs = table.learning_rates()
        lr_bytes = byte_view(lrs)
        remote = [k for k in sorted(self._clients) if spec.layout.sizes[k] > 0]
        # Send to every remote shard first, then serve the local one, then read the replies:
        # the servers work in parallel, and a bulk-synchronous wait on one shard never blocks
        # the pushes the other shards are waiting for.
        for k in remote:
            low, high = spec.shard_bounds(k)
            grad = table.grad[low:high]
            header = Header(
                Kind.PUSH, code, spec.table, rank, table.clock, spec.num_groups, len(lr_bytes) + nbytes(grad)
            )
            self._clients[k].send(header, lr_bytes, byte_view(grad))
        staleness = 0
        low, high = spec.shard_bounds(rank)
        if high > low:
            shard = self.state.shard(spec.table)
            shard.push(rank, table.clock, lrs.tolist(), table.grad[low:high])
            staleness, _ = shard.read_into(table.values[low:high], rank, table.clock + 1)
        for k in remote:
            low, high = spec.shard_bounds(k)
            reply = self._clients[k].receive(byte_view(table.values[low:high]), spec.table)
            staleness = max(staleness, reply.aux)
        table.clock += 1
        table.scatter_values()
        return staleness

    def _pull_all(self) -> None:
        """Reads every shard's current values (no staleness wait) into the local parameters."""
        rank = self.env.rank
        for table in self.tables:
            spec = table.spec
            code = DTYPE_CODES[spec.dtype]
            remote = [k for k in sorted(self._clients) if spec.layout.sizes[k] > 0]
            for k in remote:
                self._clients[k].send(Header(Kind.PULL, code, spec.table, rank, -1, 0, 0))
            low, high = spec.shard_bounds(rank)
            if high > low:
                self.state.shard(spec.table).read_into(table.values[low:high], rank, -1)
            for k in remote:
                low, high = spec.shard_bounds(k)
                self._clients[k].receive(byte_view(table.values[low:high]), spec.table)
            table.scatter_values()

    def _check_same_on_every_rank(
        self,
        fingerprints: List[str],
        what: str = "an optimizer over different parameters (shapes, dtypes or param groups)",
    ) -> None:
        gathered: List[Any] = [None] * self.env.world_size
        dist.all_gather_object(gathered, fingerprints)
        for rank, theirs in enumerate(gathered):
            if theirs != fingerprints:
                raise RuntimeError(
                    f"ParameterServer: rank {rank} prepared {what} than rank {self.env.rank}; every rank must "
                    f"build the same model and optimizer"
                )

    # ---- metrics and checkpoints ------------------------------------------------------------

    def epoch_metrics(self) -> Dict[str, float]:
        """``staleness``: the largest staleness of this worker's reads since the previous call;
        ``updates_per_sec``: its pushes (model updates applied by the servers) per second."""
        now = time.monotonic()
        seconds = now - self._window_start
        metrics = {
            "staleness": int(max(self._window_staleness, self.sparse.staleness)),
            "updates_per_sec": self._window_steps / seconds if seconds > 0 else 0.0,
        }
        self._window_start = now
        self._window_steps = 0
        self._window_staleness = 0
        self.sparse.staleness = 0
        return metrics

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shards (values, server optimizer state, clocks) and its worker clocks;
        with ShardedEmbeddings, under ``"sparse"``, the rows this rank owns and their row
        optimizer state.

        Collective: call it on every rank at the same step. The barriers around the snapshot
        make it a consistent cut — every push made before it is in, none made after.
        """
        dist.barrier()
        state = {
            "format": 1,
            "rank": self.env.rank,
            "world_size": self.env.world_size,
            "tables": [{**self.state.shard(t.spec.table).state_dict(), "worker_clock": t.clock} for t in self.tables],
        }
        if self.sparse.specs:  # only then: a checkpoint without sparse tables is as before
            state["sparse"] = self.sparse.state_dict()  # the rows this rank owns, never a whole table
        dist.barrier()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s result into this rank's shards, then pulls the restored
        parameters into the local replica. Collective, like :meth:`state_dict`."""
        if state.get("world_size") != self.env.world_size or len(state.get("tables", ())) != len(self.tables):
            raise ValueError(
                f"ParameterServer checkpoint of {state.get('world_size')} ranks and {len(state.get('tables', ()))} tables "
                f"cannot restore a run of {self.env.world_size} ranks and {len(self.tables)} tables"
            )
        for table, saved in zip(self.tables, state["tables"]):
            if saved["fingerprint"] != table.spec.fingerprint():
                raise ValueError(f"ParameterServer checkpoint of table {table.spec.table} holds different parameters")
        sparse = state.get("sparse", [])
        if len(sparse) != len(self.sparse.specs):
            raise ValueError(
                f"ParameterServer checkpoint of {len(sparse)} sparse tables cannot restore a run of "
                f"{len(self.sparse.specs)} ShardedEmbeddings"
            )
        # No shard is rewound while a worker still pushes or waits on it: a read waiting for the
        # staleness bound would wait for clocks the rewind took back, and never return.
        dist.barrier()
        for table, saved in zip(self.tables, state["tables"]):
            self.state.shard(table.spec.table).load_state_dict(saved)
            table.clock = int(saved["worker_clock"])
        self.sparse.load_state_dict(sparse)
        dist.barrier()
        self._pull_all()
        dist.barrier()

    def reshard_state(
        self, old: Sequence[Sequence[Dict[str, Any]]], old_world_size: int
    ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Elastic resume: the old shards re-laid out for this run's ranks (:mod:`.reshard`), the
        sparse tables' rows taken by their owners under the new hashing (:mod:`.sparse_checkpoint`);
        the user state is old rank ``rank % N``'s (the replica is pulled by :meth:`load_state_dict`).

        Each old part's strategy state is taken once (``old[i][1]`` reads it from storage) and
        dropped before the next: a rank holds its own rows, one old part, and every old part's
        dense shards (small; their re-layout needs them all at once)."""
        from sparkdl.strategies.parameter_server.reshard import each_old_part, relayout_state

        # Part by part, keeping only the rows this rank owns (without tables: each part's dense
        # shards read, and a checkpoint that has tables refused).
        dense: List[Dict[str, Any]] = []
        sparse = self.sparse.resharded(each_old_part(old, dense))
        tables = [(t.spec, self.state.shard(t.spec.table).optimizer) for t in self.tables]
        strategy = relayout_state(self.config.layout, dense, tables, self.env.rank, self.env.world_size)
        if self.sparse.specs:
            strategy["sparse"] = sparse
        return old[self.env.rank % old_world_size][0], strategy

    @property
    def sparse_wire_bytes(self) -> int:
        """Bytes of this worker's sparse-table frames so far, both ways (requests and replies)."""
        return self.sparse.wire_bytes.value

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.sparse.close()
        for client in self._clients.values():
            client.close()  # BYE: the other servers stop waiting for this worker
        self.state.close()  # wakes this server's threads waiting for a staleness bound, then joined
        if self._server is not None:
            self._server.close()
