"""A rank's side of a resume whose checkpoint does not fit the run as it is: written by N ranks
and loaded on M (see :mod:`sparkdl.data.reshard` for the data, :meth:`StrategyRuntime.reshard_state
<sparkdl.strategies.base.StrategyRuntime.reshard_state>` for the state), or indexing other data.

The old parts' strategy states (a parameter server's shards and sparse-table rows: together, the
whole of every table) are not loaded with the checkpoint: :func:`old_rank_states` hands the
strategy each old rank's pair with its strategy state read from storage when it is taken
(:class:`~sparkdl.checkpoint.StoredRankState`), so a strategy that takes them one at a time holds
one old part's at a time. The parts' heads (user state, RNG, stream position) are all read.

:class:`~sparkdl.context.TrainContext` calls these on its :class:`~sparkdl._runtime.rank.Rank`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from sparkdl._runtime.device_feed import move_batch
from sparkdl._runtime.liveness import LOAD
from sparkdl._runtime.rank import Rank
from sparkdl._runtime.stream import stream_state
from sparkdl.checkpoint import Checkpoint, RankState
from sparkdl.data.batching import STREAM_ORDER, to_tensors
from sparkdl.data.reshard import StreamState, check_reader, plan_remainder, remainder_batches, steps_for


def stream_fields(rank: Rank, part: RankState) -> RankState:
    """``part`` with its ``stream`` (:meth:`~sparkdl._runtime.stream.StreamPosition.checkpoint_fields`)."""
    return dataclasses.replace(part, stream=rank.position.checkpoint_fields(rank.dataset, rank.steps_per_epoch))


def _state_of(part: RankState, default_steps: Optional[int]) -> StreamState:
    return stream_state(part.batches_taken, part.stream, default_steps)


def restore_stream(rank: Rank, part: RankState) -> None:
    """A same-size resume: the stream's epoch start, and a resharded epoch still in progress."""
    state = _state_of(part, rank.steps_per_epoch)
    changed = _data_changed(rank, [part])
    if changed:
        _resume_at_next_epoch(rank, state, changed)
    else:
        rank.position.restore(state)


def _data_changed(rank: Rank, parts: Sequence[RankState]) -> Optional[str]:
    """Why the checkpoint's stream positions would index other rows than this run reads, or
    None: other data (their fingerprints, :attr:`~sparkdl.data.dataset.DatasetInfo.fingerprint`,
    differ), or a stream order of an earlier version."""
    if rank.dataset is None:
        return None
    streams = [part.stream or {} for part in parts]
    if any(stream.get("order") != STREAM_ORDER for stream in streams):
        return "it was written by an earlier sparkdl, whose stream took the rows in another order"
    if {stream.get("data") for stream in streams} != {rank.dataset.fingerprint}:
        return (
            f"it indexes other data than {rank.dataset.name} holds now (its files and row groups differ: a DataFrame "
            f"whose rows are not those of the copy kept beside the checkpoints, or one materialized again without it, "
            f"or changed files)"
        )
    return None


def _resume_at_next_epoch(rank: Rank, state: StreamState, why: str) -> None:
    """A resume whose positions index other rows: positions the stream at the start of the
    epoch after the interrupted one, as a run on these data would have it, and has the rest of
    the interrupted epoch end at once (``position.end_epoch_early``) instead of replaying
    positions onto other rows."""
    steps = state.steps_per_epoch
    if state.remaining is not None and state.remaining_taken < state.remaining_steps:
        next_epoch, left = (
            state.batches_taken // steps,
            state.remaining_steps - state.remaining_taken,
        )  # a resharded epoch
    else:
        start = (
            state.epoch_start if state.epoch_start is not None else state.batches_taken - state.batches_taken % steps
        )
        done = state.batches_taken - start
        next_epoch, left = start // steps + (1 if done > 0 else 0), (steps - done if 0 < done < steps else 0)
    rank.position.start_epoch_at(next_epoch * rank.steps_per_epoch)
    rank.position.end_epoch_early = left > 0
    if left and rank.rank == 0:  # at warning level: it reaches the driver's output
        rank.logger.warning(
            "the checkpoint's stream positions cannot be replayed: %s. Replaying them would train other rows than "
            "those it had left, so the interrupted epoch %d ends here (%d of its steps per rank skipped) and training "
            "resumes at the start of epoch %d. Mid-epoch resumes are exact on the same data: a Parquet URL whose files "
            "did not change, or a DataFrame of the same rows (its copy is kept beside the checkpoints until the run "
            "completes: docs/recovery.md)",
            why,
            next_epoch,
            left,
            next_epoch + 1,
        )


class OldRankPair(Sequence[Dict[str, Any]]):
    """Old rank ``i``'s (user state, strategy state) for :meth:`StrategyRuntime.reshard_state
    <sparkdl.strategies.base.StrategyRuntime.reshard_state>`: ``pair[0]`` is at hand, ``pair[1]``
    (and unpacking the pair) reads the strategy state from the checkpoint at each access, and the
    pair keeps no reference to it."""

    def __init__(self, user: Dict[str, Any], part: RankState) -> None:
        self._user, self._part = user, part

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: Any) -> Any:
        if index in (0, -2):
            return self._user
        if index in (1, -1):
            return self._part.strategy
        raise IndexError(index)


def old_rank_states(checkpoint: Checkpoint, users: Sequence[Dict[str, Any]]) -> List[OldRankPair]:
    """Every old rank's pair, its strategy state left in storage until taken (see the module's docstring)."""
    return [OldRankPair(user, part) for user, part in zip(users, checkpoint.ranks)]


def resume_resharded(rank: Rank, checkpoint: Checkpoint) -> Dict[str, Any]:
    """Loads a checkpoint of another number of ranks: plans this rank's part of the interrupted
    epoch, maps the old ranks' state through the strategy, and returns this rank's user state."""
    old_world = checkpoint.world_size
    changed = _data_changed(rank, checkpoint.ranks)
    if changed:
        _resume_at_next_epoch(rank, _state_of(checkpoint.ranks[0], None), changed)
    elif rank.dataset is not None:
        check_reader(rank.reader.name)
        old_steps = None
        if any(not (part.stream or {}).get("steps_per_epoch") for part in checkpoint.ranks):
            old_steps = steps_for(rank.dataset, rank.data_spec, old_world)  # a checkpoint of an earlier version
        states = [_state_of(part, old_steps) for part in checkpoint.ranks]
        remainder = plan_remainder(
            rank.dataset, rank.data_spec, states, rank.rank, rank.world_size, rank.steps_per_epoch
        )
        rank.position.start_epoch_at(remainder.next_start, remainder if remainder.steps else None)
    users = [checkpoint.user_state(old_rank) for old_rank in range(old_world)]
    user, strategy = rank.strategy.reshard_state(old_rank_states(checkpoint, users), old_world)
    rank.strategy.load_state_dict(strategy)
    del strategy  # loaded: this rank's rows are not held twice for the rest of the resume
    mine = checkpoint.ranks[rank.rank % old_world]
    mine.restore_rng(rank.device)
    if rank.rank >= old_world:
        torch.manual_seed(checkpoint.step * 1_000_003 + rank.rank)  # not a copy of another rank's random stream
    rank.amp.load_state_dict(mine.grad_scaler)
    rank.resumed_from = old_world
    rank.resumed_user_states = users
    left = rank.position.remainder.steps if rank.position.remainder is not None else 0
    # Rank 0's at warning level: it reaches the driver's output, not only the executor's log.
    (rank.logger.warning if rank.rank == 0 else rank.logger.info)(
        "resumed on %d workers from the checkpoint of %d workers at step %d (the interrupted epoch's rows left: %d steps)",
        rank.world_size,
        old_world,
        checkpoint.step,
        left,
    )
    return user


def remainder_epoch(rank: Rank) -> Iterator[Tuple[Any, Any]]:
    """The resharded epoch's batches not taken yet, on the rank's device; then the fresh stream."""
    remainder = rank.position.remainder
    source = remainder_batches(rank.dataset, rank.data_spec, remainder, rank.rank)
    try:
        for batch in source:
            step = remainder.taken + 1
            # LOAD: the step's part that follows includes reading the next remainder batch.
            rank.liveness.advance(f"training step {step} of {remainder.steps} of the resumed epoch", LOAD)
            remainder.taken += 1
            rank.handing_out_batch()
            yield move_batch(to_tensors(batch), rank.device, False)
    finally:
        source.close()
    rank.position.start_epoch_at(remainder.next_start)
