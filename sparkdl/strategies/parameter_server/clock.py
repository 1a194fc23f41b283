"""The stale-synchronous-parallel read rule (Ho et al., NeurIPS 2013), as pure bookkeeping.

A worker that has finished *c* steps may only read parameters once every worker has finished at
least *c - s* steps, for ``max_staleness`` *s*; ``None`` never waits (fully asynchronous), ``0``
is bulk-synchronous. Each server shard keeps one :class:`SSPClock` per table; the waiting itself
(condition variables, timeouts) is the shard's.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set

from sparkdl.strategies.parameter_server.wire import WireError

__all__ = ["SSPClock"]


class SSPClock:
    """Per-worker clocks of one table on one server, and the SSP read rule.

    A worker's clock is the number of pushes it has made. A worker at clock ``c`` may read when
    ``c - min(active clocks) <= max_staleness``; the difference is the read's *staleness*.
    Finished workers (they said BYE) no longer hold anyone back; lost workers (their connection
    broke) keep their clock, and a read that must wait for one fails instead of hanging.
    """

    def __init__(self, world_size: int, max_staleness: Optional[int]) -> None:
        self.world_size = world_size
        self.max_staleness = max_staleness
        self.clocks = [0] * world_size
        self.finished: Set[int] = set()
        self.lost: Dict[int, str] = {}

    def tick(self, rank: int, clock: int) -> None:
        """Records a push that ``rank`` made at ``clock`` (its pushes so far).

        Raises:
            WireError: out-of-order clock, or a push from a worker that has left.
        """
        if rank in self.finished or rank in self.lost:
            raise WireError(f"push from rank {rank}, which has left")
        if clock != self.clocks[rank]:
            raise WireError(f"rank {rank} pushed clock {clock}, expected {self.clocks[rank]}")
        self.clocks[rank] += 1

    def active(self) -> List[int]:
        return [r for r in range(self.world_size) if r not in self.finished]

    def min_clock(self) -> int:
        """The slowest active worker's clock (the largest clock when every worker finished)."""
        active = self.active()
        return min(self.clocks[r] for r in active) if active else max(self.clocks)

    def staleness(self, clock: int) -> int:
        """How many clocks a reader at ``clock`` is ahead of the slowest active worker."""
        return max(0, clock - self.min_clock())

    def can_read(self, clock: int) -> bool:
        return self.max_staleness is None or self.staleness(clock) <= self.max_staleness

    def blockers(self, clock: int) -> List[int]:
        """Active workers whose clock keeps a reader at ``clock`` waiting, slowest first."""
        if self.max_staleness is None:
            return []
        need = clock - self.max_staleness
        return sorted((r for r in self.active() if self.clocks[r] < need), key=lambda r: (self.clocks[r], r))

    def finish(self, rank: int) -> None:
        self.finished.add(rank)

    def lose(self, rank: int, reason: str) -> None:
        if rank not in self.finished:
            self.lost.setdefault(rank, reason)
