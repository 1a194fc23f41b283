"""The calibration ``sparkdl plan`` predicts from, measured on the user's own cluster, model and
data in one short barrier stage of two tasks (about half a minute, and 1.5 s per strategy timed):

1. **Each task's step** (the user's data and batch size, each task its half), timed on both tasks
   at once, part by part: the data path's rows/s alone; forward, backward and optimizer alone on
   batches already in memory; the fit loop's step with both; the model's parameter, gradient and
   optimizer-state bytes and its largest submodule. The slowest task's figures are the plan's.
2. **The link between them**: gloo allreduces, small ones for the latency and large ones for the
   bandwidth, over the transport and interface the strategies use. When both tasks ran on one
   host, that is loopback, not a network: the plan says so, and asks for ``bandwidth=``.
3. **Each strategy's synchronization**, a few of its cycles with its own code over that link:
   what one costs beyond the link model's transfer (:mod:`.sync_cost`).

With the link stated (``bandwidth=`` and ``latency=``) the stage has one task and no probe.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from sparkdl.planning.models import Measured, StrategyShape
from sparkdl.planning.sparse_calibration import bind_counting, measured_tables
from sparkdl.planning.sync_cost import sync_overheads

logger = logging.getLogger("sparkdl")

#: How long each timed part of the one-task calibration runs at most.
PART_S = 6.0
#: Allreduce sizes of the network probe: latency (4 bytes) and bandwidth (16 MiB).
SMALL_BYTES, LARGE_BYTES = 4, 16 * 2**20


@dataclasses.dataclass(frozen=True)
class TaskCalibration:
    """What the one-task stage measured."""

    batch_size: int
    data_rows_per_s: float
    compute_step_s: float
    local_step_s: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    largest_unit_bytes: int
    device: str
    threads: int
    host: str
    #: Seconds one synchronization costs beyond the link model's transfer, by strategy label.
    sync_overhead_s: Dict[str, float] = dataclasses.field(default_factory=dict)
    #: The model's sparse tables with the unique rows per step of this task's batches
    #: (:class:`~sparkdl.planning.sparse_cost.SparseTable` fields).
    sparse_tables: List[Dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class NetworkCalibration:
    """What the two-task probe measured."""

    bandwidth: float  # bytes/s each way
    latency_s: float
    hosts: List[str]
    interface: Optional[str]
    backend: str

    @property
    def loopback(self) -> bool:
        """Both tasks on one host: the probe measured memory copies, not a network."""
        return len(set(self.hosts)) < 2


def measure_task(
    model_fn: Callable[[], torch.nn.Module],
    optimizer_fn: Callable,
    loss_fn: Callable,
    batch_size: int,
    strategies: Sequence[Tuple[StrategyShape, Any]] = (),
) -> Callable:
    """The ``sparkdl.run`` function of the calibration stage. Every rank times its own step at the
    same time as the others, part by part (a barrier between parts): in a fit the ranks compute at
    once, so a rank alone on an idle host would time a step faster than any fit runs it, and a
    synchronous step waits for the slowest rank. With two or more ranks the stage then probes
    the link between them (:func:`probe_network`) and times each of ``strategies``' synchronization
    over it (:func:`sync_overheads`). Rank 0 returns every rank's figures."""

    def calibrate(ctx: Any) -> Dict[str, Any]:
        import socket

        import torch.distributed as dist

        from sparkdl.data.batching import batch_rows, call_model  # the fit loop's own: inputs= as keywords

        together = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

        def start_part_together() -> None:
            """The ranks start each part together, so each times it while the others run the same part."""
            if together:
                dist.barrier()

        model = model_fn().to(ctx.device)
        optimizer = optimizer_fn(model.parameters())
        # Sparse tables serve initial rows here and count the unique rows each step looks up.
        tables = bind_counting(model)

        on_gpu = torch.device(ctx.device).type == "cuda"

        def train_step(model: Any, optimizer: Any, features: Any, labels: Any) -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(call_model(model, features), labels)
            loss.backward()
            optimizer.step()
            if on_gpu:  # kernels run asynchronously: a step's time is when the GPU is done with it
                torch.cuda.synchronize()

        def step(features: Any, labels: Any) -> None:
            train_step(model, optimizer, features, labels)
            for table in tables:
                table.end_step()

        def passes(compute: bool, most: Optional[int] = None) -> tuple:
            """Passes over the shard as the fit loop makes them (a pass's start included, as an
            epoch's is) until PART_S have gone by, or ``most`` passes: (seconds, batches, rows,
            each whole pass's seconds per batch). One pass of a small shard is too few steps to
            time on a shared host."""
            steps = rows = made = 0
            per_batch: List[float] = []
            began = time.perf_counter()
            while most is None or made < most:
                pass_began, pass_steps = time.perf_counter(), 0
                for features, labels in ctx.epoch_batches():
                    if len(kept) < 8:
                        kept.append((features, labels))
                    if compute:
                        step(features, labels)
                    steps, pass_steps = steps + 1, pass_steps + 1
                    rows += batch_rows(features)
                    if time.perf_counter() - began > PART_S:
                        return time.perf_counter() - began, steps, rows, per_batch
                made += 1
                if pass_steps == 0:  # an empty shard: nothing to time
                    break
                per_batch.append((time.perf_counter() - pass_began) / pass_steps)
            return time.perf_counter() - began, steps, rows, per_batch

        def steady_step_s(seconds: float, steps: int, per_batch: List[float]) -> float:
            """The median pass's step when there were a few whole passes, as a fit's steady
            epochs are measured (a neighbour's burst on a shared host moves a mean, not a
            median); else the mean step of what ran."""
            if len(per_batch) >= 3:
                return statistics.median(per_batch)
            return seconds / max(1, steps)

        # 1. A first pass warms up: files opened, the shard cache filled, the optimizer's state made.
        kept: List[Any] = []
        start_part_together()
        passes(compute=True, most=1)
        # 2. The data path alone on later passes (what later epochs read): nothing computed.
        start_part_together()
        data_s, _, rows, _ = passes(compute=False)
        # 3. Compute alone, on batches already in memory.
        start_part_together()
        times = []
        deadline = time.perf_counter() + PART_S
        while kept and time.perf_counter() < deadline and len(times) < 400:
            features, labels = kept[len(times) % len(kept)]
            began = time.perf_counter()
            step(features, labels)
            times.append(time.perf_counter() - began)
        # 4. Both, as the fit loop runs them, warm: the figure the models use.
        start_part_together()
        loop_s, loop_steps, _, loop_passes = passes(compute=True)
        params = sum(t.numel() * t.element_size() for t in model.parameters())
        buffers = sum(t.numel() * t.element_size() for t in model.buffers() if t.is_floating_point())
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        state = sum(
            value.numel() * value.element_size()
            for entry in optimizer.state.values()
            for value in entry.values()
            if torch.is_tensor(value) and value.dim() > 0
        )
        mine = {
            "batch_size": batch_size,
            "data_rows_per_s": rows / data_s if data_s > 0 else float("inf"),
            "compute_step_s": statistics.median(times) if times else 0.0,
            "local_step_s": steady_step_s(loop_s, loop_steps, loop_passes),
            "param_bytes": params + buffers,
            "grad_bytes": grads,
            "optimizer_bytes": state,
            "largest_unit_bytes": _largest_unit(model),
            "device": str(ctx.device),
            "threads": torch.get_num_threads(),
            "host": socket.gethostname(),
            "sparse_tables": measured_tables(tables),
        }
        if not together:
            return {"tasks": [mine], "network": None}
        network = probe_network(ctx)

        def build() -> tuple:
            torch.manual_seed(0)
            return model_fn().to(ctx.device), optimizer_fn

        # The model's prediction of a cycle on batches in memory (what the cycles run on).
        compute_only = Measured(
            **{key: mine[key] for key in ("batch_size", "compute_step_s", "param_bytes", "grad_bytes")},
            local_step_s=mine["compute_step_s"],
            data_rows_per_s=float("inf"),
            optimizer_bytes=mine["optimizer_bytes"],
            largest_unit_bytes=mine["largest_unit_bytes"],
            bandwidth=network["bandwidth"],
            latency_s=network["latency_s"],
            backend=network["backend"],
        )
        mine["sync_overhead_s"] = sync_overheads(ctx, strategies, build, train_step, kept, compute_only)
        tasks: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(tasks, mine)
        return {"tasks": tasks, "network": network}

    return calibrate


def slowest(tasks: Sequence[Dict[str, Any]]) -> TaskCalibration:
    """One figure per part from every rank's: the slowest rank's step, data path and
    synchronizations (a synchronous step waits for it), the model's bytes (the same on every rank)."""
    pacing = max(tasks, key=lambda task: task["local_step_s"])
    labels = {label for task in tasks for label in task.get("sync_overhead_s", {})}
    return TaskCalibration(
        **{
            **pacing,
            "compute_step_s": max(task["compute_step_s"] for task in tasks),
            "data_rows_per_s": min(task["data_rows_per_s"] for task in tasks),
            "sync_overhead_s": {
                label: max(task.get("sync_overhead_s", {}).get(label, 0.0) for task in tasks)
                for label in sorted(labels)
            },
            # Each table's busiest task: the most rows a step of any task touched.
            "sparse_tables": [
                {**same[0], **{key: max(t[key] for t in same) for key in ("pulled_rows", "pushed_rows", "lookups")}}
                for same in zip(*(task.get("sparse_tables", []) for task in tasks))
            ],
        }
    )


def _largest_unit(model: torch.nn.Module) -> int:
    """The bytes of the largest direct-or-nested submodule with parameters of its own: what a
    ShardedDataParallel unit gathers whole at most (the whole model for a single layer)."""
    largest = 0
    for module in model.modules():
        own = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        largest = max(largest, own)
    return largest or sum(p.numel() * p.element_size() for p in model.parameters())


def probe_network(ctx: Any) -> Dict[str, Any]:
    """The link between the calibration's tasks, from inside its stage (gloo is up: the tasks
    already share a process group)."""
    import os
    import socket

    import torch.distributed as dist

    def timed(nbytes: int, repeats: int) -> float:
        tensor = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        dist.all_reduce(tensor)  # warm-up: the connection and the buffers
        samples = []
        for _ in range(repeats):
            dist.barrier()
            began = time.perf_counter()
            dist.all_reduce(tensor)
            samples.append(time.perf_counter() - began)
        return statistics.median(samples)

    small = timed(SMALL_BYTES, 30)
    large = timed(LARGE_BYTES, 5)
    # Two ranks: an allreduce of S sends S/2 twice (reduce-scatter, all-gather) in 2 messages:
    # t = S/B + 2α, so α = t_small / 2 and B = S / (t_large - 2α).
    latency = small / 2
    bandwidth = LARGE_BYTES / max(large - 2 * latency, 1e-9)
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return {
        "bandwidth": bandwidth,
        "latency_s": latency,
        "hosts": hosts,
        "interface": os.environ.get("GLOO_SOCKET_IFNAME"),
        "backend": dist.get_backend(),
    }
