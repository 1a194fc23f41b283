"""The worker side of the sparse tables: a forward's pull of the unique rows it needs from their
owners, and the step's push of the gradient rows back to them.

The runtime (:mod:`~sparkdl.strategies.parameter_server.runtime`) creates one
:class:`SparseTables` per rank and binds the model's
:class:`~sparkdl.strategies.parameter_server.embedding.ShardedEmbedding` modules to it. Rows
owned by this rank are read and updated in its own :class:`SparseShard` directly; the others
travel as ROW_PULL / ROW_PUSH frames (:mod:`~sparkdl.strategies.parameter_server.wire`).
"""

from __future__ import annotations

import socket
import time
import uuid
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from sparkdl import filesystem
from sparkdl._net.frames import TAG_BYTES
from sparkdl.errors import ConfigError, DataError
from sparkdl.strategies.parameter_server.embedding import ShardedEmbedding, sharded_embeddings
from sparkdl.strategies.parameter_server.prefetch import LookupPrefetch
from sparkdl.strategies.parameter_server.rows import initial_rows, owners
from sparkdl.strategies.parameter_server.shard import ServerState
from sparkdl.strategies.parameter_server.sparse_checkpoint import check_table_state, reshard_tables
from sparkdl.strategies.parameter_server.sparse_shard import SparseShard, SparseSpec
from sparkdl.strategies.parameter_server.table_files import TableFiles, TableInfo, write_manifest, write_part
from sparkdl.strategies.parameter_server.transport import ByteCounter, ShardClient
from sparkdl.strategies.parameter_server.wire import (
    DTYPE_CODES,
    HEADER,
    MAX_ROWS_PER_FRAME,
    MAX_TABLE,
    Header,
    Kind,
    byte_view,
)

__all__ = ["GATHER_CHUNK_ROWS", "PIPELINED_REPLY_BYTES", "SparseTables"]

#: Rows per message when a table is assembled on rank 0 (:meth:`SparseTables.gather`).
GATHER_CHUNK_ROWS = 1 << 18
#: Reply bytes a peer may owe one worker's pipelined pulls (:meth:`SparseTables.pull_many`): under
#: the 208 KiB that Linux gives a TCP socket's buffers by default (``net.core.rmem_default``),
#: so the replies fit in the kernel's buffers while the requests are still being sent.
PIPELINED_REPLY_BYTES = 192 * 1024


class SparseTables:
    """One rank's sparse tables: their specs, this rank's shards of them, the worker's clocks."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        state: ServerState,
        clients: Dict[int, ShardClient],
        max_staleness: Optional[int],
        timeout_s: float,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self._state, self._clients = state, clients
        self._max_staleness, self._timeout_s = max_staleness, timeout_s
        self.specs: List[SparseSpec] = []
        self.modules: List[ShardedEmbedding] = []
        self.clocks: List[int] = []
        #: Bytes of the sparse frames, both ways: requests sent and replies received.
        self.wire_bytes = ByteCounter()
        #: The largest staleness of this worker's sparse reads since the runtime last reset it.
        self.staleness = 0
        self._prefetches: List[LookupPrefetch] = []

    def bind(self, name: str, module: ShardedEmbedding) -> SparseSpec:
        """Makes ``module`` the next sparse table and registers this rank's shard of it."""
        table = len(self.specs)
        if table > MAX_TABLE:
            raise ValueError("ParameterServer: too many ShardedEmbedding tables")
        spec = SparseSpec(
            table, name, module.num_rows, module.dim, module.dtype, module.seed, module.init_std, module.row_optimizer
        )
        shard = SparseShard(spec, self.rank, self.world_size, self._max_staleness, self._timeout_s)
        self._state.register_sparse(table, shard)
        self.specs.append(spec)
        self.modules.append(module)
        self.clocks.append(0)
        module.bind(table, name, self)
        return spec

    def bind_model(self, model: torch.nn.Module) -> List[SparseSpec]:
        """Makes the model's unbound ShardedEmbeddings this rank's next sparse tables and, when
        it has some, pulls each forward's lookups together (:class:`LookupPrefetch`)."""
        specs = [self.bind(name, sub) for name, sub in sharded_embeddings(model) if sub.table is None]
        if specs:
            self._prefetches.append(LookupPrefetch(model, [self.modules[spec.table] for spec in specs], self))
        return specs

    def close(self) -> None:
        """Detaches the prefetch hooks from the models (the run is over)."""
        for prefetch in self._prefetches:
            prefetch.remove()
        self._prefetches = []

    def shard(self, table: int) -> SparseShard:
        return self._state.sparse(table)

    def _by_owner(self, ids: torch.Tensor) -> List[Tuple[int, torch.Tensor]]:
        """(rank, positions in ``ids``) of every rank that owns some of ``ids``, by rank."""
        owner = owners(ids, self.world_size)
        order = torch.argsort(owner, stable=True)  # positions grouped by rank, ascending within each
        counts = torch.bincount(owner, minlength=self.world_size).tolist()
        return [(k, where) for k, where in enumerate(torch.split(order, counts)) if len(where)]

    def _remote(self, k: int, header: Header, *payload: memoryview) -> None:
        self.wire_bytes.add(self._clients[k].send(header, *payload))

    def _reply(self, k: int, into: memoryview, table: int) -> Header:
        reply = self._clients[k].receive(into, table, Kind.ROWS)
        self.wire_bytes.add(HEADER.size + reply.length + TAG_BYTES)
        return reply

    def pull_rows(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (unique, in range) of ``table``, each from its owner, with the SSP wait
        of this worker's clock for the table."""
        return self.pull_many([(table, ids)])[0]

    def pull_many(self, lookups: Sequence[Tuple[int, torch.Tensor]]) -> List[torch.Tensor]:
        """The rows of several ``(table, ids)`` lookups (ids unique and sorted, in range): every
        table's requests to a peer go out before its replies are read, so a step that looks up
        ten tables waits for one round trip per peer, not ten
        (:mod:`~sparkdl.strategies.parameter_server.prefetch` gathers a forward's lookups).

        A peer's server answers its connection's requests in order, one after another, and
        writes each reply before it reads the next request; so the replies a peer still owes are
        kept under :data:`PIPELINED_REPLY_BYTES` (what both sockets' kernel buffers hold), else
        a long run of requests could leave both sides blocked in ``send``.
        """
        outs: List[torch.Tensor] = []
        owed: Dict[int, List[Tuple[int, torch.Tensor, torch.Tensor]]] = {}
        owed_bytes: Dict[int, int] = {}
        for table, ids in lookups:
            spec = self.specs[table]
            if len(ids) > MAX_ROWS_PER_FRAME:
                raise ValueError(
                    f"ShardedEmbedding {spec.name!r}: more than {MAX_ROWS_PER_FRAME} unique ids in one lookup"
                )
            out = torch.empty(len(ids), spec.dim, dtype=spec.dtype)
            outs.append(out)
            clock, code = self.clocks[table], DTYPE_CODES[spec.dtype]
            local = None
            for k, where in self._by_owner(ids):
                part = ids[where]
                if k == self.rank:
                    local = (where, part)  # read after the requests to the peers are out
                    continue
                reply_bytes = len(part) * spec.row_bytes
                if owed.get(k) and owed_bytes[k] + reply_bytes > PIPELINED_REPLY_BYTES:
                    self._collect(k, owed, owed_bytes)
                header = Header(Kind.ROW_PULL, code, table, self.rank, clock, len(part), 8 * len(part))
                self._remote(k, header, byte_view(part.contiguous()))
                owed.setdefault(k, []).append((table, where, out))
                owed_bytes[k] = owed_bytes.get(k, 0) + reply_bytes
            if local is not None:
                rows, staleness, _ = self.shard(table).pull(local[1], self.rank, clock, checked=True)
                out[local[0]] = rows
                self.staleness = max(self.staleness, staleness)
        for k in list(owed):
            self._collect(k, owed, owed_bytes)
        return outs

    def _collect(
        self, k: int, owed: Dict[int, List[Tuple[int, torch.Tensor, torch.Tensor]]], owed_bytes: Dict[int, int]
    ) -> None:
        """Reads every reply peer ``k`` owes, in the order of the requests, into their lookups."""
        for table, where, out in owed.pop(k, []):
            spec = self.specs[table]
            received = torch.empty(len(where), spec.dim, dtype=spec.dtype)
            self.staleness = max(self.staleness, self._reply(k, byte_view(received), table).aux)
            out[where] = received
        owed_bytes[k] = 0

    def push_all(self) -> None:
        """Pushes every table's gradient rows since the last push to their owners (every rank
        gets a push, empty where the batch touched none of its rows, so its clocks advance).

        Every table's pushes go out before any acknowledgement is read: one round trip to each
        peer per step, not one per table (a model of 10 tables waited for 10 in turn). A peer's
        server answers its connection's frames in order, and acknowledgements are empty frames,
        so none of them can fill a socket while pushes are still being sent.
        """
        sent = []
        for table, module in enumerate(self.modules):
            ids, grads = self._coalesce(table, module)
            sent.append((table, self._push(table, ids, grads)))
            self.clocks[table] += 1
        for table, peers in sent:
            for k in peers:
                self._reply(k, memoryview(bytearray(0)), table)

    def _coalesce(self, table: int, module: ShardedEmbedding) -> Tuple[torch.Tensor, torch.Tensor]:
        """The pending lookups' gradients summed per row id (a row used twice gets one push)."""
        spec = self.specs[table]
        pending, module.pending = module.pending, []
        pairs = [(ids, rows.grad) for ids, rows in pending if rows.grad is not None]
        if not pairs:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, spec.dim, dtype=spec.dtype)
        all_ids = torch.cat([ids for ids, _ in pairs])
        all_grads = torch.cat([grad.to("cpu", spec.dtype) for _, grad in pairs])
        if len(pairs) == 1:
            return all_ids, all_grads
        unique, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
        summed = torch.zeros(len(unique), spec.dim, dtype=spec.dtype).index_add_(0, inverse, all_grads)
        return unique, summed

    def _push(self, table: int, ids: torch.Tensor, grads: torch.Tensor) -> List[int]:
        """Sends ``table``'s rows to their remote owners and applies this rank's own; the ranks
        whose acknowledgement is then due (:meth:`push_all` reads them)."""
        spec = self.specs[table]
        clock, code = self.clocks[table], DTYPE_CODES[spec.dtype]
        positions = dict(self._by_owner(ids))
        nothing = torch.empty(0, dtype=torch.int64)
        local: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        sent = []
        for k in range(self.world_size):
            mine = positions.get(k, nothing)
            part_ids, part_grads = ids[mine].contiguous(), grads[mine].contiguous()
            if k == self.rank:
                local = (part_ids, part_grads)
                continue
            if len(part_ids) > MAX_ROWS_PER_FRAME:
                raise ValueError(
                    f"ShardedEmbedding {spec.name!r}: the step touched more than {MAX_ROWS_PER_FRAME} rows of rank {k}; "
                    f"step the optimizer more often"
                )
            length = len(part_ids) * (8 + spec.row_bytes)
            header = Header(Kind.ROW_PUSH, code, table, self.rank, clock, len(part_ids), length)
            self._remote(k, header, byte_view(part_ids), byte_view(part_grads))
            sent.append(k)
        if local is not None:
            self.shard(table).push(self.rank, clock, *local, checked=True)
        return sent

    def gather(self, table: int) -> Optional[torch.Tensor]:
        """The complete table on rank 0 (None elsewhere). Collective; call it once every push
        is in. Rank 0 starts from the initial rows (computed, never stored anywhere), and each
        rank streams the rows it holds to rank 0 in chunks of :data:`GATHER_CHUNK_ROWS` rows
        (``torch.distributed`` point-to-point), so no rank but 0 ever holds more than its
        shard plus one chunk."""
        spec = self.specs[table]
        ids, values = self.shard(table).snapshot()
        counts: List[Optional[int]] = [None] * self.world_size
        dist.all_gather_object(counts, len(ids))
        if self.rank != 0:
            for start in range(0, len(ids), GATHER_CHUNK_ROWS):
                dist.send(ids[start : start + GATHER_CHUNK_ROWS].contiguous(), dst=0)
                dist.send(values[start : start + GATHER_CHUNK_ROWS].contiguous(), dst=0)
            return None
        full = torch.empty(spec.num_rows, spec.dim, dtype=spec.dtype)
        for start in range(0, spec.num_rows, GATHER_CHUNK_ROWS):
            chunk = torch.arange(start, min(start + GATHER_CHUNK_ROWS, spec.num_rows))
            full[chunk] = initial_rows(spec.seed, spec.table, chunk, spec.dim, spec.init_std, spec.dtype)
        full[ids] = values
        for k in range(1, self.world_size):
            for start in range(0, int(counts[k]), GATHER_CHUNK_ROWS):
                size = min(GATHER_CHUNK_ROWS, int(counts[k]) - start)
                part_ids = torch.empty(size, dtype=torch.int64)
                part = torch.empty(size, spec.dim, dtype=spec.dtype)
                dist.recv(part_ids, src=k)
                dist.recv(part, src=k)
                full[part_ids] = part
        return full

    def assemble(self, model: torch.nn.Module) -> None:
        """Rank 0's ShardedEmbeddings of ``model`` become complete tables (the fitted model's,
        :meth:`ShardedEmbedding.materialize`), streamed from every shard by :meth:`gather`; the
        other ranks only send. Collective."""
        for _, module in sharded_embeddings(model):
            table = module.table
            if table is None or table >= len(self.modules) or self.modules[table] is not module:
                continue
            full = self.gather(table)
            if full is not None:
                module.materialize(full)

    def finish(self, model: torch.nn.Module, tables_dir: Optional[str]) -> None:
        """The fitted tables, at the runtime's ``final_module`` (collective): written by every
        rank under ``tables_dir`` when it is set (:meth:`write_files`), else assembled whole on
        rank 0 (:meth:`assemble`)."""
        if tables_dir:
            self.write_files(model, tables_dir)
        else:
            self.assemble(model)

    def write_files(self, model: torch.nn.Module, tables_dir: str) -> None:
        """Each rank writes the rows it holds of every table of ``model`` into a new run
        directory under ``tables_dir`` (:mod:`~sparkdl.strategies.parameter_server.table_files`),
        rank 0 the manifests once every part is in, and every rank's ShardedEmbeddings become
        fitted tables read from those files. Nothing travels between ranks but the run's
        directory name and each part's row count. Collective."""
        run = [f"run-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"]
        dist.broadcast_object_list(run, src=0)  # one directory for the run: rank 0's name
        run_url = filesystem.url_join(tables_dir, run[0])
        for name, module in sharded_embeddings(model):
            table = module.table
            if table is None or table >= len(self.modules) or self.modules[table] is not module:
                continue
            info = TableInfo.of(module, table, name)
            table_url = filesystem.url_join(run_url, f"table-{table}")
            store = self.shard(table).store
            with self.shard(table).cond:  # every push is in (the caller's barrier); the lock keeps it so
                ids = store.ids().numpy()
                part = write_part(table_url, self.rank, ids, _rows_of(store), info)
            parts: List[Any] = [None] * self.world_size
            dist.all_gather_object(parts, part)  # also: every part is written
            if self.rank == 0:
                write_manifest(table_url, info, self.world_size, parts)
            dist.barrier()  # the manifest is there before any rank's module reads it
            files = TableFiles(table_url, info)
            try:  # a local path on a cluster of several hosts holds each host's parts only
                files.check_complete()
            except DataError as exc:
                raise ConfigError(
                    f"ParameterServer(tables_dir={tables_dir!r}): rank {self.rank} on host {socket.gethostname()} "
                    f"does not see every rank's table files ({exc}); give a directory that every executor and the "
                    f"driver share (a shared mount, HDFS, an object store)"
                ) from exc
            module.attach_files(files)

    def state_dict(self) -> List[Dict[str, Any]]:
        """Every table's rows held by this rank, with their optimizer state and clocks (one
        checkpoint part's share; call it between the runtime's checkpoint barriers)."""
        return [self.shard(table).state_dict(clock) for table, clock in enumerate(self.clocks)]

    def load_state_dict(self, saved: List[Dict[str, Any]]) -> None:
        """Restores :meth:`state_dict`'s result, or :func:`reshard_tables`'s for this rank.

        Raises:
            ValueError: the checkpoint's sparse tables are not this run's.
        """
        if len(saved) != len(self.specs):
            raise ValueError(
                f"ParameterServer checkpoint holds {len(saved)} sparse tables, this run has {len(self.specs)} "
                f"ShardedEmbeddings"
            )
        for spec, table in zip(self.specs, saved):
            check_table_state(spec, table)
        for spec, table in zip(self.specs, saved):
            self.shard(spec.table).load_state_dict(table)
            self.clocks[spec.table] = int(table["worker_clock"])

    def resharded(self, old_parts: Iterable[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
        """This rank's :meth:`load_state_dict` argument from the old ranks' :meth:`state_dict`
        results, in rank order, on another number of ranks (:func:`reshard_tables`)."""
        return reshard_tables(self.specs, old_parts, self.rank, self.world_size)


def _rows_of(store: Any) -> Any:
    """What :func:`write_part` reads a shard's rows with: positions (numpy) -> values (numpy)."""
    return lambda slots: store.rows(torch.from_numpy(slots)).numpy()
