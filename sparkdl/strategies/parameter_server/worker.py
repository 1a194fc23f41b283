"""The worker side of one prepared optimizer: its parameters as flat, wire-ordered buffers, and
the optimizer wrapper whose ``step()`` pushes gradients and pulls fresh values instead of
stepping locally.

The push and pull themselves are the rank's runtime's
(:mod:`~sparkdl.strategies.parameter_server.runtime`, which imports this module): the wrapper
calls it through :class:`WorkerRuntime` and does not import it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Dict, List, Optional, Protocol

import torch

from sparkdl.strategies._tensors import SyncingOptimizer
from sparkdl.strategies.parameter_server.layout import TableSpec

__all__ = ["ParameterServerOptimizer", "WorkerRuntime", "WorkerTable"]


class WorkerTable:
    """A worker's view of one table: its parameters in wire order and the flat buffers."""

    def __init__(self, spec: TableSpec, params: List[torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
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
                param.copy_(self.values[offset : offset + count].view_as(param))
                offset += count

    def learning_rates(self) -> torch.Tensor:
        rates = []
        for group in self.optimizer.param_groups:
            lr = group.get("lr", math.nan)
            rates.append(float(lr) if isinstance(lr, (numbers.Real, torch.Tensor)) else math.nan)
        return torch.tensor(rates, dtype=torch.float64)


class WorkerRuntime(Protocol):
    """What the optimizer wrapper calls on its rank's runtime
    (:class:`~sparkdl.strategies.parameter_server.runtime.ParameterServerRuntime`)."""

    def _step(self, tables: List[WorkerTable]) -> None:
        """One push of ``tables``' gradients to every shard and the pull of the fresh values."""

    def epoch_metrics(self) -> Dict[str, float]:
        """``staleness`` and ``updates_per_sec`` since the previous call."""


class ParameterServerOptimizer(SyncingOptimizer):
    """What ``ctx.prepare_optimizer`` returns under :class:`~sparkdl.strategies.parameter_server.ParameterServer`.

    ``step()`` pushes this worker's gradients to every shard and replaces the local parameters
    with the servers' fresh values (after any staleness wait); it does not run the wrapped
    optimizer's own step. Everything else — ``param_groups`` (LR schedulers work: each push
    carries every group's current ``lr``), ``zero_grad``, ``defaults`` — is the wrapped
    optimizer's. Its ``state`` stays empty: the optimizer state lives on the servers (see
    :meth:`~sparkdl.strategies.base.StrategyRuntime.state_dict`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, runtime: WorkerRuntime, tables: List[WorkerTable]) -> None:
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
        to collect them. Shares its window with the runtime's
        :meth:`~sparkdl.strategies.base.StrategyRuntime.epoch_metrics`."""
        return self._runtime.epoch_metrics()


def _no_after_step() -> None:
    """The wrapper's step does all the work; nothing runs after it."""
