"""The default checkpoint store: directories of files in any filesystem
:mod:`sparkdl.filesystem` opens (the layout is in :mod:`sparkdl.checkpoint`'s docstring)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import cloudpickle
import pyarrow.fs as pafs

from sparkdl import filesystem
from sparkdl.checkpoint.base import CheckpointStore
from sparkdl.checkpoint.format import (
    PART_FORMAT,
    PART_FORMATS,
    PART_HEADER_SIZE,
    Checkpoint,
    PartInfo,
    RankState,
    StoredRankState,
    decode,
    decode_head,
    decode_part,
    decode_strategy,
    encode_part,
    head_size,
    part_digest,
)

logger = logging.getLogger("sparkdl.checkpoint")

MANIFEST = "manifest.json"
_NAME = re.compile(r"^ckpt-(\d{12})(\.pt)?$")  # a checkpoint directory, or a single file
_PART = re.compile(r"^rank-\d{5}\.pt$")
_FINISHED = "finished.pkl"


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
            raise ValueError(
                f"a checkpoint of {world_size} ranks needs one part per rank, got ranks {[i.rank for i in ordered]}"
            )
        manifest = {
            "format": PART_FORMAT,
            "step": step,
            "world_size": world_size,
            "parts": [dataclasses.asdict(info) for info in ordered],
        }
        filesystem.write_atomically(
            self._fs, filesystem.join(self._path(step), MANIFEST), json.dumps(manifest, indent=1).encode()
        )
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
        if manifest.get("format") not in PART_FORMATS or manifest.get("step") != step:
            raise ValueError(f"manifest is of format {manifest.get('format')!r}, step {manifest.get('step')!r}")
        world_size, infos = int(manifest["world_size"]), [PartInfo(**part) for part in manifest["parts"]]
        if [info.rank for info in infos] != list(range(world_size)) or not all(
            _PART.match(info.name) for info in infos
        ):
            raise ValueError("manifest does not list one part per rank")
        parts = [self._read_part(directory, info, step, world_size) for info in infos]
        return Checkpoint.from_parts(step, world_size, parts)

    def _read_part(self, directory: str, info: PartInfo, step: int, world_size: int) -> RankState:
        """A part of format 3 without its strategy state (a :class:`StoredRankState`, which
        reads it when it is taken); one of format 2 whole."""
        path = filesystem.join(directory, info.name)
        with self._fs.open_input_file(path) as file:
            length = head_size(file.read_at(PART_HEADER_SIZE, 0)) if file.size() == info.size else None
            if length is None:  # format 2, or damaged: read whole, checked here
                data = filesystem.read_bytes(self._fs, path)
                if len(data) != info.size or part_digest(data) != info.sha256:
                    raise ValueError(f"{info.name} is not the part the manifest names (size or checksum differs)")
                return decode_part(data, step, world_size, info.rank)
            header = file.read_at(PART_HEADER_SIZE, 0)
            if part_digest(header) != info.sha256 or PART_HEADER_SIZE + length > info.size:
                raise ValueError(f"{info.name} is not the part the manifest names (checksum differs)")
            fields, section = decode_head(header, file.read_at(length, PART_HEADER_SIZE), step, world_size, info.rank)
            offset = PART_HEADER_SIZE + length
            # Checked now, a chunk at a time, so that every rank falls back alike from a damaged
            # part (they must resume the same checkpoint); held only when it is taken.
            if offset + section["size"] != info.size or _sha256(file, offset, section["size"]) != section["sha256"]:
                raise ValueError(
                    f"{info.name}'s strategy state is not the one its head names (size or checksum differs)"
                )
        return StoredRankState(fields, lambda: self._read_strategy(path, offset, section))

    def _read_strategy(self, path: str, offset: int, section: Dict[str, Any]) -> Dict[str, Any]:
        """A part's strategy state, read from its section now (an elastic resume reads each old
        part's when the re-sharding reaches it)."""
        with self._fs.open_input_file(path) as file:
            data = file.read_at(section["size"], offset)
        try:
            return decode_strategy(data, section)
        except ValueError as exc:
            raise ValueError(
                f"checkpoint part {path} is damaged ({exc}); delete its checkpoint directory to resume from the "
                f"previous checkpoint"
            ) from exc

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
            if complete and step < complete[-self.keep :][0]:
                try:
                    self._delete(step, files, directories)
                except OSError as exc:  # another attempt may have pruned it already
                    logger.debug("could not delete old checkpoint %d: %s", step, exc)


def _sha256(file: Any, offset: int, size: int, chunk: int = 1 << 23) -> str:
    """The SHA-256 (hex) of ``size`` bytes of ``file`` from ``offset``, read 8 MiB at a time."""
    digest = hashlib.sha256()
    for start in range(offset, offset + size, chunk):
        digest.update(file.read_at(min(chunk, offset + size - start), start))
    return digest.hexdigest()
