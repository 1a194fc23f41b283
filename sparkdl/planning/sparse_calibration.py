"""How the calibration measures a model's sparse tables: the unique rows the user's own batches
touch per step, which is what their traffic is proportional to (:mod:`.sparse_cost`).

Why measure rather than ask: the unique rows of a batch depend on the ids' distribution (a Zipf
column of a million ids touches far fewer distinct rows in a batch of 4096 than a uniform one),
on the batch size and on how many id columns share a table; the calibration already runs the
model's steps on the user's data, so counting the ids it looks up is exact for that data and
costs nothing more. Outside a parameter server run a ``ShardedEmbedding`` has no rows: each is
bound here to a :class:`CountingRows` source that serves its initial rows (computed from the
row ids, as a server would create them) and counts what each step looks up.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from sparkdl.planning.sparse_cost import SparseTable, state_bytes_per_row
from sparkdl.strategies.parameter_server.embedding import ShardedEmbedding, sharded_embeddings
from sparkdl.strategies.parameter_server.rows import initial_rows

__all__ = ["CountingRows", "bind_counting", "measured_tables"]


class CountingRows:
    """The row source of one calibrated table: initial rows, and the ids of each step counted."""

    def __init__(self, name: str, module: ShardedEmbedding) -> None:
        self.name, self.module = name, module
        self._step_ids: List[torch.Tensor] = []
        #: Per finished step: (unique rows summed over its lookups, unique rows of the step, lookups).
        self.steps: List[tuple] = []

    def pull_rows(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        module = self.module
        module.pending.clear()  # the last step's rows: nothing pushes them here
        self._step_ids.append(ids)
        return initial_rows(module.seed, table, ids, module.dim, module.init_std, module.dtype)

    def end_step(self) -> None:
        """Records the step's lookups (a step that looked nothing up is not one of this table's)."""
        if self._step_ids:
            pulled = sum(len(ids) for ids in self._step_ids)
            pushed = len(torch.unique(torch.cat(self._step_ids)))
            self.steps.append((pulled, pushed, len(self._step_ids)))
        self._step_ids = []

    def table(self) -> SparseTable:
        module = self.module
        value_bytes = torch.empty((), dtype=module.dtype).element_size()
        count = max(1, len(self.steps))
        return SparseTable(
            name=self.name,
            num_rows=module.num_rows,
            dim=module.dim,
            value_bytes=value_bytes,
            state_bytes_per_row=state_bytes_per_row(module.row_optimizer.name, module.dim, value_bytes),
            pulled_rows=sum(step[0] for step in self.steps) / count,
            pushed_rows=sum(step[1] for step in self.steps) / count,
            lookups=sum(step[2] for step in self.steps) / count if self.steps else 1.0,
        )


def bind_counting(model: torch.nn.Module) -> List[CountingRows]:
    """Binds each of ``model``'s ShardedEmbeddings (table numbers in ``named_modules`` order, as
    the parameter server numbers them) to a :class:`CountingRows`."""
    sources = []
    for table, (name, module) in enumerate(sharded_embeddings(model)):
        source = CountingRows(name, module)
        module.bind(table, name, source)
        sources.append(source)
    return sources


def measured_tables(sources: List[CountingRows]) -> List[Dict[str, Any]]:
    """The tables as the calibration returns them (plain dicts: they travel to the driver)."""
    return [source.table().to_json() for source in sources]
