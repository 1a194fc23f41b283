"""The server side: this rank's shard of every table, updated by a copy of the user's optimizer.

Each worker's gradient is applied to the shard as its own update as soon as it arrives
(asynchronous SGD); a read waits only as long as the staleness bound asks (the rule is
:mod:`sparkdl.strategies.parameter_server.clock`'s). :class:`ServerState` is the rank's
:class:`~sparkdl.strategies.parameter_server.transport.Backend`: the other ranks' requests reach
it through the server's threads, the local worker's directly.
"""

from __future__ import annotations

import copy
import inspect
import math
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sparkdl.errors import ConfigError
from sparkdl.strategies._tensors import nbytes
from sparkdl.strategies.parameter_server.clock import SSPClock
from sparkdl.strategies.parameter_server.layout import Segment, TableSpec, shard_segments
from sparkdl.strategies.parameter_server.transport import Backend
from sparkdl.strategies.parameter_server.wire import (
    DTYPE_CODES,
    ROW_KINDS,
    Header,
    Kind,
    ParameterServerError,
    WireError,
    byte_view,
)

__all__ = ["ClockedShard", "ServerState", "Shard", "build_server_optimizer"]

# Flags that choose a kernel for the user's device; the server's shard always lives on the CPU,
# so it takes torch's CPU defaults for them instead (fused/capturable CUDA settings would fail).
_DEVICE_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})


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


class ClockedShard:
    """What every shard of a rank shares: the SSP clocks of one table, the condition its
    readers wait on, and the wait itself (:meth:`wait_readable`)."""

    def __init__(self, rank: int, world_size: int, max_staleness: Optional[int], timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.max_staleness = max_staleness
        self.clock = SSPClock(world_size, max_staleness)
        self.cond = threading.Condition()
        self.closed = False

    def wait_readable(self, rank: int, clock: int) -> None:
        """Waits, holding ``self.cond``, until a reader at ``clock`` may read (SSP); ``clock``
        -1 reads at once.

        Raises:
            ParameterServerError: the worker it waits for was lost, or the wait timed out.
        """
        deadline = time.monotonic() + self.timeout_s
        while clock >= 0 and not self.clock.can_read(clock):
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


class Shard(ClockedShard):
    """This rank's slice of one table: values, the server optimizer, the SSP clocks."""

    def __init__(
        self,
        spec: TableSpec,
        rank: int,
        world_size: int,
        max_staleness: Optional[int],
        timeout_s: float,
        initial: torch.Tensor,
        template: torch.optim.Optimizer,
    ) -> None:
        super().__init__(rank, world_size, max_staleness, timeout_s)
        self.spec = spec
        self.values = initial.detach().to("cpu", copy=True).contiguous()
        self.nbytes = nbytes(self.values)
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
            self.optimizer = build_server_optimizer(
                template, [(g, [self.tensors[i] for i in by_group[g]]) for g in self.group_map]
            )

    @staticmethod
    def _view(flat: torch.Tensor, seg: Segment, shape: Tuple[int, ...]) -> torch.Tensor:
        return flat[seg.offset : seg.offset + seg.size].view(shape)

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
        with self.cond:
            self.wait_readable(rank, clock)
            staleness = self.clock.staleness(clock) if clock >= 0 else 0
            out.copy_(self.values)
            return staleness, self.clock.min_clock()

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
                raise ValueError(
                    f"checkpointed shard has shape {tuple(values.shape)} {values.dtype}, expected {tuple(self.values.shape)} {self.values.dtype}"
                )
            self.values.copy_(values)
            if self.optimizer is not None and state["optimizer"] is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            self.clock.clocks = [int(c) for c in state["clocks"]]
            self.updates = int(state.get("updates", 0))
            self.cond.notify_all()


class ServerState(Backend):
    """This rank's shards, as the :class:`ShardServer` and the local worker see them."""

    def __init__(self, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._shards: Dict[int, Shard] = {}
        # Sparse tables (sparse_shard.SparseShard, which serves its own frames), numbered apart.
        self._sparse: Dict[int, Any] = {}
        self._departed: Dict[int, Tuple[bool, str]] = {}
        self._receive: Dict[Tuple[int, int], torch.Tensor] = {}
        self._reply: Dict[Tuple[int, int], torch.Tensor] = {}
        self._closed = False

    def register(self, table: int, shard: Shard) -> None:
        with self._cond:
            # A worker that left before this table existed must count as gone for it too.
            for rank, (clean, reason) in self._departed.items():
                shard.depart(rank, clean, reason)
            self._shards[table] = shard
            self._cond.notify_all()

    def register_sparse(self, table: int, shard: ClockedShard) -> None:
        """Registers sparse table ``table``'s shard: an object that also serves its frames
        (``buffer_for(rank, header)`` and ``handle(rank, header)``)."""
        with self._cond:
            for rank, (clean, reason) in self._departed.items():
                shard.depart(rank, clean, reason)
            self._sparse[table] = shard
            self._cond.notify_all()

    def shard(self, table: int) -> Shard:
        return self._shards[table]

    def sparse(self, table: int) -> Any:
        return self._sparse[table]

    def _wait_for(self, table: int, deadline: float, sparse: bool = False) -> Any:
        # A fast worker may push before this rank's own worker has prepared the optimizer.
        registry = self._sparse if sparse else self._shards
        with self._cond:
            while table not in registry:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    what = "sparse table" if sparse else "table"
                    raise WireError(f"request for {what} {table}, which this rank never registered")
                self._cond.wait(left)
            return registry[table]

    def buffer_for(self, rank: int, header: Header, deadline: float) -> memoryview:
        if header.kind in ROW_KINDS:
            return self._wait_for(header.table, deadline, sparse=True).buffer_for(rank, header)
        shard = self._wait_for(header.table, deadline)
        if header.dtype != DTYPE_CODES[shard.spec.dtype]:
            raise WireError(f"dtype code {header.dtype} for table {header.table} of {shard.spec.dtype}")
        if header.kind == Kind.PULL:
            if header.length != 0 or header.clock != -1:
                raise WireError("PULL frames have clock -1 and no payload")
            return memoryview(b"")
        if header.aux != shard.spec.num_groups:
            raise WireError(
                f"PUSH carries {header.aux} learning rates, table {header.table} has {shard.spec.num_groups} groups"
            )
        expected = 8 * shard.spec.num_groups + shard.nbytes
        if header.length != expected:
            raise WireError(
                f"PUSH of {header.length} bytes for table {header.table}, whose shard takes exactly {expected}"
            )
        key = (rank, header.table)
        buffer = self._receive.get(key)
        if buffer is None:
            buffer = self._receive[key] = torch.empty(expected, dtype=torch.uint8)
        return byte_view(buffer)

    def handle(self, rank: int, header: Header) -> Tuple[Header, memoryview]:
        if header.kind in ROW_KINDS:
            return self._sparse[header.table].handle(rank, header)
        shard = self._shards[header.table]
        key = (rank, header.table)
        if header.kind == Kind.PUSH:
            buffer = self._receive[key]
            count = shard.spec.num_groups
            lrs = buffer[: 8 * count].view(torch.float64)
            valid = torch.isnan(lrs) | (torch.isfinite(lrs) & (lrs >= 0))
            if not bool(valid.all()):
                raise WireError("PUSH carries a negative or infinite learning rate")
            grad = buffer[8 * count :].view(shard.spec.dtype)
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
            shards = [*self._shards.values(), *self._sparse.values()]
        for shard in shards:
            shard.depart(rank, clean, reason)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            shards = [*self._shards.values(), *self._sparse.values()]
            self._cond.notify_all()
        for shard in shards:
            shard.close()
