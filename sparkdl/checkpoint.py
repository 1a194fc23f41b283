"""Checkpoints: what one holds, and the store plug-in point that keeps them.

**Contents.** A :class:`Checkpoint` is every rank's :class:`RankState` at one step: the user's
part (model and optimizer ``state_dict``\\ s, loop counters), a share of the state identical on
every rank (stored once, split over the ranks), the strategy's state, the RNG and the data
stream's position — plain containers of tensors, so loading never runs code
(``torch.load(weights_only=True)``).

**Stores.** A :class:`CheckpointStore` stores one rank's part, commits a checkpoint once every
part is stored, loads the newest complete one, and keeps a finished run's result.
:func:`open_store` picks the store registered for the URL's scheme (:func:`register_store`),
else :class:`FileCheckpointStore` (any URL :mod:`sparkdl.filesystem` opens). Stores are built on
the driver and pickled to the tasks. How a rank writes in the background, and how the ranks
learn that every part is stored, is :mod:`sparkdl._checkpoint_writer`.

**Layout** (:class:`FileCheckpointStore`; torch DCP's): ``ckpt-<step>/`` holds one
``rank-<r>.pt`` per rank (each written by its rank, atomically, with a magic string and the
SHA-256 of its payload) and ``manifest.json`` (step, world size, each part's name, size and
checksum), written last. A directory without a manifest is incomplete and ignored; a damaged
manifest or part falls back to the previous checkpoint. The last ``keep`` are kept. Single-file
checkpoints of earlier versions (``ckpt-<step>.pt``) still load. ``finished.pkl`` holds a
finished run's result: the same job run again returns it instead of training again.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import io
import json
import logging
import re
import urllib.parse
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Type

import cloudpickle
import pyarrow.fs as pafs
import torch

from sparkdl import filesystem
from sparkdl.errors import ConfigError

logger = logging.getLogger("sparkdl.checkpoint")

FORMAT = 1  # one file per checkpoint (still read)
PART_FORMAT = 2  # one file per rank and a manifest
MANIFEST = "manifest.json"
_MAGIC = b"SPKDLCK1"
_DIGEST = slice(len(_MAGIC), len(_MAGIC) + 32)
_NAME = re.compile(r"^ckpt-(\d{12})(\.pt)?$")  # a checkpoint directory, or a single file
_PART = re.compile(r"^rank-\d{5}\.pt$")
_FINISHED = "finished.pkl"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often training state is saved.

    Args:
        url: directory (local path, ``file://``, ``hdfs://``, ``s3://``, any fsspec URL...) every
            executor can write and the driver can read.
        every_steps: save every this many optimizer steps; None saves at the end of each epoch.
        keep: how many complete checkpoints to keep (older ones are deleted).
        resume: resume from the newest checkpoint, or return the stored result of a finished
            run; False ignores what is in ``url`` and trains from scratch (overwriting it).
        async_write: write in the background after a copy to host memory (training stalls for
            the copy only); False: every part is written and committed before the save returns.
    """

    url: str
    every_steps: Optional[int] = None
    keep: int = 3
    resume: bool = True
    async_write: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError(f"checkpoint_dir={self.url!r} must be a non-empty path or URL")
        if self.every_steps is not None and (not isinstance(self.every_steps, int) or isinstance(self.every_steps, bool) or self.every_steps < 1):
            raise ConfigError(f"checkpoint_every={self.every_steps!r} must be a positive number of steps, or None for every epoch")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"keep_checkpoints={self.keep!r} must be a positive integer")
        if not isinstance(self.async_write, bool):
            raise ConfigError(f"checkpoint_async={self.async_write!r} must be True or False")


# -- what a checkpoint holds -----------------------------------------------------------------


@dataclasses.dataclass
class RankState:
    """One rank's part of a checkpoint (:func:`sparkdl._checkpoint_writer.capture` takes it)."""

    user: Dict[str, Any]
    #: State bit-identical on every rank (the model under AllReduce), stored once: whole in
    #: rank 0's part, or, with ``replicated_leaves``, this rank's share of it.
    replicated: Optional[Dict[str, Any]]
    strategy: Dict[str, Any]
    torch_rng: torch.Tensor
    cuda_rng: Optional[torch.Tensor]
    grad_scaler: Optional[Dict[str, Any]]
    #: Batches this rank took from its data stream: where a resumed stream picks up.
    batches_taken: int
    #: Which leaves of ``replicated`` (in :func:`tree_leaves` order) this rank holds; the other
    #: tensors are None here and held by other ranks. None: ``replicated`` is whole.
    replicated_leaves: Optional[List[int]] = None
    #: The epoch's rows left, for a resume on other ranks (:func:`sparkdl._resharding.stream_fields`).
    stream: Optional[Dict[str, Any]] = None

    def restore_rng(self, device: torch.device) -> None:
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None and device.type == "cuda":
            torch.cuda.set_rng_state(self.cuda_rng, device)


@dataclasses.dataclass
class Checkpoint:
    """Every rank's state at one step."""

    step: int
    world_size: int
    ranks: List[RankState]

    def to_dict(self) -> Dict[str, Any]:
        """Plain containers of tensors (what ``torch.load(weights_only=True)`` reads back)."""
        return {"format": FORMAT, "step": self.step, "world_size": self.world_size, "ranks": [_fields(r) for r in self.ranks]}

    @classmethod
    def from_dict(cls, document: Dict[str, Any]) -> "Checkpoint":
        if document.get("format") != FORMAT:
            raise ValueError(f"checkpoint format {document.get('format')!r} is not {FORMAT}")
        ranks = [_rank_state(part) for part in document["ranks"]]
        return cls.from_parts(int(document["step"]), int(document["world_size"]), ranks)

    @classmethod
    def from_parts(cls, step: int, world_size: int, parts: Sequence[RankState]) -> "Checkpoint":
        """The checkpoint of every rank's part (in rank order), the replicated state made whole
        again in rank 0's part from the shares the ranks wrote. ValueError when they disagree."""
        if len(parts) != world_size:
            raise ValueError(f"{len(parts)} parts for {world_size} ranks")
        shares = [part for part in parts if part.replicated_leaves is not None]
        if not shares:
            return cls(step, world_size, list(parts))
        if len(shares) != world_size:
            raise ValueError("only some parts hold a share of the replicated state")
        leaves = tree_leaves(parts[0].replicated)
        seen: Set[int] = set()
        for part in shares:
            mine = tree_leaves(part.replicated)
            if len(mine) != len(leaves) or seen.intersection(part.replicated_leaves):
                raise ValueError("the parts' shares of the replicated state do not fit together")
            for index in part.replicated_leaves:
                leaves[index] = mine[index]
            seen.update(part.replicated_leaves)
        whole = tree_rebuild(parts[0].replicated, iter(leaves))
        ranks = [dataclasses.replace(p, replicated=whole if r == 0 else None, replicated_leaves=None) for r, p in enumerate(parts)]
        return cls(step, world_size, ranks)

    def rank_state(self, rank: int, world_size: int, where: str) -> RankState:
        """The part of ``rank``; the checkpoint must have been written by ``world_size`` ranks."""
        if self.world_size != world_size:
            raise ConfigError(
                f"the checkpoint at step {self.step} in {where} was written by {self.world_size} "
                f"workers but this run has num_workers={world_size}; use the same num_workers or a new checkpoint_dir"
            )
        return self.ranks[rank]

    def user_state(self, rank: int) -> Dict[str, Any]:
        """What ``rank`` saved, merged with the replicated state saved once for everyone."""
        return {**(self.ranks[0].replicated or {}), **self.ranks[rank].user}


def _fields(part: RankState) -> Dict[str, Any]:
    # Not dataclasses.asdict: it deep-copies every tensor.
    return {field.name: getattr(part, field.name) for field in dataclasses.fields(part)}


def _rank_state(document: Dict[str, Any]) -> RankState:
    return RankState(**{"grad_scaler": None, "cuda_rng": None, **document})


def tree_leaves(tree: Any) -> List[Any]:
    """The leaves of nested dicts, lists and tuples, depth first (how replicated state is split)."""
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in tree_leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in tree_leaves(value)]
    return [tree]


def tree_rebuild(tree: Any, leaves: Iterator[Any]) -> Any:
    """``tree``'s shape (plain dicts, lists, tuples) around new leaves, in :func:`tree_leaves` order."""
    if isinstance(tree, dict):
        return {key: tree_rebuild(value, leaves) for key, value in tree.items()}
    if isinstance(tree, list):
        return [tree_rebuild(value, leaves) for value in tree]
    if isinstance(tree, tuple):
        return tuple(tree_rebuild(value, leaves) for value in tree)
    return next(leaves)


def _seal(document: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(document, buffer)
    payload = buffer.getbuffer()
    return b"".join((_MAGIC, hashlib.sha256(payload).digest(), payload))


def _unseal(data: bytes) -> Any:
    if data[: len(_MAGIC)] != _MAGIC:
        raise ValueError("not a sparkdl checkpoint (bad magic)")
    payload = memoryview(data)[_DIGEST.stop:]
    if hashlib.sha256(payload).digest() != data[_DIGEST]:
        raise ValueError("checksum mismatch (partial or corrupted file)")
    # weights_only: a checkpoint holds tensors and plain containers only, never code.
    return torch.load(io.BytesIO(payload), weights_only=True)


def encode(checkpoint: Checkpoint) -> bytes:
    """A whole checkpoint as bytes: magic, SHA-256 of the payload, the payload (``torch.save``)."""
    return _seal(checkpoint.to_dict())


def decode(data: bytes) -> Checkpoint:
    """What :func:`encode` wrote; raises ValueError when the bytes are damaged or not ours."""
    return Checkpoint.from_dict(_unseal(data))


def encode_part(step: int, world_size: int, rank: int, part: RankState) -> bytes:
    """One rank's part as bytes, sealed like :func:`encode`; :func:`part_digest` is its checksum."""
    return _seal({"format": PART_FORMAT, "step": step, "world_size": world_size, "rank": rank, "state": _fields(part)})


def decode_part(data: bytes, step: int, world_size: int, rank: int) -> RankState:
    """What :func:`encode_part` wrote for that step and rank; ValueError otherwise."""
    document = _unseal(data)
    found = tuple(document.get(k) for k in ("format", "step", "world_size", "rank"))
    if found != (PART_FORMAT, step, world_size, rank):
        raise ValueError(f"part is (format, step, world size, rank) {found}, expected {(PART_FORMAT, step, world_size, rank)}")
    return _rank_state(document["state"])


def part_digest(data: bytes) -> str:
    """The SHA-256 (hex) an encoded part carries for its payload."""
    return bytes(data[_DIGEST]).hex()


@dataclasses.dataclass(frozen=True)
class PartInfo:
    """Where one rank's part of a checkpoint went: what its manifest records."""

    rank: int
    name: str
    size: int
    sha256: str


# -- the store plug-in point -----------------------------------------------------------------


class CheckpointStore(abc.ABC):
    """Where a run's checkpoints and its finished result live.

    Built on the driver by :func:`open_store` and pickled to every task. Every rank writes its
    own part of a checkpoint (:meth:`save_part`, in parallel, from its own copy of the store);
    one rank, once every part is written, makes it visible (:meth:`commit`); every rank reads.
    Implementations pass ``tests/unit/test_checkpoint_store_contract.py``.
    """

    #: Write in the background (``CheckpointConfig.async_write``; :func:`open_store` sets it).
    async_write: bool = True

    def __init__(self, url: str, keep: int = 3) -> None:
        #: Where the store is, for messages.
        self.url = url
        self.keep = keep

    def location(self, step: int) -> str:
        """Where the checkpoint of ``step`` is, in the user's terms (for messages)."""
        return filesystem.join(self.url, f"ckpt-{step:012d}")

    @abc.abstractmethod
    def save_part(self, step: int, world_size: int, rank: int, part: RankState) -> PartInfo:
        """Stores ``rank``'s part of checkpoint ``step`` atomically, invisible to
        :meth:`load_latest` until :meth:`commit`; every rank stores its own part at once."""

    @abc.abstractmethod
    def commit(self, step: int, world_size: int, parts: Sequence[PartInfo]) -> str:
        """Makes the checkpoint of ``step`` visible — called once every part is stored, by any
        one rank — and keeps only the newest ``keep``; returns where it is."""

    def save(self, checkpoint: Checkpoint) -> str:
        """Every part of ``checkpoint`` from this process, then the commit."""
        step, world_size = checkpoint.step, checkpoint.world_size
        parts = [self.save_part(step, world_size, rank, part) for rank, part in enumerate(checkpoint.ranks)]
        return self.commit(step, world_size, parts)

    @abc.abstractmethod
    def load_latest(self) -> Optional[Checkpoint]:
        """The newest complete, intact checkpoint, or None; damaged ones are skipped (logged),
        and so are checkpoints whose commit never happened."""

    @abc.abstractmethod
    def save_finished(self, result: Any) -> None:
        """Stores a finished run's result (rank 0's return value, any picklable object)."""

    @abc.abstractmethod
    def load_finished(self) -> Tuple[bool, Any]:
        """(True, result) when the store holds a finished run, else (False, None)."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Deletes every checkpoint (complete or not) and the finished result (a fresh start)."""


_STORES: Dict[str, Type[CheckpointStore]] = {}


def register_store(scheme: str) -> Callable[[Type[CheckpointStore]], Type[CheckpointStore]]:
    """Class decorator: ``checkpoint_dir`` URLs of ``scheme`` (``"myscheme"`` for
    ``myscheme://...``) use the decorated store."""

    def register(cls: Type[CheckpointStore]) -> Type[CheckpointStore]:
        _STORES[scheme] = cls
        return cls

    return register


def open_store(config: CheckpointConfig) -> CheckpointStore:
    """The store for ``config.url``: the one registered for its scheme, else the file store."""
    url = filesystem.normalize_url(config.url, "checkpoint_dir")
    cls = _STORES.get(urllib.parse.urlparse(url).scheme, FileCheckpointStore)
    store = cls(url, keep=config.keep)
    store.async_write = config.async_write
    return store


class FileCheckpointStore(CheckpointStore):
    """Checkpoints as directories of files in any filesystem :mod:`sparkdl.filesystem` opens."""

    def __init__(self, url: str, keep: int = 3) -> None:
        normalized, self._fs, self._root = filesystem.open_url(url, "checkpoint_dir")
        super().__init__(normalized, keep)

    def save_part(self, step: int, world_size: int, rank: int, part: RankState) -> PartInfo:
        data = encode_part(step, world_size, rank, part)
        name = f"rank-{rank:05d}.pt"
        filesystem.write_atomically(self._fs, filesystem.join(self._path(step), name), data)
        return PartInfo(rank, name, len(data), part_digest(data))

    def commit(self, step: int, world_size: int, parts: Sequence[PartInfo]) -> str:
        ordered = sorted(parts, key=lambda info: info.rank)
        if [info.rank for info in ordered] != list(range(world_size)):
            raise ValueError(f"a checkpoint of {world_size} ranks needs one part per rank, got ranks {[i.rank for i in ordered]}")
        manifest = {"format": PART_FORMAT, "step": step, "world_size": world_size, "parts": [dataclasses.asdict(info) for info in ordered]}
        filesystem.write_atomically(self._fs, filesystem.join(self._path(step), MANIFEST), json.dumps(manifest, indent=1).encode())
        self._prune()
        return self.location(step)

    def steps(self) -> List[int]:
        """Steps of the complete checkpoints present, oldest first (damaged or not)."""
        return self._complete(*self._listing())

    def load_latest(self) -> Optional[Checkpoint]:
        files, directories = self._listing()
        # Newest first; a directory before a single file of the same step.
        for step, is_directory in sorted([(s, True) for s in directories] + [(s, False) for s in files], reverse=True):
            where = self.location(step) if is_directory else self._path(step, ".pt")
            if is_directory and not self._committed(step):
                logger.info("checkpoint %s has no manifest (a rank did not finish writing it): skipping it", where)
                continue
            try:
                return self._read_directory(step) if is_directory else decode(filesystem.read_bytes(self._fs, where))
            except Exception as exc:  # noqa: BLE001 - any damage means: fall back to the previous one
                logger.warning("checkpoint %s is unusable (%s); falling back to the previous one", where, exc)
        return None

    def save_finished(self, result: Any) -> None:
        filesystem.write_atomically(self._fs, filesystem.join(self._root, _FINISHED), cloudpickle.dumps(result))

    def load_finished(self) -> Tuple[bool, Any]:
        """The result is a pickle written by :meth:`save_finished`: it is trusted like the
        checkpoint directory itself, which only the job that owns it should write."""
        path = filesystem.join(self._root, _FINISHED)
        if not filesystem.is_file(self._fs, path):
            return False, None
        return True, cloudpickle.loads(filesystem.read_bytes(self._fs, path))

    def clear(self) -> None:
        files, directories = self._listing()
        for step in files | directories:
            self._delete(step, files, directories)
        finished = filesystem.join(self._root, _FINISHED)
        if filesystem.is_file(self._fs, finished):
            self._fs.delete_file(finished)

    def _read_directory(self, step: int) -> Checkpoint:
        directory = self._path(step)
        manifest = json.loads(filesystem.read_bytes(self._fs, filesystem.join(directory, MANIFEST)))
        if manifest.get("format") != PART_FORMAT or manifest.get("step") != step:
            raise ValueError(f"manifest is of format {manifest.get('format')!r}, step {manifest.get('step')!r}")
        world_size, infos = int(manifest["world_size"]), [PartInfo(**part) for part in manifest["parts"]]
        if [info.rank for info in infos] != list(range(world_size)) or not all(_PART.match(info.name) for info in infos):
            raise ValueError("manifest does not list one part per rank")
        parts = []
        for info in infos:
            data = filesystem.read_bytes(self._fs, filesystem.join(directory, info.name))
            if len(data) != info.size or part_digest(data) != info.sha256:
                raise ValueError(f"{info.name} is not the part the manifest names (size or checksum differs)")
            parts.append(decode_part(data, step, world_size, info.rank))
        return Checkpoint.from_parts(step, world_size, parts)

    def _listing(self) -> Tuple[Set[int], Set[int]]:
        """Steps of the single-file checkpoints, and of the checkpoint directories."""
        files: Set[int] = set()
        directories: Set[int] = set()
        for info in self._fs.get_file_info(pafs.FileSelector(self._root, recursive=False, allow_not_found=True)):
            match = _NAME.match(info.base_name)
            if match and info.type == (pafs.FileType.File if match.group(2) else pafs.FileType.Directory):
                (files if match.group(2) else directories).add(int(match.group(1)))
        return files, directories

    def _complete(self, files: Set[int], directories: Set[int]) -> List[int]:
        return sorted(files | {step for step in directories if self._committed(step)})

    def _committed(self, step: int) -> bool:
        return filesystem.is_file(self._fs, filesystem.join(self._path(step), MANIFEST))

    def _path(self, step: int, suffix: str = "") -> str:
        return filesystem.join(self._root, f"ckpt-{step:012d}{suffix}")

    def _delete(self, step: int, files: Set[int], directories: Set[int]) -> None:
        if step in directories:
            self._fs.delete_dir(self._path(step))
        if step in files:
            self._fs.delete_file(self._path(step, ".pt"))

    def _prune(self) -> None:
        """Deletes what is older than the newest ``keep`` complete checkpoints, incomplete ones
        too; never newer ones: other ranks may be writing the next checkpoint's parts already."""
        files, directories = self._listing()
        complete = self._complete(files, directories)
        for step in sorted(files | directories):
            if complete and step < complete[-self.keep:][0]:
                try:
                    self._delete(step, files, directories)
                except OSError as exc:  # another attempt may have pruned it already
                    logger.debug("could not delete old checkpoint %d: %s", step, exc)
