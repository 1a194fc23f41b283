"""Checkpoints: where training state is written, and how a run finds the newest good one.

A checkpoint is one file, ``ckpt-<step>.pt``, holding every rank's state (gathered to rank 0,
which writes it). It is written to a temporary name and renamed, so a reader never sees half a
file; it starts with a magic string and the SHA-256 of its payload, so a file damaged later is
detected and skipped in favour of the previous one. The last ``keep`` checkpoints are kept.

When a run finishes, its result is stored as ``finished.pkl``: running the same job against the
same directory again (an Airflow retry, a new driver) returns it instead of training again.

The store is a plug-in point: local paths, HDFS and object stores all go through
``pyarrow.fs`` (``hdfs://``, ``s3://``, ``gs://``, ... where pyarrow has the filesystem).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import re
import uuid
from typing import Any, Dict, List, Optional, Tuple

import cloudpickle
import pyarrow.fs as pafs
import torch

from sparkdl.data.dataset import normalize_url
from sparkdl.errors import ConfigError

logger = logging.getLogger("sparkdl.checkpoint")

_MAGIC = b"SPKDLCK1"
_NAME = re.compile(r"^ckpt-(\d{12})\.pt$")
_FINISHED = "finished.pkl"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often training state is saved.

    Args:
        url: directory (local path, ``file://``, ``hdfs://``, ``s3://``...) every executor can
            write and the driver can read.
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


class CheckpointStore:
    """Saves, lists, loads and prunes checkpoints under one directory URL."""

    def __init__(self, url: str, keep: int = 3) -> None:
        self.url = normalize_url(url)
        self.keep = keep
        self._fs, self._root = pafs.FileSystem.from_uri(self.url)

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, step: int, state: Dict[str, Any]) -> str:
        """Writes ``state`` as the checkpoint of ``step`` atomically; returns its path."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        payload = buffer.getvalue()
        path = self._path(f"ckpt-{step:012d}.pt")
        self._write_atomically(path, _MAGIC + hashlib.sha256(payload).digest() + payload)
        self._prune()
        return path

    def steps(self) -> List[int]:
        """Steps of the checkpoints present, oldest first (complete or not)."""
        self._fs.create_dir(self._root, recursive=True)
        selector = pafs.FileSelector(self._root, recursive=False, allow_not_found=True)
        found = []
        for info in self._fs.get_file_info(selector):
            match = _NAME.match(info.base_name)
            if match and info.type == pafs.FileType.File:
                found.append(int(match.group(1)))
        return sorted(found)

    def load_latest(self) -> Optional[Tuple[int, Dict[str, Any]]]:
        """The newest checkpoint that verifies, as (step, state); damaged ones are skipped."""
        for step in reversed(self.steps()):
            path = self._path(f"ckpt-{step:012d}.pt")
            try:
                return step, self._read_checkpoint(path)
            except Exception as exc:  # noqa: BLE001 - any damage means: fall back to the previous one
                logger.warning("checkpoint %s is unusable (%s); falling back to the previous one", path, exc)
        return None

    def _read_checkpoint(self, path: str) -> Dict[str, Any]:
        with self._fs.open_input_stream(path) as stream:
            data = stream.read()
        if data[: len(_MAGIC)] != _MAGIC:
            raise ValueError("not a sparkdl checkpoint (bad magic)")
        digest, payload = data[len(_MAGIC): len(_MAGIC) + 32], data[len(_MAGIC) + 32:]
        if hashlib.sha256(payload).digest() != digest:
            raise ValueError("checksum mismatch (partial or corrupted file)")
        # weights_only: a checkpoint holds tensors and plain containers only, never code.
        return torch.load(io.BytesIO(payload), weights_only=True)

    # -- finished runs -------------------------------------------------------------------------

    def save_finished(self, result: Any) -> None:
        """Stores a finished run's result (rank 0's return value)."""
        self._write_atomically(self._path(_FINISHED), cloudpickle.dumps(result))

    def load_finished(self) -> Tuple[bool, Any]:
        """(True, result) when this directory holds a finished run, else (False, None).

        The result is a pickle written by :meth:`save_finished`: it is trusted like the
        checkpoint directory itself, which only the job that owns it should write."""
        path = self._path(_FINISHED)
        if self._fs.get_file_info(path).type != pafs.FileType.File:
            return False, None
        with self._fs.open_input_stream(path) as stream:
            return True, cloudpickle.loads(stream.read())

    def clear(self) -> None:
        """Deletes every checkpoint and the finished marker (a fresh start)."""
        for step in self.steps():
            self._fs.delete_file(self._path(f"ckpt-{step:012d}.pt"))
        if self._fs.get_file_info(self._path(_FINISHED)).type == pafs.FileType.File:
            self._fs.delete_file(self._path(_FINISHED))

    # -- helpers ---------------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return f"{self._root.rstrip('/')}/{name}"

    def _write_atomically(self, path: str, data: bytes) -> None:
        self._fs.create_dir(self._root, recursive=True)
        temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with self._fs.open_output_stream(temporary) as out:
            out.write(data)
        self._fs.move(temporary, path)

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep]:
            try:
                self._fs.delete_file(self._path(f"ckpt-{step:012d}.pt"))
            except OSError as exc:  # another attempt may have pruned it already
                logger.debug("could not delete old checkpoint %d: %s", step, exc)


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
