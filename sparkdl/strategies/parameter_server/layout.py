"""How a table's parameters are cut into one shard per rank: pure functions of the sizes.

``layout="balanced"`` (the default) flattens the parameters in a fixed order and cuts the flat
vector into ``world_size`` near-equal contiguous ranges, so every server receives, applies and
sends the same number of bytes whatever the tensor sizes; ``layout="tensors"`` bin-packs whole
tensors greedily, for optimizers that need each tensor's shape. Every rank computes the same
layout from the same sizes, so it never travels. See ``docs/parameter_server.md`` for the
measurements behind the default.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Sequence, Tuple

import torch

__all__ = [
    "LAYOUTS",
    "Layout",
    "Segment",
    "TableSpec",
    "balanced_layout",
    "make_layout",
    "shard_segments",
    "tensor_layout",
]

#: The values of ``ParameterServer.layout``, as :func:`make_layout` names them.
LAYOUTS = ("balanced", "tensors")


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one table's parameters are cut into shards.

    Attributes:
        order: parameter indices in *wire order*: the order in which their flattened values are
            concatenated into the table's flat vector.
        bounds: ``num_shards + 1`` offsets into that flat vector; shard ``k`` (held by rank
            ``k``) is ``[bounds[k], bounds[k+1])``.
    """

    order: Tuple[int, ...]
    bounds: Tuple[int, ...]

    @property
    def sizes(self) -> List[int]:
        """Elements per shard."""
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def imbalance(self) -> float:
        """Largest shard over the mean shard (1.0 is perfectly even)."""
        sizes = self.sizes
        total = sum(sizes)
        return max(sizes) * len(sizes) / total if total else 1.0


@dataclasses.dataclass(frozen=True)
class Segment:
    """The part of one parameter that lies in one shard.

    Attributes:
        param: index of the parameter in the table.
        start: first element, within the parameter's flattened values.
        stop: one past the last element.
        offset: where the segment begins within the shard's flat vector.
    """

    param: int
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def balanced_layout(sizes: Sequence[int], num_shards: int) -> Layout:
    """Parameters in their own order, flat vector cut into ``num_shards`` near-equal ranges.

    Shard sizes differ by at most one element; a tensor that straddles a cut is split.
    """
    _check_shards(num_shards)
    total = sum(sizes)
    return Layout(tuple(range(len(sizes))), tuple(total * k // num_shards for k in range(num_shards + 1)))


def tensor_layout(sizes: Sequence[int], num_shards: int) -> Layout:
    """Whole tensors, greedily bin-packed: largest first onto the least-loaded shard (LPT).

    Within a shard, parameters keep their original relative order. Ties go to the lowest shard
    and, among equal sizes, to the earlier parameter, so every rank computes the same layout.
    """
    _check_shards(num_shards)
    loads = [0] * num_shards
    members: List[List[int]] = [[] for _ in range(num_shards)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        target = min(range(num_shards), key=lambda k: (loads[k], k))
        loads[target] += sizes[index]
        members[target].append(index)
    order: List[int] = []
    bounds = [0]
    for shard in members:
        order.extend(sorted(shard))
        bounds.append(bounds[-1] + sum(sizes[i] for i in shard))
    return Layout(tuple(order), tuple(bounds))


def make_layout(kind: str, sizes: Sequence[int], num_shards: int) -> Layout:
    """``balanced_layout`` or ``tensor_layout`` by name (one of :data:`LAYOUTS`)."""
    if kind == "balanced":
        return balanced_layout(sizes, num_shards)
    if kind == "tensors":
        return tensor_layout(sizes, num_shards)
    raise ValueError(f"unknown layout {kind!r}")


def shard_segments(layout: Layout, sizes: Sequence[int], shard: int) -> List[Segment]:
    """The segments of shard ``shard``, in wire order."""
    low, high = layout.bounds[shard], layout.bounds[shard + 1]
    segments: List[Segment] = []
    position = 0
    for index in layout.order:
        begin, end = position, position + sizes[index]
        first, last = max(begin, low), min(end, high)
        if first < last:
            segments.append(Segment(index, first - begin, last - begin, first - low))
        position = end
    return segments


def _check_shards(num_shards: int) -> None:
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards} must be >= 1")


# --------------------------------------------------------------------------------------------
# Tables: what every rank agrees on
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One prepared optimizer's parameters of one dtype; identical on every rank."""

    table: int
    dtype: torch.dtype
    shapes: Tuple[Tuple[int, ...], ...]
    groups: Tuple[int, ...]  # the user's param-group index of each parameter
    num_groups: int  # param groups of the user's optimizer (all of them: lrs travel per group)
    layout: Layout

    @property
    def sizes(self) -> List[int]:
        return [math.prod(shape) for shape in self.shapes]

    def fingerprint(self) -> str:
        return repr((self.table, str(self.dtype), self.shapes, self.groups, self.num_groups, self.layout))

    def shard_bounds(self, shard: int) -> Tuple[int, int]:
        return self.layout.bounds[shard], self.layout.bounds[shard + 1]
