"""What a checkpoint holds and how its bytes look: :class:`Checkpoint` (every rank's
:class:`RankState` at one step), plain containers of tensors sealed with a magic string and the
SHA-256 of their payload, so loading never runs code (``torch.load(weights_only=True)``).

A rank's part (:func:`encode_part`) keeps its strategy state — a parameter server's shards and
sparse-table rows, the bulk of a part — in a section of its own after everything else (the
*head*: user state, RNG, stream position), so that a store can read the head alone and hand
out a :class:`StoredRankState`, whose strategy state is read from storage when it is taken and
kept by nobody else: an elastic resume then holds one old part's strategy state at a time."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch

from sparkdl.errors import ConfigError

FORMAT = 1  # one file per checkpoint (still read)
WHOLE_PART_FORMAT = 2  # one file per rank and a manifest, the strategy state inline (still read)
PART_FORMAT = 3  # as 2, each part's strategy state in a section of its own
PART_FORMATS = (WHOLE_PART_FORMAT, PART_FORMAT)
_MAGIC = b"SPKDLCK1"
_DIGEST = slice(len(_MAGIC), len(_MAGIC) + 32)
#: A part of format 3 opens with this magic, the head's length (8 bytes, big-endian) and the
#: SHA-256 of the head (the digest a manifest records); the head follows, then the strategy
#: section, whose length and SHA-256 the head records.
_SPLIT_MAGIC = b"SPKDLCK3"
_HEAD_DIGEST = slice(len(_SPLIT_MAGIC) + 8, len(_SPLIT_MAGIC) + 40)
PART_HEADER_SIZE = _HEAD_DIGEST.stop


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


class StoredRankState(RankState):
    """A part read from a store without its strategy state, which stays in storage:
    :attr:`strategy` reads it again at every access, and the part keeps no reference to it.
    Whoever takes the old parts' strategy states one at a time and drops each before taking the
    next holds one at a time (:func:`sparkdl._runtime.resume.old_rank_states`)."""

    def __init__(self, fields: Dict[str, Any], read_strategy: Callable[[], Dict[str, Any]]) -> None:
        # Not RankState's __init__: ``strategy`` is the property below, not a field to set.
        for field in dataclasses.fields(RankState):
            if field.name != "strategy":
                setattr(self, field.name, fields.get(field.name, field.default))
        self._read_strategy = read_strategy

    @property  # type: ignore[override]
    def strategy(self) -> Dict[str, Any]:
        """This part's strategy state, read from storage now (checksum checked)."""
        return self._read_strategy()

    def __repr__(self) -> str:  # the dataclass's would read the strategy state
        return f"StoredRankState(batches_taken={self.batches_taken}, strategy=<in storage>)"


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
        return cls(step, world_size, [_with_replicated(p, whole if r == 0 else None) for r, p in enumerate(parts)])

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


def _with_replicated(part: RankState, replicated: Optional[Dict[str, Any]]) -> RankState:
    # A shallow copy, not dataclasses.replace: a StoredRankState's strategy state stays in storage.
    out = copy.copy(part)
    out.replicated, out.replicated_leaves = replicated, None
    return out


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


def _payload(document: Any) -> memoryview:
    buffer = io.BytesIO()
    torch.save(document, buffer)
    return buffer.getbuffer()


def _load(payload: Any) -> Any:
    # weights_only: a checkpoint holds tensors and plain containers only, never code.
    return torch.load(io.BytesIO(payload), weights_only=True)


def _sha256(data: Any) -> bytes:
    return hashlib.sha256(data).digest()


def _seal(document: Any) -> bytes:
    payload = _payload(document)
    return b"".join((_MAGIC, _sha256(payload), payload))


def _unseal(data: bytes) -> Any:
    if data[: len(_MAGIC)] != _MAGIC:
        raise ValueError("not a sparkdl checkpoint (bad magic)")
    payload = memoryview(data)[_DIGEST.stop :]
    if _sha256(payload) != data[_DIGEST]:
        raise ValueError("checksum mismatch (partial or corrupted file)")
    return _load(payload)


def encode(checkpoint: Checkpoint) -> bytes:
    """A whole checkpoint as bytes: magic, SHA-256 of the payload, the payload (``torch.save``)."""
    return _seal(checkpoint.to_dict())


def decode(data: bytes) -> Checkpoint:
    """What :func:`encode` wrote; raises ValueError when the bytes are damaged or not ours."""
    return Checkpoint.from_dict(_unseal(data))


def encode_part(step: int, world_size: int, rank: int, part: RankState) -> bytes:
    """One rank's part as bytes: its head (everything but the strategy state), then its strategy
    state in a section of its own (a store reads the head alone: :func:`head_size`,
    :func:`decode_head`); :func:`part_digest` is its checksum."""
    fields = _fields(part)
    strategy = _payload({"strategy": fields.pop("strategy")})
    head = _payload(
        {
            **_identity(PART_FORMAT, step, world_size, rank),
            "state": fields,
            "strategy_section": {"size": len(strategy), "sha256": _sha256(strategy).hex()},
        }
    )
    return b"".join((_SPLIT_MAGIC, len(head).to_bytes(8, "big"), _sha256(head), head, strategy))


def decode_part(data: bytes, step: int, world_size: int, rank: int) -> RankState:
    """What :func:`encode_part` wrote for that step and rank, strategy state included, or a part
    of format 2; ValueError otherwise."""
    length = head_size(data[:PART_HEADER_SIZE])
    if length is None:
        document = _unseal(data)
        _check_identity(document, WHOLE_PART_FORMAT, step, world_size, rank)
        return _rank_state(document["state"])
    view = memoryview(data)
    header, head, section = view[:PART_HEADER_SIZE], view[PART_HEADER_SIZE:], view[PART_HEADER_SIZE + length :]
    fields, where = decode_head(header, head[:length], step, world_size, rank)
    return _rank_state({**fields, "strategy": decode_strategy(section, where)})


def head_size(header: bytes) -> Optional[int]:
    """The length of the head of a part whose first :data:`PART_HEADER_SIZE` bytes are
    ``header``, or None when they are not those of a part of format 3 (one of format 2, whole)."""
    if len(header) != PART_HEADER_SIZE or header[: len(_SPLIT_MAGIC)] != _SPLIT_MAGIC:
        return None
    return int.from_bytes(header[len(_SPLIT_MAGIC) : _HEAD_DIGEST.start], "big")


def decode_head(
    header: bytes, head: Any, step: int, world_size: int, rank: int
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """A part's fields but its strategy state, and where that is: its strategy section's
    ``size`` and ``sha256`` (for :func:`decode_strategy`). ValueError when damaged or not that
    step's and rank's."""
    if _sha256(head) != header[_HEAD_DIGEST]:
        raise ValueError("checksum mismatch (partial or corrupted file)")
    document = _load(head)
    _check_identity(document, PART_FORMAT, step, world_size, rank)
    return document["state"], document["strategy_section"]


def decode_strategy(section: Any, where: Dict[str, Any]) -> Dict[str, Any]:
    """The strategy state of a part's strategy section, checked against what its head recorded."""
    if len(section) != where["size"] or _sha256(section).hex() != where["sha256"]:
        raise ValueError("the strategy state's section is not the one its part's head names (size or checksum differs)")
    return _load(section)["strategy"]


def _identity(format_: int, step: int, world_size: int, rank: int) -> Dict[str, int]:
    return {"format": format_, "step": step, "world_size": world_size, "rank": rank}


def _check_identity(document: Dict[str, Any], format_: int, step: int, world_size: int, rank: int) -> None:
    found = tuple(document.get(k) for k in ("format", "step", "world_size", "rank"))
    expected = tuple(_identity(format_, step, world_size, rank).values())
    if found != expected:
        raise ValueError(f"part is (format, step, world size, rank) {found}, expected {expected}")


def part_digest(data: bytes) -> str:
    """The SHA-256 (hex) an encoded part carries: of its head (format 3), of its payload (2)."""
    return bytes(data[_HEAD_DIGEST if data[: len(_SPLIT_MAGIC)] == _SPLIT_MAGIC else _DIGEST]).hex()


@dataclasses.dataclass(frozen=True)
class PartInfo:
    """Where one rank's part of a checkpoint went: what its manifest records."""

    rank: int
    name: str
    size: int
    sha256: str
