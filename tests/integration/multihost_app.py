"""A driver on the namespace cluster's driver host (scripts/netcluster): runs the scenarios named
on the command line in one Spark application and prints one JSON line per scenario.

    scripts/netcluster exec h0 -- python tests/integration/multihost_app.py --out DIR SCENARIO ...

Each line: ``{"scenario", "ok", "seconds", "hosts"`` (the host names the ranks ran on), ``"error"``
and ``"error_type"`` when it failed, and what the scenario measured: bytes each host's
interfaces sent while it ran (``tx``: host -> interface -> bytes), accuracy, run_info fields.
Run by tests/integration/test_multihost.py; every host shares this machine's filesystem.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]


def record_host(out_dir: str) -> None:
    """Called on every rank: leaves this host's name in the shared directory (not on the
    driver, which builds the model too)."""
    from pyspark import TaskContext

    if TaskContext.get() is None:
        return
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{socket.gethostname()}-{os.getpid()}"), "w") as handle:
        handle.write(socket.gethostname())


class HostRecordingModel:
    """A model factory that records where each rank built it (a picklable callable)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def __call__(self):
        from models import digits_mlp

        record_host(self.out_dir)
        return digits_mlp()


def hosts_in(out_dir: str) -> list:
    if not os.path.isdir(out_dir):
        return []
    paths = [os.path.join(out_dir, name) for name in os.listdir(out_dir)]
    return sorted({open(path).read() for path in paths if os.path.isfile(path) and name_is_host(path)})


def name_is_host(path: str) -> bool:
    return os.path.basename(path).startswith("sparkdl-h")


def interface_bytes() -> dict:
    """Bytes sent so far by each interface of each host, read from the namespaces' sysfs."""
    import subprocess

    state = json.load(open(os.path.join(os.environ["SPARKDL_NETCLUSTER_DIR"], "state.json")))
    sent = {}
    for host, ns in zip(state["host_names"], state["namespaces"]):
        listed = subprocess.run(
            ["ip", "-n", ns, "-s", "-j", "link", "show"], capture_output=True, text=True, check=True
        )
        sent[host] = {link["ifname"]: link["stats64"]["tx"]["bytes"] for link in json.loads(listed.stdout)}
    return sent


def sent_between(before: dict, after: dict) -> dict:
    return {host: {name: after[host][name] - before[host].get(name, 0) for name in after[host]} for host in after}


def strategy_for(name: str):
    import sparkdl

    return {
        "allreduce": lambda: sparkdl.AllReduce(),
        "averaging": lambda: sparkdl.ModelAveraging(sync_every=4),
        "diloco": lambda: sparkdl.ModelAveraging(
            sync_every=4, outer_optimizer=sparkdl.OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
        ),
        "elastic": lambda: sparkdl.ElasticAveraging(sync_every=4),
        "ps": lambda: sparkdl.ParameterServer(),
        "sharded": lambda: sparkdl.ShardedDataParallel(),
    }[name]()


def fit(spark, args, scenario: str, strategy: str, out_dir: str, data=None, **overrides) -> dict:
    from models import accuracy, read_digits

    import sparkdl

    estimator = sparkdl.TorchEstimator(
        model=HostRecordingModel(out_dir),
        feature_cols=["features"],
        label_col="label",
        strategy=strategy_for(strategy),
        num_workers=overrides.pop("num_workers", args.workers),
        batch_size=32,
        epochs=overrides.pop("epochs", 3),
        progress=False,
        **overrides,
    )
    model = estimator.fit(data if data is not None else args.train)
    features, labels = read_digits(args.test)
    result = {
        "accuracy": accuracy(model.module, features, labels),
        "strategy": model.run_info.get("strategy"),
        "steps": model.run_info.get("steps"),
        "attempts": model.run_info.get("attempts"),
        "workers": model.run_info.get("workers"),
    }
    if scenario.startswith("transform"):
        frame = spark.read.parquet(args.test)
        scored = model.transform(frame).select("label", "prediction").collect()
        # The prediction is the model's output row (10 logits): its argmax is the class.
        right = sum(int(r.label == max(range(len(r.prediction)), key=r.prediction.__getitem__)) for r in scored)
        result["transform"] = {"rows": len(scored), "accuracy": right / len(scored)}
    return result


class RankOneFailsAtStep:
    """Cross-entropy whose rank 1, at its ``at``-th step (once: a marker file on the shared
    filesystem, holding the host and time), after its checkpoint writer has finished, either
    ends its process (``how="exit"``), unplugs its own host's cluster link and trains on
    (``how="unplug"``: its next sync waits for a peer it can no longer reach, as on a host whose
    switch port died) or has its host's Spark worker decommissioned (``how="decommission"``:
    SIGPWR to the worker, what a node's shutdown or a pre-stop hook does) and trains on,
    sends its executor's JVM SIGTERM (``how="sigterm"``, what Kubernetes and spot reclaim do) and
    trains on, or unplugs its host's link for ``blip_s`` seconds only (``how="blip"``). Every
    step takes at least ``step_s`` (compute of a bigger model), so the run outlasts the notice."""

    def __init__(self, marker: str, at: int, how: str, step_s: float = 0.0, blip_s: float = 0.0) -> None:
        self.marker, self.at, self.how, self.step_s, self.blip_s, self.calls = marker, at, how, step_s, blip_s, 0

    def __call__(self, output, label):
        import subprocess
        import threading

        import torch

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
        if rank >= 0:
            self.calls += 1
            if rank == 1 and self.calls == self.at and not os.path.exists(self.marker):
                for thread in threading.enumerate():
                    if thread.name.startswith("sparkdl-checkpoint"):
                        thread.join()
                with open(self.marker, "w") as handle:
                    handle.write(f"{socket.gethostname()} {time.time()}")
                if self.how == "exit":
                    os._exit(9)
                if self.how == "sigterm":
                    import signal

                    os.kill(executor_jvm(), signal.SIGTERM)
                    return torch.nn.functional.cross_entropy(output, label)
                if self.how == "blip":
                    link = [sys.executable, os.path.join(REPO, "scripts", "netcluster"), "link", socket.gethostname()]
                    subprocess.run([*link, "down"], check=True, capture_output=True)
                    threading.Timer(
                        self.blip_s,
                        subprocess.run,
                        args=([*link, "up"],),
                        kwargs={"check": True, "capture_output": True},
                    ).start()
                    return torch.nn.functional.cross_entropy(output, label)
                if self.how == "decommission":
                    import signal

                    state = json.load(open(os.path.join(os.environ["SPARKDL_NETCLUSTER_DIR"], "state.json")))
                    os.kill(state["pids"][f"worker-{socket.gethostname().rsplit('-', 1)[1]}"], signal.SIGPWR)
                    return torch.nn.functional.cross_entropy(output, label)
                subprocess.run(
                    [sys.executable, os.path.join(REPO, "scripts", "netcluster"), "link", socket.gethostname(), "down"],
                    check=True,
                    capture_output=True,
                )
        if rank >= 0 and self.step_s:
            time.sleep(self.step_s)  # the step's compute, not a synchronization
        return torch.nn.functional.cross_entropy(output, label)


def executor_jvm() -> int:
    """The pid of the executor JVM this Python worker runs under (its nearest such ancestor)."""
    pid = os.getppid()
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if b"CoarseGrainedExecutorBackend" in handle.read():
                return pid
        with open(f"/proc/{pid}/stat") as handle:
            pid = int(handle.read().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("no executor JVM above this process")


class LogTimes(logging.Handler):
    """When sparkdl's driver logged what: (time, message) of every record."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record) -> None:
        self.records.append((record.created, record.getMessage()))


def host_lost(spark, args, scenario: str, out_dir: str, noticed_by: str = "host_timeout") -> dict:
    """Rank 1 unplugs its host's link for good at its 15th step. ``noticed_by``: what ends the
    attempt — ``"host_timeout"`` (spark.sparkdl.hostTimeout=20s, before anything else) or
    ``"watchdog"`` (watchdog_timeout_s=30 and timeout_s=30, before the default hostTimeout of
    45 s: the issue's case, where the host was never treated as lost)."""
    import subprocess

    os.makedirs(out_dir, exist_ok=True)
    marker = os.path.join(out_dir, "cut")
    settings = dict(max_failures=1)
    if noticed_by == "host_timeout":
        spark.conf.set("spark.sparkdl.hostTimeout", "20s")
    else:
        settings = dict(max_failures=2, watchdog_timeout_s=30, timeout_s=30)
    log = LogTimes()
    logging.getLogger("sparkdl").addHandler(log)
    try:
        result = fit(
            spark,
            args,
            scenario,
            "allreduce",
            out_dir,
            epochs=3,
            checkpoint_dir=os.path.join(out_dir, "checkpoints"),
            checkpoint_every=10,
            min_workers=1,
            loss=RankOneFailsAtStep(marker, at=15, how="unplug"),
            **settings,
        )
    finally:
        logging.getLogger("sparkdl").removeHandler(log)
        spark.conf.unset("spark.sparkdl.hostTimeout")
        if os.path.exists(marker):
            cut_host = open(marker).read().split()[0]
            subprocess.run(
                [sys.executable, os.path.join(REPO, "scripts", "netcluster"), "link", cut_host, "up"],
                check=True,
                capture_output=True,
            )
    cut_host, cut_at = open(marker).read().split()

    def first(text):
        return next((when - float(cut_at) for when, message in log.records if text in message), None)

    result.update(
        cut_host=cut_host,
        detected_after_s=first("treating the host as lost"),
        relaunched_after_s=first("attempt 1 failed"),
        resumed_after_s=first("resumed on 1 workers"),
        log=[message[:300] for _, message in log.records],
    )
    return result


class CutOnceWriting:
    """A row filter (keeps every row) that, in the first task that evaluates it on a worker host
    (the driver materializing the DataFrame), unplugs that host's cluster link for good (a
    marker file on the shared filesystem: once per scenario). Each row costs ``row_s`` (a costly
    transformation), so the write is still running on the other host when this one drops out."""

    def __init__(self, marker: str, row_s: float = 0.002) -> None:
        self.marker, self.row_s = marker, row_s

    def __call__(self, labels):
        import subprocess

        # The copy's write is the first job that evaluates the DataFrame's rows (the fit's checks
        # before it read only its schema): the first call on a worker host is inside it.
        if socket.gethostname().startswith("sparkdl-h") and not os.path.exists(self.marker):
            with open(self.marker, "w") as handle:
                handle.write(f"{socket.gethostname()} {time.time()}")
            link = [sys.executable, os.path.join(REPO, "scripts", "netcluster"), "link", socket.gethostname(), "down"]
            subprocess.run(link, check=True, capture_output=True)
        time.sleep(self.row_s * len(labels))  # the transformation's compute, not a synchronization
        return labels == labels


def host_lost_materializing(spark, args, scenario: str, out_dir: str) -> dict:
    """A DataFrame fit (min_workers=1) whose materialization loses a worker host for good: Spark
    re-runs that host's write tasks on the other host once it declares the executor lost
    (spark.network.timeout, set short by the test), and the fit trains on the host that is left."""
    import subprocess

    from pyspark.sql import functions as F

    from sparkdl.data.cache import CACHE_DIR_CONF

    os.makedirs(out_dir, exist_ok=True)
    marker = os.path.join(out_dir, "cut")
    keep = F.pandas_udf(CutOnceWriting(marker), "boolean")
    frame = spark.read.parquet(args.train).repartition(4).filter(keep(F.col("label")))
    spark.conf.set(CACHE_DIR_CONF, os.path.join(out_dir, "cache"))
    try:
        # The lost host's slot cannot come back while its link is down: waiting the default 30 s
        # for it (slot_wait_s) would only lengthen the test; 3 s still counts the free slots.
        result = fit(spark, args, scenario, "allreduce", out_dir, epochs=2, min_workers=1, slot_wait_s=3.0, data=frame)
    finally:
        spark.conf.unset(CACHE_DIR_CONF)
        if os.path.exists(marker):
            cut_host = open(marker).read().split()[0]
            subprocess.run(
                [sys.executable, os.path.join(REPO, "scripts", "netcluster"), "link", cut_host, "up"],
                check=True,
                capture_output=True,
            )
    result["cut_host"] = open(marker).read().split()[0]
    result["hosts_after_cut"] = [h for h in hosts_in(out_dir) if h != result["cut_host"]]
    return result


CANARY_METRIC = "sparkdl_canary_metric_5f1d"


class CanaryModel:
    """digits_mlp whose parameters, on each rank's first backward pass, leave the first 64 bytes
    of their gradient in ``out_dir`` (what a parameter-server push then carries): known tensor
    bytes to look for on the wire."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def __call__(self):
        from models import digits_mlp

        record_host(self.out_dir)
        module = digits_mlp()
        for name, param in module.named_parameters():
            param.register_hook(self._recorder(name))
        return module

    def _recorder(self, name: str):
        def record(grad):
            import torch

            if torch.distributed.is_initialized() and grad.numel() >= 16:
                path = os.path.join(self.out_dir, f"grad-{torch.distributed.get_rank()}-{name}.bin")
                if not os.path.exists(path):
                    with open(path, "wb") as handle:
                        handle.write(grad.detach().reshape(-1)[:16].contiguous().float().numpy().tobytes())
            return grad

        return record


class CanaryLoss:
    """Cross-entropy that reports a metric of a name found nowhere else, once per rank."""

    def __init__(self) -> None:
        self.reported = False

    def __call__(self, output, label):
        import torch

        if torch.distributed.is_initialized() and not self.reported:
            import sparkdl

            sparkdl.report(**{CANARY_METRIC: 1.0})
            self.reported = True
        return torch.nn.functional.cross_entropy(output, label)


def canary(spark, args, out_dir: str) -> dict:
    """A parameter-server fit carrying the canaries through sparkdl's own connections (channel,
    store, parameter server); the test captures the wire meanwhile."""
    from models import accuracy, read_digits

    import sparkdl

    os.makedirs(out_dir, exist_ok=True)
    model = sparkdl.TorchEstimator(
        model=CanaryModel(out_dir),
        loss=CanaryLoss(),
        feature_cols=["features"],
        label_col="label",
        strategy=sparkdl.ParameterServer(),
        num_workers=2,
        batch_size=32,
        epochs=1,
        progress=False,
    ).fit(args.train)
    features, labels = read_digits(args.test)
    grads = {
        name: open(os.path.join(out_dir, name), "rb").read().hex()
        for name in sorted(os.listdir(out_dir))
        if name.startswith("grad-")
    }
    return {
        "accuracy": accuracy(model.module, features, labels),
        "grads": grads,
        "metric": CANARY_METRIC,
        "encrypt": spark.conf.get("spark.network.crypto.enabled", "false"),
    }


def gathered_hosts(ctx):
    """A sparkdl.run function: every rank's host name and collective interface, gathered with a
    gloo collective (so the gather itself crosses the hosts)."""
    import torch.distributed as dist

    mine = {"host": socket.gethostname(), "gloo": os.environ.get("GLOO_SOCKET_IFNAME")}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


LAUNCHED_SCRIPT = """
import json, os, socket, sys
import torch.distributed as dist

dist.init_process_group("gloo")  # env://, as a torchrun script does
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, {"host": socket.gethostname(), "gloo": os.environ.get("GLOO_SOCKET_IFNAME")})
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as handle:
        json.dump(everyone, handle)
dist.destroy_process_group()
"""


def resource_facts(ctx):
    """A sparkdl.run function: every rank's host, the GPU addresses Spark assigned its task, the
    device assignment sparkdl made of them, and its CPU amount and threads, gathered across hosts."""
    import torch
    import torch.distributed as dist
    from pyspark import TaskContext

    task = TaskContext.get()
    exact = getattr(task, "cpuAmount", None)
    mine = {
        "host": socket.gethostname(),
        "gpus": list(task.resources()["gpu"].addresses) if "gpu" in task.resources() else [],
        "spark_addresses": list(ctx.device_assignment.spark_addresses),
        "cpus": task.cpus(),
        "cpu_amount": None if exact is None else str(exact()),
        "torch_threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def scoring_resources(spark, resources) -> dict:
    """TorchModel.transform with the same stage resources as the training stage: the profile
    ids its job ran with, and what each scoring task was given where it built the model."""
    import glob
    import tempfile

    import sparkdl
    from sparkdl._driver.resource_profile import stage_profile_ids
    from tests.models import CountingFactory, Poisonable

    sc = spark.sparkContext
    builds = tempfile.mkdtemp(prefix="sparkdl-scoring-")
    model = sparkdl.TorchModel.from_state(
        Poisonable().state_dict(), model=CountingFactory(builds), feature_cols=["features"], output_shape=[3]
    ).setResources(resources)
    frame = spark.createDataFrame([(i, [0.5] * 8) for i in range(200)], "id long, features array<float>").repartition(4)
    sc.addJobTag("score")
    try:
        scored = model.transform(frame).filter("prediction IS NOT NULL").count()
    finally:
        sc.removeJobTag("score")
    found = [json.load(open(path)) for path in sorted(glob.glob(os.path.join(builds, "*.json")))]
    return {
        "scored": scored,
        "score_profiles": stage_profile_ids(sc, "score"),
        "score_builds": [b for b in found if b["pid"] != os.getpid()],
    }


def stage_resources(spark) -> dict:
    """ETL, a training stage with 2 CPUs and 1 GPU per task, ETL again, in one application: the
    resource profile ids Spark's status store recorded for each, the slots counted with and
    without the profile, and a profile the executors cannot hold."""
    import sparkdl
    from sparkdl._driver.cluster import free_slots
    from sparkdl._driver.resource_profile import stage_profile, stage_profile_ids
    from sparkdl._spark import Session

    sc = spark.sparkContext

    def etl(tag):
        sc.addJobTag(tag)
        try:
            spark.range(0, 2000, 1, 4).selectExpr("id % 7 AS k").groupBy("k").count().collect()
        finally:
            sc.removeJobTag(tag)
        return stage_profile_ids(sc, tag)

    resources = sparkdl.Resources(cpus=2, gpus=1)
    result = {"etl_before": etl("etl-before")}
    sc.addJobTag("train")
    try:
        result["ranks"] = sparkdl.run(resource_facts, num_workers=2, progress=False, resources=resources)
    finally:
        sc.removeJobTag("train")
    result["train_profiles"] = stage_profile_ids(sc, "train")
    result.update(scoring_resources(spark, resources))
    result["etl_after"] = etl("etl-after")
    result["slots"] = {"default": free_slots(sc), "profile": free_slots(sc, stage_profile(Session(spark), resources))}
    started = time.monotonic()
    try:
        sparkdl.run(resource_facts, num_workers=2, progress=False, resources=sparkdl.Resources(cpus=4, gpus=1))
        result["too_big"] = None
    except sparkdl.InsufficientSlotsError as exc:
        result["too_big"] = {"error": str(exc), "seconds": time.monotonic() - started}
    return result


def plan_mlp():
    """The plan validation's model: 256-1024-1024-10, 1.31 M parameters (5.3 MB of float32): its
    synchronisation costs more than its compute on the shaped links, as on a slow network."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(256, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )


def plan_strategies():
    from sparkdl.strategies import (
        AllReduce,
        ElasticAveraging,
        ModelAveraging,
        OuterSGD,
        ParameterServer,
        ShardedDataParallel,
    )

    return {
        "AllReduce": AllReduce(),
        "ModelAveraging(sync_every=8)": ModelAveraging(sync_every=8),
        "DiLoCo(sync_every=16)": ModelAveraging(
            sync_every=16, outer_optimizer=OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
        ),
        "ElasticAveraging(sync_every=4)": ElasticAveraging(sync_every=4),
        "ParameterServer": ParameterServer(),
        "ShardedDataParallel": ShardedDataParallel(),
    }


def plan_data(out_dir: str, rows: int) -> str:
    """``rows`` rows of 256 float features in 10 classes, 32 rows per row group."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(7)
    centers = rng.standard_normal((10, 256)).astype(np.float32)
    labels = rng.integers(0, 10, rows)
    features = centers[labels] + rng.standard_normal((rows, 256)).astype(np.float32)
    path = os.path.join(out_dir, "plan-data")
    os.makedirs(path, exist_ok=True)
    table = pa.table(
        {"features": pa.array(list(features), type=pa.list_(pa.float32())), "label": labels.astype(np.int64)}
    )
    pq.write_table(table, os.path.join(path, "part-0.parquet"), row_group_size=32)
    return path


#: How far a plan's samples/s may be from the measured ones (the issue's bar).
PLAN_TOLERANCE = 0.25
#: The validation's data: 16 steps of 32 rows per epoch on each of 2 workers.
PLAN_EPOCH_ROWS = 2 * 32 * 16
#: Seconds of steady epochs each validation fit runs at least, at the planned rate.
STEADY_S = 4.0


def plan_against_fits(spark, args, rate: str, out_dir: str) -> dict:
    """On links shaped to ``rate``: ``sparkdl.plan``'s prediction for 2 workers against each
    strategy's measured steady samples/s (the median epoch after the first) on the same data."""
    import statistics
    import subprocess

    import torch

    import sparkdl

    netcluster = [sys.executable, os.path.join(REPO, "scripts", "netcluster")]
    subprocess.run([*netcluster, "shape", rate], check=True, capture_output=True)
    try:
        os.makedirs(out_dir, exist_ok=True)
        data = plan_data(out_dir, rows=PLAN_EPOCH_ROWS)
        optimizer = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
        strategies = plan_strategies()
        planned = sparkdl.plan(
            model=plan_mlp, data=data, batch_size=32, strategies=strategies, workers=[2], optimizer=optimizer
        )
        predicted = {p.strategy: p.samples_per_s for p in planned.predictions}

        def measure(strategy, epochs: int) -> float:
            fitted = sparkdl.TorchEstimator(
                model=plan_mlp,
                optimizer=optimizer,
                strategy=strategy,
                num_workers=2,
                batch_size=32,
                epochs=epochs,
                progress=False,
            ).fit(data)
            return statistics.median(epoch["samples_per_sec"] for epoch in fitted.history[1:])

        def steady_epochs(rate_predicted: float) -> int:
            # The first epoch warms up; the others are measured, at least STEADY_S of them at the
            # planned rate: an epoch of a compute-bound strategy lasts a fifth of a second, too
            # short a window on a shared machine.
            return 1 + max(3, math.ceil(STEADY_S * rate_predicted / PLAN_EPOCH_ROWS))

        measured, fits, first_pairs = {}, {}, {}
        for label, strategy in strategies.items():
            measured[label] = measure(strategy, steady_epochs(predicted[label]))
            fits[label] = [measured[label]]
            if abs(predicted[label] / measured[label] - 1) <= PLAN_TOLERANCE:
                continue
            # This machine is shared and its speed drifts by a fifth and more within minutes
            # (docs/performance.md, "sparkdl plan against measurement"): a pair off by more than the bar is
            # measured twice again, calibration and fit, and the pair of the median ratio of the three is
            # judged. A model error is off in every pair, so the median is off too; a neighbour's burst
            # during one calibration or fit moves one pair, which the median leaves out.
            first_pairs[label] = {"predicted": predicted[label], "measured": measured[label]}
            pairs = [(predicted[label], measured[label])]
            for _ in range(2):
                again = sparkdl.plan(
                    model=plan_mlp,
                    data=data,
                    batch_size=32,
                    strategies={label: strategy},
                    workers=[2],
                    optimizer=optimizer,
                )
                planned_again = {p.strategy: p.samples_per_s for p in again.predictions}[label]
                pairs.append((planned_again, measure(strategy, steady_epochs(planned_again))))
                fits[label].append(pairs[-1][1])
            predicted[label], measured[label] = sorted(pairs, key=lambda pair: pair[0] / pair[1])[1]
        return {
            "rate": rate,
            "predicted": predicted,
            "fits": fits,
            "bound": {p.strategy: p.bound for p in planned.predictions},
            "measured": measured,
            "first_pairs": first_pairs,  # the strategies measured again, their first pair
            "calibration": planned.to_json()["measured"],
            "task_steps": [task["local_step_s"] for task in planned.calibration["tasks"]],
            # What the calibration timed each synchronization at beyond its transfer (the first plan's).
            "sync_overhead_s": dict(planned.measured.sync_overhead_s),
            "network": planned.calibration["network"],
        }
    finally:
        subprocess.run([*netcluster, "shape", "none"], check=True, capture_output=True)


def scenario_dir(args, scenario: str) -> str:
    return os.path.join(args.out, scenario.replace(":", "-"))


def run_scenario(spark, args, scenario: str) -> dict:
    import sparkdl

    out_dir = scenario_dir(args, scenario)
    name, _, option = scenario.partition(":")
    if name == "resolve":  # not a run: what every host's own name resolves to from now on
        import subprocess

        subprocess.run(
            [sys.executable, os.path.join(REPO, "scripts", "netcluster"), "resolve", option],
            check=True,
            capture_output=True,
        )
        return {"resolve": option}
    if name == "fit":
        return fit(spark, args, scenario, option or "allreduce", out_dir)
    if name == "fit_checkpointed":  # checkpoints in this application's own directory
        result = fit(
            spark, args, scenario, option or "allreduce", out_dir, checkpoint_dir=os.path.join(out_dir, "checkpoints")
        )
        result["checkpoints"] = sorted(os.listdir(os.path.join(out_dir, "checkpoints")))
        result["driver_address"] = spark.conf.get("spark.driver.host")
        return result
    if name == "fit_on":  # fit_on:N: a fit asking for N workers
        return fit(spark, args, scenario, "allreduce", out_dir, num_workers=int(option), slot_wait_s=5.0)
    if name == "transform":
        return fit(spark, args, scenario, "allreduce", out_dir)
    if name == "run":
        ranks = sparkdl.run(gathered_hosts, num_workers=2, progress=False)
        return {"ranks": ranks}
    if name == "launch":
        os.makedirs(out_dir, exist_ok=True)
        script, output = os.path.join(out_dir, "train.py"), os.path.join(out_dir, "ranks.json")
        with open(script, "w") as handle:
            handle.write(LAUNCHED_SCRIPT)
        result = sparkdl.launch(script, output, num_workers=2, progress=False)
        return {"exit_code": result.exit_code, "ranks": json.load(open(output))}
    if name == "allow_plaintext_collectives":  # not a run: accept gloo's plaintext from now on
        spark.conf.set("spark.sparkdl.allowUnencryptedCollectives", "true")
        return {}
    if name == "resources":
        return stage_resources(spark)
    if name == "plan":  # plan:RATE
        return plan_against_fits(spark, args, option, out_dir)
    if name == "canary":
        return canary(spark, args, out_dir)
    if name == "drain":  # drain:decommission or drain:sigterm
        # Rank 1's host is decommissioned at its 12th step; nothing fails, the run drains.
        os.makedirs(out_dir, exist_ok=True)
        result = fit(
            spark,
            args,
            scenario,
            "allreduce",
            out_dir,
            epochs=6,
            checkpoint_dir=os.path.join(out_dir, "checkpoints"),
            max_failures=0,
            min_workers=1,
            loss=RankOneFailsAtStep(os.path.join(out_dir, "notice"), at=12, how=option or "decommission", step_s=0.05),
        )
        result["decommissioned"] = open(os.path.join(out_dir, "notice")).read().split()[0]
        return result
    if name == "partition_heals":
        # Rank 1's host is cut off for 8 s, under spark.sparkdl.hostTimeout=20s: the run goes on.
        os.makedirs(out_dir, exist_ok=True)
        spark.conf.set("spark.sparkdl.hostTimeout", "20s")
        try:
            return fit(
                spark,
                args,
                scenario,
                "allreduce",
                out_dir,
                epochs=2,
                loss=RankOneFailsAtStep(os.path.join(out_dir, "cut"), at=15, how="blip", blip_s=8.0),
            )
        finally:
            spark.conf.unset("spark.sparkdl.hostTimeout")
    if name == "host_lost":  # host_lost or host_lost:watchdog
        return host_lost(spark, args, scenario, out_dir, noticed_by=option or "host_timeout")
    if name == "host_lost_materializing":
        return host_lost_materializing(spark, args, scenario, out_dir)
    if name == "resume":
        # Rank 1's process dies at its 15th step, once; the relaunch resumes the step-10 checkpoint.
        os.makedirs(out_dir, exist_ok=True)
        loss = RankOneFailsAtStep(os.path.join(out_dir, "died"), at=15, how="exit")
        return fit(
            spark,
            args,
            scenario,
            "allreduce",
            out_dir,
            epochs=2,
            checkpoint_dir=os.path.join(out_dir, "checkpoints"),
            checkpoint_every=10,
            max_failures=1,
            loss=loss,
        )
    raise SystemExit(f"unknown scenario {scenario}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--master", default=None)
    parser.add_argument("--train", default=None)
    parser.add_argument("--test", default=None)
    parser.add_argument("--conf", action="append", default=[], help="KEY=VALUE, a Spark setting of this application")
    parser.add_argument("--host", default="h0", help="the host this driver runs on (its address is the driver's)")
    parser.add_argument("--ready", default=None, help="a file to create once the session is up")
    parser.add_argument("--wait-for", default=None, help="a file to wait for (bounded) before the first scenario")
    parser.add_argument("--workers", type=int, default=2, help="num_workers of every run")
    parser.add_argument("scenarios", nargs="+")
    args = parser.parse_args()
    state = json.load(open(os.path.join(os.environ["SPARKDL_NETCLUSTER_DIR"], "state.json")))
    from pyspark.sql import SparkSession

    address = state["cluster_addresses"][int(args.host[1:])]
    builder = (
        SparkSession.builder.master(args.master or state["master_url"])
        .appName("sparkdl-multihost")
        .config("spark.driver.host", address)
        .config("spark.driver.bindAddress", address)
        .config("spark.ui.enabled", "false")
        .config("spark.executor.instances", str(state["hosts"] - 1))
        .config("spark.executor.memory", "768m")
        .config("spark.executorEnv.PYTHONPATH", REPO + os.pathsep + os.path.join(REPO, "tests"))
        .config("spark.sparkdl.cacheDir", os.path.join(args.out, "cache"))
    )
    for setting in args.conf:
        key, _, value = setting.partition("=")
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if args.train is None:
        from examples.digits import write_split

        args.train, args.test = write_split(os.path.join(args.out, "digits"))
    if args.ready:
        open(args.ready, "w").close()
    if args.wait_for:
        deadline = time.monotonic() + 180
        while not os.path.exists(args.wait_for):  # another driver's session: bounded poll
            if time.monotonic() > deadline:
                raise SystemExit(f"{args.wait_for} did not appear within 180 s")
            time.sleep(0.1)
    try:
        for scenario in args.scenarios:
            before, started = interface_bytes(), time.monotonic()
            line = {"scenario": scenario}
            try:
                line.update(run_scenario(spark, args, scenario))
                line["ok"] = True
            except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
                line.update(
                    ok=False,
                    error_type=type(exc).__name__,
                    error=str(exc)[:4000],
                    traceback=traceback.format_exc()[-3000:],
                )
            line["seconds"] = round(time.monotonic() - started, 2)
            line["wall"] = [round(time.time() - (time.monotonic() - started), 3), round(time.time(), 3)]
            line["tx"] = sent_between(before, interface_bytes())
            line["hosts"] = hosts_in(scenario_dir(args, scenario))
            print("MULTIHOST " + json.dumps(line), flush=True)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
