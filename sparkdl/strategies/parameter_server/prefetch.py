"""One round trip per peer for a forward's sparse lookups: the tables' ids are read from the
model's inputs before its ``forward`` runs, and every table's rows pulled together.

Each ``ShardedEmbedding`` lookup needs its rows before the forward can go on, so a model of ten
tables looked up one after another waits for ten round trips to every peer per forward, and
the peer's server wakes ten times. A DLRM's tables are usually looked up with id tensors that
are the model's inputs as given (``self.tables[name](features[name])``); then the ids are known
before ``forward`` starts.

How it finds them, without the user declaring anything: on a forward without a prefetch, each
table's lookups note the id tensors they got; after that forward, a table whose every id tensor
*is* one of the forward's arguments (the same object, found in ``args``/``kwargs`` and in the
dicts, lists and tuples in them) is bound to where it was found. Before the next forwards a
pre-hook takes the tensors from those places, checks them as a lookup would, and pulls every
bound table's unique rows with one :meth:`SparseTables.pull_many`. A lookup uses its prefetched
rows only if it gets that very tensor, unmodified since (``Tensor._version``), in the same order;
anything else (a model that computes its ids, a routing that changed) is an ordinary pull, and a
table whose prefetch went unused is unbound until a later forward binds it again. So the result
is always the same rows a plain lookup would have pulled; only the waiting changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import torch

from sparkdl.strategies.parameter_server.embedding import ShardedEmbedding

__all__ = ["LookupPrefetch", "Prefetched"]

#: How deep the search for an id tensor goes into the arguments' dicts, lists and tuples.
_MAX_DEPTH = 3
#: Where a tensor was found: ("args", 0, "c1") is args[0]["c1"], ("kwargs", "c1") kwargs["c1"].
Path = Tuple[Any, ...]


class BatchRowSource(Protocol):
    """What the prefetch pulls through (the rank's :class:`SparseTables`)."""

    def pull_many(self, lookups: Sequence[Tuple[int, torch.Tensor]]) -> List[torch.Tensor]:
        """The rows of each ``(table, unique sorted ids)``, in order."""


@dataclass
class Prefetched:
    """One lookup's rows, pulled before the forward: valid for ``ids`` at ``version`` only."""

    ids: torch.Tensor
    version: int
    unique: torch.Tensor
    inverse: torch.Tensor
    rows: torch.Tensor

    def serves(self, ids: torch.Tensor) -> bool:
        return ids is self.ids and ids._version == self.version


def _find(value: Any, target: torch.Tensor, path: Path, depth: int) -> Optional[Path]:
    if value is target:
        return path
    if depth >= _MAX_DEPTH:
        return None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    else:
        return None
    for key, item in items:
        found = _find(item, target, path + (key,), depth + 1)
        if found is not None:
            return found
    return None


def _resolve(args: Tuple[Any, ...], kwargs: Dict[str, Any], path: Path) -> Any:
    value: Any = args if path[0] == "args" else kwargs
    for key in path[1:]:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return value


class LookupPrefetch:
    """The pre- and post-forward hooks of one prepared model (see the module's docstring)."""

    def __init__(self, model: torch.nn.Module, tables: List[ShardedEmbedding], source: BatchRowSource) -> None:
        self._tables, self._source = tables, source
        #: Per table: where each of its lookups' ids were found, in lookup order.
        self.bindings: Dict[int, List[Path]] = {}
        #: Lookups that took prefetched rows, and forwards whose every lookup did (for tests
        #: and benchmarks).
        self.served_lookups = 0
        self.served_forwards = 0
        self._planned = 0
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True, always_call=True),
        ]

    def remove(self) -> None:
        """Detaches the hooks (the run's end: the tables are no longer bound to the servers)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for table in self._tables:
            table.prefetched, table.seen = [], None

    def _before(self, model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        lookups: List[Tuple[int, torch.Tensor]] = []
        entries: List[Prefetched] = []
        for index, table in enumerate(self._tables):
            table.prefetched, table.seen = [], []
            if table.source is not self._source:  # unbound: the run's end made it a plain table
                table.seen = None
                continue
            for path in self.bindings.get(index, ()):
                ids = _resolve(args, kwargs, path)
                if not isinstance(ids, torch.Tensor):
                    self.bindings.pop(index)
                    break
                table.check_ids(ids)  # the DataError a lookup would raise, raised before the pulls
                unique, inverse = torch.unique(ids.detach().to("cpu", torch.int64), sorted=True, return_inverse=True)
                lookups.append((table.table, unique))
                entries.append(Prefetched(ids, ids._version, unique, inverse, torch.empty(0)))
                table.prefetched.append(entries[-1])
        self._planned = len(entries)
        if not lookups:
            return
        for entry, rows in zip(entries, self._source.pull_many(lookups)):
            entry.rows = rows

    def _after(self, model: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> None:
        served = True
        self.served_lookups += self._planned - sum(len(table.prefetched) for table in self._tables)
        self._planned = 0
        for index, table in enumerate(self._tables):
            if table.prefetched:  # pulled for a lookup that did not come: the routing changed
                self.bindings.pop(index, None)
                served = False
            seen, table.prefetched, table.seen = table.seen, [], None
            if not seen:
                continue
            served = False
            paths = [_find(kwargs, ids, ("kwargs",), 0) or _find(args, ids, ("args",), 0) for ids in seen]
            if all(path is not None for path in paths) and index not in self.bindings:
                self.bindings[index] = paths  # type: ignore[assignment]
        if served and self.bindings:
            self.served_forwards += 1
