"""The server side of a sparse table: the rows this rank owns, each with its optimizer state,
created on first touch and updated row by row.

A rank owns the rows whose id hashes to it (:func:`~sparkdl.strategies.parameter_server.rows.owners`)
and stores only those it has seen: a row never touched is its initial value, which anyone can
compute, so nothing of it needs to exist until a batch uses it. The rows held live in a
:class:`~sparkdl.strategies.parameter_server.row_store.RowStore` (flat arrays, 16-24 bytes a row
beyond the values and the optimizer state). Reads and pushes keep the SSP
clocks of the dense shards (:class:`~sparkdl.strategies.parameter_server.shard.ClockedShard`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple

import torch

from sparkdl.strategies.parameter_server.row_store import RowStore, likely_most_rows
from sparkdl.strategies.parameter_server.rows import RowOptimizer, initial_rows, owners
from sparkdl.strategies.parameter_server.shard import ClockedShard
from sparkdl.strategies.parameter_server.wire import (
    DTYPE_CODES,
    MAX_ROWS_PER_FRAME,
    Header,
    Kind,
    ParameterServerError,
    WireError,
    byte_view,
)

__all__ = ["SparseShard", "SparseSpec"]

_ID_BYTES = 8


@dataclasses.dataclass(frozen=True)
class SparseSpec:
    """What every rank knows of one sparse table (the same on every rank)."""

    table: int
    name: str
    num_rows: int
    dim: int
    dtype: torch.dtype
    seed: int
    init_std: float
    optimizer: RowOptimizer

    @property
    def row_bytes(self) -> int:
        return self.dim * torch.empty((), dtype=self.dtype).element_size()

    def fingerprint(self) -> str:
        return repr((self.table, self.name, self.num_rows, self.dim, str(self.dtype), self.seed, self.init_std))


class SparseShard(ClockedShard):
    """The rows of one sparse table that this rank owns, and their optimizer state."""

    def __init__(self, spec: SparseSpec, rank: int, world_size: int, max_staleness, timeout_s: float) -> None:
        super().__init__(rank, world_size, max_staleness, timeout_s)
        self.spec = spec
        self.world_size = world_size
        self.store = RowStore(spec.dim, spec.dtype, spec.optimizer, likely_most_rows(spec.num_rows, world_size))
        self._receive: Dict[int, torch.Tensor] = {}
        self._reply: Dict[int, torch.Tensor] = {}

    @property
    def rows_held(self) -> int:
        """Rows this rank has materialized (touched at least once)."""
        return self.store.count

    def held_ids(self) -> torch.Tensor:
        """The ids of the rows held, in the order they were created (a copy)."""
        with self.cond:
            return self.store.ids()

    def _initial(self, ids: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        return initial_rows(spec.seed, spec.table, ids, spec.dim, spec.init_std, spec.dtype)

    def _check_ids(self, ids: torch.Tensor) -> None:
        # The worker checked the user's ids; what arrives here came from a worker of this job,
        # so a bad id is a protocol error, not user input. Workers send each request's ids
        # sorted (they come from torch.unique), so "strictly increasing" is the cheap check
        # that no row is repeated (one comparison per id, not a sort).
        if not len(ids):
            return
        if int(ids.min()) < 0 or int(ids.max()) >= self.spec.num_rows:
            raise WireError(f"row ids outside sparse table {self.spec.table}'s {self.spec.num_rows} rows")
        if bool((owners(ids, self.world_size) != self.rank).any()):
            raise WireError(f"row ids of sparse table {self.spec.table} that rank {self.rank} does not own")
        if bool((ids[1:] <= ids[:-1]).any()):
            raise WireError(f"repeated row ids, or ids not in increasing order, for sparse table {self.spec.table}")

    def pull(self, ids: torch.Tensor, rank: int, clock: int, checked: bool = False) -> Tuple[torch.Tensor, int, int]:
        """Rows ``ids`` once a reader at ``clock`` may read (SSP); returns ``(rows, staleness,
        slowest clock)``. ``checked``: the ids are this rank's own worker's, taken from its
        lookups (unique, sorted, owned here), not a peer's frame to check."""
        if not checked:
            self._check_ids(ids)
        with self.cond:
            self.wait_readable(rank, clock)
            rows = self.store.rows(self.store.slots_for(ids, self._initial))
            return rows, self.clock.staleness(clock) if clock >= 0 else 0, self.clock.min_clock()

    def push(self, rank: int, clock: int, ids: torch.Tensor, grads: torch.Tensor, checked: bool = False) -> None:
        """Applies one worker's gradient rows with the row-wise optimizer (only those rows);
        ``checked`` as for :meth:`pull`.

        Raises:
            WireError: out-of-order clock, a worker that has left, or bad ids.
            ParameterServerError: the server is closing.
        """
        if not checked:
            self._check_ids(ids)
        with self.cond:
            if self.closed:
                raise ParameterServerError(f"the parameter server on rank {self.rank} is shutting down")
            self.clock.tick(rank, clock)
            if len(ids):
                self.store.update(self.store.slots_for(ids, self._initial), grads)
            self.cond.notify_all()

    def snapshot(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The rows held: ``(ids, values)``, copies taken under the lock."""
        with self.cond:
            held = self.store.export()
        return held["ids"], held["values"]

    def state_dict(self, worker_clock: int) -> Dict[str, Any]:
        """The rows this rank holds, their optimizer state and the clocks, copies taken under the
        lock (:mod:`~sparkdl.strategies.parameter_server.sparse_checkpoint`); ``worker_clock`` is
        this rank's worker's clock for the table."""
        with self.cond:
            held = self.store.export()
            clocks = list(self.clock.clocks)
        return {
            "fingerprint": self.spec.fingerprint(),
            "optimizer": self.spec.optimizer.name,
            "ids": held.pop("ids"),
            "values": held.pop("values"),
            "state": {key[len("state.") :]: value for key, value in held.items()},
            "clocks": clocks,
            "worker_clock": int(worker_clock),
        }

    def load_state_dict(self, saved: Dict[str, Any]) -> None:
        """Replaces the rows held by ``saved``'s (checked by the caller, see
        :func:`~sparkdl.strategies.parameter_server.sparse_checkpoint.check_table_state`).

        Raises:
            ValueError: rows that this rank does not own, or a clock per rank of another run.
        """
        ids = saved["ids"]
        if len(ids) and bool((owners(ids, self.world_size) != self.rank).any()):
            raise ValueError(f"checkpointed rows of sparse table {self.spec.table} that rank {self.rank} does not own")
        if len(saved["clocks"]) != self.world_size:
            raise ValueError(f"checkpointed clocks of {len(saved['clocks'])} ranks for {self.world_size}")
        with self.cond:
            self.store.load(ids, saved["values"], saved["state"])
            self.clock.clocks = [int(c) for c in saved["clocks"]]
            self.cond.notify_all()

    # ---- frames from other ranks (ServerState delegates ROW_PULL / ROW_PUSH here) -----------

    def buffer_for(self, rank: int, header: Header) -> memoryview:
        spec = self.spec
        if header.dtype != DTYPE_CODES[spec.dtype]:
            raise WireError(f"dtype code {header.dtype} for sparse table {spec.table} of {spec.dtype}")
        count = header.aux
        if not 0 <= count <= min(MAX_ROWS_PER_FRAME, spec.num_rows):
            raise WireError(f"{count} rows in one frame for sparse table {spec.table}")
        per_row = _ID_BYTES + (spec.row_bytes if header.kind == Kind.ROW_PUSH else 0)
        if header.length != count * per_row:
            raise WireError(f"{Kind(header.kind).name} of {header.length} bytes for {count} rows of table {spec.table}")
        buffer = self._receive.get(rank)
        if buffer is None or len(buffer) < header.length:
            buffer = self._receive[rank] = torch.empty(header.length, dtype=torch.uint8)
        return byte_view(buffer[: header.length])

    def handle(self, rank: int, header: Header) -> Tuple[Header, memoryview]:
        spec = self.spec
        count = header.aux
        payload = self._receive[rank][: header.length]
        ids = payload[: _ID_BYTES * count].view(torch.int64)
        if header.kind == Kind.ROW_PUSH:
            grads = payload[_ID_BYTES * count :].view(spec.dtype).view(count, spec.dim)
            self.push(rank, header.clock, ids, grads)
            with self.cond:
                slowest = self.clock.min_clock()
            return Header(Kind.ROWS, header.dtype, spec.table, self.rank, slowest, 0, 0), memoryview(b"")
        rows, staleness, slowest = self.pull(ids, rank, header.clock)
        self._reply[rank] = rows  # kept alive until the reply is sent
        out = Header(
            Kind.ROWS, header.dtype, spec.table, self.rank, slowest, staleness, rows.numel() * rows.element_size()
        )
        return out, byte_view(rows)
