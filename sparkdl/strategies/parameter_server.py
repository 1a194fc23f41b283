"""Asynchronous parameter server with bounded staleness, hosted inside the barrier stage.

The centralized asynchronous strategy of DistBelief's Downpour SGD (Dean et al., NIPS 2012), the
parameter server of Li et al. (OSDI 2014) and Project Adam (Chilimbi et al., OSDI 2014), with the
stale-synchronous-parallel bound of Ho et al. (NeurIPS 2013):

* every barrier task hosts one **shard** of the parameters (a server thread beside its trainer);
  the shard's values and the optimizer state for them live only there;
* a worker's optimizer ``step()`` **pushes** its gradients to every shard, each server applies
  them at once with a copy of the user's optimizer, and the worker **pulls** the fresh values
  back; workers never wait for each other...
* ...except to respect ``max_staleness`` *s*: a worker that has finished *c* steps may only read
  parameters once every worker has finished at least *c - s* steps (SSP). ``None`` never waits
  (fully asynchronous), ``0`` is bulk-synchronous.

Layout: the optimizer's parameters (per dtype) are flattened in a fixed order and cut into
``world_size`` near-equal contiguous ranges (``layout="balanced"``, the default: every server
gets the same number of bytes to receive, apply and send, whatever the tensor sizes), or whole
tensors are bin-packed greedily (``layout="tensors"``, for optimizers that need whole tensors).
See ``docs/parameter_server.md`` for the measurements behind the default.

The wire protocol and its security live in :mod:`sparkdl.strategies._ps_wire`.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import logging
import math
import numbers
import secrets
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from sparkdl.errors import ConfigError
from sparkdl.strategies._ps_wire import (
    DTYPE_CODES,
    MAX_TABLE,
    Backend,
    ByteCounter,
    Header,
    Kind,
    ParameterServerError,
    ShardClient,
    ShardServer,
    WireError,
    byte_view,
    connect_all,
    listen,
)
from sparkdl.strategies.averaging import (
    _by_device_and_dtype,
    _flatten,
    _nbytes,
    _SyncingOptimizer,
    _unflatten_into,
    broadcast_from_rank0,
)
from sparkdl.strategies.base import Strategy, StrategyRuntime

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl._rendezvous import DistEnv

__all__ = [
    "Layout",
    "ParameterServer",
    "ParameterServerError",
    "ParameterServerOptimizer",
    "SSPClock",
    "Segment",
    "balanced_layout",
    "make_layout",
    "shard_segments",
    "tensor_layout",
]

logger = logging.getLogger("sparkdl.parameter_server")

LAYOUTS = ("balanced", "tensors")
#: Seconds a worker waits before raising that it lost a peer. The peer's own death (or error)
#: is the root cause; the launcher names a vanished process "WorkerLost" when it sees its channel
#: drop, but only if no other rank's report got there first, and this rank notices the loss just
#: as fast. The driver cancels the job at its first failure, so the wait usually ends with this
#: task being killed; if not, the error below still names the peer.
PEER_LOSS_GRACE_S = 5.0
# Flags that choose a kernel for the user's device; the server's shard always lives on the CPU,
# so it takes torch's CPU defaults for them instead (fused/capturable CUDA settings would fail).
_DEVICE_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})


@dataclasses.dataclass(frozen=True)
class ParameterServer(Strategy):
    """Asynchronous, sharded parameter server with an optional staleness bound (SSP).

    Every task hosts one shard of the parameters, updated by a server-side copy of the user's
    optimizer. The optimizer that ``prepare_optimizer`` returns does not step locally: its
    ``step()`` sends the gradients to every shard and replaces the local parameters with the
    servers' fresh values. Each worker's gradient is applied as its own update, as soon as it
    arrives (asynchronous SGD): with N workers the servers apply N updates per "step" of each
    worker, each computed from one worker's batch.

    Args:
        max_staleness: how many steps (clocks) the fastest worker may run ahead of the slowest.
            ``None``: never wait (fully asynchronous, Downpour SGD); ``0``: bulk-synchronous —
            every read includes every worker's previous steps; ``s``: stale-synchronous.
        timeout_s: bound on connecting, on each message and on each staleness wait. A worker
            that holds the others back for longer fails the run with an error naming it.
        layout: ``"balanced"`` (default) cuts the flattened parameters into equal contiguous
            ranges, one per rank; ``"tensors"`` keeps tensors whole and bin-packs them
            (largest first onto the least-loaded rank), for optimizers that need each tensor's
            shape (Adafactor, Muon).

    Example::

        est = sparkdl.TorchEstimator(model=make_net, strategy=sparkdl.ParameterServer(max_staleness=2), ...)
    """

    name = "parameter_server"
    identical_final_weights = True
    # The order in which the servers apply the workers' pushes depends on timing.
    deterministic = False

    max_staleness: Optional[int] = None
    timeout_s: float = 300.0
    layout: str = "balanced"

    def __post_init__(self) -> None:
        s = self.max_staleness
        if s is not None and (not isinstance(s, numbers.Integral) or isinstance(s, bool) or s < 0):
            raise ConfigError(
                f"ParameterServer.max_staleness={s!r} must be None (fully asynchronous) or an integer >= 0 "
                f"(how many steps the fastest worker may run ahead of the slowest; 0 = bulk-synchronous)"
            )
        t = self.timeout_s
        if not isinstance(t, numbers.Real) or isinstance(t, bool) or not (math.isfinite(t) and t > 0):
            raise ConfigError(f"ParameterServer.timeout_s={t!r} must be a number of seconds > 0")
        if self.layout not in LAYOUTS:
            raise ConfigError(f"ParameterServer.layout={self.layout!r} must be one of {', '.join(map(repr, LAYOUTS))}")

    def create_runtime(self, env: "DistEnv") -> StrategyRuntime:
        if env.all_gather is None or len(env.peer_addresses) != env.world_size:
            raise RuntimeError(
                "ParameterServer needs the barrier stage's task addresses and allGather (DistEnv.peer_addresses "
                f"and DistEnv.all_gather, which the launcher's rendezvous fills in); this one has "
                f"{len(env.peer_addresses)} address(es) for {env.world_size} ranks and all_gather={env.all_gather!r}"
            )
        address = env.peer_addresses[env.rank]
        host = address.rsplit(":", 1)[0].strip("[]")  # "[::1]:port" for IPv6
        # Every rank calls create_runtime at the same point (after rendezvous), so this
        # allGather pairs up across ranks like the rendezvous one does.
        return _ParameterServerRuntime(self, env, env.all_gather, host)


# --------------------------------------------------------------------------------------------
# Layout: pure functions
# --------------------------------------------------------------------------------------------


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
    """``balanced_layout`` or ``tensor_layout`` by name."""
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
# Stale-synchronous clocks: pure logic
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Tables: what every rank agrees on
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _TableSpec:
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


def _hyperparameters(group: Dict[str, Any]) -> Dict[str, Any]:
    out = {}
    for key, value in group.items():
        if key == "params" or key in _DEVICE_FLAGS:
            continue
        out[key] = float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    return out


def build_server_optimizer(
    template: torch.optim.Optimizer, groups: List[Tuple[int, List[torch.Tensor]]]
) -> torch.optim.Optimizer:
    """A new optimizer of ``template``'s type over a shard's segment tensors.

    Each ``(user_group_index, tensors)`` becomes one param group with that user group's
    hyperparameters (so per-group settings carry over); the constructor also gets the user's
    ``defaults`` that it accepts. Device-specific flags (``foreach``, ``fused``, ``capturable``,
    ``differentiable``) are left to torch's CPU defaults.

    Raises:
        ConfigError: the optimizer type cannot run on a server (LBFGS needs a closure) or cannot
            be rebuilt from its defaults.
    """
    cls = type(template)
    if isinstance(template, torch.optim.LBFGS):
        raise ConfigError(
            "ParameterServer cannot run LBFGS on the servers: its step re-evaluates the loss through a "
            "closure, which only the worker has; use a first-order optimizer (SGD, Adam, ...)"
        )
    try:
        accepted = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        accepted = {}
    kwargs = {k: v for k, v in _hyperparameters(dict(template.defaults)).items() if k in accepted and k != "params"}
    param_groups = [{**_hyperparameters(template.param_groups[index]), "params": tensors} for index, tensors in groups]
    try:
        return cls(param_groups, **kwargs)
    except Exception as exc:  # noqa: BLE001 - turned into one actionable message
        raise ConfigError(
            f"ParameterServer rebuilds the optimizer on each server shard as {cls.__name__}(param_groups, **defaults), "
            f"which failed: {type(exc).__name__}: {exc}. Use a torch.optim optimizer, or one whose constructor "
            f"accepts its own defaults as keyword arguments"
        ) from exc


# --------------------------------------------------------------------------------------------
# Server side
# --------------------------------------------------------------------------------------------


class _Shard:
    """This rank's slice of one table: values, the server optimizer, the SSP clocks."""

    def __init__(
        self,
        spec: _TableSpec,
        rank: int,
        world_size: int,
        max_staleness: Optional[int],
        timeout_s: float,
        initial: torch.Tensor,
        template: torch.optim.Optimizer,
    ) -> None:
        self.spec = spec
        self.rank = rank
        self.timeout_s = timeout_s
        self.max_staleness = max_staleness
        self.values = initial.detach().to("cpu", copy=True).contiguous()
        self.nbytes = _nbytes(self.values)
        self.clock = SSPClock(world_size, max_staleness)
        self.cond = threading.Condition()
        self.closed = False
        #: Updates applied (one per push, from any worker).
        self.updates = 0
        sizes, shapes = spec.sizes, spec.shapes
        self.segments = shard_segments(spec.layout, sizes, rank)
        # Whole tensors keep their shape (shape-aware optimizers see real matrices); the pieces
        # of a tensor cut by the balanced layout are 1-D.
        self.tensors = [
            self._view(self.values, seg, shapes[seg.param] if seg.size == sizes[seg.param] else (seg.size,))
            for seg in self.segments
        ]
        by_group: Dict[int, List[int]] = {}
        for i, seg in enumerate(self.segments):
            by_group.setdefault(spec.groups[seg.param], []).append(i)
        self.group_map = sorted(by_group)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        if self.segments:
            self.optimizer = build_server_optimizer(template, [(g, [self.tensors[i] for i in by_group[g]]) for g in self.group_map])

    @staticmethod
    def _view(flat: torch.Tensor, seg: Segment, shape: Tuple[int, ...]) -> torch.Tensor:
        return flat[seg.offset: seg.offset + seg.size].view(shape)

    def push(self, rank: int, clock: int, lrs: Sequence[float], grad: torch.Tensor) -> None:
        """Applies one worker's gradient for this shard with the server optimizer.

        Raises:
            WireError: out-of-order clock or a worker that has left.
            ParameterServerError: the server is closing.
        """
        with self.cond:
            if self.closed:
                raise ParameterServerError(f"the parameter server on rank {self.rank} is shutting down")
            self.clock.tick(rank, clock)
            if self.optimizer is not None:
                for group, user_index in zip(self.optimizer.param_groups, self.group_map):
                    lr = lrs[user_index]
                    if not math.isnan(lr):  # LR schedulers on the worker reach the server this way
                        group["lr"] = lr
                for seg, tensor in zip(self.segments, self.tensors):
                    tensor.grad = self._view(grad, seg, tensor.shape)
                self.optimizer.step()
                for tensor in self.tensors:
                    tensor.grad = None  # drop the reference to the receive buffer
            self.updates += 1
            self.cond.notify_all()

    def read_into(self, out: torch.Tensor, rank: int, clock: int) -> Tuple[int, int]:
        """Copies the values into ``out`` once a reader at ``clock`` may read (SSP); ``clock``
        -1 reads at once. Returns ``(staleness, slowest clock)``.

        Raises:
            ParameterServerError: the worker it waits for was lost, or the wait timed out.
        """
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            if clock >= 0:
                while not self.clock.can_read(clock):
                    if self.closed:
                        raise ParameterServerError(f"the parameter server on rank {self.rank} is shutting down")
                    blockers = self.clock.blockers(clock)
                    lost = [r for r in blockers if r in self.clock.lost]
                    if lost:
                        peer = lost[0]
                        raise ParameterServerError(
                            f"rank {peer}'s worker left the parameter server on rank {self.rank} "
                            f"({self.clock.lost[peer]}) at clock {self.clock.clocks[peer]}, while rank {rank} "
                            f"at clock {clock} waited for it (max_staleness={self.max_staleness}); "
                            f"rank {peer} has probably failed: see its error",
                            peer,
                        )
                    left = deadline - time.monotonic()
                    if left <= 0:
                        peer = blockers[0]
                        raise ParameterServerError(
                            f"rank {rank} at clock {clock} waited {self.timeout_s:g}s on the parameter server of "
                            f"rank {self.rank} for rank {peer}, which is stuck at clock {self.clock.clocks[peer]} "
                            f"(max_staleness={self.max_staleness}); raise ParameterServer.timeout_s if rank "
                            f"{peer} is just slow",
                            peer,
                        )
                    self.cond.wait(left)
            staleness = self.clock.staleness(clock) if clock >= 0 else 0
            out.copy_(self.values)
            return staleness, self.clock.min_clock()

    def depart(self, rank: int, clean: bool, reason: str) -> None:
        with self.cond:
            if clean:
                self.clock.finish(rank)
            else:
                self.clock.lose(rank, reason)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def state_dict(self) -> Dict[str, Any]:
        with self.cond:
            return {
                "fingerprint": self.spec.fingerprint(),
                "values": self.values.clone(),
                "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
                "clocks": list(self.clock.clocks),
                "updates": self.updates,
            }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        with self.cond:
            values = state["values"]
            if tuple(values.shape) != tuple(self.values.shape) or values.dtype != self.values.dtype:
                raise ValueError(f"checkpointed shard has shape {tuple(values.shape)} {values.dtype}, expected {tuple(self.values.shape)} {self.values.dtype}")
            self.values.copy_(values)
            if self.optimizer is not None and state["optimizer"] is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            self.clock.clocks = [int(c) for c in state["clocks"]]
            self.updates = int(state.get("updates", 0))
            self.cond.notify_all()


class _ServerState(Backend):
    """This rank's shards, as the :class:`ShardServer` and the local worker see them."""

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._shards: Dict[int, _Shard] = {}
        self._departed: Dict[int, Tuple[bool, str]] = {}
        self._receive: Dict[Tuple[int, int], torch.Tensor] = {}
        self._reply: Dict[Tuple[int, int], torch.Tensor] = {}
        self._closed = False

    def register(self, table: int, shard: _Shard) -> None:
        with self._cond:
            # A worker that left before this table existed must count as gone for it too.
            for rank, (clean, reason) in self._departed.items():
                shard.depart(rank, clean, reason)
            self._shards[table] = shard
            self._cond.notify_all()

    def shard(self, table: int) -> _Shard:
        return self._shards[table]

    def _wait_for(self, table: int, deadline: float) -> _Shard:
        # A fast worker may push before this rank's own worker has prepared the optimizer.
        with self._cond:
            while table not in self._shards:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    raise WireError(f"request for table {table}, which this rank never registered")
                self._cond.wait(left)
            return self._shards[table]

    def buffer_for(self, rank: int, header: Header, deadline: float) -> memoryview:
        shard = self._wait_for(header.table, deadline)
        if header.dtype != DTYPE_CODES[shard.spec.dtype]:
            raise WireError(f"dtype code {header.dtype} for table {header.table} of {shard.spec.dtype}")
        if header.kind == Kind.PULL:
            if header.length != 0 or header.clock != -1:
                raise WireError("PULL frames have clock -1 and no payload")
            return memoryview(b"")
        if header.aux != shard.spec.num_groups:
            raise WireError(f"PUSH carries {header.aux} learning rates, table {header.table} has {shard.spec.num_groups} groups")
        expected = 8 * shard.spec.num_groups + shard.nbytes
        if header.length != expected:
            raise WireError(f"PUSH of {header.length} bytes for table {header.table}, whose shard takes exactly {expected}")
        key = (rank, header.table)
        buffer = self._receive.get(key)
        if buffer is None:
            buffer = self._receive[key] = torch.empty(expected, dtype=torch.uint8)
        return byte_view(buffer)

    def handle(self, rank: int, header: Header) -> Tuple[Header, memoryview]:
        shard = self._shards[header.table]
        key = (rank, header.table)
        if header.kind == Kind.PUSH:
            buffer = self._receive[key]
            count = shard.spec.num_groups
            lrs = buffer[: 8 * count].view(torch.float64)
            valid = torch.isnan(lrs) | (torch.isfinite(lrs) & (lrs >= 0))
            if not bool(valid.all()):
                raise WireError("PUSH carries a negative or infinite learning rate")
            grad = buffer[8 * count:].view(shard.spec.dtype)
            shard.push(rank, header.clock, lrs.tolist(), grad)
            clock = header.clock + 1
        else:
            clock = -1
        reply = self._reply.get(key)
        if reply is None:
            reply = self._reply[key] = torch.empty_like(shard.values)
        staleness, slowest = shard.read_into(reply, rank, clock)
        out = Header(Kind.PARAMS, header.dtype, header.table, self.rank, slowest, staleness, shard.nbytes)
        return out, byte_view(reply)

    def disconnected(self, rank: int, clean: bool, reason: str) -> None:
        with self._cond:
            self._departed[rank] = (clean, reason)
            shards = list(self._shards.values())
        for shard in shards:
            shard.depart(rank, clean, reason)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            shards = list(self._shards.values())
            self._cond.notify_all()
        for shard in shards:
            shard.close()


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


class _WorkerTable:
    """A worker's view of one table: its parameters in wire order and the flat buffers."""

    def __init__(self, spec: _TableSpec, params: List[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
        self.spec = spec
        self.params = [params[i] for i in spec.layout.order]
        self.optimizer = optimizer
        total = sum(spec.sizes)
        self.grad = torch.empty(total, dtype=spec.dtype)
        self.values = torch.empty(total, dtype=spec.dtype)
        self.clock = 0

    def gather_grads(self) -> None:
        pieces = []
        for param in self.params:
            grad = param.grad
            if grad is None:  # unused in this step: an explicit zero gradient (see the docs)
                grad = torch.zeros_like(param)
            elif grad.is_sparse:
                grad = grad.to_dense()
            pieces.append(grad.detach().reshape(-1))
        if len(pieces) == 1:
            self.grad.copy_(pieces[0])
        elif pieces[0].device.type == "cpu":
            torch.cat(pieces, out=self.grad)
        else:
            self.grad.copy_(torch.cat(pieces))  # one device-to-host copy

    def scatter_values(self) -> None:
        offset = 0
        with torch.no_grad():
            for param in self.params:
                count = param.numel()
                param.copy_(self.values[offset: offset + count].view_as(param))
                offset += count

    def learning_rates(self) -> torch.Tensor:
        rates = []
        for group in self.optimizer.param_groups:
            lr = group.get("lr", math.nan)
            rates.append(float(lr) if isinstance(lr, (numbers.Real, torch.Tensor)) else math.nan)
        return torch.tensor(rates, dtype=torch.float64)


class ParameterServerOptimizer(_SyncingOptimizer):
    """What ``ctx.prepare_optimizer`` returns under :class:`ParameterServer`.

    ``step()`` pushes this worker's gradients to every shard and replaces the local parameters
    with the servers' fresh values (after any staleness wait); it does not run the wrapped
    optimizer's own step. Everything else — ``param_groups`` (LR schedulers work: each push
    carries every group's current ``lr``), ``zero_grad``, ``defaults`` — is the wrapped
    optimizer's. Its ``state`` stays empty: the optimizer state lives on the servers (see
    :meth:`StrategyRuntime.state_dict`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, runtime: "_ParameterServerRuntime", tables: List[_WorkerTable]) -> None:
        super().__init__(optimizer, _no_after_step)
        self.__dict__["_runtime"] = runtime
        self.__dict__["_tables"] = tables

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """Pushes gradients, pulls parameters; returns ``closure()``'s loss when given one."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._runtime._step(self._tables)
        return loss

    def epoch_metrics(self) -> Dict[str, float]:
        """This worker's ``staleness`` (largest since the previous call) and ``updates_per_sec``
        (its pushes per second since the previous call); for custom loops, which have no FitLoop
        to collect them. Shares its window with :meth:`StrategyRuntime.epoch_metrics`."""
        return self._runtime.epoch_metrics()


def _no_after_step() -> None:
    """The wrapper's step does all the work; nothing runs after it."""


class _ParameterServerRuntime(StrategyRuntime):
    def __init__(
        self,
        config: ParameterServer,
        env: "DistEnv",
        all_gather: Callable[[str], Sequence[str]],
        host: str,
    ) -> None:
        """Starts this rank's server and connects to every other rank's.

        Args:
            config: the strategy.
            env: this rank's place in the process group.
            all_gather: ``env.all_gather`` (the barrier's ``allGather``) or an equivalent in tests:
                carries each rank's port and rank 0's secret.
            host: the address this rank's server binds to and the others connect to.
        """
        if sys.byteorder != "little":
            raise ConfigError("ParameterServer sends raw tensor bytes and supports little-endian hosts only")
        # Bytes this rank puts on the wire: its worker's requests, its server's replies, and its
        # share of the start-up broadcasts. Created before the base class assigns comm_bytes.
        self._sent = ByteCounter()
        super().__init__(env)
        self.config = config
        self.max_staleness = config.max_staleness
        self.timeout_s = float(config.timeout_s)
        self.modules: List[torch.nn.Module] = []
        self.tables: List[_WorkerTable] = []
        self._optimizers: List[ParameterServerOptimizer] = []
        self._server: Optional[ShardServer] = None
        self._clients: Dict[int, ShardClient] = {}
        self._closed = False
        self._steps = 0
        self._window_steps = 0
        self._window_start = time.monotonic()
        self._window_staleness = 0
        self.peer_loss_grace_s = PEER_LOSS_GRACE_S
        self.state = _ServerState(env.rank, env.world_size, self.timeout_s)
        listener = listen(host)
        try:
            own_secret = secrets.token_bytes(32) if env.rank == 0 else b""
            port = listener.getsockname()[1]
            # Hex in JSON: allGather carries strings. The secret travels only inside the barrier
            # coordinator's messages, never on a command line or in a log line.
            replies = [json.loads(m) for m in all_gather(json.dumps({"host": host, "port": port, "secret": own_secret.hex()}))]
            if len(replies) != env.world_size:
                raise RuntimeError(f"ParameterServer: allGather returned {len(replies)} entries for {env.world_size} ranks")
            secret = bytes.fromhex(replies[0]["secret"])
            if len(secret) < 16:
                raise RuntimeError("ParameterServer: rank 0 sent no usable secret")
            self._server = ShardServer(listener, secret, env.rank, env.world_size, self.state, self.timeout_s, self._sent)
            listener = None
            addresses = [(str(r["host"]), int(r["port"])) for r in replies]
            self._clients = connect_all(addresses, secret, env.rank, self.timeout_s, self._sent)
        except BaseException:
            if listener is not None:
                listener.close()
            self.close()
            raise

    # comm_bytes is read and reset by the training loop; it is backed by the thread-safe counter
    # that the server's threads also add to.
    @property  # type: ignore[override]
    def comm_bytes(self) -> int:
        return self._sent.value

    @comm_bytes.setter
    def comm_bytes(self, value: int) -> None:
        self._sent.set(value)

    # ---- strategy helpers ------------------------------------------------------------------

    def prepare_model(self, module: torch.nn.Module) -> torch.nn.Module:
        if any(m is module for m in self.modules):
            return module
        # Custom loops need not seed: every replica starts from rank 0's weights, like DDP.
        self._sent.add(broadcast_from_rank0(module))
        self.modules.append(module)
        return module

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if isinstance(optimizer, ParameterServerOptimizer) and optimizer._runtime is self:
            return optimizer
        if not self.modules:
            raise RuntimeError(
                "ParameterServer: call ctx.prepare_model(module) before ctx.prepare_optimizer(...), "
                "and build the optimizer over the prepared module's parameters"
            )
        known = {id(p) for m in self.modules for p in m.parameters()}
        params: List[torch.Tensor] = []
        groups: List[int] = []
        seen: Set[int] = set()
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if id(param) not in known:
                    raise RuntimeError(
                        "ParameterServer: the optimizer updates a parameter that belongs to no module passed to "
                        "ctx.prepare_model; build the optimizer over the prepared model's parameters"
                    )
                if id(param) not in seen:
                    seen.add(id(param))
                    params.append(param)
                    groups.append(index)
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i, param in enumerate(params):
            if param.dtype not in DTYPE_CODES:
                raise ConfigError(f"ParameterServer: parameters of dtype {param.dtype} are not supported (float16/32/64 and bfloat16 are)")
            by_dtype.setdefault(param.dtype, []).append(i)
        specs: List[Tuple[_TableSpec, List[torch.Tensor]]] = []
        for dtype, members in by_dtype.items():
            table = len(self.tables) + len(specs)
            if table > MAX_TABLE:
                raise ConfigError("ParameterServer: too many prepared optimizers")
            sizes = [params[i].numel() for i in members]
            spec = _TableSpec(
                table=table,
                dtype=dtype,
                shapes=tuple(tuple(params[i].shape) for i in members),
                groups=tuple(groups[i] for i in members),
                num_groups=len(optimizer.param_groups),
                layout=make_layout(self.config.layout, sizes, self.env.world_size),
            )
            specs.append((spec, [params[i] for i in members]))
        self._check_same_on_every_rank([spec.fingerprint() for spec, _ in specs])
        created = []
        for spec, members in specs:
            worker = _WorkerTable(spec, members, optimizer)
            with torch.no_grad():
                # The servers start from rank 0's values, and so does every replica.
                flat = _flatten(worker.params)
                dist.broadcast(flat, src=0)
                if self.env.rank == 0:
                    self._sent.add(_nbytes(flat))
                _unflatten_into(flat, worker.params)
            low, high = spec.shard_bounds(self.env.rank)
            shard = _Shard(spec, self.env.rank, self.env.world_size, self.max_staleness, self.timeout_s, flat[low:high], optimizer)
            self.state.register(spec.table, shard)
            created.append(worker)
        if not self.tables:
            self._window_start = time.monotonic()  # updates_per_sec counts from the first optimizer
        self.tables.extend(created)
        wrapped = ParameterServerOptimizer(optimizer, self, created)
        self._optimizers.append(wrapped)
        return wrapped

    def final_module(self, model: torch.nn.Module) -> torch.nn.Module:
        if not any(m is model for m in self.modules):
            raise RuntimeError("ParameterServer: final_module got a module that ctx.prepare_model did not return")
        if not self.tables:
            raise RuntimeError(
                "ParameterServer updates parameters on the servers at optimizer steps, but no optimizer was "
                "prepared: use optimizer = ctx.prepare_optimizer(optimizer) and call its step()"
            )
        # Every worker's last push was applied before its step returned, so after this barrier
        # the servers hold the final parameters; all ranks pull the same bytes.
        dist.barrier()
        self._pull_all()
        with torch.no_grad():
            # Buffers (BatchNorm statistics) are not on the servers: average the floating ones,
            # take rank 0's integer ones (step counters), so every rank returns the same module.
            for group in _by_device_and_dtype(list(model.buffers())):
                flat = _flatten(group)
                if flat.is_floating_point() or flat.is_complex():
                    flat.div_(self.env.world_size)
                    dist.all_reduce(flat)
                    self._sent.add(_nbytes(flat))
                else:
                    dist.broadcast(flat, src=0)
                    if self.env.rank == 0:
                        self._sent.add(_nbytes(flat))
                _unflatten_into(flat, group)
        # No server may shut down while another rank is still pulling from it.
        dist.barrier()
        return model

    # ---- the step --------------------------------------------------------------------------

    def _step(self, tables: List[_WorkerTable]) -> None:
        if self._closed:
            raise RuntimeError("ParameterServer: optimizer.step() after the strategy was closed")
        staleness = 0
        try:
            for table in tables:
                staleness = max(staleness, self._push_pull(table))
        except ParameterServerError as exc:
            if exc.peer_rank is not None and self.peer_loss_grace_s > 0:
                logger.warning("rank %d: %s; reporting it in %gs unless the run is cancelled first", self.env.rank, exc, self.peer_loss_grace_s)
                time.sleep(self.peer_loss_grace_s)  # not synchronization: see PEER_LOSS_GRACE_S
            raise
        self._steps += 1
        self._window_steps += 1
        self._window_staleness = max(self._window_staleness, staleness)

    def _push_pull(self, table: _WorkerTable) -> int:
        """One push of this worker's gradients to every shard and the pull of the new values."""
        spec = table.spec
        rank = self.env.rank
        code = DTYPE_CODES[spec.dtype]
        table.gather_grads()
        lrs = table.learning_rates()
        lr_bytes = byte_view(lrs)
        remote = [k for k in sorted(self._clients) if spec.layout.sizes[k] > 0]
        # Send to every remote shard first, then serve the local one, then read the replies:
        # the servers work in parallel, and a bulk-synchronous wait on one shard never blocks
        # the pushes the other shards are waiting for.
        for k in remote:
            low, high = spec.shard_bounds(k)
            grad = table.grad[low:high]
            header = Header(Kind.PUSH, code, spec.table, rank, table.clock, spec.num_groups, len(lr_bytes) + _nbytes(grad))
            self._clients[k].send(header, lr_bytes, byte_view(grad))
        staleness = 0
        low, high = spec.shard_bounds(rank)
        if high > low:
            shard = self.state.shard(spec.table)
            shard.push(rank, table.clock, lrs.tolist(), table.grad[low:high])
            staleness, _ = shard.read_into(table.values[low:high], rank, table.clock + 1)
        for k in remote:
            low, high = spec.shard_bounds(k)
            reply = self._clients[k].receive(byte_view(table.values[low:high]), spec.table)
            staleness = max(staleness, reply.aux)
        table.clock += 1
        table.scatter_values()
        return staleness

    def _pull_all(self) -> None:
        """Reads every shard's current values (no staleness wait) into the local parameters."""
        rank = self.env.rank
        for table in self.tables:
            spec = table.spec
            code = DTYPE_CODES[spec.dtype]
            remote = [k for k in sorted(self._clients) if spec.layout.sizes[k] > 0]
            for k in remote:
                self._clients[k].send(Header(Kind.PULL, code, spec.table, rank, -1, 0, 0))
            low, high = spec.shard_bounds(rank)
            if high > low:
                self.state.shard(spec.table).read_into(table.values[low:high], rank, -1)
            for k in remote:
                low, high = spec.shard_bounds(k)
                self._clients[k].receive(byte_view(table.values[low:high]), spec.table)
            table.scatter_values()

    def _check_same_on_every_rank(self, fingerprints: List[str]) -> None:
        gathered: List[Any] = [None] * self.env.world_size
        dist.all_gather_object(gathered, fingerprints)
        for rank, theirs in enumerate(gathered):
            if theirs != fingerprints:
                raise RuntimeError(
                    f"ParameterServer: rank {rank} prepared an optimizer over different parameters (shapes, dtypes "
                    f"or param groups) than rank {self.env.rank}; every rank must build the same model and optimizer"
                )

    # ---- metrics and checkpoints ------------------------------------------------------------

    def epoch_metrics(self) -> Dict[str, float]:
        """``staleness``: the largest staleness of this worker's reads since the previous call;
        ``updates_per_sec``: its pushes (model updates applied by the servers) per second."""
        now = time.monotonic()
        seconds = now - self._window_start
        metrics = {
            "staleness": int(self._window_staleness),
            "updates_per_sec": self._window_steps / seconds if seconds > 0 else 0.0,
        }
        self._window_start = now
        self._window_steps = 0
        self._window_staleness = 0
        return metrics

    def state_dict(self) -> Dict[str, Any]:
        """This rank's shards (values, server optimizer state, clocks) and its worker clocks.

        Collective: call it on every rank at the same step. The barriers around the snapshot
        make it a consistent cut — every push made before it is in, none made after.
        """
        dist.barrier()
        state = {
            "format": 1,
            "rank": self.env.rank,
            "world_size": self.env.world_size,
            "tables": [
                {**self.state.shard(t.spec.table).state_dict(), "worker_clock": t.clock} for t in self.tables
            ],
        }
        dist.barrier()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s result into this rank's shards, then pulls the restored
        parameters into the local replica. Collective, like :meth:`state_dict`."""
        if state.get("world_size") != self.env.world_size or len(state.get("tables", ())) != len(self.tables):
            raise ValueError(
                f"ParameterServer checkpoint of {state.get('world_size')} ranks and {len(state.get('tables', ()))} tables "
                f"cannot restore a run of {self.env.world_size} ranks and {len(self.tables)} tables"
            )
        for table, saved in zip(self.tables, state["tables"]):
            if saved["fingerprint"] != table.spec.fingerprint():
                raise ValueError(f"ParameterServer checkpoint of table {table.spec.table} holds different parameters")
            self.state.shard(table.spec.table).load_state_dict(saved)
            table.clock = int(saved["worker_clock"])
        dist.barrier()
        self._pull_all()
        dist.barrier()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for client in self._clients.values():
            client.close()  # BYE: the other servers stop waiting for this worker
        # Wake this server's threads that wait for a staleness bound before joining them.
        self.state.close()
        if self._server is not None:
            self._server.close()
