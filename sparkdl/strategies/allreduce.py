"""Synchronous data parallelism: gradients are averaged by allreduce every step (DDP)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sparkdl.errors import ConfigError
from sparkdl.strategies.base import Strategy, StrategyRuntime

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl._rendezvous import DistEnv


@dataclasses.dataclass(frozen=True)
class AllReduce(Strategy):
    """DDP: every step, gradients are averaged across ranks before the optimizer runs.

    Args:
        bucket_cap_mb: size of DDP's gradient buckets; larger buckets mean fewer, bigger messages.
        find_unused_parameters: set when some parameters get no gradient in a step.
    """

    name = "allreduce"

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
        ddp.register_comm_hook(self, _counting_allreduce_hook)
        return ddp

    def final_module(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model


def _counting_allreduce_hook(runtime, bucket):  # unannotated: DDP rejects string annotations here
    """DDP's default averaging allreduce, counting the bytes each bucket puts on the wire."""
    buffer = bucket.buffer()
    runtime.comm_bytes += buffer.numel() * buffer.element_size()
    buffer.div_(dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
