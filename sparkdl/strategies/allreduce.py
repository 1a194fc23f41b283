"""Synchronous data parallelism: gradients are averaged by allreduce every step (DDP)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import TYPE_CHECKING, Any, ContextManager

import torch
from torch.nn.parallel import DistributedDataParallel

from sparkdl.errors import ConfigError
from sparkdl.strategies.base import Strategy, StrategyRuntime, allreduce_bytes_sent

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl.strategies.base import DistEnv


@dataclasses.dataclass(frozen=True)
class AllReduce(Strategy):
    """DDP: every step, gradients are averaged across ranks before the optimizer runs.

    Args:
        bucket_cap_mb: size of DDP's gradient buckets; larger buckets mean fewer, bigger messages.
        find_unused_parameters: set when some parameters get no gradient in a step.
    """

    name = "allreduce"
    cost_model = "allreduce"
    #: On fewer workers, accumulate to the planned global batch (docs/recovery.md).
    on_resize_choices = ("keep_global_batch", "scale_lr", "none")

    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ConfigError(f"AllReduce.bucket_cap_mb={self.bucket_cap_mb!r} must be > 0")

    def create_runtime(self, env: "DistEnv") -> "StrategyRuntime":
        return _AllReduceRuntime(self, env)


class _AllReduceRuntime(StrategyRuntime):
    # Every rank applies the same averaged gradients to the same weights with the same optimizer.
    replicas_identical = True

    def __init__(self, config: AllReduce, env: "DistEnv") -> None:
        super().__init__(env)
        self.config = config

    def prepare_model(self, module: torch.nn.Module) -> torch.nn.Module:
        device_ids = [self.env.device] if self.env.device.type == "cuda" else None
        ddp = DistributedDataParallel(
            module,
            device_ids=device_ids,
            bucket_cap_mb=self.config.bucket_cap_mb,
            find_unused_parameters=self.config.find_unused_parameters,
        )
        # DDP's own C++ allreduce stays in charge: a Python comm hook per bucket (to count bytes)
        # cost 5% of a small model's step on one core. Its buckets hold every parameter that
        # requires a gradient, so each synchronizing backward allreduces their bytes (2(n-1)/n of
        # them sent per rank, as DDP's ring allreduce does; nothing on a lone rank).
        gradient_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        sent = allreduce_bytes_sent(gradient_bytes, self.env.world_size)
        ddp.register_forward_pre_hook(functools.partial(_count_gradient_sync, self, sent))
        return ddp

    def final_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def gradient_sync(self, model: torch.nn.Module, enabled: bool) -> ContextManager[None]:
        # DDP's no_sync(): gradients accumulate locally; the next synchronizing backward
        # allreduces the sum (and the forward hook above counts no bytes inside it).
        if enabled or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()


def _count_gradient_sync(runtime: _AllReduceRuntime, sent: int, ddp: DistributedDataParallel, _args: Any) -> None:
    """Counts one gradient allreduce (``sent``: this rank's bytes of it) for a forward pass whose
    backward DDP will synchronize: the condition DDP's own forward uses (gradients on, not inside ``no_sync()``)."""
    if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
        runtime.comm_bytes += sent
