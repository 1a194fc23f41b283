"""A fitted sparse table as files: each rank writes the rows it holds, and lookups read them
memory-mapped, so no process ever holds the table.

Why: returning a table whole streams every rank's rows to rank 0 and sends the result through
Spark's task result to the driver, through two JVM heaps; a table of many GB dies there. With
``ParameterServer(tables_dir=...)`` the runtime's ``final_module`` has each rank write its own
rows here instead (:meth:`SparseTables.write_files
<sparkdl.strategies.parameter_server.sparse_worker.SparseTables.write_files>`), and the fitted
``ShardedEmbedding`` looks ids up in these files (:class:`TableFiles`).

One table's directory::

    manifest.json                 written last, by rank 0, once every part is in
    part-00000.ids.npy            rank 0's rows: their ids, int64, sorted
    part-00000.values.npy         and their values, [rows, dim], in the same order
    part-00001.ids.npy ...

A part holds the rows its rank owns that some batch touched; optimizer state is not written
(the model needs the values only; checkpoints keep the state). A row never touched is in no
part: its value is its initial one, computed from (seed, table, id). The ``.npy`` files are
plain numpy arrays that ``np.load(..., mmap_mode="r")`` maps; an id's part is its owner under
the training's hash (:func:`~sparkdl.strategies.parameter_server.rows.owners` with the
manifest's ``world_size``), found there by binary search.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import shutil
import tempfile
import threading
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pyarrow.fs as pafs
import torch

from sparkdl import filesystem
from sparkdl.errors import DataError
from sparkdl.strategies.parameter_server.rows import initial_rows, owners

__all__ = ["MANIFEST", "TableFiles", "TableInfo", "part_names", "write_manifest", "write_part"]

FORMAT = 1
MANIFEST = "manifest.json"
#: How ``owners`` picks a row's rank, recorded in every manifest for readers outside sparkdl.
HASH_SCHEME = "splitmix64_finalizer(uint64(id) + 0x9E3779B97F4A7C15) mod world_size"
#: Rows written or assembled per chunk: what a writer or ``full_table`` holds beyond its output.
CHUNK_ROWS = 1 << 18
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclasses.dataclass(frozen=True)
class TableInfo:
    """What identifies a table's values: its shape, dtype and initialization."""

    name: str
    table: int
    num_rows: int
    dim: int
    dtype: str
    seed: int
    init_std: float

    @classmethod
    def of(cls, module: Any, table: int, name: str) -> "TableInfo":
        """The info of a ``ShardedEmbedding`` that is table ``table`` of its model."""
        dtype = str(module.dtype).replace("torch.", "")
        return cls(name, table, module.num_rows, module.dim, dtype, module.seed, module.init_std)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def same_values(self, other: "TableInfo") -> bool:
        """Whether ``other`` describes a table of the same shape, dtype and initial rows (the
        name may differ: a module reached under another name)."""
        return dataclasses.replace(self, name="") == dataclasses.replace(other, name="")


def part_names(rank: int) -> Tuple[str, str]:
    """The ids and values file names of rank ``rank``'s part."""
    return f"part-{rank:05d}.ids.npy", f"part-{rank:05d}.values.npy"


# ---- writing (each rank its part, rank 0 the manifest) ---------------------------------------


def write_part(
    table_url: str, rank: int, ids: np.ndarray, rows_at: Callable[[np.ndarray], np.ndarray], info: TableInfo
) -> Dict[str, Any]:
    """Writes rank ``rank``'s part of the table at ``table_url``: ``ids`` (int64, the rows it
    holds, any order) sorted, and their values, read ``CHUNK_ROWS`` at a time with
    ``rows_at(positions in ids)``, so the writer holds the ids and one chunk, never a second
    copy of its shard. Returns the part's manifest entry."""
    _, fs, root = filesystem.open_url(table_url, "ParameterServer(tables_dir=...)")
    fs.create_dir(root, recursive=True)
    order = np.argsort(ids, kind="stable")
    ids_name, values_name = part_names(rank)
    _write_npy(fs, filesystem.join(root, ids_name), np.int64, (len(ids),), lambda s, e: ids[order[s:e]])
    dtype = torch.empty(0, dtype=info.torch_dtype).numpy().dtype
    shape = (len(ids), info.dim)
    _write_npy(fs, filesystem.join(root, values_name), dtype, shape, lambda s, e: rows_at(order[s:e]))
    return {"rank": rank, "ids": ids_name, "values": values_name, "rows": len(ids)}


def _write_npy(
    fs: pafs.FileSystem, path: str, dtype: Any, shape: Tuple[int, ...], chunk: Callable[[int, int], np.ndarray]
) -> None:
    """A ``.npy`` file of ``shape`` written chunk by chunk (to a temporary name, then renamed)."""
    dtype = np.dtype(dtype).newbyteorder("<")
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(temporary) as out:
        np.lib.format.write_array_header_1_0(out, header)
        for start in range(0, shape[0], CHUNK_ROWS):
            end = min(start + CHUNK_ROWS, shape[0])
            out.write(np.ascontiguousarray(chunk(start, end), dtype=dtype).tobytes())
    fs.move(temporary, path)


def write_manifest(table_url: str, info: TableInfo, world_size: int, parts: List[Dict[str, Any]]) -> None:
    """The table's manifest, written once every part is (its presence means the table is whole)."""
    document = {
        "format": FORMAT,
        **dataclasses.asdict(info),
        "world_size": world_size,
        "hash": HASH_SCHEME,
        "parts": sorted(parts, key=lambda part: part["rank"]),
        "rows_stored": sum(int(part["rows"]) for part in parts),
    }
    filesystem.write_file(filesystem.url_join(table_url, MANIFEST), json.dumps(document, indent=2).encode())


# ---- reading -----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Part:
    ids: np.ndarray
    values: np.ndarray


class TableFiles:
    """A fitted table read from its files: lookups map the parts (a non-local URL is copied to a
    local directory once per process first) and take a row from its owner's part where stored,
    else its initial value. Pickles as its URL and info only.

    Args:
        url: the table's directory (a local path or a URL).
        info: what the module using it expects; the manifest must describe the same table.
    """

    def __init__(self, url: str, info: TableInfo) -> None:
        self.url, self.info = url, info
        self._parts: Optional[List[_Part]] = None
        self._world_size = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:
        return {"url": self.url, "info": self.info}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["url"], state["info"])

    def __repr__(self) -> str:
        return f"TableFiles({self.url!r}, table {self.info.table} {self.info.name!r})"

    def _where(self) -> str:
        info = self.info
        return f"ShardedEmbedding {info.name!r} (table {info.table}, {info.num_rows} rows)"

    def manifest(self) -> Dict[str, Any]:
        """The table's manifest (read from its directory at every call)."""
        path = filesystem.url_join(self.url, MANIFEST)
        try:
            manifest = json.loads(filesystem.read_file(path, "ParameterServer(tables_dir=...)"))
        except Exception as exc:  # noqa: BLE001 - any failure to read it: the table cannot be used
            raise DataError(f"{self._where()}: cannot read its table files' manifest {path!r} ({exc})") from exc
        saved = TableInfo(**{field.name: manifest.get(field.name) for field in dataclasses.fields(TableInfo)})
        if manifest.get("format") != FORMAT or not saved.same_values(self.info):
            raise DataError(
                f"{self._where()}: the table files at {self.url!r} hold another table ({saved}); this model's is "
                f"{self.info}"
            )
        return manifest

    def check_complete(self) -> None:
        """Raises DataError unless the manifest and every part file it lists can be seen from
        this process: what a fit checks on every rank once the files are written, without
        reading (or, from an object store, copying) any rows."""
        manifest = self.manifest()
        _, fs, root = filesystem.open_url(self.url, "ParameterServer(tables_dir=...)")
        paths = [filesystem.join(root, part[key]) for part in manifest["parts"] for key in ("ids", "values")]
        missing = [info.path for info in fs.get_file_info(paths) if info.type != pafs.FileType.File]
        if missing:
            raise DataError(f"{self._where()}: part files not found at {self.url!r}: {', '.join(missing[:4])}")

    def _open(self) -> List[_Part]:
        with self._lock:
            if self._parts is None:
                manifest = self.manifest()
                local = local_copy(self.url)
                self._parts = [self._map(local, part) for part in manifest["parts"]]
                self._world_size = int(manifest["world_size"])
            return self._parts

    def _map(self, local: str, part: Dict[str, Any]) -> _Part:
        count, dim = int(part["rows"]), self.info.dim
        dtype = torch.empty(0, dtype=self.info.torch_dtype).numpy().dtype
        arrays = []
        for key, shape, kind in (("ids", (count,), np.int64), ("values", (count, dim), dtype)):
            path = filesystem.join(local, part[key])
            try:
                # np.load cannot map an empty array; an empty part is read (it is a header).
                array = np.load(path, mmap_mode="r" if count else None, allow_pickle=False)
            except Exception as exc:  # noqa: BLE001 - missing, unreadable or not an .npy file
                raise DataError(
                    f"{self._where()}: cannot read its part file {path!r} ({type(exc).__name__}: {exc}); the table "
                    f"files at {self.url!r} are incomplete"
                ) from exc
            if array.shape != shape or array.dtype != np.dtype(kind):
                raise DataError(
                    f"{self._where()}: part file {path!r} holds {array.dtype}{list(array.shape)}, its manifest says "
                    f"{np.dtype(kind)}{list(shape)}"
                )
            arrays.append(array)
        return _Part(*arrays)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape of integer ids in range) as ``ids.shape + (dim,)``."""
        flat = ids.reshape(-1).to("cpu", torch.int64)
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        return self._unique_rows(unique)[inverse].reshape(*ids.shape, self.info.dim)

    def _unique_rows(self, ids: torch.Tensor) -> torch.Tensor:
        info = self.info
        parts = self._open()
        out = torch.empty(len(ids), info.dim, dtype=info.torch_dtype)
        values = out.numpy()
        keys = ids.numpy()
        owner = owners(ids, self._world_size).numpy() if len(ids) else np.empty(0, np.int64)
        stored = np.zeros(len(keys), dtype=bool)
        for rank, part in enumerate(parts):
            where = np.flatnonzero(owner == rank)
            if not len(where) or not len(part.ids):
                continue
            wanted = keys[where]
            position = np.minimum(np.searchsorted(part.ids, wanted), len(part.ids) - 1)
            hit = part.ids[position] == wanted
            values[where[hit]] = part.values[position[hit]]
            stored[where[hit]] = True
        if not stored.all():
            missing = torch.from_numpy(np.flatnonzero(~stored))
            out[missing] = initial_rows(info.seed, info.table, ids[missing], info.dim, info.init_std, info.torch_dtype)
        return out

    def full_table(self) -> torch.Tensor:
        """The whole table, ``num_rows x dim``, in memory: what ``ShardedEmbedding.load_full_table``
        asks for explicitly (chunk by chunk, as rank 0 assembled it before)."""
        info = self.info
        parts = self._open()
        full = torch.empty(info.num_rows, info.dim, dtype=info.torch_dtype)
        for start in range(0, info.num_rows, CHUNK_ROWS):
            chunk = torch.arange(start, min(start + CHUNK_ROWS, info.num_rows))
            full[chunk] = initial_rows(info.seed, info.table, chunk, info.dim, info.init_std, info.torch_dtype)
        array = full.numpy()
        for part in parts:
            for start in range(0, len(part.ids), CHUNK_ROWS):
                array[part.ids[start : start + CHUNK_ROWS]] = part.values[start : start + CHUNK_ROWS]
        return full

    def copy_to(self, destination_url: str) -> None:
        """Copies the table's files into directory ``destination_url`` as streams (never loading
        them): what a ``TorchModel.save`` does with them."""
        manifest = self.manifest()
        names = [MANIFEST, *(part[key] for part in manifest["parts"] for key in ("ids", "values"))]
        _, source_fs, source = filesystem.open_url(self.url, "ShardedEmbedding table files")
        _, target_fs, target = filesystem.open_url(destination_url, "model path")
        target_fs.create_dir(target, recursive=True)
        for name in names[1:] + names[:1]:  # the manifest last: a copy is whole once it is there
            try:
                pafs.copy_files(filesystem.join(source, name), filesystem.join(target, name), source_fs, target_fs)
            except Exception as exc:  # noqa: BLE001 - a missing or unreadable part
                raise DataError(
                    f"{self._where()}: cannot copy its part file {filesystem.url_join(self.url, name)!r} to "
                    f"{destination_url!r} ({type(exc).__name__}: {exc})"
                ) from exc


# ---- a process's local copies of tables on other filesystems -------------------------------------

_local_copies: Dict[str, str] = {}
_local_lock = threading.Lock()


def local_copy(url: str) -> str:
    """A local directory holding the table at ``url``: its own path when it is on this machine's
    filesystem, else a copy made once per process (removed when the process exits) that every
    later lookup of the table maps."""
    _, fs, path = filesystem.open_url(url, "ShardedEmbedding table files")
    if isinstance(fs, pafs.LocalFileSystem):
        return path
    with _local_lock:
        found = _local_copies.get(url)
        if found is None:
            found = tempfile.mkdtemp(prefix="sparkdl-table-")
            atexit.register(shutil.rmtree, found, True)
            try:
                pafs.copy_files(path, found, fs, pafs.LocalFileSystem())
            except Exception as exc:  # noqa: BLE001 - in the reader's terms
                shutil.rmtree(found, ignore_errors=True)
                raise DataError(f"cannot copy the table files at {url!r} to this machine ({exc})") from exc
            _local_copies[url] = found
        return found


# ---- references in state dicts ----------------------------------------------------------------

#: The state-dict key (after the module's prefix) of a files-backed table's reference.
REFERENCE_KEY = "table_files"
#: Where ``TorchModel.save`` puts a model's tables, relative to its directory.
SAVED_TABLES = "tables"


def encode_reference(url: str, info: TableInfo) -> torch.Tensor:
    """The reference a files-backed table puts in its state dict: JSON of the table's URL and
    info as a uint8 tensor, so that the state dict stays tensors only (``torch.load(...,
    weights_only=True)``, ``.to(device)`` and every other tensor-wise code take it)."""
    document = json.dumps({"format": FORMAT, "url": url, **dataclasses.asdict(info)})
    return torch.frombuffer(bytearray(document.encode()), dtype=torch.uint8).clone()


def decode_reference(tensor: torch.Tensor) -> Tuple[str, TableInfo]:
    """``(url, info)`` of :func:`encode_reference`'s tensor."""
    document = json.loads(bytes(tensor.to("cpu", torch.uint8).numpy()).decode())
    return document["url"], TableInfo(**{field.name: document[field.name] for field in dataclasses.fields(TableInfo)})


def _rewrite_references(state: Dict[str, Any], rewrite: Callable[[str, TableInfo], str]) -> Dict[str, Any]:
    """``state`` with each table reference's URL replaced by ``rewrite(url, info)``; a state
    without references comes back as is (not copied)."""
    keys = [key for key in state if key == REFERENCE_KEY or key.endswith("." + REFERENCE_KEY)]
    if not keys:
        return state
    state = dict(state)
    for key in keys:
        url, info = decode_reference(state[key])
        state[key] = encode_reference(rewrite(url, info), info)
    return state


def save_tables(state: Dict[str, Any], model_url: str) -> Dict[str, Any]:
    """``state`` with its tables' files copied into ``model_url/tables/table-<k>`` (streamed) and
    their references made relative to ``model_url``, so the saved directory is whole and may be
    moved or downloaded elsewhere (MLflow does). A state without references comes back as is."""

    def copy(url: str, info: TableInfo) -> str:
        relative = f"{SAVED_TABLES}/table-{info.table}"
        target = filesystem.url_join(model_url, relative)
        if filesystem.normalize_url(url) != filesystem.normalize_url(target):
            TableFiles(url, info).copy_to(target)
        else:  # saved again where it was loaded from: the files must still be there
            TableFiles(url, info).manifest()
        return relative

    return _rewrite_references(state, copy)


def resolve_tables(state: Dict[str, Any], model_url: str) -> Dict[str, Any]:
    """``state`` as read from a saved model at ``model_url``: relative table references made
    absolute (the references of :func:`save_tables`)."""

    def absolute(url: str, info: TableInfo) -> str:
        if filesystem.is_url(url) or url.startswith("/"):
            return url
        return filesystem.url_join(filesystem.normalize_url(model_url), url)

    return _rewrite_references(state, absolute)
