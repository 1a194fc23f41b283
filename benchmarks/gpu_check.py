"""Does one sparkdl task keep its GPU busy? A device check without Spark or Java.

Runs what one barrier task runs — the Arrow reader streaming a Parquet shard, the prefetch thread
(batches written into a ring of pinned buffers), the copy of the next batch on a side CUDA
stream, ``FitLoop`` with the ``AllReduce`` strategy on a one-rank process group — on one GPU, for
each precision, and reports:

* **samples/s** of the training loop (steady state, after warm-up steps);
* **GPU busy fraction**: per step, CUDA events at the forward pass's start and after the
  optimizer step; busy = the sum of those intervals over the span from the first start to the
  last end (time the GPU spends waiting for data or for the Python thread is the rest). Also
  ``torch.cuda.utilization()`` sampled during the run when ``pynvml`` is installed;
* **loader feed rate**: samples/s and MB/s that the reader plus prefetch thread deliver alone
  (pinned batches, nothing trains), next to the **pinned and pageable host-to-device copy
  bandwidth** measured on the same GPU, and the MB/s training actually consumed;
* **bf16 vs fp32** (and fp16 on GPUs): the same loop per precision;
* **host batches**: per precision, how many training batches came from the pinned ring
  (``sparkdl._runtime.pinned_ring``), how many were pageable, and how often the prefetch thread
  waited for a copy to free a buffer;
* **inference**: sparkdl's scorer (what ``TorchModel.transform`` and ``sparkdl.predict`` run in
  a task) over the same Parquet with the same model, rows/s per precision, and the feed alone
  (read + model inputs) beside it (``benchmarks/_gpu_inference.py``).

Run from the repository root on a machine with a GPU (it needs torch with CUDA, numpy, pyarrow and
cloudpickle; pyspark is not needed)::

    python benchmarks/gpu_check.py                      # cuda, wide MLP, 32 / bf16-mixed / 16-mixed
    python benchmarks/gpu_check.py --device cpu --tiny  # the same code path on a CPU, in seconds
    python benchmarks/gpu_check.py --loader-only --device cpu  # the loader alone per decode worker

``--loader-only`` measures only the data path (``benchmarks/_loader.py``): for 1, 2, ... up to
the machine's CPUs decode workers (``--workers N`` caps them), the first epoch (Parquet) and the
later ones (shard cache; ``--no-cache`` streams them too): rows/s, MB/s, CPU-µs per row, rows/s
per worker and the scaling against one worker.

``--json PATH`` also writes the results as JSON. The data is synthetic Parquet the script writes
itself (``--data DIR`` keeps it between runs). See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from _gpu_inference import print_scoring, score_runs  # noqa: E402
from _loader import available_cpus, loader_table, print_loader_table  # noqa: E402

from sparkdl._runtime.host_batches import Prefetcher  # noqa: E402
from sparkdl._runtime.rendezvous import rendezvous, teardown  # noqa: E402
from sparkdl._task.fit_loop import FitLoop  # noqa: E402
from sparkdl.context import TrainContext  # noqa: E402
from sparkdl.data.batching import DataSpec, batches  # noqa: E402
from sparkdl.data.dataset import inspect_dataset  # noqa: E402
from sparkdl.data.readers import reader_from_name  # noqa: E402
from sparkdl.strategies.allreduce import AllReduce  # noqa: E402

SIZES = {
    # A wide MLP: ~42M parameters, 4 KiB of features per row; large enough that a modern GPU
    # needs a fast loader to stay busy, small enough to fit any GPU.
    "default": dict(
        rows=200_000, features=1024, hidden=4096, layers=4, classes=1000, batch_size=512, steps=200, warmup=20
    ),
    "tiny": dict(rows=8192, features=64, hidden=128, layers=2, classes=10, batch_size=64, steps=40, warmup=5),
}


def write_dataset(directory: str, rows: int, features: int, classes: int, seed: int = 0) -> str:
    """Synthetic Parquet: ``features`` (list<float>) and ``label`` (int64), 16 row groups per file,
    labels from a random linear teacher so the loss can fall. Reused when already written."""
    marker = os.path.join(directory, f"_done_{rows}_{features}_{classes}")
    if os.path.exists(marker):
        return directory
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((features, classes)).astype(np.float32)
    per_file = max(1, rows // 4)
    written = 0
    index = 0
    while written < rows:
        count = min(per_file, rows - written)
        x = rng.standard_normal((count, features)).astype(np.float32)
        y = (x @ teacher).argmax(axis=1).astype(np.int64)
        column = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), features).cast(pa.list_(pa.float32()))
        table = pa.table({"features": column, "label": pa.array(y)})
        pq.write_table(table, os.path.join(directory, f"part-{index:05d}.parquet"), row_group_size=max(1, count // 16))
        written += count
        index += 1
    open(marker, "w").close()
    return directory


def make_model(features: int, hidden: int, layers: int, classes: int) -> torch.nn.Module:
    blocks: List[torch.nn.Module] = [torch.nn.Linear(features, hidden), torch.nn.ReLU()]
    for _ in range(layers - 2):
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    blocks.append(torch.nn.Linear(hidden, classes))
    return torch.nn.Sequential(*blocks)


class StepTimer:
    """Marks each step's start (forward pre-hook) and end (optimizer post-step hook).

    On CUDA the marks are events on the training stream, so intervals are GPU time and gaps are
    the GPU waiting (for a batch's copy, or for the Python thread); on the CPU they are host clocks.
    """

    def __init__(self, device: torch.device, skip: int) -> None:
        self.cuda = device.type == "cuda"
        self.skip = skip
        self.starts: List[Any] = []
        self.ends: List[Any] = []

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, *_: Any) -> None:
        if len(self.ends) < len(self.starts):
            # The previous step never reached optimizer.step(): a "16-mixed" overflow skip.
            self.ends.append(None)
        self.starts.append(self._mark())

    def end(self, *_: Any) -> None:
        self.ends.append(self._mark())

    def summary(self) -> Dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        starts, ends = self.starts[self.skip :], self.ends[self.skip : len(self.starts)]
        # Skipped steps count in the span (as idle) but not as busy; "skipped" says how many.
        done = [(s, e) for s, e in zip(starts, ends) if e is not None]
        last = done[-1][1]
        if self.cuda:
            busy = sum(s.elapsed_time(e) for s, e in done) / 1000
            span = starts[0].elapsed_time(last) / 1000
        else:
            busy = sum(e - s for s, e in done)
            span = last - starts[0]
        return {
            "steps": len(starts),
            "skipped": len(starts) - len(done),
            "busy_s": busy,
            "span_s": span,
        }


class UtilizationSampler:
    """``torch.cuda.utilization()`` every 50 ms on a thread (needs pynvml; None without it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.samples: List[int] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "UtilizationSampler":
        if self.device.type == "cuda":
            try:
                torch.cuda.utilization(self.device)
            except Exception:  # noqa: BLE001 - pynvml missing or NVML unavailable: report None
                return self
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append(int(torch.cuda.utilization(self.device)))

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def mean(self) -> Optional[float]:
        return sum(self.samples) / len(self.samples) if self.samples else None


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> Dict[str, Optional[float]]:
    """Host-to-device GB/s from pinned and from pageable memory (None on the CPU)."""
    if device.type != "cuda":
        return {"pinned_gbps": None, "pageable_gbps": None}
    out: Dict[str, Optional[float]] = {}
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for name, pinned in (("pinned_gbps", True), ("pageable_gbps", False)):
        source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        source.fill_(1)
        target.copy_(source, non_blocking=pinned)  # warm-up
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(repeats):
            target.copy_(source, non_blocking=pinned)
        end.record()
        torch.cuda.synchronize()
        out[name] = nbytes * repeats / (begin.elapsed_time(end) / 1000) / 1e9
    return out


def loader_rate(
    dataset: Any, spec: DataSpec, reader_name: str, device: torch.device, seconds: float = 2.0, ring: bool = True
) -> Dict[str, float]:
    """What the reader plus the prefetch thread deliver with nothing training (pinned on CUDA),
    read for at least ``seconds`` (the stream cycles over the data forever). ``ring=False`` on
    CUDA: each batch pinned with ``pin_memory()`` instead, the path before the pinned ring."""
    source = batches(reader_from_name(reader_name), dataset, spec, 0, 1)
    pin = device.type == "cuda"
    # device=None makes no ring (the ring is a CUDA device's); pin_memory() then pins on the
    # current GPU, the check's device.
    prefetcher = Prefetcher(source, pin=pin, device=device if ring or not pin else None)
    try:
        features, _ = prefetcher.next()  # start-up (first row groups) is not the steady rate
        row_bytes = features[0].numel() * features.element_size() + 8
        started = time.perf_counter()
        count = 0
        while count < 20 or time.perf_counter() - started < seconds:
            prefetcher.release(prefetcher.next())  # nothing copies it: its ring buffer is free at once
            count += 1
        elapsed = time.perf_counter() - started
    finally:
        prefetcher.close()
    samples = count * spec.batch_size
    return {"samples_per_s": samples / elapsed, "mb_per_s": samples * row_bytes / elapsed / 1e6, "row_bytes": row_bytes}


def train(
    dataset: Any,
    spec: DataSpec,
    reader_name: str,
    device: torch.device,
    precision: str,
    sizes: Dict[str, int],
    seed: int,
) -> Dict[str, Any]:
    """One task's FitLoop for ``warmup + steps`` steps (one epoch) on a one-rank process group."""
    timer = StepTimer(device, skip=sizes["warmup"])

    def model_fn() -> torch.nn.Module:
        module = make_model(sizes["features"], sizes["hidden"], sizes["layers"], sizes["classes"])
        module.register_forward_pre_hook(timer.start)
        return module

    def optimizer_fn(params: Any) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
        optimizer.register_step_post_hook(timer.end)
        return optimizer

    env = rendezvous(0, 1, ["127.0.0.1:0"], lambda value: [value], device, timeout_s=120)
    records: List[Dict[str, Any]] = []
    runtime = AllReduce().create_runtime(env)
    ctx = TrainContext(
        env,
        runtime,
        records.append,
        dataset=dataset,
        data_spec=spec,
        reader=reader_from_name(reader_name),
        steps_per_epoch=sizes["warmup"] + sizes["steps"],
        precision=precision,
    )
    loop = FitLoop(model=model_fn, optimizer=optimizer_fn, loss=torch.nn.functional.cross_entropy, epochs=1, seed=seed)
    try:
        with UtilizationSampler(device) as sampler:
            result = loop(ctx)
            timing = timer.summary()
        ring = feed_ring_stats(ctx)
    finally:
        ctx.close()
        runtime.close()
        teardown()
    samples = timing["steps"] * spec.batch_size
    return {
        "precision": precision,
        # Over the measured steps' span (first forward to last optimizer step, on the GPU's clock):
        # the end of the run (saving the final weights) is not training throughput.
        "samples_per_s": samples / timing["span_s"],
        "busy_fraction": timing["busy_s"] / timing["span_s"] if timing["span_s"] > 0 else math.nan,
        "step_ms": 1000 * timing["busy_s"] / max(1, timing["steps"] - timing["skipped"]),
        "nvml_utilization": sampler.mean,
        "loss": result["history"][-1]["loss"],
        "pinned_ring": ring,
        **timing,
    }


def feed_ring_stats(ctx: TrainContext) -> Optional[Dict[str, Any]]:
    """Where the training batches' host memory came from: the prefetch thread's pinned ring
    counters (batches written into it, served pageable, waits for a copy), None on the CPU."""
    feed = ctx._rank.feed  # the epoch's DeviceFeed, still open until ctx.close()
    return feed.ring_stats() if feed is not None else None


def describe_ring(ring: Optional[Dict[str, Any]]) -> str:
    if ring is None:
        return "none (CPU: batches share the reader's arrays)"
    total = ring["filled_batches"] + ring["pageable_batches"]
    return (
        f"{ring['filled_batches']}/{total} batches from the {ring['memory']} ring ({ring['buffers']} buffers, "
        f"{ring['held_bytes'] / 1e6:,.1f} MB; {ring.get('gathered_batches', 0)} gathered straight into it), "
        f"{ring['pageable_batches']} pageable, {ring['waits']} waits for a copy"
    )


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small sizes (CPU check in seconds)")
    parser.add_argument("--precisions", default=None, help="comma-separated; default 32,bf16-mixed (+16-mixed on cuda)")
    parser.add_argument("--reader", default="arrow", choices=["arrow", "petastorm"])
    parser.add_argument("--data", default=None, help="directory for the synthetic Parquet (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (a Spark task uses spark.task.cpus)"
    )
    parser.add_argument("--loader-only", action="store_true", help="only the loader, per decode worker count")
    parser.add_argument("--workers", type=int, default=None, help="--loader-only: most decode workers (CPUs)")
    parser.add_argument("--epochs", type=int, default=3, help="--loader-only: epochs per worker count")
    parser.add_argument("--repeats", type=int, default=1, help="--loader-only: runs per worker count (best kept)")
    parser.add_argument("--no-cache", action="store_true", help="--loader-only: stream later epochs from Parquet")
    for name in SIZES["default"]:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = dict(SIZES["tiny" if args.tiny else "default"])
    sizes.update({k: getattr(args, k) for k in sizes if getattr(args, k) is not None})
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch has no CUDA here; use --device cpu")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    precisions = (
        args.precisions.split(",")
        if args.precisions
        else ["32", "bf16-mixed"] + (["16-mixed"] if device.type == "cuda" else [])
    )

    data_dir = args.data or os.path.join(tempfile.gettempdir(), "sparkdl-gpu-check")
    started = time.perf_counter()
    write_dataset(data_dir, sizes["rows"], sizes["features"], sizes["classes"], args.seed)
    write_s = time.perf_counter() - started
    dataset = inspect_dataset(data_dir, ["features"], "label")
    spec = DataSpec(batch_size=sizes["batch_size"], seed=args.seed)
    if args.loader_only:
        return loader_only(args, dataset, sizes, device)

    batch_bytes = sizes["batch_size"] * (sizes["features"] * 4 + 8)
    bandwidth = copy_bandwidth(device, max(batch_bytes, 64 << 20))
    loader = loader_rate(dataset, spec, args.reader, device, seconds=0.5 if args.tiny else 3.0)
    if device.type == "cuda":  # the same feed pinned per batch, as before the ring: an A/B on this GPU
        loader["pin_memory_samples_per_s"] = loader_rate(
            dataset, spec, args.reader, device, seconds=0.5 if args.tiny else 3.0, ring=False
        )["samples_per_s"]
    runs = [train(dataset, spec, args.reader, device, p, sizes, args.seed) for p in precisions]
    autocasts = [None, "bf16"] + (["fp16"] if device.type == "cuda" else [])
    scoring = score_runs(data_dir, make_model, sizes, device, autocasts)

    report = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "sizes": sizes,
        "parameters": sum(
            p.numel()
            for p in make_model(sizes["features"], sizes["hidden"], sizes["layers"], sizes["classes"]).parameters()
        ),
        "reader": args.reader,
        "data_write_s": write_s,
        "h2d": bandwidth,
        "loader": loader,
        "runs": runs,
        "scoring": scoring,
    }
    print_report(report)
    print_scoring(report)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


def loader_only(args: argparse.Namespace, dataset: Any, sizes: Dict[str, int], device: torch.device) -> Dict[str, Any]:
    cpus = args.workers or available_cpus()
    table = loader_table(
        dataset,
        sizes["batch_size"],
        device,
        cpus,
        max(1, args.epochs),
        not args.no_cache,
        max(1, args.repeats),
        args.reader,
    )
    report = {"device": str(device), "cpus": cpus, "cache": not args.no_cache, "reader": args.reader}
    report.update(sizes=sizes, loader_workers=table)
    print_loader_table(report)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return report


def print_report(report: Dict[str, Any]) -> None:
    sizes, loader, h2d = report["sizes"], report["loader"], report["h2d"]
    print(
        f"device {report['device']} ({report['device_name']}), torch {report['torch']}, {report['threads']} CPU threads"
    )
    print(
        f"model: MLP {sizes['features']}->{sizes['hidden']}x{sizes['layers'] - 1}->{sizes['classes']} "
        f"({report['parameters']:,} parameters), batch {sizes['batch_size']}, {sizes['steps']} steps after "
        f"{sizes['warmup']} warm-up; reader {report['reader']} on {sizes['rows']} rows of {loader['row_bytes']} B"
    )
    pinned = f"{h2d['pinned_gbps']:.1f} GB/s" if h2d["pinned_gbps"] else "n/a (no GPU)"
    pageable = f"{h2d['pageable_gbps']:.1f} GB/s" if h2d["pageable_gbps"] else "n/a"
    print(f"host->device copy: pinned {pinned}, pageable {pageable}")
    print(
        f"loader alone (reader + prefetch thread{', pinned' if h2d['pinned_gbps'] else ''}): {loader['samples_per_s']:,.0f} samples/s = {loader['mb_per_s']:,.1f} MB/s"
    )
    if loader.get("pin_memory_samples_per_s"):
        print(
            f"loader alone with pin_memory() per batch instead of the pinned ring: "
            f"{loader['pin_memory_samples_per_s']:,.0f} samples/s "
            f"(ring {loader['samples_per_s'] / loader['pin_memory_samples_per_s']:.2f}x)"
        )
    print()
    print(
        "| precision | samples/s | busy fraction | busy ms/step | NVML util % | consumed MB/s | loader headroom | copy share of step | loss |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in report["runs"]:
        consumed = run["samples_per_s"] * loader["row_bytes"] / 1e6
        headroom = loader["samples_per_s"] / run["samples_per_s"]
        copy_ms = (
            sizes["batch_size"] * loader["row_bytes"] / (h2d["pinned_gbps"] * 1e9) * 1000
            if h2d["pinned_gbps"]
            else None
        )
        copy_share = f"{copy_ms / run['step_ms']:.0%}" if copy_ms and run["step_ms"] > 0 else "n/a"
        util = f"{run['nvml_utilization']:.0f}" if run["nvml_utilization"] is not None else "n/a"
        label = run["precision"] + (f" ({run['skipped']} skipped)" if run["skipped"] else "")
        print(
            f"| {label} | {run['samples_per_s']:,.0f} | {run['busy_fraction']:.2f} | {run['step_ms']:.2f} | {util} | "
            f"{consumed:,.1f} | {headroom:.1f}x | {copy_share} | {run['loss']:.4f} |"
        )
    for run in report["runs"]:
        print(f"{run['precision']} host batches: {describe_ring(run['pinned_ring'])}")
    fp32 = next((r for r in report["runs"] if r["precision"] == "32"), None)
    for run in report["runs"]:
        if fp32 is not None and run is not fp32:
            print(f"{run['precision']} vs 32: {run['samples_per_s'] / fp32['samples_per_s']:.2f}x samples/s")
    slowest = min(report["runs"], key=lambda r: loader["samples_per_s"] / r["samples_per_s"])
    if loader["samples_per_s"] < 1.2 * slowest["samples_per_s"]:
        print(
            f"verdict: the loader is the bottleneck ({slowest['precision']} consumes {slowest['samples_per_s']:,.0f} of the "
            f"{loader['samples_per_s']:,.0f} samples/s it delivers): more reader threads/processes or a cheaper format"
        )
    elif min(r["busy_fraction"] for r in report["runs"]) >= 0.9:
        print("verdict: the loader keeps up and the device is busy >= 90% of the time in every precision")
    else:
        idle = min(report["runs"], key=lambda r: r["busy_fraction"])
        print(
            f"verdict: the loader keeps up, but {idle['precision']} leaves the device idle {1 - idle['busy_fraction']:.0%} of "
            f"the time between steps: per-step host overhead (Python, kernel launches, syncs), not data"
        )


if __name__ == "__main__":
    main()
