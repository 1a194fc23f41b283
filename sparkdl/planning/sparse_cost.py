"""The cost model of a sparse table (``sparkdl.ShardedEmbedding``) under the parameter server: the
bytes one rank's step puts on the wire and the memory its shard of the table takes, on N ranks.

Plain arithmetic, no torch: the figures a calibration measured of the table (:class:`SparseTable`)
in, bytes out. The wire format is :mod:`sparkdl.strategies.parameter_server.wire`'s, as
:class:`~sparkdl.strategies.parameter_server.sparse_worker.SparseTables` sends it:

* each lookup (a forward's call of the table) pulls the batch's unique ids from their owners:
  to every other rank that owns some of them a ROW_PULL frame of 8 bytes an id, and back a ROWS
  frame of the rows (``dim`` values each);
* each step pushes the step's unique rows (the lookups' ids coalesced) to their owners: to every
  other rank a ROW_PUSH frame of 8 bytes an id plus its gradient row (an empty one where none
  of its rows were touched, so that its clock advances), and back an empty ROWS frame;
* each frame costs its header and its authentication tag (:data:`FRAME_BYTES`).

The ids hash uniformly onto the ranks (SplitMix64), so (N−1)/N of the rows are remote, and a
lookup of u unique rows reaches each other rank with probability 1 − (1 − 1/N)^u.

Memory per rank: its 1/N share of the table's rows, each with its values, its row optimizer's
state (Adagrad: one sum a value; Adam: two moments and a step count) and the store's index
(:mod:`~sparkdl.strategies.parameter_server.row_store`: at most 24 bytes a row), plus a step's
pulled rows and their gradients. The whole table is counted: rows are created on first touch,
so a run that touches a fraction of them holds less; the plan prices the table the user declared.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

#: A frame's header (``wire.HEADER``: 36 bytes) and its authentication tag (``frames.TAG_BYTES``: 16).
FRAME_BYTES = 36 + 16
#: Bytes of a row id on the wire.
ID_BYTES = 8
#: The row store's index per row held, at most: an int64 id and int32 buckets at least a quarter full.
INDEX_BYTES_PER_ROW = 24


@dataclasses.dataclass(frozen=True)
class SparseTable:
    """One sparse table, as the cost model sees it.

    Attributes:
        name: the module's name in the model.
        num_rows, dim: the table's shape.
        value_bytes: bytes of one value (4 for float32).
        state_bytes_per_row: the row optimizer's state per row (SGD 0, Adagrad ``dim`` values,
            Adam two moments and an 8-byte step count).
        pulled_rows: unique rows one rank pulls per step (summed over the step's lookups),
            measured on the user's batches.
        pushed_rows: unique rows one rank pushes per step (the step's lookups coalesced).
        lookups: the table's lookups per step.
    """

    name: str
    num_rows: int
    dim: int
    value_bytes: int
    state_bytes_per_row: int
    pulled_rows: float
    pushed_rows: float
    lookups: float = 1.0

    @property
    def row_bytes(self) -> int:
        return self.dim * self.value_bytes

    def frames_per_step(self, workers: int) -> float:
        """Frames one rank sends and receives per step, both ways: a pull (request and reply) to
        each other rank a lookup reaches, a push (request and ack) to every other rank."""
        if workers <= 1:
            return 0.0
        per_lookup = self.pulled_rows / self.lookups if self.lookups > 0 else 0.0
        reached = (workers - 1) * (1 - (1 - 1 / workers) ** per_lookup)
        return 2 * self.lookups * reached + 2 * (workers - 1)

    def wire_bytes(self, workers: int) -> float:
        """Bytes of this table's frames one rank sends and receives per step, both ways."""
        if workers <= 1:
            return 0.0
        remote = (workers - 1) / workers
        per_row = ID_BYTES + self.row_bytes
        rows = remote * (self.pulled_rows + self.pushed_rows) * per_row
        return self.frames_per_step(workers) * FRAME_BYTES + rows

    def messages_per_step(self, workers: int) -> float:
        """Round trips on the step's path: one per lookup (its pulls go out at once) and one for
        the push."""
        return 0.0 if workers <= 1 else self.lookups + 1

    def shard_bytes(self, workers: int) -> float:
        """Memory of one rank's share of the table's rows, their state and the index."""
        return self.num_rows / workers * (self.row_bytes + self.state_bytes_per_row + INDEX_BYTES_PER_ROW)

    def memory_bytes(self, workers: int) -> float:
        """One rank's memory for the table: its shard plus one step's pulled rows and gradients."""
        return self.shard_bytes(workers) + 2 * self.pulled_rows * self.row_bytes

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def state_bytes_per_row(optimizer: str, dim: int, value_bytes: int) -> int:
    """The row optimizer's state per row (``sgd``, ``adagrad``, ``adam``)."""
    if optimizer == "adagrad":
        return dim * value_bytes
    if optimizer == "adam":
        return 2 * dim * value_bytes + 8
    return 0
