"""What the network costs each training strategy, on a multi-host Spark cluster of Linux network
namespaces (``scripts/netcluster``): two worker hosts, links unshaped and shaped with ``tc tbf``.
Needs root (network namespaces). Run from the repository root::

    .venv/bin/python benchmarks/network.py                # defaults: ~15 min on a 2-core machine
    .venv/bin/python benchmarks/network.py --quick        # smoke run (~2 min): 1.3 M parameters, 2 rates
    ... [--rates none,1gbit,100mbit] [--strategies allreduce,ma,diloco,elastic,ps,sharded] [--taus 4,16,64]
        [--rows 512 --epochs 8 --batch-size 32] [--interleave] [--json results.json]

It brings up its own cluster (``--cluster-name sdb``, state in ``--cluster-dir``, default
``.sparkdl-netcluster-bench``: h0 runs the standalone master and the driver, h1 and h2 one
one-core Spark worker each), writes the dataset into the cluster's state directory (every host
shares the filesystem), runs *this file* with ``--driver`` inside h0 (``scripts/netcluster exec
h0 -- python benchmarks/network.py --driver ...``) as one Spark application, and always takes the
cluster down at the end, also after a failure. In the driver, for each rate (``shape RATE`` on
every host's cluster link, so every flow between two hosts is shaped at its sender) every
strategy trains the same model on the same data for the same samples, one after the other
(``--interleave``: each strategy at every rate back to back instead). The machine is shared, so
its load drifts: "x AllReduce" compares fits of one rate block (minutes apart), "kept vs
unshaped" fits of different blocks (``--interleave`` swaps which of the two is close in time).

Strategies: AllReduce; ModelAveraging τ ∈ ``--taus`` (4, 16, 64); DiLoCo (ModelAveraging
τ = ``--diloco-tau`` with ``OuterSGD(lr=0.7, momentum=0.9, nesterov=True)``);
ElasticAveraging(sync_every=``--elastic-tau``, 4); ParameterServer(); ShardedDataParallel(). Inner optimizer Adam
(``--lr``), per-worker batch ``--batch-size``, 2 workers, seed 0 for every fit.

Model and data: an MLP ``features-hidden-hidden-10`` (``--hidden`` 2112 with 256 features:
5.03 M parameters, 20 MB of float32, cheap to compute, so communication matters). The data is 10
Gaussian classes: each Parquet row holds its class's centroid (a random direction of norm about
``--separation`` x 16) and ``transform_fn`` adds fresh N(0, 1) noise to every batch on the
executors, so every epoch draws new samples (a stream: the training loss is not memorization).

Columns (per rate; ratios matter, the machine is shared):

* samples/s: all samples over the time the epochs took (``history`` seconds: no start-up, no
  final gather of the model); "x AllReduce" is that over AllReduce's at the same rate, "kept"
  over the same strategy's unshaped rate.
* wire MB/sample: bytes the two worker hosts sent each other on the cluster network while rank 0
  trained (from its first batch to the end of its loop: ``run_info`` prepare + startup seconds
  after the call, plus ``train_seconds``), over the samples: the workers' eth0 tx less what the
  driver's host received (the returned weights, task results, heartbeats). The driver polls
  ``/proc/<pid>/net/dev`` of a process in each host's namespace (the counters ``ip -n NS -s link``
  shows) every 0.1 s and interpolates at both ends. TCP/IP headers included; "sparkdl
  MB/sample" is what the strategy itself counted (``history`` ``comm_bytes`` x ranks / samples).
* loss @ equal samples: the last epoch's mean training loss (fresh samples) after
  ``--rows`` x ``--epochs`` samples, the same for every row.
* loss @ equal time: the training-loss curve interpolated at T, the time the fastest strategy of
  that rate took for all its samples: each epoch's mean loss is placed at the middle of that
  epoch (cumulative epoch seconds), the initial model's held-out loss at 0, linear in between,
  the last epoch's value after its middle. The fastest row's value is its equal-samples loss.
* final held-out: the returned model (the average / center / gathered shards) on 2048 fresh
  held-out samples, evaluated on the driver.

The verdict tests SparkNet's premise (averaging every τ steps keeps throughput when allreduce is
bandwidth-bound): at each shaped rate, AllReduce counts as bandwidth-bound when it keeps less
than 70% of its unshaped samples/s, and a τ "keeps throughput" when ModelAveraging(τ) keeps at
least 80% of its own (SHOWN); PARTLY when none does but one is at least 2x AllReduce's
samples/s at that rate; REFUTED otherwise. It also names the averaging family's (ModelAveraging,
DiLoCo, ElasticAveraging) lowest loss at equal time against AllReduce's.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETCLUSTER = os.path.join(REPO_ROOT, "scripts", "netcluster")
STRATEGY_KEYS = ("allreduce", "ma", "diloco", "elastic", "ps", "sharded")
WORLD = 2  # ranks: one per worker host


# ---------------------------------------------------------------------------- arguments


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="smoke run: hidden 1024, 512 rows x 2 epochs, rates none,100mbit"
    )
    p.add_argument(
        "--rates", default=None, help="comma-separated tc rates, 'none' = unshaped (default none,1gbit,100mbit)"
    )
    p.add_argument(
        "--strategies",
        default="allreduce,ma,diloco,elastic,ps,sharded",
        help=f"comma-separated, from {','.join(STRATEGY_KEYS)} (ma = one row per --taus)",
    )
    p.add_argument("--taus", default="4,16,64", help="ModelAveraging sync_every values")
    p.add_argument("--diloco-tau", type=int, default=16, help="DiLoCo's sync_every")
    p.add_argument("--elastic-tau", type=int, default=4, help="ElasticAveraging's sync_every")
    p.add_argument("--features", type=int, default=256)
    p.add_argument(
        "--hidden", type=int, default=None, help="hidden width (default 2112: 5.03 M parameters; --quick 1024)"
    )
    p.add_argument("--rows", type=int, default=None, help="Parquet rows = samples per epoch (default 512)")
    p.add_argument("--epochs", type=int, default=None, help="epochs per fit (default 8; --quick 2)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per batch per worker")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (inner optimizer)")
    p.add_argument("--separation", type=float, default=0.1, help="class centroids: N(0, separation^2) per feature")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout-s", type=float, default=240.0, help="the estimator's timeout_s (rendezvous, each collective)"
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up fit")
    p.add_argument(
        "--interleave",
        action="store_true",
        help="run each strategy at every rate back to back (reshaping between fits) instead of every strategy at one "
        "rate, then the next: 'kept vs unshaped' then compares fits seconds apart, 'x AllReduce' fits minutes apart",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also save the results as JSON")
    p.add_argument("--cluster-name", default="sdb", help="netcluster --name (namespace prefix)")
    p.add_argument(
        "--cluster-dir",
        default=os.path.join(REPO_ROOT, ".sparkdl-netcluster-bench"),
        help="netcluster --dir (state, logs, data)",
    )
    p.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # internal: the driver inside h0
    p.add_argument("--results", default=None, help=argparse.SUPPRESS)  # internal: where the driver writes
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fills the size defaults (--quick's or the full run's)."""
    quick = args.quick
    if args.hidden is None:
        args.hidden = 1024 if quick else 2112
    if args.rows is None:
        args.rows = 512
    if args.epochs is None:
        args.epochs = 2 if quick else 8
    if args.rates is None:
        args.rates = "none,100mbit" if quick else "none,1gbit,100mbit"
    args.rate_list = [r.strip() for r in args.rates.split(",") if r.strip()]
    args.tau_list = [int(t) for t in args.taus.split(",") if t.strip()]
    args.strategy_list = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in args.strategy_list if s not in STRATEGY_KEYS]
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; choose from {STRATEGY_KEYS}")
    if args.rows % (WORLD * args.batch_size):
        raise SystemExit(f"--rows {args.rows} must be a multiple of 2 x --batch-size ({WORLD * args.batch_size})")
    return args


def widths(args: argparse.Namespace) -> List[int]:
    return [args.features, args.hidden, args.hidden, 10]


def n_params(w: Sequence[int]) -> int:
    return sum(a * b + b for a, b in zip(w, w[1:]))


def rate_label(rate: str) -> str:
    return "unshaped" if rate == "none" else rate


# ---------------------------------------------------------------------------- model and data (shipped by value)


def make_mlp(w: Sequence[int]):
    import torch

    layers: List[Any] = []
    for a, b in zip(w, w[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def add_noise(features, labels):
    """transform_fn: a fresh N(0, 1) draw around each row's class centroid, every batch."""
    import numpy as np

    noise = np.random.default_rng().standard_normal(features.shape, dtype=np.float32)
    return features + noise, labels


def centroids(args: argparse.Namespace):
    import numpy as np

    return (np.random.default_rng(args.seed + 1000).standard_normal((10, args.features)) * args.separation).astype(
        np.float32
    )


def write_dataset(args: argparse.Namespace, path: str) -> str:
    """``rows`` rows (features: list<float32> = the class centroid, label: int64), 32 per row group."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    mu = centroids(args)
    labels = np.random.default_rng(args.seed + 2000).integers(0, 10, args.rows)
    table = pa.table(
        {
            "features": pa.array(list(mu[labels]), type=pa.list_(pa.float32())),
            "label": pa.array(labels.astype(np.int64)),
        }
    )
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        os.remove(os.path.join(path, name))
    pq.write_table(table, os.path.join(path, "part-00000.parquet"), row_group_size=32)
    return path


def holdout(args: argparse.Namespace, rows: int = 2048):
    import numpy as np
    import torch

    rng = np.random.default_rng(args.seed + 3000)
    labels = rng.integers(0, 10, rows)
    features = centroids(args)[labels] + rng.standard_normal((rows, args.features), dtype=np.float32)
    return torch.from_numpy(features), torch.from_numpy(labels.astype(np.int64))


def heldout_loss(module, data) -> float:
    import torch

    features, labels = data
    module.eval()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(module(features), labels))


def strategies(args: argparse.Namespace) -> List[Tuple[str, str, Any]]:
    """(key, label, strategy) in table order; AllReduce first (the ratio's baseline)."""
    import sparkdl

    rows: List[Tuple[str, str, Any]] = []
    for key in args.strategy_list:
        if key == "allreduce":
            rows.append(("allreduce", "AllReduce", sparkdl.AllReduce()))
        elif key == "ma":
            rows += [(f"ma{t}", f"ModelAveraging τ={t}", sparkdl.ModelAveraging(sync_every=t)) for t in args.tau_list]
        elif key == "diloco":
            outer = sparkdl.OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
            rows.append(
                (
                    "diloco",
                    f"DiLoCo τ={args.diloco_tau}",
                    sparkdl.ModelAveraging(sync_every=args.diloco_tau, outer_optimizer=outer),
                )
            )
        elif key == "elastic":
            rows.append(
                (
                    "elastic",
                    f"ElasticAveraging τ={args.elastic_tau}",
                    sparkdl.ElasticAveraging(sync_every=args.elastic_tau),
                )
            )
        elif key == "ps":
            rows.append(("ps", "ParameterServer", sparkdl.ParameterServer()))
        elif key == "sharded":
            rows.append(("sharded", "ShardedDataParallel", sparkdl.ShardedDataParallel()))
    return rows


# ---------------------------------------------------------------------------- wire counters


def proc_counters(pid: int, interface: str = "eth0") -> Optional[Tuple[int, int]]:
    """(bytes received, bytes sent) by ``interface`` in the network namespace of process ``pid``
    (what ``ip -n NS -s link show`` reports, without a process per reading)."""
    try:
        with open(f"/proc/{pid}/net/dev") as handle:
            for line in handle:
                name, _, values = line.partition(":")
                if name.strip() == interface:
                    fields = values.split()
                    return int(fields[0]), int(fields[8])
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None
    return None


class WireSampler:
    """Polls every host's eth0 counters (one process per namespace: the driver for h0, the
    workers' JVMs for h1..) every ``interval`` s, with the time, in a daemon thread. Keys
    ``"<host> tx"`` and ``"<host> rx"``."""

    def __init__(self, state: Dict[str, Any], interval: float = 0.1) -> None:
        self.driver_host = state["host_names"][0]
        self.pids = {self.driver_host: os.getpid()}
        for index in range(1, state["hosts"]):
            self.pids[state["host_names"][index]] = int(state["pids"][f"worker-h{index}"])
        self.interval = interval
        self.samples: List[Tuple[float, Dict[str, int]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wire-sampler", daemon=True)

    def start(self) -> "WireSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            read = {host: proc_counters(pid) for host, pid in self.pids.items()}
            if all(v is not None for v in read.values()):
                counts = {
                    f"{host} {kind}": value for host, pair in read.items() for kind, value in zip(("rx", "tx"), pair)
                }
                with self._lock:
                    self.samples.append((now, counts))
            self._stop.wait(self.interval)

    def at(self, when: float) -> Optional[Dict[str, float]]:
        """Each host's counter at ``when``, linear between the two samples around it."""
        with self._lock:
            samples = list(self.samples)
        before = [s for s in samples if s[0] <= when]
        after = [s for s in samples if s[0] >= when]
        if not before or not after:
            return None
        (t0, c0), (t1, c1) = before[-1], after[0]
        share = 0.0 if t1 == t0 else (when - t0) / (t1 - t0)
        return {host: c0[host] + share * (c1[host] - c0[host]) for host in c0}


# ---------------------------------------------------------------------------- driver (inside h0)


def netcluster(args: argparse.Namespace, *command: str) -> None:
    subprocess.run(
        [sys.executable, NETCLUSTER, "--name", args.cluster_name, "--dir", args.cluster_dir, *command],
        check=True,
        stdin=subprocess.DEVNULL,
    )


def fit_one(args, spark_data: str, strategy, epochs: int):
    import torch

    import sparkdl

    return sparkdl.TorchEstimator(
        model=functools.partial(make_mlp, widths(args)),
        optimizer=functools.partial(torch.optim.Adam, lr=args.lr),
        feature_cols=["features"],
        label_col="label",
        strategy=strategy,
        num_workers=WORLD,
        batch_size=args.batch_size,
        epochs=epochs,
        seed=args.seed,
        progress=False,
        transform_fn=add_noise,
        timeout_s=args.timeout_s,
    ).fit(spark_data)


def measure(args, data: str, sampler: WireSampler, rate: str, key: str, label: str, strategy, held) -> Dict[str, Any]:
    record: Dict[str, Any] = {"rate": rate, "key": key, "strategy": label}
    called = time.time()
    try:
        model = fit_one(args, data, strategy, args.epochs)
    except Exception as exc:  # noqa: BLE001 - reported in the table, verbatim
        record.update(
            ok=False,
            error_type=type(exc).__name__,
            error=str(exc)[:4000],
            traceback=traceback.format_exc()[-3000:],
            fit_seconds=time.time() - called,
        )
        return record
    info, history = model.run_info, model.history
    samples = sum(h["samples"] for h in history)
    seconds = sum(h["seconds"] for h in history)
    first_batch = called + (info.get("prepare_seconds") or 0.0) + (info.get("startup_seconds") or 0.0)
    record.update(
        ok=True,
        fit_seconds=time.time() - called,
        startup_seconds=info.get("startup_seconds"),
        samples=samples,
        epoch_seconds=seconds,
        samples_per_sec=samples / seconds if seconds > 0 else None,
        comm_bytes=sum(h["comm_bytes"] for h in history) * WORLD,
        history=[
            {k: h[k] for k in ("epoch", "loss", "samples", "seconds", "samples_per_sec", "comm_bytes")} for h in history
        ],
        final_heldout_loss=heldout_loss(model.module, held),
        described=info.get("strategy"),
        steps=info.get("steps"),
    )
    # The wire between the worker hosts while rank 0 trained (first batch to the end of its loop,
    # final sync included: none is pending when τ divides the steps): what the workers sent,
    # less what the driver's host received (the returned weights, task results, heartbeats).
    end = first_batch + (info.get("train_seconds") or seconds)
    time.sleep(3 * sampler.interval)  # the sampler has a sample past the window's end
    before, after = sampler.at(first_batch), sampler.at(end)
    if before is not None and after is not None:
        moved = {name: after[name] - before[name] for name in after}
        record["wire_counters"] = moved
        workers = [host for host in sampler.pids if host != sampler.driver_host]
        record["wire_bytes"] = sum(moved[f"{h} tx"] for h in workers) - moved[f"{sampler.driver_host} rx"]
        record["wire_window_s"] = end - first_batch
    return record


def driver_main(args: argparse.Namespace) -> int:
    sys.path.insert(0, REPO_ROOT)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    state = json.load(open(os.path.join(args.cluster_dir, "state.json")))
    from pyspark.sql import SparkSession

    address = state["cluster_addresses"][0]
    spark = (
        SparkSession.builder.master(state["master_url"])
        .appName("sparkdl-benchmark-network")
        .config("spark.driver.host", address)
        .config("spark.driver.bindAddress", address)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executor.instances", str(state["hosts"] - 1))
        .config("spark.executor.memory", "768m")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.executorEnv.PYTHONPATH", REPO_ROOT)
        .config("spark.sparkdl.cacheDir", os.path.join(args.cluster_dir, "cache"))
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    import torch

    torch.set_num_threads(1)
    data = os.path.join(args.cluster_dir, "bench-data")
    held = holdout(args)
    torch.manual_seed(args.seed)
    initial_loss = heldout_loss(make_mlp(widths(args)), held)
    sampler = WireSampler(state).start()
    results: Dict[str, Any] = {"records": [], "initial_loss": initial_loss}
    try:
        import sparkdl

        if not args.no_warmup:  # untimed: the executors' Python workers start and import torch/sparkdl
            started = time.time()
            try:
                fit_one(args, data, sparkdl.AllReduce(), 1)
                print(f"[network] warm-up fit: {time.time() - started:.1f}s", file=sys.stderr, flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"[network] warm-up fit failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        rows = strategies(args)
        if args.interleave:  # each strategy at every rate back to back
            plan = [(rate, row) for row in rows for rate in args.rate_list]
        else:  # every strategy at one rate, then the next rate
            plan = [(rate, row) for rate in args.rate_list for row in rows]
        shaped = None
        for rate, (key, label, strategy) in plan:
            if rate != shaped:
                netcluster(args, "shape", rate)
                shaped = rate
            record = measure(args, data, sampler, rate, key, label, strategy, held)
            results["records"].append(record)
            if record["ok"]:
                wire = record.get("wire_bytes")
                print(
                    f"[network] {rate_label(rate)} {label}: {record['samples_per_sec']:.0f} samples/s, "
                    f"wire {wire / record['samples'] / 1e6 if wire else float('nan'):.3f} MB/sample, "
                    f"loss {record['history'][-1]['loss']:.3f}, fit {record['fit_seconds']:.1f}s",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                print(
                    f"[network] {rate_label(rate)} {label}: FAILED {record['error_type']}: {record['error'][:300]}",
                    file=sys.stderr,
                    flush=True,
                )
            with open(args.results, "w") as handle:  # partial results survive a later crash
                json.dump(results, handle)
    finally:
        sampler.stop()
        try:
            netcluster(args, "shape", "none")
        except subprocess.CalledProcessError:
            pass
        spark.stop()
    with open(args.results, "w") as handle:
        json.dump(results, handle)
    return 0


# ---------------------------------------------------------------------------- tables and verdict


def loss_at(record: Dict[str, Any], when: float, initial: float) -> float:
    """The training-loss curve at ``when`` seconds of epochs: (0, initial), then each epoch's mean
    loss at its middle, linear in between, flat after the last middle."""
    points = [(0.0, initial)]
    elapsed = 0.0
    for h in record["history"]:
        points.append((elapsed + h["seconds"] / 2, h["loss"]))
        elapsed += h["seconds"]
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if when <= t1:
            return l0 + (l1 - l0) * (when - t0) / (t1 - t0) if t1 > t0 else l1
    return points[-1][1]


def analyse(results: Dict[str, Any], args: argparse.Namespace) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """Adds the derived figures (ratios, equal-time loss) to each record; keyed (rate, key)."""
    by = {(r["rate"], r["key"]): r for r in results["records"]}
    initial = results["initial_loss"]
    for rate in args.rate_list:
        done = [r for r in results["records"] if r["rate"] == rate and r["ok"]]
        if not done:
            continue
        fastest = min(done, key=lambda r: r["epoch_seconds"])
        base = by.get((rate, "allreduce"))
        for r in done:
            r["equal_time_s"] = fastest["epoch_seconds"]
            r["equal_time_of"] = fastest["strategy"]
            r["loss_equal_time"] = loss_at(r, fastest["epoch_seconds"], initial)
            r["loss_equal_samples"] = r["history"][-1]["loss"]
            if base and base.get("ok"):
                r["x_allreduce"] = r["samples_per_sec"] / base["samples_per_sec"]
            own = by.get(("none", r["key"]))
            if own and own.get("ok") and rate != "none":
                r["kept"] = r["samples_per_sec"] / own["samples_per_sec"]
    return by


def fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def tables(results: Dict[str, Any], args: argparse.Namespace) -> str:
    by = analyse(results, args)
    w = widths(args)
    steps = args.rows * args.epochs // (WORLD * args.batch_size)
    lines = [
        f"MLP {'-'.join(map(str, w))} ({n_params(w) / 1e6:.2f} M parameters, {n_params(w) * 4 / 1e6:.1f} MB float32), "
        f"2 worker hosts x 1 core (namespace cluster, tc tbf on every host's link), batch {args.batch_size}/worker, "
        f"{args.rows} rows x {args.epochs} epochs = {args.rows * args.epochs} samples ({steps} steps/worker) per fit, "
        f"Adam lr={args.lr}, seed {args.seed}; initial held-out loss {results['initial_loss']:.3f}",
        "loss @ equal time: training-loss curve (epoch means at epoch midpoints, initial loss at 0) interpolated at T = "
        "the epochs' time of the fastest row at that rate",
    ]
    odd = [t for t in args.tau_list + ([args.diloco_tau] if "diloco" in args.strategy_list else []) if steps % t]
    if odd:
        lines.append(
            f"note: τ={'/'.join(map(str, odd))} does not divide the {steps} steps: the final average after the epochs "
            "is in wire MB/sample but not in samples/s (nor in sparkdl MB/sample)"
        )
    errors = []
    for rate in args.rate_list:
        rows = [r for r in results["records"] if r["rate"] == rate]
        if not rows:
            continue
        done = [r for r in rows if r["ok"]]
        when = f", T = {done[0]['equal_time_s']:.1f}s ({done[0]['equal_time_of']})" if done else ""
        lines += [
            "",
            f"### {rate_label(rate)}{when}",
            "",
            "| strategy | samples/s | x AllReduce | kept vs unshaped | wire MB/sample | sparkdl MB/sample | loss @ equal samples | loss @ equal time | final held-out |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            if not r["ok"]:
                lines.append(f"| {r['strategy']} | FAILED ({r['error_type']}) | | | | | | | |")
                errors.append(f"{rate_label(rate)} {r['strategy']}: {r['error_type']}: {r['error']}")
                continue
            wire = r.get("wire_bytes")
            lines.append(
                f"| {r['strategy']} | {r['samples_per_sec']:,.0f} | {fmt(r.get('x_allreduce'), '.2f')} | {fmt(r.get('kept'), '.0%')} | "
                f"{fmt(wire / r['samples'] / 1e6 if wire is not None else None, '.4f')} | {r['comm_bytes'] / r['samples'] / 1e6:.4f} | "
                f"{r['loss_equal_samples']:.3f} | {r['loss_equal_time']:.3f} | {r['final_heldout_loss']:.3f} |"
            )
    if errors:
        lines += ["", "Failures (verbatim):"] + [f"- {e}" for e in errors]
    verdict, detail = premise(by, args)
    results["verdict"] = verdict
    lines += ["", verdict] + [f"  {d}" for d in detail]
    return "\n".join(lines)


def premise(by: Dict[Tuple[str, str], Dict[str, Any]], args: argparse.Namespace) -> Tuple[str, List[str]]:
    """One verdict line (at the last shaped rate measured, the most limited by default) and one
    detail line for each other shaped rate.

    SHOWN: AllReduce is bandwidth-bound (keeps < 70% of its unshaped samples/s) and some τ of
    ModelAveraging keeps >= 80% of its own; PARTLY: none keeps 80%, but the best is >= 2x
    AllReduce's samples/s at that rate; REFUTED: not even that. Each line also compares the loss
    of the averaging family's best row at equal time with AllReduce's."""
    shaped = [r for r in args.rate_list if r != "none"]
    ar_base = by.get(("none", "allreduce"))
    if not shaped or not (ar_base and ar_base.get("ok")) or not args.tau_list or "ma" not in args.strategy_list:
        return "Verdict: not tested (needs 'none', a shaped rate, AllReduce and ModelAveraging rows).", []
    family = [f"ma{t}" for t in args.tau_list] + ["diloco", "elastic"]
    lines: List[str] = []
    for rate in shaped:
        ar = by.get((rate, "allreduce"))
        if not (ar and ar.get("ok")):
            lines.append(f"{rate}: not tested, AllReduce failed")
            continue
        ar_kept = ar["samples_per_sec"] / ar_base["samples_per_sec"]
        taus = []  # (τ, kept, x AllReduce)
        for tau in args.tau_list:
            ma, base = by.get((rate, f"ma{tau}")), by.get(("none", f"ma{tau}"))
            if ma and ma.get("ok") and base and base.get("ok"):
                taus.append(
                    (
                        tau,
                        ma["samples_per_sec"] / base["samples_per_sec"],
                        ma["samples_per_sec"] / ar["samples_per_sec"],
                    )
                )
        if not taus:
            lines.append(f"{rate}: not tested, every ModelAveraging fit failed")
            continue
        kept = "/".join(f"{k:.0%}" for _, k, _ in taus)
        speed = "/".join(f"{x:.1f}x" for _, _, x in taus)
        names = "/".join(str(t) for t, _, _ in taus)
        if ar_kept >= 0.7:
            outcome = "NOT TESTED (AllReduce is not bandwidth-bound here)"
        elif max(k for _, k, _ in taus) >= 0.8:
            outcome = "SHOWN"
        elif max(x for _, _, x in taus) >= 2.0:
            outcome = "PARTLY (averaging beats AllReduce but no τ keeps 80% of its unshaped samples/s)"
        else:
            outcome = "REFUTED"
        rows = [by[(rate, key)] for key in family if by.get((rate, key), {}).get("ok")]
        best = min(rows, key=lambda r: r["loss_equal_time"])
        lines.append(
            f"{rate}: {outcome} — AllReduce keeps {ar_kept:.0%} of its unshaped samples/s; ModelAveraging τ={names} keeps "
            f"{kept} of its own ({speed} AllReduce's); at equal time the family's best, {best['strategy']}, reaches loss "
            f"{best['loss_equal_time']:.3f} vs AllReduce's {ar['loss_equal_time']:.3f} (at equal samples {best['loss_equal_samples']:.3f} "
            f"vs {ar['loss_equal_samples']:.3f})"
        )
    return (
        f"Verdict on SparkNet's premise (averaging every τ steps keeps throughput when allreduce is bandwidth-bound) at {lines[-1]}",
        lines[:-1],
    )


# ---------------------------------------------------------------------------- outer process (root namespace)


def outer_main(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/network.py needs root (scripts/netcluster creates network namespaces)")
    base = [sys.executable, NETCLUSTER, "--name", args.cluster_name, "--dir", args.cluster_dir]
    env = dict(
        os.environ,
        PYSPARK_PYTHON=sys.executable,
        SPARKDL_NETCLUSTER_NAME=args.cluster_name,
        SPARKDL_NETCLUSTER_DIR=args.cluster_dir,
    )
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    results_path = os.path.join(args.cluster_dir, "bench-results.json")
    started = time.time()

    def terminated(signum, frame):  # SIGTERM (timeout, kill) also takes the cluster down
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    try:
        subprocess.run(
            [*base, "up", "--hosts", "3", "--cores", "1", "--memory", "1g"],
            check=True,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        write_dataset(args, os.path.join(args.cluster_dir, "bench-data"))
        if os.path.exists(results_path):
            os.remove(results_path)
        print(f"[network] cluster up in {time.time() - started:.0f}s; driver in h0", file=sys.stderr, flush=True)
        done = subprocess.run(
            [
                *base,
                "exec",
                "h0",
                "--",
                sys.executable,
                os.path.abspath(__file__),
                *argv,
                "--driver",
                "--results",
                results_path,
            ],
            env=env,
            cwd=REPO_ROOT,
            stdin=subprocess.DEVNULL,
        )
        if not os.path.exists(results_path):
            print(f"[network] the driver wrote no results (exit {done.returncode})", file=sys.stderr)
            return 1
        results = json.load(open(results_path))
    finally:
        subprocess.run([*base, "down"], env=env, stdin=subprocess.DEVNULL)
        shutil.rmtree(os.path.join(args.cluster_dir, "bench-data"), ignore_errors=True)
    results["args"] = {k: v for k, v in vars(args).items() if k not in ("driver", "results")}
    results["wall_seconds"] = time.time() - started
    print(tables(results, args))
    print(f"\n(whole run {results['wall_seconds'] / 60:.1f} min)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0 if done.returncode == 0 else 1


def main(argv: Sequence[str]) -> int:
    args = resolve(parser().parse_args(list(argv)))
    if args.driver:
        return driver_main(args)
    return outer_main(args, strip_json(argv))


def strip_json(argv: Sequence[str]) -> List[str]:
    """argv without ``--json PATH`` (the outer process writes it, not the driver)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--json":
            skip = True
            continue
        if a.startswith("--json="):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
