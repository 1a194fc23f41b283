"""What a training function sees inside a Spark task: :class:`TrainContext`."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from sparkdl._runtime import resume
from sparkdl._runtime.accumulation import ResizeMethods
from sparkdl._runtime.checkpoint_writer import CheckpointWriteError, CheckpointWriter, capture
from sparkdl._runtime.device import DeviceAssignment
from sparkdl._runtime.device_feed import DeviceFeed, move_batch
from sparkdl._runtime.host_batches import batch_ring, host_batches
from sparkdl._runtime.liveness import COMPUTE, LOAD, Liveness
from sparkdl._runtime.precision import Precision, PrecisionRuntime
from sparkdl._runtime.rank import Rank
from sparkdl._runtime.resize import ResizePlan
from sparkdl.checkpoint import CheckpointStore
from sparkdl.data.batching import DataSpec, batches
from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.readers.base import DataReader
from sparkdl.errors import RankFailure
from sparkdl.strategies.base import DistEnv, StrategyRuntime

__all__ = ["Batch", "Liveness", "TrainContext"]

#: (inputs, labels): inputs is one tensor with ``feature_cols``, a dict of named tensors with ``inputs=``.
Batch = Tuple[Any, Optional[torch.Tensor]]


class TrainContext(ResizeMethods):
    """Handed to ``train_fn(ctx)`` on every rank.

    Attributes:
        rank: this task's rank, 0..world_size-1 (its barrier partition id).
        world_size: number of ranks.
        device: where this rank's model and batches live (``cpu`` or the task's GPU).
        steps_per_epoch: steps every rank runs per epoch (None when the run has no dataset).
        device_assignment: how ``device`` was chosen from the GPUs Spark assigned the task
            (:class:`sparkdl._runtime.device.DeviceAssignment`; ``visible_devices`` is the
            ``CUDA_VISIBLE_DEVICES`` for a child process that should see only this task's GPUs).
        logger: a logger whose records reach the driver prefixed with the rank.

    On fewer workers than ``num_workers``, ``on_resize`` applies through ``accumulation_steps``,
    ``micro_batches``, ``gradient_sync``, ``backward`` and ``apply_resize_lr``
    (:mod:`sparkdl._runtime.accumulation` shows the loop).
    """

    def __init__(
        self,
        env: DistEnv,
        runtime: StrategyRuntime,
        send: "callable",
        dataset: Optional[DatasetInfo] = None,
        data_spec: Optional[DataSpec] = None,
        reader: Optional[DataReader] = None,
        steps_per_epoch: Optional[int] = None,
        store: Optional[CheckpointStore] = None,
        liveness: Optional["Liveness"] = None,
        assignment: Optional[DeviceAssignment] = None,
        precision: str = "32",
        startup_marks: Optional[Dict[str, Optional[float]]] = None,
        resize: Optional[ResizePlan] = None,
    ) -> None:
        # What the rank holds; the runtime's modules work on it, never on this class's fields.
        # The precision is built now so that one the device cannot run fails before any training.
        self._rank = Rank(
            env,
            runtime,
            PrecisionRuntime(Precision(precision), env.device, env.world_size),
            liveness or Liveness(),
            logging.getLogger(f"sparkdl.rank{env.rank}"),
            dataset,
            data_spec,
            reader,
            steps_per_epoch,
            resize=resize or ResizePlan(planned_workers=env.world_size, world_size=env.world_size),
        )
        self._send = send
        self._checkpoints = store
        #: How this task's device was chosen from Spark's GPU assignment (None outside Spark).
        self.device_assignment = assignment
        #: This attempt's checkpoints on this rank: ``count`` and ``seconds``, the stall of the
        #: training thread (the copy to host memory); ``written`` and ``write_seconds``, the
        #: writes finished in the background so far and their time.
        self.checkpoint_stats = {"count": 0, "seconds": 0.0, "written": 0, "write_seconds": 0.0}
        self._writer: Optional[CheckpointWriter] = None
        self.steps_per_epoch = steps_per_epoch
        #: A logger whose records reach the driver prefixed with the rank.
        self.logger = self._rank.logger
        #: This rank's place in the job, for a second strategy's ``create_runtime`` (sparkdl plan).
        self.dist_env = env
        #: Wall-clock times of the task's start-up: ``worker_started`` (its Python process),
        #: ``task_entered``, ``ready`` (process group and strategy up); see run_info["startup"].
        self.startup_marks: Dict[str, Optional[float]] = dict(startup_marks or {})

    @property
    def rank(self) -> int:
        return self._rank.rank

    @property
    def world_size(self) -> int:
        return self._rank.world_size

    @property
    def device(self) -> torch.device:
        return self._rank.device

    @property
    def comm_bytes(self) -> int:
        """Bytes this rank has sent in collectives to keep replicas consistent."""
        return self._rank.strategy.comm_bytes

    @property
    def first_batch_time(self) -> Optional[float]:
        """Wall-clock time of the first batch handed out: start-up cost is measured up to here."""
        return self._rank.first_batch_time

    @property
    def resumed_from(self) -> Optional[int]:
        """The number of ranks of the checkpoint an elastic resume loaded; else None."""
        return self._rank.resumed_from

    @property
    def resumed_user_states(self) -> Optional[List[Dict[str, Any]]]:
        """Every old rank's user state of the checkpoint an elastic resume loaded; else None."""
        return self._rank.resumed_user_states

    def prepare_model(self, module: torch.nn.Module) -> torch.nn.Module:
        """Moves the module to the task's device and applies the strategy (e.g. wraps it in DDP)."""
        return self._rank.strategy.prepare_model(module.to(self.device))

    @property
    def precision(self) -> str:
        """The run's precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``."""
        return str(self._rank.amp.precision.value)

    def autocast(self) -> Any:
        """Context manager for the forward pass and the loss under the run's precision (a no-op
        for ``"32"``). Custom loops: ``with ctx.autocast(): loss = loss_fn(model(x), y)``."""
        return self._rank.amp.autocast()

    def backward_and_step(
        self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, max_grad_norm: Optional[float] = None
    ) -> bool:
        """``loss.backward(); optimizer.step()`` under the run's precision. For ``"16-mixed"`` it
        scales the loss and skips steps whose gradients overflowed — on every rank alike, which
        the averaging and parameter-server strategies need. ``max_grad_norm`` clips the true
        (unscaled) gradients' norm first. Returns whether the step was taken. Call
        ``optimizer.zero_grad()`` yourself, as usual."""
        return self._rank.amp.backward_and_step(loss, optimizer, max_grad_norm)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Applies the strategy to an optimizer built over the prepared model's parameters."""
        return self._rank.strategy.prepare_optimizer(optimizer)

    def final_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The plain trained module (unwrapped; the final average for averaging strategies).
        Call it on every rank after the last step: some strategies synchronize here."""
        return self._rank.strategy.final_module(model)

    @property
    def phase(self) -> str:
        """What this rank is doing now, as error reports and the watchdog name it."""
        return self._rank.liveness.phase

    def epoch_batches(self, skip: int = 0) -> Iterator[Batch]:
        """This epoch's ``steps_per_epoch`` batches of the rank's shard, on ``device``.

        Each batch is ``(inputs, labels)``: ``inputs`` is one float tensor with ``feature_cols=``
        and a dict of named tensors (call the model as ``model(**inputs)``) with ``inputs=``;
        ``labels`` is None for unlabeled data. Call once per epoch; the stream continues across
        epochs (:mod:`sparkdl.data.batching`: the remainder rows). After resuming mid-epoch, pass
        ``skip`` = the steps of this epoch already done: the stream is already positioned after them.
        """
        rank, position = self._rank, self._rank.position
        if rank.dataset is None:
            raise RuntimeError("this run has no dataset: pass data=... to sparkdl.run")
        if rank.shard_dataset is not None:
            raise RuntimeError(
                "this rank reads its shard through ctx.shard_dataset(): use it or ctx.epoch_batches(), not both"
            )
        if position.skips_epoch():  # the rest of an epoch interrupted on other data: none of it
            return
        if position.remainder is not None:
            yield from resume.remainder_epoch(rank)  # an elastic resume's epoch: ignores skip
            rank.liveness.advance("ending the epoch (after its last batch)")
            return
        position.begin_epoch(skip)
        if rank.feed is None:
            # Resuming: replay the seeded stream up to the checkpoint's position (cut, not
            # decoded). Reading is far cheaper than training, and replay makes resumed batches exact.
            ring = batch_ring(self.device)  # pinned buffers the batches are gathered or written into
            source = batches(
                rank.reader,
                rank.dataset,
                rank.data_spec,
                self.rank,
                self.world_size,
                skip=position.batches_taken,
                epoch_steps=self.steps_per_epoch,
                gather_into=ring.gather_arrays if ring is not None else None,
            )
            # On CUDA a prefetch thread pins batches and DeviceFeed copies the next one to the
            # GPU on a side stream while the current one trains; on the CPU this thread converts
            # each batch when it takes it (sparkdl._runtime.host_batches says why).
            rank.feed = DeviceFeed(host_batches(source, self.device, ring=ring), self.device)
        non_blocking = self.device.type == "cuda"
        for step in range(skip, self.steps_per_epoch):
            rank.liveness.advance(f"loading data (step {step + 1})", LOAD)
            features, labels = rank.feed.next()
            position.take()
            rank.liveness.advance(f"training step {step + 1} (forward, backward, sync, optimizer)", COMPUTE)
            rank.handing_out_batch()
            yield move_batch((features, labels), self.device, non_blocking)
        # What the loop does between epochs (metrics, validation, a checkpoint) is no part of a
        # step: the watchdog's "auto" bound for steps does not apply to it.
        rank.liveness.advance("ending the epoch (after its last batch)")

    # ---- validation (sparkdl._runtime.validation) -------------------------------------------

    @property
    def has_validation(self) -> bool:
        """True when the run was given ``validation=`` data."""
        spec = self._rank.data_spec
        return spec is not None and spec.validation is not None

    def validation_batches(self) -> Iterator[Batch]:
        """One pass over this rank's validation rows, on ``device``: unshuffled batches of
        ``batch_size`` (the last one smaller). Ranks may get different numbers of batches."""
        from sparkdl._runtime.validation import validation_batches

        return validation_batches(self._rank)

    def validate(
        self, model: torch.nn.Module, loss: Optional[Any] = None, metrics: Optional[Dict[str, Any]] = None
    ) -> Dict[str, float]:
        """Mean loss and metrics over all ranks' validation rows: ``{"val_loss", "val_<name>",
        "val_samples"}``. Collective: call on every rank. ``metrics`` defaults to the run's."""
        from sparkdl._runtime.validation import evaluate

        return evaluate(self._rank, model, loss, metrics)

    @property
    def replicas_identical(self) -> bool:
        """Whether the strategy keeps model and optimizer state bit-identical on every rank at
        every step (AllReduce), so one copy of them describes all ranks."""
        return self._rank.strategy.replicas_identical

    def shard_cache_stats(self) -> Optional[Dict[str, Any]]:
        """This rank's shard cache (:mod:`sparkdl.data.shard_cache`): bytes and row groups kept,
        row groups served from memory or streamed, the reading seconds a pass from memory
        saves; None when the rank streams every pass."""
        cache = self._rank.reader.shard_cache if self._rank.reader is not None else None
        return cache.stats() if cache is not None else None

    def strategy_metrics(self) -> Dict[str, Any]:
        """The strategy's own figures for this rank since the last call (e.g. a parameter
        server's largest staleness); empty for most strategies."""
        return self._rank.strategy.epoch_metrics()

    def set_phase(self, phase: str) -> None:
        """Names what this rank is doing now and counts as progress for the hang watchdog.
        Custom loops with long steps outside ``epoch_batches`` should call it now and then."""
        self._rank.liveness.advance(phase)

    def should_drain(self) -> bool:
        """Whether every rank is to checkpoint now and stop, because a host of the run is being
        decommissioned (sparkdl._runtime.drain). Call it after every optimizer step, on every
        rank: the ranks agree through a small allreduce about every half second, so most calls
        return at once. Always False without a checkpoint directory (nothing to resume from)."""
        if self._checkpoints is None:  # asked at every step: nothing more to do here
            return False
        if self._rank.drain_agreement is None:
            from sparkdl._runtime.drain import DrainAgreement

            self._rank.drain_agreement = DrainAgreement(self._rank.liveness.drain, self.device)
        return self._rank.drain_agreement.check()

    @property
    def drain_reason(self) -> str:
        from sparkdl._runtime.drain import drain_reason

        return drain_reason(self._rank.liveness.drain)

    def save_checkpoint(self, state: Dict[str, Any], step: int, replicated: Optional[Dict[str, Any]] = None) -> None:
        """Saves a checkpoint of this run. Collective: call on every rank at the same step.

        ``state`` is this rank's own part (model and optimizer ``state_dict``s, counters...);
        the strategy's state, this rank's RNG and its data-stream position are added to it.
        ``replicated`` is state that is bit-identical on every rank (the model and optimizer
        under AllReduce): it is stored once, split over the ranks, each storing a share.

        Every tensor is copied to host memory before this returns, so training may change them
        at once; the write runs in the background, one at a time (this first waits for the
        previous one and raises its error). Each rank stores its own part in parallel; the
        checkpoint counts once every part is stored and its manifest is written. With
        ``async_write=False`` the checkpoint is complete when this returns. No-op without a
        ``checkpoint_dir``.
        """
        if self._checkpoints is None:
            return
        previous = self.phase
        started = time.perf_counter()
        self.set_phase(f"checkpointing step {step}")
        writer = self._checkpoint_writer()
        writer.wait()  # the previous write's error, before anything of this one is copied
        part = capture(
            user=state,
            replicated=replicated,
            strategy=self._rank.strategy.state_dict(),
            grad_scaler=self._rank.amp.state_dict(),
            batches_taken=self._rank.position.batches_taken,
            device=self.device,
            rank=self.rank,
            world_size=self.world_size,
        )
        writer.submit(step, resume.stream_fields(self._rank, part))
        if not self._checkpoints.async_write:
            # Nobody runs ahead of a checkpoint that is not committed yet.
            torch.distributed.barrier()
        self.checkpoint_stats["count"] += 1
        self.checkpoint_stats["seconds"] += time.perf_counter() - started
        self.set_phase(previous)

    def wait_for_checkpoint(self) -> None:
        """Blocks until this rank's checkpoint write in flight is done, and raises its error
        (:class:`~sparkdl._runtime.checkpoint_writer.CheckpointWriteError`, naming the rank and the
        checkpoint). ``close`` calls it; the checkpoint is complete once every rank's is done."""
        if self._writer is not None:
            self._writer.wait()

    def _checkpoint_writer(self) -> CheckpointWriter:
        if self._writer is None:
            self._writer = CheckpointWriter(self._checkpoints, self.rank, self.world_size, self.checkpoint_stats)
        return self._writer

    def load_checkpoint(self) -> Optional[Dict[str, Any]]:
        """This rank's ``state`` from the newest complete checkpoint, merged with the
        ``replicated`` state saved with it, or None to start fresh.

        Call on every rank after ``prepare_model`` and ``prepare_optimizer`` and before the
        first batch: it also restores the strategy's state, the RNG and the stream position.
        """
        if self._checkpoints is None:
            return None
        self.set_phase("loading checkpoint")
        self.wait_for_checkpoint()
        checkpoint = self._checkpoints.load_latest()
        if checkpoint is None:
            return None
        self._rank.checkpoint_workers = checkpoint.world_size  # the workers its lr was for (ctx.apply_resize_lr)
        if checkpoint.world_size != self.world_size:
            return resume.resume_resharded(self._rank, checkpoint)
        part = checkpoint.rank_state(self.rank, self.world_size, self._checkpoints.url)
        self._rank.strategy.load_state_dict(part.strategy)
        part.restore_rng(self.device)
        self._rank.amp.load_state_dict(part.grad_scaler)
        resume.restore_stream(self._rank, part)
        self.logger.info("resumed from checkpoint step %d", checkpoint.step)
        return checkpoint.user_state(self.rank)

    def describe_non_finite_data(self) -> str:
        """Where the first NaN or infinity of the run's float input columns is (read after a
        non-finite loss, to say whether the data is the cause)."""
        if self._rank.dataset is None:
            return "this run has no dataset, so the data is not the cause: the model or the optimizer diverged"
        from sparkdl.data.nonfinite import describe_non_finite

        return describe_non_finite(self._rank.dataset)

    def report_epoch(self, record: Dict[str, Any]) -> None:
        """Sends one epoch's summary (``epoch``, ``loss``, ...) to the driver's progress display.
        Call it on rank 0 with values already aggregated over ranks."""
        self._send({"kind": "epoch", "record": _jsonable(record)})

    def report(self, **metrics: Any) -> None:
        """Sends metrics to the driver's progress display (numbers and strings only)."""
        self._send({"kind": "metrics", "metrics": _jsonable(metrics)})

    def all_reduce_mean(self, values: Dict[str, float]) -> Dict[str, float]:
        """Mean of each value over all ranks (a convenience for custom loops' metrics)."""
        names = sorted(values)
        tensor = torch.tensor([float(values[n]) for n in names], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(tensor)
        return {n: v / self.world_size for n, v in zip(names, tensor.tolist())}

    def close(self) -> None:
        """Ends the data streams and waits for the checkpoint write in flight. Its error is
        reported to the driver and raised — unless the rank is failing already: then it is
        logged, and the original error stays the one reported."""
        failing = sys.exc_info()[1] is not None
        try:
            self.wait_for_checkpoint()
        except CheckpointWriteError as exc:
            if failing:
                self.logger.warning("%s (while this rank was failing already)", exc)
            else:
                # close runs after the task reported "done": the driver learns of it here.
                with contextlib.suppress(Exception):
                    self._send(
                        {
                            "kind": "error",
                            "failure": RankFailure.from_exception(self.rank, exc, "writing a checkpoint").to_json(),
                        }
                    )
                raise
        finally:
            if self._rank.feed is not None:
                self._rank.feed.close()
                self._rank.feed = None
            if self._rank.shard_dataset is not None:  # ctx.shard_dataset()'s stream
                self._rank.shard_dataset.close()

    def model_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The model's and optimizer's state to put in a checkpoint, as the strategy keeps it:
        ``{"model": ..., "optimizer": ...}`` state dicts, or this rank's shards of them under
        :class:`~sparkdl.ShardedDataParallel`. Custom loops: save it (in ``replicated=`` when
        ``ctx.replicas_identical``, else in ``state``) and restore it with :meth:`load_model_state`."""
        return self._rank.strategy.model_state(model, optimizer)

    def load_model_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
        """Restores what :meth:`model_state` returned (found in :meth:`load_checkpoint`'s dict)
        into the prepared model and optimizer."""
        self._rank.strategy.load_model_state(model, optimizer, state)

    def shard_dataset(self) -> Any:
        """This rank's shard as a :class:`~sparkdl.ShardDataset` (= ``sparkdl.shard_dataset()``; checkpoints record its position)."""
        from sparkdl._runtime.shard_dataset import of_rank

        return of_rank(self._rank)


def _jsonable(metrics: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = value.item()
        elif isinstance(value, np.generic):
            value = value.item()
        if not isinstance(value, (int, float, str, bool)) and value is not None:
            raise TypeError(f"metric {key!r} has type {type(value).__name__}; report numbers or strings")
        out[str(key)] = value
    return out
