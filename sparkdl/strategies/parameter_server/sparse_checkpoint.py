"""Checkpoints of the sparse tables: each rank saves the rows it owns, and a resume on M ranks
takes from the old parts only the rows that it owns under the new hashing.

A rank's part holds, per table, the ids of the rows it has materialized, their values and their
row optimizer's state (Adagrad's sums, Adam's moments and per-row step counts), taken under the
shard's lock between the same barriers as the dense shards (a consistent cut). No table is ever
gathered on one rank. Rows never touched are not saved: their values depend only on
(seed, table, id), and they are created again on first touch.

On M ranks (:func:`reshard_tables`) new rank ``r`` goes through the old parts one at a time and
keeps the rows with ``owners(id, M) == r``; what it holds at any time is its own rows plus one
old part's selection of them. The clocks restart level, at the checkpoint's clock, as the dense
shards' do (:mod:`~sparkdl.strategies.parameter_server.reshard`).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence

import torch

from sparkdl.strategies.parameter_server.rows import owners
from sparkdl.strategies.parameter_server.sparse_shard import SparseSpec

__all__ = ["check_table_state", "reshard_tables"]


def check_table_state(spec: SparseSpec, saved: Dict[str, Any]) -> None:
    """Raises ValueError when ``saved`` (one table of a checkpoint) is not a state of ``spec``'s
    table: another table, another row optimizer, or rows of the wrong shape."""
    if saved.get("fingerprint") != spec.fingerprint():
        raise ValueError(
            f"ParameterServer checkpoint of sparse table {spec.table} ({spec.name!r}) holds another table: "
            f"{saved.get('fingerprint')} is not {spec.fingerprint()}"
        )
    if saved.get("optimizer") != spec.optimizer.name:
        raise ValueError(
            f"ParameterServer checkpoint of sparse table {spec.table} ({spec.name!r}) was trained with "
            f"optimizer={saved.get('optimizer')!r}, this run uses optimizer={spec.optimizer.name!r}"
        )
    ids, values = saved["ids"], saved["values"]
    count = len(ids)
    if ids.dtype != torch.int64 or tuple(values.shape) != (count, spec.dim) or values.dtype != spec.dtype:
        raise ValueError(f"ParameterServer checkpoint of sparse table {spec.table}: rows of the wrong shape or dtype")
    if count and (int(ids.min()) < 0 or int(ids.max()) >= spec.num_rows):
        raise ValueError(f"ParameterServer checkpoint of sparse table {spec.table}: row ids out of range")
    expected = set(spec.optimizer.new_state(0, spec.dim, spec.dtype))
    if set(saved["state"]) != expected or any(len(value) != count for value in saved["state"].values()):
        raise ValueError(f"ParameterServer checkpoint of sparse table {spec.table}: optimizer state does not fit")


def _select(saved: Dict[str, Any], mine: torch.Tensor) -> Dict[str, Any]:
    return {
        "ids": saved["ids"][mine],
        "values": saved["values"][mine],
        "state": {key: value[mine] for key, value in saved["state"].items()},
    }


def reshard_tables(
    specs: Sequence[SparseSpec], old_parts: Iterable[Sequence[Dict[str, Any]]], rank: int, world_size: int
) -> List[Dict[str, Any]]:
    """New rank ``rank``'s sparse-table states from the old ranks' ones.

    Args:
        specs: this run's sparse tables.
        old_parts: every old rank's list of table states (the ``"sparse"`` entry of its
            :meth:`ParameterServerRuntime.state_dict`), in rank order; consumed one at a time.
        rank, world_size: the new rank and number of ranks.

    Raises:
        ValueError: the checkpoint's tables are not this run's, or a row is in two parts.
    """
    kept: List[List[Dict[str, Any]]] = [[] for _ in specs]
    clocks: List[int] = [0] * len(specs)
    # Not enumerate(old_parts): its reused result tuple would hold a part while the next is read.
    first = True
    for part in old_parts:
        if len(part) != len(specs):
            raise ValueError(
                f"ParameterServer checkpoint holds {len(part)} sparse tables, this run has {len(specs)} ShardedEmbeddings"
            )
        for spec, saved in zip(specs, part):
            check_table_state(spec, saved)
            if first:
                clocks[spec.table] = int(saved["worker_clock"])
            kept[spec.table].append(_select(saved, owners(saved["ids"], world_size) == rank))
        first, part, saved = False, None, None  # released before the next part is read
    out = []
    for spec, pieces in zip(specs, kept):
        ids = torch.cat([piece["ids"] for piece in pieces]) if pieces else torch.empty(0, dtype=torch.int64)
        if len(torch.unique(ids)) != len(ids):
            raise ValueError(f"ParameterServer checkpoint of sparse table {spec.table}: a row is saved twice")
        empty = spec.optimizer.new_state(0, spec.dim, spec.dtype)
        out.append(
            {
                "fingerprint": spec.fingerprint(),
                "optimizer": spec.optimizer.name,
                "ids": ids,
                "values": torch.cat([p["values"] for p in pieces])
                if pieces
                else torch.empty(0, spec.dim, dtype=spec.dtype),
                "state": {key: torch.cat([empty[key], *(p["state"][key] for p in pieces)]) for key in empty},
                "clocks": [clocks[spec.table]] * world_size,
                "worker_clock": clocks[spec.table],
            }
        )
    return out
