"""The loader alone, per decode worker: ``benchmarks/gpu_check.py --loader-only``.

What one task's data path delivers with nothing training: the Arrow reader over the check's
``list<float>`` Parquet, the shuffle buffer, the batches and the conversion to host tensors (a
prefetch thread writing them into its ring of pinned buffers on CUDA, as in training), for 1, 2,
... decode workers (``DataSpec.decode_threads``: row groups read and decoded at once). For each
count it reports the first epoch (every row group read and decoded from Parquet) and the later
epochs (served from the shard cache, when ``--cache`` is on): rows/s, MB/s, CPU-µs per row (the
process's CPU time, every thread's, over the rows) and rows/s per worker, and the scaling against
one worker.

Runs without Spark and without a GPU (``--device cpu``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List

import torch

from sparkdl._runtime.host_batches import InlineBatches, Prefetcher
from sparkdl.data.batching import DataSpec, batches, steps_per_epoch
from sparkdl.data.readers import reader_from_name
from sparkdl.data.shard_cache import Decision, rank_bytes


def worker_counts(limit: int) -> List[int]:
    """1, 2, 3, ... up to ``limit`` (powers of two past 4, and ``limit`` itself)."""
    counts = [n for n in range(1, min(limit, 4) + 1)]
    n = 8
    while n < limit:
        counts.append(n)
        n *= 2
    if limit not in counts:
        counts.append(limit)
    return counts


def _cache_decision(dataset: Any, enabled: bool) -> Any:
    if not enabled:
        return None
    need = rank_bytes(dataset, 0, 1)
    # Room for the whole shard: the benchmark measures serving it, not the budget's cut-off.
    return Decision("memory", 2 * need + (64 << 20), need, 2 * need + (64 << 20), "gpu_check --loader-only")


def epoch_rates(
    dataset: Any,
    batch_size: int,
    workers: int,
    device: torch.device,
    epochs: int,
    cache: bool,
    reader_name: str = "arrow",
    seed: int = 0,
) -> List[Dict[str, float]]:
    """Each epoch's wall and process-CPU seconds over ``workers`` decode workers."""
    steps = steps_per_epoch(dataset.num_rows, batch_size, 1)
    spec = DataSpec(
        batch_size=batch_size, seed=seed, decode_threads=workers, shard_cache=_cache_decision(dataset, cache)
    )
    source = batches(reader_from_name(reader_name), dataset, spec, 0, 1, epoch_steps=steps)
    feed = Prefetcher(source, pin=True, device=device) if device.type == "cuda" else InlineBatches(source)
    pinned = device.type == "cuda"
    row_bytes = None
    out = []
    try:
        for _ in range(epochs):
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                features, _labels = batch = feed.next()
                if pinned:  # nothing copies it: its pinned ring buffer is free again at once
                    feed.release(batch)
                row_bytes = row_bytes or features[0].numel() * features.element_size() + 8
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            rows = steps * batch_size
            out.append({"rows": rows, "wall_s": wall, "cpu_s": cpu, "row_bytes": row_bytes})
    finally:
        feed.close()
    return out


def loader_table(
    dataset: Any,
    batch_size: int,
    device: torch.device,
    max_workers: int,
    epochs: int,
    cache: bool,
    repeats: int = 1,
    reader_name: str = "arrow",
) -> List[Dict[str, Any]]:
    """Per worker count: the first epoch and the mean of the later ones (best of ``repeats``)."""
    rows_out = []
    for workers in worker_counts(max_workers):
        best: Dict[str, Dict[str, float]] = {}
        for _ in range(repeats):
            runs = epoch_rates(dataset, batch_size, workers, device, epochs, cache, reader_name)
            phases = {"first": runs[:1], "later": runs[1:]}
            for phase, measured in phases.items():
                if not measured:
                    continue
                rows = sum(r["rows"] for r in measured)
                wall = sum(r["wall_s"] for r in measured)
                cpu = sum(r["cpu_s"] for r in measured)
                result = {
                    "rows_per_s": rows / wall,
                    "mb_per_s": rows * measured[0]["row_bytes"] / wall / 1e6,
                    "cpu_us_per_row": cpu / rows * 1e6,
                }
                if phase not in best or result["rows_per_s"] > best[phase]["rows_per_s"]:
                    best[phase] = result
        for phase, result in best.items():
            rows_out.append({"workers": workers, "epoch": phase, **result})
    for row in rows_out:
        base = next(r for r in rows_out if r["epoch"] == row["epoch"] and r["workers"] == 1)
        row["rows_per_s_per_worker"] = row["rows_per_s"] / row["workers"]
        row["scaling"] = row["rows_per_s"] / base["rows_per_s"]
    return rows_out


def print_loader_table(report: Dict[str, Any]) -> None:
    sizes = report["sizes"]
    print(
        f"loader alone: reader {report['reader']}, {sizes['rows']:,} rows of {sizes['features']} float32 "
        f"(list<float> Parquet), batch {sizes['batch_size']}, device {report['device']}, "
        f"{report['cpus']} CPUs, shard cache {'on' if report['cache'] else 'off'}"
    )
    print()
    print("| epoch | decode workers | rows/s | MB/s | CPU-µs/row | rows/s per worker | scaling vs 1 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    labels = {"first": "first (Parquet)", "later": "later (shard cache)" if report["cache"] else "later (Parquet)"}
    for row in sorted(report["loader_workers"], key=lambda r: (r["epoch"], r["workers"])):
        print(
            f"| {labels[row['epoch']]} | {row['workers']} | {row['rows_per_s']:,.0f} | {row['mb_per_s']:,.0f} | "
            f"{row['cpu_us_per_row']:.2f} | {row['rows_per_s_per_worker']:,.0f} | {row['scaling']:.2f}x |"
        )


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
