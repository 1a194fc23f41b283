"""``sparkdl.ShardedEmbedding``: an embedding table whose rows live on the parameter servers,
sharded by row over all ranks, pulled and pushed by the rows each batch touches.

Why a module of its own rather than the strategy taking over ``nn.Embedding(sparse=True)``:
``nn.Embedding(num_rows, dim)`` allocates and initializes its whole ``weight`` when the user's
``model()`` builds it, on every rank, before any strategy sees it — a 10 M x 64 table is 2.5 GB
on each rank, and a table larger than a worker cannot even be built. It is also a parameter of
the user's dense optimizer (whose Adam would keep two more full-size moments). A
``ShardedEmbedding`` holds no parameter and no rows: constructing it costs nothing, the user's
optimizer never sees it, and under :class:`~sparkdl.strategies.parameter_server.ParameterServer`
each rank stores only the rows it owns (a hash of the row id picks the rank, so the hot ids of
a Zipf distribution spread over all ranks), created on first touch from (seed, table, row id)
so that the values do not depend on the number of ranks. The row-wise optimizer (SGD, Adagrad,
lazy Adam: :class:`~sparkdl.strategies.parameter_server.rows.RowOptimizer`) is the table's own
setting and runs on the owning server, with each row's state next to the row.

Per forward a worker pulls the unique ids of the batch (once each), looks the batch up in that
small tensor, and the gradient reaches only those rows; the optimizer's ``step()`` pushes them
(ids and gradient rows) to their owners with the dense gradients. See ``docs/embeddings.md``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch

from sparkdl.errors import ConfigError, DataError
from sparkdl.strategies.parameter_server.rows import RowOptimizer
from sparkdl.strategies.parameter_server.table_files import (
    REFERENCE_KEY,
    TableFiles,
    decode_reference,
    encode_reference,
)

__all__ = [
    "MODES",
    "RowSource",
    "ShardedEmbedding",
    "check_sharded_embeddings",
    "refuse_sharded_embeddings",
    "sharded_embeddings",
]

#: The values of ``ShardedEmbedding.mode``: one row per id, or a bag's sum or mean per sample.
MODES = (None, "sum", "mean")
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class RowSource(Protocol):
    """Where a bound table's rows come from (the rank's parameter server runtime)."""

    def pull_rows(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """The current rows ``ids`` (unique, in range) of sparse table ``table``."""


class ShardedEmbedding(torch.nn.Module):
    """An embedding table sharded by row over the parameter servers (``strategy=ParameterServer``).

    Args:
        num_rows: rows in the table (ids are ``0 .. num_rows - 1``).
        dim: the width of a row.
        mode: ``None``: one row per id, output ``ids.shape + (dim,)``; ``"sum"`` or ``"mean"``:
            ``ids`` of shape ``(batch, bag)`` give ``(batch, dim)`` (an ``nn.EmbeddingBag``).
        optimizer: ``"sgd"``, ``"adagrad"`` (default) or ``"adam"`` (lazy: each row with its
            own step count), applied row by row on the servers; the user's optimizer updates
            the dense parameters only.
        lr: the row optimizer's learning rate (LR schedulers of the user's optimizer do not
            change it).
        betas: Adam's betas.
        eps: the optimizer's epsilon; default 1e-10 (Adagrad), 1e-8 (Adam).
        initial_accumulator: Adagrad's initial sum of squares.
        init_std: rows start as N(0, init_std²); default ``1 / sqrt(dim)``; 0 for zeros.
        seed: with the table's number (its place among the model's ShardedEmbeddings), what a
            row's initial values are drawn from.
        dtype: float32 (default) or float64.

    Example::

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.items = sparkdl.ShardedEmbedding(10_000_000, 32, mode="sum", optimizer="adagrad", lr=0.05)
                self.head = torch.nn.Linear(32, 1)

            def forward(self, item_ids):
                return self.head(self.items(item_ids))
    """

    #: A fitted table written by ``ParameterServer(tables_dir=...)``: its files, which lookups
    #: read (:mod:`~sparkdl.strategies.parameter_server.table_files`); None otherwise. A class
    #: default, so that modules pickled before it existed unpickle.
    _files: Optional[TableFiles] = None
    #: The prefetch's per-forward state (set in ``__init__``); class defaults for the same reason.
    prefetched: Any = ()
    seen: Optional[List[torch.Tensor]] = None

    def __init__(
        self,
        num_rows: int,
        dim: int,
        mode: Optional[str] = None,
        optimizer: str = "adagrad",
        lr: float = 0.01,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: Optional[float] = None,
        initial_accumulator: float = 0.0,
        init_std: Optional[float] = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        for field, value in (("num_rows", num_rows), ("dim", dim)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not 0 < value < 2**62:
                raise ConfigError(f"ShardedEmbedding {field}={value!r} must be a positive integer")
        if mode not in MODES:
            raise ConfigError(f"ShardedEmbedding mode={mode!r} must be one of {', '.join(map(repr, MODES))}")
        if dtype not in (torch.float32, torch.float64):
            raise ConfigError(f"ShardedEmbedding dtype={dtype} must be torch.float32 or torch.float64")
        std = 1.0 / math.sqrt(dim) if init_std is None else init_std
        if not isinstance(std, numbers.Real) or not (math.isfinite(std) and std >= 0):
            raise ConfigError(f"ShardedEmbedding init_std={init_std!r} must be a finite number >= 0")
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise ConfigError(f"ShardedEmbedding seed={seed!r} must be an integer")
        self.num_rows, self.dim, self.mode = int(num_rows), int(dim), mode
        if eps is not None and (not isinstance(eps, numbers.Real) or not (math.isfinite(eps) and eps >= 0)):
            raise ConfigError(f"ShardedEmbedding eps={eps!r} must be None (the optimizer's default) or a number >= 0")
        self.row_optimizer = RowOptimizer(optimizer, lr, betas, -1.0 if eps is None else eps, initial_accumulator)
        self.init_std, self.seed, self.dtype = float(std), int(seed), dtype
        self.table_name = ""
        self._table: Optional[int] = None
        self._source: Optional[RowSource] = None
        #: (unique ids, their pulled rows) of the forwards since the last push; the runtime's
        #: push takes and clears them.
        self.pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
        #: Rows pulled for this forward's lookups before it started, and the id tensors of its
        #: lookups that had none (:mod:`~sparkdl.strategies.parameter_server.prefetch`).
        self.prefetched: List[Any] = []
        self.seen: Optional[List[torch.Tensor]] = None

    def extra_repr(self) -> str:
        return f"{self.num_rows}, {self.dim}, mode={self.mode!r}, optimizer={self.row_optimizer.name!r}"

    def __getstate__(self) -> Dict[str, Any]:
        # A copy is unbound: the runtime (sockets, threads) does not travel.
        state = dict(self.__dict__)
        state.update(_table=None, _source=None, pending=[], prefetched=[], seen=None)
        return state

    def bind(self, table: int, name: str, source: RowSource) -> None:
        """Called by the runtime's ``prepare_model``: this module is sparse table ``table``."""
        self._table, self.table_name, self._source = table, name, source

    @property
    def source(self) -> Optional[RowSource]:
        """Where the rows come from while the table is bound to a run's servers, else None."""
        return self._source

    @property
    def table(self) -> Optional[int]:
        """The table's number among the model's sparse tables once bound, else None."""
        return self._table

    def check_ids(self, ids: torch.Tensor) -> None:
        """Raises DataError for ids that are not integers or not in ``[0, num_rows)``."""
        where = f"ShardedEmbedding {self.table_name or '(unbound)'!r} (table {self._table}, {self.num_rows} rows)"
        if not isinstance(ids, torch.Tensor) or ids.dtype not in _INTEGER_DTYPES:
            got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise DataError(f"{where} takes integer row ids, got {got}; cast the id column to an integer type")
        if ids.numel() == 0:
            return
        low, high = int(ids.min()), int(ids.max())
        bad = low if low < 0 else high if high >= self.num_rows else None
        if bad is not None:
            raise DataError(
                f"{where}: id {bad} is out of range [0, {self.num_rows}); map the ids into the table "
                f"or raise its num_rows"
            )

    def materialize(self, weight: torch.Tensor) -> None:
        """Makes this module a plain, complete table: ``weight`` (``num_rows x dim``) becomes its
        ``weight`` buffer (what ``state_dict`` saves and the fitted model looks up) and the
        module is unbound from the servers. The runtime's ``final_module`` calls it on rank 0."""
        if tuple(weight.shape) != (self.num_rows, self.dim):
            raise ValueError(f"a table of {tuple(weight.shape)} for a ShardedEmbedding of {(self.num_rows, self.dim)}")
        self.register_buffer("weight", weight.to(self.dtype))
        self._source, self.pending, self._files = None, [], None

    def attach_files(self, files: TableFiles) -> None:
        """Makes this module a fitted table read from ``files`` (what the runtime's
        ``final_module`` does under ``ParameterServer(tables_dir=...)``): lookups map its parts,
        ``state_dict`` carries a reference to them, not rows, and the module is unbound."""
        self._buffers.pop("weight", None)
        self._source, self.pending, self._files = None, [], files
        self.table_name = self.table_name or files.info.name

    @property
    def table_files(self) -> Optional[TableFiles]:
        """The files of a fitted table written by ``ParameterServer(tables_dir=...)``, else None."""
        return self._files

    def load_full_table(self) -> torch.Tensor:
        """Reads a files-backed table whole into memory (``num_rows x dim``) as its ``weight``
        buffer, which ``state_dict`` then holds instead of the reference; returns it. Only when
        asked: a table of many GB is meant to stay in its files."""
        if self._files is None:
            weight = self._buffers.get("weight")
            if weight is None:
                raise ConfigError(f"ShardedEmbedding {self.table_name!r} holds no fitted table to load")
            return weight
        self.materialize(self._files.full_table())
        return self._buffers["weight"]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._files is not None:  # a reference to the table's files, never a partial table
            destination[prefix + REFERENCE_KEY] = encode_reference(self._files.url, self._files.info)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # A fitted model's state_dict holds the complete table, or a reference to its files: an
        # unbound module (the driver's, a loaded TorchModel's) takes either. Bound ones never do.
        if self._source is None and prefix + REFERENCE_KEY in state_dict:
            url, info = decode_reference(state_dict[prefix + REFERENCE_KEY])
            self.attach_files(TableFiles(url, info))
        elif prefix + "weight" in state_dict and "weight" not in self._buffers and self._source is None:
            self.register_buffer("weight", torch.empty(self.num_rows, self.dim, dtype=self.dtype))
            self._files = None
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if prefix + REFERENCE_KEY in unexpected_keys:
            unexpected_keys.remove(prefix + REFERENCE_KEY)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The current rows ``ids`` (any shape of integer ids) as ``ids.shape + (dim,)``, without
        recording a gradient: how a custom loop reads the trained table while the run is open."""
        with torch.no_grad():
            return self._lookup(ids, record=False).detach()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Looks the ids up (``mode=None``) or reduces each bag (``"sum"``, ``"mean"``)."""
        if self.mode is not None and (not isinstance(ids, torch.Tensor) or ids.dim() != 2):
            raise DataError(
                f"ShardedEmbedding {self.table_name!r} with mode={self.mode!r} takes ids of shape (batch, bag), got "
                f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}"
            )
        out = self._lookup(ids, record=torch.is_grad_enabled())
        if self.mode == "sum":
            return out.sum(dim=1)
        if self.mode == "mean":
            return out.mean(dim=1)
        return out

    def _lookup(self, ids: torch.Tensor, record: bool) -> torch.Tensor:
        weight = self._buffers.get("weight")
        if self._source is None and (weight is not None or self._files is not None):
            if record and self.training:
                raise ConfigError(
                    f"ShardedEmbedding {self.table_name!r} holds a fitted table (a buffer, not trained here): "
                    f"train it under strategy=sparkdl.ParameterServer(...), or call model.eval() to use it"
                )
            self.check_ids(ids)
            if weight is None:  # a files-backed table (ParameterServer(tables_dir=...))
                return self._files.rows(ids).to(ids.device)
            return torch.nn.functional.embedding(ids.long(), weight)
        if self._source is None:
            raise ConfigError(
                "ShardedEmbedding rows live on the parameter servers: train the model with "
                "strategy=sparkdl.ParameterServer(...) and pass it through ctx.prepare_model (under another "
                "strategy, or outside a run, its rows would never be trained)"
            )
        device = ids.device
        if self.prefetched and self.prefetched[0].serves(ids):
            entry = self.prefetched.pop(0)
            unique, inverse, rows = entry.unique, entry.inverse, entry.rows
        else:
            if self.seen is not None:
                self.seen.append(ids)
            self.check_ids(ids)
            unique, inverse = torch.unique(ids.detach().to("cpu", torch.int64), sorted=True, return_inverse=True)
            rows = self._source.pull_rows(self._table, unique)
        if record:
            rows.requires_grad_(True)
            self.pending.append((unique, rows))
        return torch.nn.functional.embedding(inverse.to(device), rows.to(device))


def sharded_embeddings(module: torch.nn.Module) -> List[Tuple[str, ShardedEmbedding]]:
    """The model's ShardedEmbeddings (name, module), in ``named_modules`` order: their tables'
    numbers. A module reachable under two names counts once."""
    return [
        (name or type(module).__name__, sub)
        for name, sub in module.named_modules()
        if isinstance(sub, ShardedEmbedding)
    ]


def refuse_sharded_embeddings(module: torch.nn.Module, what: str) -> None:
    """Raises ConfigError, before anything launches, when ``module`` holds ShardedEmbeddings
    and ``what`` (a feature this slice does not cover for them) would use it."""
    names = [name for name, _ in sharded_embeddings(module)]
    if names:
        raise ConfigError(
            f"{what} does not support ShardedEmbedding tables yet ({', '.join(map(repr, names[:5]))} of "
            f"{type(module).__name__}); see docs/embeddings.md for what covers them"
        )


def check_sharded_embeddings(module: torch.nn.Module, strategy_name: str) -> None:
    """On the driver, before a fit launches: a model with ShardedEmbeddings trains only under
    ParameterServer (ConfigError naming the setting); checkpoints and (elastic) resumes cover
    its tables (:mod:`~sparkdl.strategies.parameter_server.sparse_checkpoint`)."""
    names = [name for name, _ in sharded_embeddings(module)]
    if not names:
        return
    if strategy_name != "parameter_server":
        raise ConfigError(
            f"{type(module).__name__} holds ShardedEmbedding tables ({', '.join(map(repr, names[:5]))}), whose rows "
            f"live on the parameter servers: use strategy=sparkdl.ParameterServer(...), not {strategy_name!r}"
        )
