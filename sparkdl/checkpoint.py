"""Checkpoints: what one holds, and the store plug-in point that keeps them.

**Contents.** A :class:`Checkpoint` is the state of every rank at one step: each
:class:`RankState` holds the user's part (model and optimizer ``state_dict``\\ s, loop counters),
the part that is identical on every rank (kept once, by rank 0), the strategy's state, the RNG
and the data stream's position. It is stored as plain containers of tensors, so loading never
runs code (``torch.load(weights_only=True)``).

**Stores.** A :class:`CheckpointStore` saves a checkpoint, loads the newest good one, stores and
loads a finished run's result, and clears everything (Lightning's ``CheckpointIO`` is the
model). :func:`open_store` is the one factory: it picks the store registered for the URL's
scheme (:func:`register_store`), else :class:`FileCheckpointStore`, which writes through
:mod:`sparkdl.filesystem` and so serves local paths, HDFS, object stores and any fsspec URL.
The store object is built on the driver and travels to the tasks (it must pickle; the file
store's filesystem pickles with it, so a filesystem configured on the driver is the one used).

:class:`FileCheckpointStore` writes one file per checkpoint, ``ckpt-<step>.pt``, to a temporary
name and renames it, so a reader never sees half a file; the file starts with a magic string and
the SHA-256 of its payload, so a file damaged later is detected and skipped in favour of the
previous one. The last ``keep`` checkpoints are kept. A finished run's result is stored as
``finished.pkl``: running the same job against the same directory again (an Airflow retry, a
new driver) returns it instead of training again.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import io
import logging
import re
import urllib.parse
from typing import Any, Callable, Dict, List, Optional, Tuple, Type

import cloudpickle
import torch

from sparkdl import filesystem
from sparkdl.errors import ConfigError

logger = logging.getLogger("sparkdl.checkpoint")

FORMAT = 1
_MAGIC = b"SPKDLCK1"
_NAME = re.compile(r"^ckpt-(\d{12})\.pt$")
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
    """

    url: str
    every_steps: Optional[int] = None
    keep: int = 3
    resume: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise ConfigError(f"checkpoint_dir={self.url!r} must be a non-empty path or URL")
        if self.every_steps is not None and (not isinstance(self.every_steps, int) or isinstance(self.every_steps, bool) or self.every_steps < 1):
            raise ConfigError(f"checkpoint_every={self.every_steps!r} must be a positive number of steps, or None for every epoch")
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ConfigError(f"keep_checkpoints={self.keep!r} must be a positive integer")


# -- what a checkpoint holds -----------------------------------------------------------------


@dataclasses.dataclass
class RankState:
    """One rank's part of a checkpoint."""

    user: Dict[str, Any]
    #: State bit-identical on every rank (the model under AllReduce): only rank 0's is kept.
    replicated: Optional[Dict[str, Any]]
    strategy: Dict[str, Any]
    torch_rng: torch.Tensor
    cuda_rng: Optional[torch.Tensor]
    grad_scaler: Optional[Dict[str, Any]]
    #: Batches this rank took from its data stream: where a resumed stream picks up.
    batches_taken: int

    @classmethod
    def capture(
        cls,
        user: Dict[str, Any],
        replicated: Optional[Dict[str, Any]],
        strategy: Dict[str, Any],
        grad_scaler: Optional[Dict[str, Any]],
        batches_taken: int,
        device: torch.device,
    ) -> "RankState":
        """This rank's state now, with the RNG state, every tensor copied to the CPU."""
        return cls(
            user=to_cpu(user),
            replicated=to_cpu(replicated),
            strategy=to_cpu(strategy),
            torch_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            grad_scaler=to_cpu(grad_scaler),
            batches_taken=batches_taken,
        )

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
        # Not dataclasses.asdict: it deep-copies every tensor.
        ranks = [{field.name: getattr(r, field.name) for field in dataclasses.fields(r)} for r in self.ranks]
        return {"format": FORMAT, "step": self.step, "world_size": self.world_size, "ranks": ranks}

    @classmethod
    def from_dict(cls, document: Dict[str, Any]) -> "Checkpoint":
        if document.get("format") != FORMAT:
            raise ValueError(f"checkpoint format {document.get('format')!r} is not {FORMAT}")
        ranks = [RankState(**{"grad_scaler": None, "cuda_rng": None, **part}) for part in document["ranks"]]
        return cls(int(document["step"]), int(document["world_size"]), ranks)

    def rank_state(self, rank: int, world_size: int, where: str) -> RankState:
        """The part of ``rank``; the checkpoint must have been written by ``world_size`` ranks."""
        if self.world_size != world_size:
            raise ConfigError(
                f"the checkpoint at step {self.step} in {where} was written by {self.world_size} "
                f"workers but this run has num_workers={world_size}; use the same num_workers or a new checkpoint_dir"
            )
        return self.ranks[rank]

    def user_state(self, rank: int) -> Dict[str, Any]:
        """What ``rank`` saved, merged with the replicated state rank 0 saved for everyone."""
        return {**(self.ranks[0].replicated or {}), **self.ranks[rank].user}


def encode(checkpoint: Checkpoint) -> bytes:
    """A checkpoint as bytes: magic, SHA-256 of the payload, the payload (``torch.save``)."""
    buffer = io.BytesIO()
    torch.save(checkpoint.to_dict(), buffer)
    payload = buffer.getvalue()
    return _MAGIC + hashlib.sha256(payload).digest() + payload


def decode(data: bytes) -> Checkpoint:
    """What :func:`encode` wrote; raises ValueError when the bytes are damaged or not ours."""
    if data[: len(_MAGIC)] != _MAGIC:
        raise ValueError("not a sparkdl checkpoint (bad magic)")
    digest, payload = data[len(_MAGIC): len(_MAGIC) + 32], data[len(_MAGIC) + 32:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("checksum mismatch (partial or corrupted file)")
    # weights_only: a checkpoint holds tensors and plain containers only, never code.
    return Checkpoint.from_dict(torch.load(io.BytesIO(payload), weights_only=True))


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor on the CPU (checkpoints must not pin devices). CPU tensors are
    not copied: checkpoints are serialized before training touches them again."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        converted = [to_cpu(v) for v in value]
        return type(value)(converted) if isinstance(value, list) else tuple(converted)
    return value


# -- the store plug-in point -----------------------------------------------------------------


class CheckpointStore(abc.ABC):
    """Where a run's checkpoints and its finished result live.

    Built on the driver by :func:`open_store` and pickled to every task. Only rank 0 writes;
    every rank reads. Implementations pass ``tests/unit/test_checkpoint_store_contract.py``.
    """

    def __init__(self, url: str, keep: int = 3) -> None:
        #: Where the store is, for messages.
        self.url = url
        self.keep = keep

    @abc.abstractmethod
    def save(self, checkpoint: Checkpoint) -> str:
        """Stores ``checkpoint`` atomically (a reader sees all of it or none), keeps only the
        newest ``keep``; returns where it went."""

    @abc.abstractmethod
    def load_latest(self) -> Optional[Checkpoint]:
        """The newest checkpoint that is intact, or None; damaged ones are skipped (logged)."""

    @abc.abstractmethod
    def save_finished(self, result: Any) -> None:
        """Stores a finished run's result (rank 0's return value, any picklable object)."""

    @abc.abstractmethod
    def load_finished(self) -> Tuple[bool, Any]:
        """(True, result) when the store holds a finished run, else (False, None)."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Deletes every checkpoint and the finished result (a fresh start)."""


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
    return cls(url, keep=config.keep)


class FileCheckpointStore(CheckpointStore):
    """Checkpoints as files in one directory of any filesystem :mod:`sparkdl.filesystem` opens."""

    def __init__(self, url: str, keep: int = 3) -> None:
        normalized, self._fs, self._root = filesystem.open_url(url, "checkpoint_dir")
        super().__init__(normalized, keep)

    def save(self, checkpoint: Checkpoint) -> str:
        path = self._checkpoint_path(checkpoint.step)
        filesystem.write_atomically(self._fs, path, encode(checkpoint))
        self._prune()
        return path

    def steps(self) -> List[int]:
        """Steps of the checkpoints present, oldest first (complete or not)."""
        found = (_NAME.match(info.base_name) for info in filesystem.list_files(self._fs, self._root))
        return sorted(int(match.group(1)) for match in found if match)

    def load_latest(self) -> Optional[Checkpoint]:
        for step in reversed(self.steps()):
            path = self._checkpoint_path(step)
            try:
                return decode(filesystem.read_bytes(self._fs, path))
            except Exception as exc:  # noqa: BLE001 - any damage means: fall back to the previous one
                logger.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, exc)
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
        for step in self.steps():
            self._fs.delete_file(self._checkpoint_path(step))
        finished = filesystem.join(self._root, _FINISHED)
        if filesystem.is_file(self._fs, finished):
            self._fs.delete_file(finished)

    def _checkpoint_path(self, step: int) -> str:
        return filesystem.join(self._root, f"ckpt-{step:012d}.pt")

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep]:
            try:
                self._fs.delete_file(self._checkpoint_path(step))
            except OSError as exc:  # another attempt may have pruned it already
                logger.debug("could not delete old checkpoint %d: %s", step, exc)
