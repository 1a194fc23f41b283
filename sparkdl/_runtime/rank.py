"""What one rank holds while it trains: the internal state that
:class:`sparkdl.context.TrainContext` is the public face of.

The runtime's modules (elastic resume, validation, the shard dataset) work on a :class:`Rank`,
never on the context's private fields.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Dict, List, Optional

import torch

from sparkdl._runtime.device_feed import DeviceFeed
from sparkdl._runtime.drain import DrainAgreement
from sparkdl._runtime.liveness import Liveness
from sparkdl._runtime.precision import PrecisionRuntime
from sparkdl._runtime.resize import ResizePlan
from sparkdl._runtime.stream import StreamPosition
from sparkdl.data.batching import DataSpec
from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.readers.base import DataReader
from sparkdl.strategies.base import DistEnv, StrategyRuntime


@dataclasses.dataclass(eq=False)
class Rank:
    """One rank's process group, strategy, data, precision and stream position.

    Attributes:
        env: where the rank sits in the job (rank, world size, device, backend).
        strategy: the strategy's runtime on this rank.
        amp: the run's precision (autocast, gradient scaling).
        liveness: the phase and progress the heartbeat reports.
        logger: records that reach the driver prefixed with the rank.
        dataset, data_spec, reader: what the rank reads (None: a run without data).
        steps_per_epoch: steps every rank runs per epoch.
        position: where the rank is in its data stream.
        feed: ``ctx.epoch_batches``'s open stream, on the device; None until the first epoch.
        shard_dataset: ``ctx.shard_dataset()``'s dataset, once asked for.
        first_batch_time: wall-clock time of the first batch handed out.
        resumed_from, resumed_user_states: the ranks (and their user states) of the checkpoint
            an elastic resume loaded; else None.
        resize: the attempt's ``on_resize`` arithmetic (accumulation, learning-rate factor).
        checkpoint_workers: the workers that wrote the checkpoint loaded, None before one is.
        drain_agreement: when ``ctx.should_drain`` agrees next, None before its first call.
    """

    env: DistEnv
    strategy: StrategyRuntime
    amp: PrecisionRuntime
    liveness: Liveness
    logger: logging.Logger
    dataset: Optional[DatasetInfo] = None
    data_spec: Optional[DataSpec] = None
    reader: Optional[DataReader] = None
    steps_per_epoch: Optional[int] = None
    position: StreamPosition = dataclasses.field(default_factory=StreamPosition)
    feed: Optional[DeviceFeed] = None
    shard_dataset: Optional[Any] = None
    first_batch_time: Optional[float] = None
    resumed_from: Optional[int] = None
    resumed_user_states: Optional[List[Dict[str, Any]]] = None
    resize: ResizePlan = dataclasses.field(default_factory=ResizePlan)
    checkpoint_workers: Optional[int] = None
    drain_agreement: Optional[DrainAgreement] = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def device(self) -> torch.device:
        return self.env.device

    def handing_out_batch(self) -> None:
        """Start-up cost is measured up to the first batch handed out."""
        if self.first_batch_time is None:
            self.first_batch_time = time.time()
