"""Reader throughput: Petastorm vs the native Arrow reader vs in-memory tensors.

What one training task does with its shard, in one process: the reader's chunks, rebatched and
shuffled by ``sparkdl.data.batching.batches``, turned into tensors as a TrainContext on the CPU
does (``sparkdl._runtime.host_batches``), fed to a tiny model (one linear layer) so that the data path
dominates. The in-memory baseline runs the same training loop over batches sliced from tensors
already in memory.

    .venv/bin/python benchmarks/data_readers.py [--rows 300000] [--width 64] [--epochs 3] [--repeats 3]

Prints one table row per data path: samples/s of the data path alone (batches taken as fast as
possible), samples/s into the model (steady state, after the first batch), time to the first
batch, and the ratio to the in-memory loop; and the model alone on one batch made beforehand,
the ceiling no data path can pass. Each figure is the best of ``--repeats`` runs, since
a shared machine's load only ever slows a run down.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from typing import Dict, List, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sparkdl._runtime.host_batches import host_batches
from sparkdl.data.batching import DataSpec, batches, steps_per_epoch
from sparkdl.data.dataset import inspect_dataset
from sparkdl.data.readers import reader_from_name

FEATURES = 64  # --width sets it
CLASSES = 10


def write_dataset(path: str, rows: int, files: int, row_group_rows: int, layout: str = "list") -> str:
    """``files`` Parquet files (snappy, like sparkdl's DataFrame cache) of features stored as
    ``list<float>`` (what Spark writes for an array column) or, with ``layout="packed"``, as
    float32 bytes per row (what sparkdl writes for either reader: sparkdl.data.tensor_bytes),
    marked in the footer as Spark marks it."""
    from sparkdl.data.tensor_bytes import pack_array, spark_footer_metadata

    rng = np.random.default_rng(0)
    os.makedirs(path, exist_ok=True)
    per_file = rows // files
    for index in range(files):
        features = rng.standard_normal((per_file, FEATURES), dtype=np.float32)
        labels = rng.integers(0, CLASSES, per_file)
        column = pa.ListArray.from_arrays(
            pa.array(np.arange(0, per_file * FEATURES + 1, FEATURES, dtype=np.int32)), pa.array(features.ravel())
        )
        table = pa.table({"features": column, "label": pa.array(labels)})
        dictionary = True
        if layout == "packed":
            table = pa.table({"features": pack_array(column), "label": pa.array(labels)})
            table = table.replace_schema_metadata(spark_footer_metadata(table.schema, ["features"]))
            dictionary = ["label"]
        pq.write_table(
            table,
            os.path.join(path, f"part-{index:05d}.parquet"),
            row_group_size=row_group_rows,
            compression="snappy",
            use_dictionary=dictionary,
        )
    return path


def train(batch_source, steps: int, epochs: int, model_step: bool = True) -> Tuple[float, float, int, float]:
    """Runs the tiny model (or, without ``model_step``, nothing) over ``epochs * steps``
    batches; returns (first-batch seconds, steady seconds, samples after the first batch, CPU
    seconds of every thread of the process after the first batch)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, CLASSES)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    started = time.perf_counter()
    first = None
    cpu_first = 0.0
    samples = 0
    for _ in range(epochs):
        for _ in range(steps):
            features, labels = batch_source()
            if first is None:
                first = time.perf_counter()
                cpu_first = time.process_time()
            else:
                samples += len(features)
            if model_step:
                optimizer.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(features), labels).backward()
                optimizer.step()
    return first - started, time.perf_counter() - first, samples, time.process_time() - cpu_first


def run_reader(name: str, url: str, batch_size: int, epochs: int, model_step: bool) -> Dict[str, float]:
    started = time.perf_counter()
    dataset = inspect_dataset(url, ["features"], "label")
    spec = DataSpec(batch_size=batch_size, shuffle=True, seed=0)
    steps = steps_per_epoch(dataset.num_rows, batch_size, 1)
    stream = host_batches(batches(reader_from_name(name), dataset, spec, rank=0, world_size=1), torch.device("cpu"))
    try:
        first, steady, samples, cpu = train(stream.next, steps, epochs, model_step)
    finally:
        stream.close()
    inspect_s = time.perf_counter() - started - first - steady
    # Time to first batch includes reading the footers on the "driver" (inspect_dataset).
    return {"samples_per_s": samples / steady, "first_batch_s": first + inspect_s, "cpu_us": cpu / samples * 1e6}


LAYOUT_LABELS = {"list": "list<float>", "packed": "float32 bytes (sparkdl cache)"}


def run_in_memory(url: str, batch_size: int, epochs: int, model_step: bool) -> Dict[str, float]:
    started = time.perf_counter()
    table = pq.read_table(url)
    features = torch.from_numpy(
        table.column("features").combine_chunks().flatten().to_numpy().reshape(-1, FEATURES).copy()
    )
    labels = torch.from_numpy(table.column("label").to_numpy().copy())
    load_s = time.perf_counter() - started
    steps = len(labels) // batch_size
    generator = torch.Generator().manual_seed(0)
    state = {"order": torch.randperm(len(labels), generator=generator), "step": 0}

    def next_batch():
        # A shuffled pass per epoch, as the readers do; slices of contiguous copies.
        if state["step"] == steps:
            state["order"] = torch.randperm(len(labels), generator=generator)
            state["step"] = 0
        index = state["order"][state["step"] * batch_size : (state["step"] + 1) * batch_size]
        state["step"] += 1
        return features[index], labels[index]

    first, steady, samples, cpu = train(next_batch, steps, epochs, model_step)
    return {"samples_per_s": samples / steady, "first_batch_s": first + load_s, "cpu_us": cpu / samples * 1e6}


def run_model_alone(url: str, batch_size: int, epochs: int, model_step: bool) -> Dict[str, float]:
    """The ceiling: the model stepping on one batch made beforehand, so no data path at all. No
    reader can feed the model faster than this, which bounds what "N× Petastorm" can show."""
    table = pq.read_table(url).slice(0, batch_size)
    features = torch.from_numpy(
        table.column("features").combine_chunks().flatten().to_numpy().reshape(-1, FEATURES).copy()
    )
    labels = torch.from_numpy(table.column("label").to_numpy().copy())
    steps = sum(pq.ParquetFile(os.path.join(url, name)).metadata.num_rows for name in os.listdir(url)) // batch_size
    first, steady, samples, cpu = train(lambda: (features, labels), steps, epochs, model_step)
    return {"samples_per_s": samples / steady, "first_batch_s": first, "cpu_us": cpu / samples * 1e6}


def best_of(repeats: int, run, *args) -> Dict[str, float]:
    runs = [run(*args) for _ in range(repeats)]
    return {key: (max if key == "samples_per_s" else min)(r[key] for r in runs) for key in runs[0]}


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--width", type=int, default=64, help="floats per row (one list<float> column)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--row-group-rows", type=int, default=32_768)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a task gets spark.task.cpus)")
    parser.add_argument("--readers", default="petastorm,arrow", help="the readers (each reads every layout)")
    parser.add_argument(
        "--layouts", default="list,packed", help="list: Spark's list<float>; packed: float32 bytes, what sparkdl writes"
    )
    args = parser.parse_args(argv)
    global FEATURES
    FEATURES = args.width
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # Petastorm's legacy-pyarrow deprecation warnings
    readers = [name for name in args.readers.split(",") if name and (name != "petastorm" or _has_petastorm())]
    with tempfile.TemporaryDirectory() as tmp:
        url = write_dataset(os.path.join(tmp, "data"), args.rows, args.files, args.row_group_rows)
        size_mb = sum(os.path.getsize(os.path.join(url, f)) for f in os.listdir(url)) / 2**20
        print(
            f"{args.rows:,} rows x {FEATURES} float32 features + int64 label, {args.files} files, "
            f"row groups of {args.row_group_rows:,} rows, snappy, {size_mb:.0f} MiB as list<float>; batch {args.batch_size}, "
            f"{args.epochs} epochs, torch threads {args.threads}, model Linear({FEATURES}, {CLASSES}), pyarrow {pa.__version__}"
        )
        paths = {"in-memory tensors": (run_in_memory, url)}
        for layout in args.layouts.split(","):
            layout_url = (
                url
                if layout == "list"
                else write_dataset(os.path.join(tmp, layout), args.rows, args.files, args.row_group_rows, layout)
            )
            for name in readers:
                paths[f"{name} reader, {LAYOUT_LABELS[layout]}"] = (run_reader, name, layout_url)
        alone, model = {}, {}
        for label, (run, *run_args) in paths.items():
            alone[label] = best_of(args.repeats, run, *run_args, args.batch_size, args.epochs, False)
            model[label] = best_of(args.repeats, run, *run_args, args.batch_size, args.epochs, True)
        ceiling = best_of(args.repeats, run_model_alone, url, args.batch_size, args.epochs, True)
    baseline = model["in-memory tensors"]["samples_per_s"]
    print()
    print(
        "| data path | data path alone, samples/s | CPU µs/sample (alone) | into the model, samples/s | vs in-memory | CPU µs/sample (model) | time to first batch |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label in paths:
        print(
            f"| {label} | {alone[label]['samples_per_s']:,.0f} | {alone[label]['cpu_us']:.2f} | {model[label]['samples_per_s']:,.0f} | "
            f"{model[label]['samples_per_s'] / baseline:.2f} | {model[label]['cpu_us']:.2f} | {model[label]['first_batch_s']:.3f} s |"
        )
    print(
        f"| the model alone (one batch made beforehand: the ceiling) | – | – | {ceiling['samples_per_s']:,.0f} | {ceiling['samples_per_s'] / baseline:.2f} | {ceiling['cpu_us']:.2f} | – |"
    )
    petastorm = f"petastorm reader, {LAYOUT_LABELS['list']}"  # Petastorm on the lists Spark writes
    if petastorm in paths:
        print(
            f"\nthe model alone / {petastorm}: {ceiling['samples_per_s'] / model[petastorm]['samples_per_s']:.1f}x "
            f"(no data path can be more than this many times Petastorm's rate into this model)"
        )
    for other in [label for label in paths if label not in ("in-memory tensors", petastorm)]:
        if petastorm in paths:
            print(
                f"\n{other} / {petastorm}: {alone[other]['samples_per_s'] / alone[petastorm]['samples_per_s']:.1f}x "
                f"data path alone, {model[other]['samples_per_s'] / model[petastorm]['samples_per_s']:.1f}x into the model, "
                f"{model[petastorm]['first_batch_s'] / model[other]['first_batch_s']:.1f}x faster first batch"
            )


def _has_petastorm() -> bool:
    try:
        import petastorm  # noqa: F401
    except ImportError:
        print("petastorm is not installed in this environment: its row is left out (use .venv-petastorm)")
        return False
    return True


if __name__ == "__main__":
    main()
