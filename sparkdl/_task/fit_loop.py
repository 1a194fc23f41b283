"""The training loop ``TorchEstimator.fit`` runs on every rank (custom loops use ``sparkdl.run``)."""

from __future__ import annotations

import dataclasses
import io
import math
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from sparkdl.context import TrainContext
from sparkdl.data.batching import batch_rows, call_model
from sparkdl.errors import HostDrained, NonFiniteLossError

ModelFactory = Callable[[], torch.nn.Module]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """Adam with lr=1e-3 when the user names no optimizer."""
    return torch.optim.Adam(params, lr=1e-3)


@dataclasses.dataclass
class _LoopState:
    """Where the loop is; saved in checkpoints so a resumed run continues mid-epoch exactly."""

    epoch: int = 1
    step: int = 0  # steps done in ``epoch``
    global_step: int = 0
    loss_sum: float = 0.0
    samples: int = 0
    comm_bytes: int = 0  # model-sync bytes of ``epoch`` before the last resume
    seconds: float = 0.0  # time spent in ``epoch`` before the last resume
    history: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    output_shape: Optional[List[int]] = None


@dataclasses.dataclass(frozen=True)
class FitLoop:
    """Epochs of forward/backward/step over the rank's batches; picklable so it travels by value.

    With a checkpoint directory, state is saved at the end of every epoch and, with
    ``checkpoint_every``, every that many steps; a relaunched run resumes from the newest
    checkpoint with the same batches, RNG and strategy state, so the steps after it are redone
    exactly and none before it are repeated.
    """

    model: ModelFactory
    optimizer: OptimizerFactory
    loss: LossFn
    epochs: int
    seed: int
    checkpoint_every: Optional[int] = None

    def __call__(self, ctx: TrainContext) -> Optional[Dict[str, Any]]:
        """The fit on this rank: build, resume, the epochs, finish; rank 0 returns the result."""
        model, optimizer = self._build(ctx)
        state = self._restore(ctx, model, optimizer)
        # on_resize="scale_lr" on another number of workers than the lr was for; else nothing.
        ctx.apply_resize_lr(optimizer)
        resize = ctx.report_resize()
        resumed_at = state.global_step
        watch = LossWatch(ctx, NONFINITE_CHECK_EVERY)
        start = time.time()
        while state.epoch <= self.epochs:
            state = self._epoch(ctx, model, optimizer, state, watch)
        ctx.set_phase("finishing")
        ctx.wait_for_checkpoint()  # the last checkpoint is stored, and counted in the stats below
        final = ctx.final_module(model)
        if ctx.rank != 0:
            return None
        return self._result(ctx, final, state, start, resumed_at, resize)

    def _build(self, ctx: TrainContext) -> tuple:
        """The model and optimizer, prepared for the run's strategy (wrapped, sharded...)."""
        # Same seed everywhere: every rank builds the same initial weights (DDP and the averaging
        # strategies also broadcast rank 0's).
        torch.manual_seed(self.seed)
        module = self.model()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"model() must return a torch.nn.Module, got {type(module).__name__}")
        model = ctx.prepare_model(module)
        optimizer = ctx.prepare_optimizer(self.optimizer(model.parameters()))
        return model, optimizer

    @staticmethod
    def _restore(ctx: TrainContext, model, optimizer) -> _LoopState:
        """Where the loop starts: the newest checkpoint's weights and position, else the beginning."""
        state = _LoopState()
        restored = ctx.load_checkpoint()
        if restored is not None:
            ctx.load_model_state(model, optimizer, restored)  # state dicts, or this rank's shards
            state = _LoopState(**restored["loop"])
            if ctx.resumed_from is not None:
                state = _resharded_counters(ctx, state)
        return state

    def _epoch(self, ctx: TrainContext, model, optimizer, state: _LoopState, watch: LossWatch) -> _LoopState:
        """One epoch from ``state``'s position: its steps, its record (validation included), its
        checkpoint; the state the next epoch starts from."""
        epoch = state.epoch
        ctx.set_phase(f"training epoch {epoch}")
        model.train()
        epoch_start = time.time()
        comm_start = ctx.comm_bytes
        loss_sum = torch.full((), state.loss_sum, dtype=torch.float64, device=ctx.device)

        def save_mid_epoch() -> None:  # the loop's position now, with the epoch's figures so far
            watch.check()  # a checkpoint never holds weights a NaN loss already spoiled
            state.loss_sum = loss_sum.item()
            self._save(ctx, model, optimizer, state, ctx.comm_bytes - comm_start, time.time() - epoch_start)

        self._train_steps(ctx, model, optimizer, state, watch, loss_sum, save_mid_epoch)
        watch.check()
        record = self._epoch_record(ctx, state, loss_sum, epoch_start, comm_start)
        # The validation pass (sparkdl._runtime.validation), with the run's metrics: adds
        # val_loss, val_<metric>, val_samples when the run has validation data.
        if ctx.has_validation:
            record.update(ctx.validate(model, self.loss))
        state.history.append(record)
        if ctx.rank == 0:
            ctx.report_epoch(record)
        following = _LoopState(
            epoch=epoch + 1, global_step=state.global_step, history=state.history, output_shape=state.output_shape
        )
        self._save(ctx, model, optimizer, following, 0, 0.0)
        return following

    def _train_steps(
        self,
        ctx: TrainContext,
        model,
        optimizer,
        state: _LoopState,
        watch: LossWatch,
        loss_sum: torch.Tensor,
        save_mid_epoch: Callable[[], None],
    ) -> None:
        """The epoch's steps from ``state.step`` on, counted in ``state`` and (the rank's loss, on
        the device) in ``loss_sum``; a checkpoint every ``checkpoint_every`` steps, a stop at a drain."""
        epoch = state.epoch
        starts_step = True
        # One micro-batch per step, or accumulation_steps of them on fewer workers with
        # on_resize="keep_global_batch": the step's losses scaled so its gradient is their mean,
        # synchronized only at its last backward. state.step counts batches (the data position).
        for features, labels, scale, last in ctx.micro_batches(skip=state.step):
            if starts_step:
                optimizer.zero_grad(set_to_none=True)
            starts_step = last
            with ctx.gradient_sync(model, last):
                with ctx.autocast():  # the run's precision: a no-op for "32"
                    output = call_model(model, features)  # model(**inputs) with inputs=
                    loss = self.loss(output, labels)
                detached = watch.add(epoch, state.step + 1, loss)
                scaled = loss if scale == 1.0 else loss * scale
                if last:
                    ctx.backward_and_step(scaled, optimizer)  # through the grad scaler for "16-mixed"
                else:
                    ctx.backward(scaled)
            rows = batch_rows(features)
            loss_sum.add_(detached, alpha=rows)  # one op: the float64 sum takes the loss as it is
            state.samples += rows
            state.step += 1
            if state.output_shape is None:
                state.output_shape = list(output.shape[1:])
            if not last:  # checkpoints and drains only between optimizer steps
                continue
            state.global_step += 1
            saved = (
                bool(self.checkpoint_every)
                and state.global_step % self.checkpoint_every == 0
                and state.step < ctx.steps_per_epoch
            )
            if saved:
                save_mid_epoch()
            if state.step < ctx.steps_per_epoch and ctx.should_drain():
                # A host is going away: this step's checkpoint (unless just taken), stored before anyone stops.
                if not saved:
                    save_mid_epoch()
                ctx.wait_for_checkpoint()
                raise HostDrained(
                    f"drained at step {state.global_step} ({ctx.drain_reason}): the checkpoint of that step is stored; "
                    f"the run resumes from it"
                )

    @staticmethod
    def _epoch_record(
        ctx: TrainContext, state: _LoopState, loss_sum: torch.Tensor, epoch_start: float, comm_start: int
    ) -> Dict[str, Any]:
        """The epoch's figures over all ranks (collective), as the history and the driver get them."""
        seconds = state.seconds + time.time() - epoch_start
        # One small allreduce per epoch for metrics; not counted in comm_bytes (that is the
        # strategy's model-sync traffic).
        totals = torch.tensor(
            [loss_sum.item(), float(state.samples), float(state.comm_bytes + ctx.comm_bytes - comm_start)],
            dtype=torch.float64,
            device=ctx.device,
        )
        dist.all_reduce(totals)
        total_samples = int(totals[1].item())
        record = {
            "epoch": state.epoch,
            "loss": totals[0].item() / max(1, total_samples),
            "samples": total_samples,
            "seconds": seconds,
            "samples_per_sec": total_samples / seconds if seconds > 0 else math.inf,
            "comm_bytes": int(totals[2].item() / ctx.world_size),
            "global_batch": ctx.global_batch_size,  # rows per optimizer step (on_resize)
            **_per_rank_rates(ctx, state.samples, seconds),  # rank0_samples_per_sec, rank1_...
        }
        # Strategy-specific figures (a parameter server's staleness...); nothing for most strategies.
        record.update(_strategy_metrics(ctx))
        cache = ctx.shard_cache_stats()
        if cache is not None:  # the rank's decoded shard kept in memory (sparkdl.data.shard_cache)
            record["cache_mb"] = round(int(cache["held_bytes"]) / 1e6, 1)
        return record

    @staticmethod
    def _result(
        ctx: TrainContext, final: torch.nn.Module, state: _LoopState, start: float, resumed_at: int, resize: Any
    ) -> Dict[str, Any]:
        """Rank 0's value for the driver: the trained weights, the history and the run's figures."""
        buffer = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in final.state_dict().items()}, buffer)
        return {
            "state_dict": buffer.getvalue(),
            "history": state.history,
            "output_shape": state.output_shape or [],
            "timing": {**ctx.startup_marks, "start": start, "first_batch": ctx.first_batch_time, "end": time.time()},
            "steps": {"resumed_at": resumed_at, "run": state.global_step - resumed_at, "total": state.global_step},
            "checkpoints": dict(ctx.checkpoint_stats),
            "device": str(ctx.device),
            "precision": ctx.precision,
            "resize": resize,
            "shard_cache": ctx.shard_cache_stats(),
            "resumed": {"from_workers": ctx.resumed_from, "on_workers": ctx.world_size}
            if ctx.resumed_from is not None
            else None,
        }

    @staticmethod
    def _save(
        ctx: TrainContext, model, optimizer, state: _LoopState, comm_in_epoch: int, seconds_in_epoch: float
    ) -> None:
        loop = dataclasses.replace(
            state, comm_bytes=state.comm_bytes + comm_in_epoch, seconds=state.seconds + seconds_in_epoch
        )
        # Gathering the weights is the checkpoint's, not the last step's (the watchdog's "auto"
        # bound for steps must not judge it: a sharded model's gather can take a while).
        ctx.set_phase(f"checkpointing step {state.global_step}")
        weights = ctx.model_state(model, optimizer)
        ctx.save_checkpoint(
            {"loop": dataclasses.asdict(loop), **({} if ctx.replicas_identical else weights)},
            step=state.global_step,
            replicated=weights if ctx.replicas_identical else None,
        )


def startup_phases(
    prepare_s: float, launched: float, timing: Dict[str, Optional[float]]
) -> Optional[Dict[str, Optional[float]]]:
    """Where a fit's start-up went, in seconds, from the driver's clock (``launched``) and rank 0's
    marks (``timing``; both hosts' wall clocks, so skew between them shows in ``schedule``):

    * ``prepare``: the driver's checks before launching (data inspection, slots, loss, optimizer);
    * ``schedule``: Spark schedules the barrier stage and hands rank 0's task to a Python worker
      (a new one is forked for an executor's first Python task); after a relaunch, the failed
      attempts too;
    * ``worker_imports``: a new worker unpickling the task, which imports torch, pyarrow and
      sparkdl; None when the worker was reused (started before the launch, its imports done);
    * ``rendezvous``: the process group and the strategy set up;
    * ``first_step``: the model built and wrapped, the optimizer built (a process's first one
      imports torch._dynamo) and the first batch read.

    None when no batch was trained (a finished checkpoint) or rank 0 recorded no marks.
    """
    entered, ready, first = timing.get("task_entered"), timing.get("ready"), timing.get("first_batch")
    if entered is None or ready is None or first is None:
        return None
    worker = timing.get("worker_started")
    fresh = worker is not None and worker > launched
    return {
        "prepare": prepare_s,
        "schedule": (worker if fresh else entered) - launched,
        "worker_imports": entered - worker if fresh else None,
        "rendezvous": ready - entered,
        "first_step": first - ready,
    }


def _resharded_counters(ctx: TrainContext, state: _LoopState) -> _LoopState:
    """An elastic resume's epoch counters: the old ranks' sums of loss and samples go to rank 0
    (each counted once in the epoch's record, none lost), the traffic and time so far are the
    old ranks' mean and longest, the same on every new rank."""
    loops = [user["loop"] for user in ctx.resumed_user_states]
    first = ctx.rank == 0
    return dataclasses.replace(
        state,
        loss_sum=sum(float(loop["loss_sum"]) for loop in loops) if first else 0.0,
        samples=sum(int(loop["samples"]) for loop in loops) if first else 0,
        comm_bytes=sum(int(loop["comm_bytes"]) for loop in loops) // len(loops),
        seconds=max(float(loop["seconds"]) for loop in loops),
    )


#: Steps between checks of the losses for NaN/inf: each check is a host sync (a GPU's queue drains).
NONFINITE_CHECK_EVERY = 16


class LossWatch:
    """Fails the run at a NaN or infinite loss without a host sync every step.

    The step losses stay on the device and are checked together every ``every`` steps and
    before anything lasting (a checkpoint, the end of an epoch); the error still names the
    first bad step, its epoch and its value, and says whether the data holds NaN/inf.
    """

    def __init__(self, ctx: TrainContext, every: int) -> None:
        self._ctx = ctx
        self._every = every
        self._pending: List[Any] = []  # (epoch, step, detached loss)

    def add(self, epoch: int, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Keeps the step's loss for the next check; returns it detached (the loop sums that one)."""
        detached = loss.detach()
        self._pending.append((epoch, step, detached))
        if len(self._pending) >= self._every:
            self.check()
        return detached

    def check(self) -> None:
        """Raises NonFiniteLossError for the first non-finite pending loss (one host sync)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        # A scalar loss is stacked as it is (stack promotes mixed dtypes): a third of the ops, and
        # of the check's cost, of taking every loss's first element as float32.
        finite = torch.isfinite(
            torch.stack([loss if loss.dim() == 0 else loss.reshape(-1)[0] for _, _, loss in pending])
        )
        if bool(finite.all()):
            return
        epoch, step, loss = pending[int((~finite).nonzero()[0, 0])]
        ctx = self._ctx
        value = loss.float().reshape(-1)[0].item()
        ctx.set_phase(f"looking for NaN or infinite values in the data (loss is {value})")
        cause = ctx.describe_non_finite_data()
        # The failure names the bad step (the check came later), not the search.
        ctx.set_phase(f"training step {step} (forward, backward, sync, optimizer)")
        advice = "" if cause.startswith("column") else "; lower the learning rate or clip gradients"
        raise NonFiniteLossError(f"loss is {value} at epoch {epoch}, step {step} on rank {ctx.rank}: {cause}{advice}")


def _strategy_metrics(ctx: TrainContext) -> Dict[str, Any]:
    """The strategy runtime's ``epoch_metrics()`` over all ranks: keys ending in ``_per_sec`` are
    summed (rates add up), the others take the maximum. Collective when there are any keys (every
    rank has the same strategy, so the same keys); no communication otherwise."""
    local = ctx.strategy_metrics()
    out: Dict[str, Any] = {}
    names = sorted(local)
    sums = [name for name in names if name.endswith("_per_sec")]
    peaks = [name for name in names if name not in sums]
    for keys, op in ((sums, dist.ReduceOp.SUM), (peaks, dist.ReduceOp.MAX)):
        if keys:
            values = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64, device=ctx.device)
            dist.all_reduce(values, op=op)
            out.update({k: int(v) if isinstance(local[k], int) else v for k, v in zip(keys, values.tolist())})
    return out


def _per_rank_rates(ctx: TrainContext, samples: int, seconds: float) -> Dict[str, float]:
    """Each rank's samples/s this epoch as ``rank<r>_samples_per_sec`` (collective: one small
    allreduce), so a slow executor shows in the history, not only as a lower global rate. Flat
    numbers, because epoch records travel to the driver as flat JSON metrics."""
    rates = torch.zeros(ctx.world_size, dtype=torch.float64, device=ctx.device)
    rates[ctx.rank] = samples / seconds if seconds > 0 else 0.0
    dist.all_reduce(rates)
    return {f"rank{r}_samples_per_sec": round(rate, 3) for r, rate in enumerate(rates.tolist())}
