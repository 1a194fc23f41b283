"""Writing a rank's checkpoint part: a copy to host memory on the training thread, the write in
the background, and the commit once every rank's part is stored.

**The copy** (:func:`capture`). Every tensor the part holds is copied to the CPU — a real copy
(``clone`` for CPU tensors), so the optimizer steps that follow cannot change what is written.
State identical on every rank (``replicated``: the model and optimizer under AllReduce) is
stored once in all, split over the ranks the way torch DCP deduplicates it: each tensor goes to
the rank with the fewest bytes so far (largest first, the same choice on every rank), and a rank
copies and writes only its own share, so the copy and the write shrink with the world size.

**The write** (:class:`CheckpointWriter`). A background thread serializes the part and stores
it (:meth:`CheckpointStore.save_part <sparkdl.checkpoint.CheckpointStore.save_part>`); the
training thread goes on at once. One write per rank is in flight at most: the next save, and
``close``, wait for it first, and raise its error there, naming the rank and the checkpoint.

**The commit.** No collective runs in the background (two threads' gloo calls on one process
group are not safe). Instead each rank, once its part is stored, records the part in the
rendezvous store (:mod:`sparkdl._net.rendezvous_store`) and counts itself with an atomic ``add``; the rank whose
``add`` completes the count — the last one to finish — writes the manifest
(:meth:`CheckpointStore.commit <sparkdl.checkpoint.CheckpointStore.commit>`). Nobody waits for
anybody: a rank that dies before its part is stored leaves a checkpoint without a manifest,
which a resumed run skips for the previous one. Commits come in step order, since every rank
stores its parts in order and the committer of one checkpoint has finished it before it starts
its next part.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from sparkdl._net.rendezvous_client import StoreClient
from sparkdl._runtime.rendezvous import active_store
from sparkdl.checkpoint import CheckpointStore, PartInfo, RankState, tree_leaves, tree_rebuild
from sparkdl.errors import PeerLostError

__all__ = ["CheckpointPeerLostError", "CheckpointWriteError", "CheckpointWriter", "capture", "snapshot"]


class CheckpointWriteError(RuntimeError):
    """A rank could not store its part of a checkpoint (or the write did not finish in time)."""


class CheckpointPeerLostError(CheckpointWriteError, PeerLostError):
    """The write failed because the rendezvous store (the driver's) is gone: a consequence."""


def snapshot(value: Any) -> Any:
    """``value`` with every tensor copied to the CPU and every dict, list and tuple rebuilt:
    nothing in it shares memory or containers with the training state."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        return tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu")
    if isinstance(value, dict):
        return {key: snapshot(item) for key, item in value.items()}
    if isinstance(value, list):
        return [snapshot(item) for item in value]
    if isinstance(value, tuple):
        return tuple(snapshot(item) for item in value)
    return value


def owners(leaves: List[Any], world_size: int) -> Dict[int, int]:
    """Leaf index -> the rank that stores it, for the tensor leaves: the largest first, each to
    the rank holding the fewest bytes so far (ties to the lower rank). Deterministic, so every
    rank computes the same split from its identical copy."""
    tensors = [
        (index, leaf.numel() * leaf.element_size())
        for index, leaf in enumerate(leaves)
        if isinstance(leaf, torch.Tensor)
    ]
    load = [0] * world_size
    chosen: Dict[int, int] = {}
    for index, size in sorted(tensors, key=lambda item: (-item[1], item[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        chosen[index] = rank
        load[rank] += size
    return chosen


def share(replicated: Any, rank: int, world_size: int) -> Tuple[Any, List[int]]:
    """``rank``'s share of ``replicated``: a copy with only its tensors (the others None), and
    their leaf indices (what ``RankState.replicated_leaves`` records)."""
    leaves = tree_leaves(replicated)
    chosen = owners(leaves, world_size)
    mine = sorted(index for index, owner in chosen.items() if owner == rank)
    kept = [None if chosen.get(index, rank) != rank else snapshot(leaf) for index, leaf in enumerate(leaves)]
    return tree_rebuild(replicated, iter(kept)), mine


def capture(
    user: Dict[str, Any],
    replicated: Optional[Dict[str, Any]],
    strategy: Dict[str, Any],
    grad_scaler: Optional[Dict[str, Any]],
    batches_taken: int,
    device: torch.device,
    rank: int,
    world_size: int,
) -> RankState:
    """This rank's part now — its state, its share of ``replicated``, the RNG — copied to the CPU."""
    shared, leaves = share(replicated, rank, world_size) if replicated is not None else (None, None)
    return RankState(
        user=snapshot(user),
        replicated=shared,
        strategy=snapshot(strategy),
        torch_rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        grad_scaler=snapshot(grad_scaler),
        batches_taken=batches_taken,
        replicated_leaves=leaves,
    )


class _Ledger:
    """Which ranks have stored their part of a checkpoint, kept in the rendezvous store.

    Keys are per save (every rank's n-th save is the same checkpoint), not per step, so a step
    saved twice is two checkpoints; the rank that completes the count reads the others' parts
    and deletes the keys, so the store does not grow with the run.
    """

    def __init__(self, rank: int, world_size: int, client: Optional[StoreClient]) -> None:
        self._rank, self._world_size, self._client = rank, world_size, client
        if client is None and world_size > 1:
            raise RuntimeError(
                "checkpoints of more than one rank need sparkdl's rendezvous store (run inside sparkdl.run or fit)"
            )

    @property
    def timeout_s(self) -> Optional[float]:
        """The run's bound on waiting for anything (``timeout_s``), None outside a rendezvous."""
        return None if self._client is None else self._client.timeout.total_seconds() or None

    def stored(self, save: int, step: int, info: PartInfo) -> Optional[List[PartInfo]]:
        """Records this rank's part; every rank's parts when this rank stored the last one (it
        commits), else None."""
        if self._world_size == 1:
            return [info]
        prefix = f"sparkdl/checkpoint/{save}"
        keys = [f"{prefix}/rank/{r}" for r in range(self._world_size)]
        self._client.set(keys[self._rank], json.dumps({"step": step, "part": dataclasses.asdict(info)}))
        if self._client.add(f"{prefix}/stored", 1) < self._world_size:
            return None
        # Each rank set its key before its add: every key is there already.
        records = [json.loads(value) for value in self._client.multi_get(keys)]
        for key in keys + [f"{prefix}/stored"]:
            self._client.delete_key(key)
        steps = sorted({record["step"] for record in records})
        if steps != [step]:
            raise CheckpointWriteError(
                f"the ranks saved different steps {steps} in the same save_checkpoint call; call it on every rank at the same step"
            )
        return [PartInfo(**record["part"]) for record in records]


class CheckpointWriter:
    """This rank's checkpoint writes, one at a time, on a thread named ``sparkdl-checkpoint-<step>``
    (``async_write``) or on the caller's.

    It adds to ``stats`` (``TrainContext.checkpoint_stats``) ``written`` and ``write_seconds``:
    the writes finished so far and their seconds (serialize, store, commit).
    """

    def __init__(
        self,
        store: CheckpointStore,
        rank: int,
        world_size: int,
        stats: Dict[str, Any],
        client: Optional[StoreClient] = None,
    ) -> None:
        """``client``: the rendezvous store the ranks record their parts in (this process's)."""
        self._store, self._rank, self._world_size = store, rank, world_size
        if client is None:
            found = active_store()
            client = None if found is None else found[1]
        self._ledger = _Ledger(rank, world_size, client)
        self._stats = stats
        self._saves = 0
        self._thread: Optional[threading.Thread] = None
        self._step: Optional[int] = None  # of the write in flight, or of the last one
        self._error: Optional[CheckpointWriteError] = None

    def submit(self, step: int, part: RankState) -> None:
        """Stores ``part`` as this rank's part of checkpoint ``step``: in the background, or
        before returning without ``async_write``. Waits for the previous write first."""
        self.wait()
        self._saves += 1
        self._step = step
        if not self._store.async_write:
            self._write(self._saves, step, part)
            self.wait()
            return
        self._thread = threading.Thread(
            target=self._write, args=(self._saves, step, part), name=f"sparkdl-checkpoint-{step}", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Until the write in flight is done (at most the run's ``timeout_s``); raises its error."""
        thread, timeout = self._thread, self._ledger.timeout_s
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise CheckpointWriteError(
                    f"rank {self._rank}: writing checkpoint {self._store.location(self._step)} did not finish within "
                    f"timeout_s={timeout:g}s; the storage is stuck or much slower than expected"
                )
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _write(self, save: int, step: int, part: RankState) -> None:
        started = time.perf_counter()
        try:
            info = self._store.save_part(step, self._world_size, self._rank, part)
            parts = self._ledger.stored(save, step, info)
            if parts is not None:
                self._store.commit(step, self._world_size, parts)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread by wait()
            kind = CheckpointPeerLostError if isinstance(exc, PeerLostError) else CheckpointWriteError
            error = kind(
                f"rank {self._rank} could not write checkpoint {self._store.location(step)}: {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            self._error = error
            return
        self._stats["written"] += 1
        self._stats["write_seconds"] += time.perf_counter() - started
