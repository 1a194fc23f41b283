"""The cost models ``sparkdl plan`` predicts with: one optimizer step of each strategy on N
workers, from what a calibration measured (:class:`Measured`).

Plain arithmetic, no Spark and no torch: the models are the standard ones, written down with
their assumptions in docs/planning.md.

* One step of a rank alone takes ``local_step_s``: forward, backward, optimizer and the data path
  as the fit loop runs them on one task. When the data path alone takes longer per batch than
  compute alone, the rank is data-bound.
* A link carries ``bandwidth`` bytes/s each way and costs ``latency_s`` per message (α–β model);
  every rank has one link, full duplex, and the ranks' links do not share a bottleneck (a
  switched network; a shared uplink is not modelled).
* **Ring allreduce** of S bytes (gloo and NCCL): each rank sends and receives 2(N−1)/N·S, in
  2(N−1) messages: ``2(N−1)/N·S/B + 2(N−1)·α``. DDP allreduces the gradients in 25 MB buckets,
  each as soon as the backward has filled it; the last bucket waits for the end of the backward.
  So a model in one bucket overlaps nothing (the step is compute + allreduce), and with k buckets
  at most (k−1)/k of the allreduce hides behind the backward (taken as 2/3 of the compute).
* **Model averaging / DiLoCo / elastic averaging** every τ steps: one ring allreduce of the
  parameters (and floating buffers) after the step, not overlapped: ``local + allreduce / τ``.
* **Parameter server**, shards hosted in the N tasks (balanced layout): each step a rank pushes
  the (N−1)/N of its gradients that remote shards own and serves its shard's parameters to N−1
  pulls, 2(N−1)/N·S each way, as allreduce does, after its backward and before its next forward
  (no overlap). Its shard hosts serve every worker: with fewer shards than workers (``shards``) a
  host's link carries N/shards times a worker's share (server-bound).
* **What a synchronization costs beyond its transfer** (γ, ``sync_overhead_s``): the strategy's own
  copies, the steps after it from cold caches, the wait for the slower rank; timed per strategy
  by the calibration (:mod:`sparkdl.planning.sync_cost`) and added once per synchronization.
* **Sharded data parallel** (FSDP2): per step each unit's parameters are all-gathered for the
  forward and again for the backward (resharded after forward), (N−1)/N·S each, and the
  gradients reduce-scattered: (N−1)/N·S on NCCL; on gloo, which has no reduce-scatter, an
  allreduce (2(N−1)/N·S). On CPU ranks with gloo the collectives run in the training thread's
  turn, so the step is compute + communication (prefetching would hide some of it on GPUs:
  the model is conservative there).
* **Sparse tables** (``sparkdl.ShardedEmbedding``, parameter server only): each step's bytes are
  those of the unique rows its batches touch, not of the table, and each rank holds its 1/N
  share of the rows (:mod:`.sparse_cost`); their traffic is added to the dense parameters' (the
  step waits for both), their shards to the memory.
* **Memory budget**: where one is known (``memory_budget_bytes``), a prediction whose memory per
  rank exceeds it ``fits=False``: the plan says it does not fit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from sparkdl.planning.sparse_cost import SparseTable

#: DDP's gradient bucket (``bucket_cap_mb=25``): one allreduce, one set of 2(N−1) messages each.
DDP_BUCKET_BYTES = 25 * 2**20
#: The share of a step's compute the backward pass takes (forward 1, backward 2 in FLOPs).
BACKWARD_SHARE = 2 / 3


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a calibration measured (or the user stated: ``bandwidth``, ``latency_s``).

    Attributes:
        batch_size: rows per rank per step.
        local_step_s: one optimizer step of one rank alone, data path included (the fit loop).
        compute_step_s: forward, backward and optimizer alone, on batches already in memory.
        data_rows_per_s: rows per second the data path alone delivers on one task.
        param_bytes: the model's parameters and floating buffers (what averaging exchanges).
        grad_bytes: the gradients one step produces (what DDP allreduces).
        optimizer_bytes: the optimizer's state after a step (Adam: twice the parameters).
        largest_unit_bytes: the largest module ShardedDataParallel would gather whole.
        bandwidth: bytes per second a link carries each way.
        latency_s: the cost of one message (α).
        backend: ``"gloo"`` or ``"nccl"`` (what the ranks' collectives run on).
        sync_overhead_s: by strategy label, what one synchronization costs a rank beyond the
            link model's transfer (γ); a strategy not in it is charged its transfer alone.
        sparse_tables: the model's sparse tables, with their unique rows per step measured on
            the user's batches (:mod:`.sparse_cost`).
        memory_budget_bytes: the memory one rank may use (None: unknown, nothing is checked).
    """

    batch_size: int
    local_step_s: float
    compute_step_s: float
    data_rows_per_s: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    largest_unit_bytes: int
    bandwidth: float
    latency_s: float
    backend: str = "gloo"
    sync_overhead_s: Dict[str, float] = dataclasses.field(default_factory=dict)
    sparse_tables: Tuple[SparseTable, ...] = ()
    memory_budget_bytes: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class StrategyShape:
    """A strategy as the models see it: ``kind`` and its period or shards."""

    kind: str  # allreduce | averaging | elastic | parameter_server | sharded
    label: str
    sync_every: int = 1
    shards: Optional[int] = None  # parameter server hosts; None: one per worker

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown strategy kind {self.kind!r}")


KINDS = ("allreduce", "averaging", "elastic", "parameter_server", "sharded")


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One strategy on ``workers`` workers."""

    strategy: str
    workers: int
    step_s: float
    samples_per_s: float
    efficiency: float  # samples/s over workers x one rank alone
    wire_bytes_per_step: int  # what one rank sends per optimizer step (its link carries as much in)
    memory_per_rank_bytes: int  # parameters, gradients and optimizer state held (activations not included)
    bound: str  # what the step spends most on: compute | data | bandwidth | latency | server
    #: What the communication is bound by (bandwidth | latency | server): what costs the
    #: efficiency as workers are added.
    comm_bound: str = "bandwidth"
    #: Whether ``memory_per_rank_bytes`` is within the rank's memory budget (None: no budget known).
    fits: Optional[bool] = None

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def ring_allreduce_s(nbytes: float, workers: int, bandwidth: float, latency_s: float, messages: int = 1) -> float:
    """Seconds of a ring allreduce of ``nbytes`` split into ``messages`` collectives."""
    if workers <= 1:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes / bandwidth + messages * 2 * (workers - 1) * latency_s


def predict(measured: Measured, shape: StrategyShape, workers: int) -> Prediction:
    """One strategy's step on ``workers`` workers (see the module's docstring)."""
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")
    n, bandwidth, alpha = workers, measured.bandwidth, measured.latency_s
    data_s = measured.batch_size / measured.data_rows_per_s if measured.data_rows_per_s > 0 else 0.0
    local = measured.local_step_s
    local_bound = "data" if data_s > measured.compute_step_s else "compute"
    share = (n - 1) / n if n > 1 else 0.0
    state = measured.param_bytes + measured.grad_bytes + measured.optimizer_bytes
    overhead = measured.sync_overhead_s.get(shape.label, 0.0)  # per synchronization
    if shape.kind == "allreduce":
        buckets = max(1, math.ceil(measured.grad_bytes / DDP_BUCKET_BYTES))
        bandwidth_s = 2 * share * measured.grad_bytes / bandwidth
        latency_part = buckets * 2 * (n - 1) * alpha if n > 1 else 0.0
        comm = bandwidth_s + latency_part
        # Buckets other than the last allreduce while the backward still runs.
        hidden = min(comm * (buckets - 1) / buckets, BACKWARD_SHARE * measured.compute_step_s)
        step, wire, memory = local + comm - hidden + overhead, int(2 * share * measured.grad_bytes), state
        comm_bound = "bandwidth" if bandwidth_s >= latency_part else "latency"
    elif shape.kind in ("averaging", "elastic"):
        tau = max(1, shape.sync_every)
        sync = ring_allreduce_s(measured.param_bytes, n, bandwidth, alpha)
        comm = sync / tau
        step, wire = local + comm + overhead / tau, int(2 * share * measured.param_bytes / tau)
        # Elastic averaging keeps a center copy of the parameters on every rank.
        memory = state + (measured.param_bytes if shape.kind == "elastic" else 0)
        comm_bound = "bandwidth" if 2 * share * measured.param_bytes / bandwidth >= 2 * (n - 1) * alpha else "latency"
    elif shape.kind == "parameter_server":
        shards = min(n, shape.shards or n)
        # A shard host's link: its own push/pull share plus serving every worker's slice of its shard.
        per_worker = 2 * share * measured.grad_bytes
        host_load = per_worker * (n / shards)
        messages = 2 * (n - 1) * alpha if n > 1 else 0.0
        # Sparse tables: their rows hash over all N ranks, whatever ``shards`` the dense part uses.
        sparse_wire = sum(table.wire_bytes(n) for table in measured.sparse_tables)
        messages += sum(table.messages_per_step(n) for table in measured.sparse_tables) * 2 * alpha
        comm = (host_load + sparse_wire) / bandwidth + messages
        step, wire = local + comm, int(per_worker + sparse_wire)
        memory = state + measured.param_bytes // max(1, shards)
        memory += sum(table.memory_bytes(n) for table in measured.sparse_tables)
        transfer_s = (host_load + sparse_wire) / bandwidth
        comm_bound = "server" if shards < n else "bandwidth" if transfer_s >= messages else "latency"
    else:  # sharded
        reduce_scatter = share if measured.backend == "nccl" else 2 * share
        volume = (2 * share + reduce_scatter) * measured.param_bytes
        latency_part = 3 * (n - 1) * alpha if n > 1 else 0.0
        comm = volume / bandwidth + latency_part
        step, wire = local + comm + overhead, int(volume)
        memory = int(state / n) + 2 * measured.largest_unit_bytes if n > 1 else state
        comm_bound = "bandwidth" if volume / bandwidth >= latency_part else "latency"
    # What the step spends most on: the rank's own work, or the communication.
    bound = comm_bound if comm > local else local_bound
    samples = n * measured.batch_size / step
    alone = measured.batch_size / local
    return Prediction(
        strategy=shape.label,
        workers=n,
        step_s=step,
        samples_per_s=samples,
        efficiency=samples / (n * alone),
        wire_bytes_per_step=wire,
        memory_per_rank_bytes=int(memory),
        bound=bound,
        comm_bound=comm_bound,
        fits=None if measured.memory_budget_bytes is None else int(memory) <= measured.memory_budget_bytes,
    )


def stops_scaling(predictions: Sequence[Prediction], efficiency: float = 0.8) -> Optional[Prediction]:
    """The first worker count whose scaling efficiency falls below ``efficiency`` (None: none
    does): where adding workers stops paying for itself."""
    for prediction in sorted(predictions, key=lambda p: p.workers):
        if prediction.workers > 1 and prediction.efficiency < efficiency:
            return prediction
    return None


def sweep(measured: Measured, shapes: Sequence[StrategyShape], workers: Sequence[int]) -> List[Prediction]:
    return [predict(measured, shape, n) for shape in shapes for n in workers]
