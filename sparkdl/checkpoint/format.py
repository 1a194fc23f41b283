"""What a checkpoint holds and how its bytes look: :class:`Checkpoint` (every rank's
:class:`RankState` at one step), plain containers of tensors sealed with a magic string and the
SHA-256 of their payload, so loading never runs code (``torch.load(weights_only=True)``)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set

import torch

from sparkdl.errors import ConfigError

FORMAT = 1  # one file per checkpoint (still read)
PART_FORMAT = 2  # one file per rank and a manifest
_MAGIC = b"SPKDLCK1"
_DIGEST = slice(len(_MAGIC), len(_MAGIC) + 32)


@dataclasses.dataclass
class RankState:
    """One rank's part of a checkpoint (:func:`sparkdl._runtime.checkpoint_writer.capture` takes it)."""

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
    #: The epoch's rows left, for a resume on other ranks (:func:`sparkdl._runtime.resume.stream_fields`).
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
        return {
            "format": FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "ranks": [_fields(r) for r in self.ranks],
        }

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
        ranks = [
            dataclasses.replace(p, replicated=whole if r == 0 else None, replicated_leaves=None)
            for r, p in enumerate(parts)
        ]
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
    payload = memoryview(data)[_DIGEST.stop :]
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
        raise ValueError(
            f"part is (format, step, world size, rank) {found}, expected {(PART_FORMAT, step, world_size, rank)}"
        )
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
