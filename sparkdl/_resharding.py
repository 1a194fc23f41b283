"""A task's side of an elastic resume: a checkpoint of N ranks loaded on M (see
:mod:`sparkdl.data.elastic` for the data, :meth:`StrategyRuntime.reshard_state
<sparkdl.strategies.base.StrategyRuntime.reshard_state>` for the state).

:class:`~sparkdl.context.TrainContext` calls these; they read and set its stream fields.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Tuple

import numpy as np
import torch

from sparkdl._device_feed import move_batch
from sparkdl.checkpoint import Checkpoint, RankState
from sparkdl.data.batching import STREAM_ORDER, to_tensors
from sparkdl.data.elastic import Remainder, StreamState, check_reader, plan_remainder, remainder_batches, steps_for

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl.context import TrainContext


def stream_fields(ctx: "TrainContext", part: RankState) -> RankState:
    """``part`` with its ``stream``: ``epoch_start`` (the stream's batch index where the current
    epoch began), ``steps_per_epoch``, and in an epoch resumed on a new number of ranks this
    rank's share of it (``remaining``: positions, int64, in reading order) split into
    ``remaining_steps`` batches of which ``remaining_taken`` were taken."""
    remainder = ctx._remainder
    stream = {"epoch_start": ctx._epoch_start, "steps_per_epoch": ctx.steps_per_epoch}
    if ctx._dataset is not None:
        stream["data"] = ctx._dataset.fingerprint  # which rows the positions index
        stream["order"] = STREAM_ORDER  # and in which order they were taken
    if remainder is not None:
        stream.update(remaining=torch.from_numpy(remainder.share.copy()), remaining_steps=remainder.steps, remaining_taken=remainder.taken)
    return dataclasses.replace(part, stream=stream)


def _stream_state(part: RankState, default_steps: Optional[int]) -> StreamState:
    stream = part.stream or {}
    remaining = stream.get("remaining")
    return StreamState(
        int(part.batches_taken),
        None if stream.get("epoch_start") is None else int(stream["epoch_start"]),
        int(stream.get("steps_per_epoch") or default_steps or 1),
        remaining.numpy().astype(np.int64) if remaining is not None else None,
        int(stream.get("remaining_steps", 0)),
        int(stream.get("remaining_taken", 0)),
    )


def restore_stream(ctx: "TrainContext", part: RankState) -> None:
    """A same-size resume: the stream's epoch start, and a resharded epoch still in progress."""
    state = _stream_state(part, ctx.steps_per_epoch)
    changed = _data_changed(ctx, [part])
    if changed:
        _resume_at_next_epoch(ctx, state, changed)
        return
    ctx._batches_taken = state.batches_taken
    taken = state.batches_taken
    ctx._epoch_start = state.epoch_start if state.epoch_start is not None else taken - taken % state.steps_per_epoch
    ctx._remainder = None
    if state.remaining is not None and state.remaining_taken < state.remaining_steps:
        ctx._remainder = Remainder(state.remaining, state.remaining_steps, state.remaining_taken, taken)


def _data_changed(ctx: "TrainContext", parts) -> Optional[str]:
    """Why the checkpoint's stream positions would index other rows than this run reads, or
    None: other data (their fingerprints, :attr:`~sparkdl.data.dataset.DatasetInfo.fingerprint`,
    differ), or a stream order of an earlier version."""
    if ctx._dataset is None:
        return None
    streams = [part.stream or {} for part in parts]
    if any(stream.get("order") != STREAM_ORDER for stream in streams):
        return "it was written by an earlier sparkdl, whose stream took the rows in another order"
    if {stream.get("data") for stream in streams} != {ctx._dataset.fingerprint}:
        return (
            f"it indexes other data than {ctx._dataset.name} holds now (its files and row groups differ: a DataFrame "
            f"materialized again, e.g. by a new driver, whose rows Spark does not promise in the same order, or changed files)"
        )
    return None


def _resume_at_next_epoch(ctx: "TrainContext", state: StreamState, why: str) -> None:
    """A resume whose positions index other rows: positions the stream at the start of the
    epoch after the interrupted one, as a run on these data would have it, and has the rest of
    the interrupted epoch end at once (``ctx._end_epoch_early``) instead of replaying positions
    onto other rows."""
    steps = state.steps_per_epoch
    if state.remaining is not None and state.remaining_taken < state.remaining_steps:
        next_epoch, left = state.batches_taken // steps, state.remaining_steps - state.remaining_taken  # a resharded epoch
    else:
        start = state.epoch_start if state.epoch_start is not None else state.batches_taken - state.batches_taken % steps
        done = state.batches_taken - start
        next_epoch, left = start // steps + (1 if done > 0 else 0), (steps - done if 0 < done < steps else 0)
    ctx._batches_taken = ctx._epoch_start = next_epoch * ctx.steps_per_epoch
    ctx._remainder = None
    ctx._end_epoch_early = left > 0
    if left and ctx.rank == 0:  # at warning level: it reaches the driver's output
        ctx.logger.warning(
            "the checkpoint's stream positions cannot be replayed: %s. Replaying them would train other rows than "
            "those it had left, so the interrupted epoch %d ends here (%d of its steps per rank skipped) and training "
            "resumes at the start of epoch %d. For exact mid-epoch resumes by a new driver, train on a Parquet URL "
            "(df.write.parquet once)", why, next_epoch, left, next_epoch + 1,
        )


def resume_resharded(ctx: "TrainContext", checkpoint: Checkpoint) -> Dict[str, Any]:
    """Loads a checkpoint of another number of ranks: plans this rank's part of the interrupted
    epoch, maps the old ranks' state through the strategy, and returns this rank's user state."""
    old_world = checkpoint.world_size
    changed = _data_changed(ctx, checkpoint.ranks)
    if changed:
        _resume_at_next_epoch(ctx, _stream_state(checkpoint.ranks[0], None), changed)
    elif ctx._dataset is not None:
        check_reader(ctx._reader.name)
        old_steps = None
        if any(not (part.stream or {}).get("steps_per_epoch") for part in checkpoint.ranks):
            old_steps = steps_for(ctx._dataset, ctx._data_spec, old_world)  # a checkpoint of an earlier version
        states = [_stream_state(part, old_steps) for part in checkpoint.ranks]
        remainder = plan_remainder(ctx._dataset, ctx._data_spec, states, ctx.rank, ctx.world_size, ctx.steps_per_epoch)
        ctx._batches_taken = ctx._epoch_start = remainder.next_start
        ctx._remainder = remainder if remainder.steps else None
    users = [checkpoint.user_state(rank) for rank in range(old_world)]
    pairs = [(user, part.strategy) for user, part in zip(users, checkpoint.ranks)]
    user, strategy = ctx._runtime.reshard_state(pairs, old_world)
    ctx._runtime.load_state_dict(strategy)
    mine = checkpoint.ranks[ctx.rank % old_world]
    mine.restore_rng(ctx.device)
    if ctx.rank >= old_world:
        torch.manual_seed(checkpoint.step * 1_000_003 + ctx.rank)  # not a copy of another rank's random stream
    ctx._amp.load_state_dict(mine.grad_scaler)
    ctx.resumed_from = old_world
    ctx.resumed_user_states = users
    left = ctx._remainder.steps if ctx._remainder is not None else 0
    # Rank 0's at warning level: it reaches the driver's output, not only the executor's log.
    (ctx.logger.warning if ctx.rank == 0 else ctx.logger.info)(
        "resumed on %d workers from the checkpoint of %d workers at step %d (the interrupted epoch's rows left: %d steps)",
        ctx.world_size, old_world, checkpoint.step, left,
    )
    return user


def remainder_epoch(ctx: "TrainContext") -> Iterator[Tuple[Any, Any]]:
    """The resharded epoch's batches not taken yet, on ``ctx.device``; then the fresh stream."""
    remainder = ctx._remainder
    source = remainder_batches(ctx._dataset, ctx._data_spec, remainder, ctx.rank)
    try:
        for batch in source:
            step = remainder.taken + 1
            ctx._liveness.advance(f"training step {step} of {remainder.steps} of the resumed epoch")
            remainder.taken += 1
            if ctx.first_batch_time is None:
                import time

                ctx.first_batch_time = time.time()
            yield move_batch(to_tensors(batch), ctx.device, False)
    finally:
        source.close()
    ctx._remainder = None
    ctx._epoch_start = ctx._batches_taken = remainder.next_start
