"""Measures sparkdl's ParameterServer: wire throughput, layouts, and time to accuracy on digits.

Prints markdown tables (they go into ``docs/parameter_server.md``). Run from the repository root::

    .venv/bin/python benchmarks/parameter_server.py                 # everything (several minutes)
    .venv/bin/python benchmarks/parameter_server.py --part wire     # one part: wire, layout, digits

Parts:

* **wire** — the loopback bandwidth of this machine (one process streams 4 MiB ``sendall``s to
  another over 127.0.0.1), then two processes each running a real ParameterServer runtime (its
  server thread plus a worker) on a gloo process group, both pushing fixed random gradients as
  fast as they can (fully asynchronous, no forward/backward) for MLPs of about 1M and 10M
  parameters. Reported per run: worker steps/s, the model updates/s the servers applied (both
  workers' pushes), the bytes/s both ranks put on the wire, and that rate over the loopback
  bandwidth. A gloo allreduce of the same gradient is the AllReduce reference.
* **layout** — how evenly the two layouts spread parameters (largest shard over the mean) for
  a few architectures and 2/4/8 ranks; the wire part also times both layouts.
* **digits** — time to a target test accuracy on digits with ``sparkdl.run`` on its own
  ``local-cluster[2,1,1024]`` Spark application, for max_staleness 0, 2, 8, None and AllReduce,
  with equal workers and with rank 1 sleeping every step. Rank 0 evaluates its replica after
  every epoch; "final acc" is the returned model (the servers' parameters) after all epochs.
"""

from __future__ import annotations

import argparse
import datetime
import math
import multiprocessing
import os
import socket
import statistics
import sys
import time
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
# Executors must run this interpreter and everything stays on loopback; set before the JVM starts.
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"

import torch  # noqa: E402

import sparkdl  # noqa: E402

MODELS = {"1M": [784, 1024, 256, 10], "10M": [2048, 2048, 2048, 1024, 10]}


def mlp(widths: Sequence[int]) -> torch.nn.Module:
    layers: List[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


# --------------------------------------------------------------------------------------------
# wire
# --------------------------------------------------------------------------------------------


def _drain(conn: socket.socket) -> None:
    view = memoryview(bytearray(4 << 20))
    while conn.recv_into(view):
        pass


def _stream(conn: socket.socket, total_bytes: int) -> None:
    chunk = bytearray(4 << 20)
    sent = 0
    while sent < total_bytes:
        conn.sendall(chunk)
        sent += len(chunk)
    conn.shutdown(socket.SHUT_WR)


def _peer(port_queue: Any, both_ways: bool, total_bytes: int) -> None:
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    sender = threading.Thread(target=_stream, args=(conn, total_bytes)) if both_ways else None
    if sender:
        sender.start()
    _drain(conn)
    if sender:
        sender.join()
    conn.close()


def loopback_bandwidth(both_ways: bool, total_bytes: int = 2 << 30) -> float:
    """Bytes/s of plain ``sendall`` loops between this process and another over 127.0.0.1:
    one stream, or one stream each way at once (summed) — the shape of parameter-server
    traffic, where every rank sends pushes and replies at the same time."""
    import threading

    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    peer = ctx.Process(target=_peer, args=(ports, both_ways, total_bytes), daemon=True)
    peer.start()
    sock = socket.create_connection(("127.0.0.1", ports.get(timeout=60)))
    started = time.perf_counter()
    receiver = threading.Thread(target=_drain, args=(sock,)) if both_ways else None
    if receiver:
        receiver.start()
    _stream(sock, total_bytes)
    if receiver:
        receiver.join()
    else:
        _drain(sock)  # EOF once the peer has read everything and closed
    seconds = time.perf_counter() - started
    sock.close()
    peer.join(60)
    return (2 if both_ways else 1) * total_bytes / seconds


def _gather(message: str) -> List[str]:
    import torch.distributed as dist

    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, message)
    return out


def _wire_worker(rank: int, port: int, jobs: List[Dict[str, Any]], out: Any) -> None:
    import torch.distributed as dist

    from sparkdl.strategies.base import DistEnv
    from sparkdl.strategies.parameter_server.runtime import ParameterServerRuntime as _ParameterServerRuntime
    from tests.gloo import exit_without_finalizing

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    env = DistEnv(rank, 2, torch.device("cpu"), "gloo", "127.0.0.1", port)
    try:
        for job in jobs:
            torch.manual_seed(0)
            model = mlp(MODELS[job["model"]])
            grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
            if job["kind"] == "allreduce":
                flat = torch.cat([g.reshape(-1) for g in grads])
                for _ in range(2):
                    dist.all_reduce(flat)
                dist.barrier()
                started = time.perf_counter()
                for _ in range(job["steps"]):
                    dist.all_reduce(flat)
                seconds = time.perf_counter() - started
                out.put(
                    {
                        **job,
                        "rank": rank,
                        "steps_per_sec": job["steps"] / seconds,
                        "bytes": flat.numel() * 4 * job["steps"],
                        "seconds": seconds,
                        "updates": job["steps"],
                    }
                )
                continue
            strategy = sparkdl.ParameterServer(max_staleness=None, layout=job["layout"])
            runtime = _ParameterServerRuntime(strategy, env, _gather, "127.0.0.1")
            try:
                model = runtime.prepare_model(model)
                user = (
                    torch.optim.Adam(model.parameters(), lr=1e-4)
                    if job["optimizer"] == "adam"
                    else torch.optim.SGD(model.parameters(), lr=1e-4)
                )
                optimizer = runtime.prepare_optimizer(user)
                for p, g in zip(model.parameters(), grads):
                    p.grad = g
                for _ in range(2):  # warm-up: allocate the buffers
                    optimizer.step()
                dist.barrier()
                shard = runtime.state.shard(0)
                updates_before, bytes_before = shard.updates, runtime.comm_bytes
                started = time.perf_counter()
                for _ in range(job["steps"]):
                    for p, g in zip(model.parameters(), grads):
                        p.grad = g  # the pull replaced nothing but values; keep the same gradient
                    optimizer.step()
                seconds = time.perf_counter() - started
                # The other rank may still be pushing: count what this rank's server applied in
                # this rank's window (both workers' pushes), as a rate.
                updates = shard.updates - updates_before
                sent = runtime.comm_bytes - bytes_before
                dist.barrier()
                runtime.final_module(model)
                out.put(
                    {
                        **job,
                        "rank": rank,
                        "steps_per_sec": job["steps"] / seconds,
                        "bytes": sent,
                        "seconds": seconds,
                        "updates": updates,
                    }
                )
            finally:
                runtime.close()
    finally:
        dist.destroy_process_group()
    exit_without_finalizing()  # the results are on the SimpleQueue already


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wire_part(repeats: int) -> None:
    jobs: List[Dict[str, Any]] = []
    for name, steps in (("1M", 200), ("10M", 30)):
        for optimizer in ("sgd", "adam"):
            jobs.append({"kind": "ps", "model": name, "optimizer": optimizer, "layout": "balanced", "steps": steps})
        jobs.append({"kind": "ps", "model": name, "optimizer": "sgd", "layout": "tensors", "steps": steps})
        jobs.append({"kind": "allreduce", "model": name, "optimizer": "-", "layout": "-", "steps": steps})
    ctx = multiprocessing.get_context("spawn")
    rows: Dict[Tuple, List[Dict[str, Any]]] = {}
    one_way: List[float] = []
    two_way: List[float] = []
    for _ in range(repeats):
        # Measured right before each repeat: the machine is shared, so its bandwidth drifts.
        one_way.append(loopback_bandwidth(both_ways=False))
        two_way.append(loopback_bandwidth(both_ways=True))
        queue = ctx.SimpleQueue()
        torch.multiprocessing.start_processes(
            _wire_worker, args=(_free_port(), jobs, queue), nprocs=2, join=True, start_method="spawn"
        )
        while not queue.empty():
            result = queue.get()
            result["loopback"] = two_way[-1]
            rows.setdefault((result["kind"], result["model"], result["optimizer"], result["layout"]), []).append(result)
    print(
        f"\nLoopback bandwidth, plain sendall loops between two processes on 127.0.0.1 (median of {repeats}, "
        f"measured before each repeat): one stream {statistics.median(one_way) / 1e9:.2f} GB/s "
        f"({', '.join(f'{b / 1e9:.2f}' for b in one_way)}); one stream each way at once "
        f"{statistics.median(two_way) / 1e9:.2f} GB/s in total ({', '.join(f'{b / 1e9:.2f}' for b in two_way)}).\n"
    )
    print(
        "| model | params | run | layout | worker steps/s (per rank) | model updates/s (servers) | wire MB/s (both ranks) | of two-way loopback |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for job in jobs:
        key = (job["kind"], job["model"], job["optimizer"], job["layout"])
        results = sorted(rows[key], key=lambda r: r["loopback"])
        params = sum(p.numel() for p in mlp(MODELS[job["model"]]).parameters())
        by_repeat: Dict[float, List[Dict[str, Any]]] = {}
        for r in results:
            by_repeat.setdefault(r["loopback"], []).append(r)
        pairs = list(by_repeat.values())
        steps = statistics.median(statistics.mean(r["steps_per_sec"] for r in pair) for pair in pairs)
        wire = statistics.median(sum(r["bytes"] / r["seconds"] for r in pair) for pair in pairs)
        ratio = statistics.median(sum(r["bytes"] / r["seconds"] for r in pair) / pair[0]["loopback"] for pair in pairs)
        if job["kind"] == "allreduce":
            label, updates = "gloo allreduce (reference)", steps
        else:
            label = f"PS, {job['optimizer']}"
            # Each shard applies every worker's push; averaging the two shards' rates gives the
            # model updates per second of the whole job.
            updates = statistics.median(sum(r["updates"] / r["seconds"] for r in pair) / 2 for pair in pairs)
        print(
            f"| {job['model']} | {params / 1e6:.2f}M | {label} | {job['layout']} | {steps:.1f} | {updates:.1f} | {wire / 1e6:.0f} | {ratio:.0%} |"
        )


# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------


def layout_models() -> Dict[str, torch.nn.Module]:
    return {
        "digits MLP (tests)": torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)),
        "MLP 1M": mlp(MODELS["1M"]),
        "MLP 10M": mlp(MODELS["10M"]),
        "small CNN": torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3),
            torch.nn.Conv2d(32, 64, 3),
            torch.nn.Conv2d(64, 128, 3),
            torch.nn.Flatten(),
            torch.nn.Linear(128 * 26 * 26, 10),
        ),
        "Transformer (4 layers, d=256)": torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(256, 4, 1024), 4, enable_nested_tensor=False
        ),
        "embedding 50k x 128 + head": torch.nn.Sequential(torch.nn.EmbeddingBag(50_000, 128), torch.nn.Linear(128, 2)),
    }


def busiest_server_ms(model: torch.nn.Module, ranks: int, layout: str, repeats: int) -> float:
    """Milliseconds the busiest of ``ranks`` servers needs to apply one Adam update to its shard
    (the real ``_Shard.push``, one thread, no network): the pace-setter of every step. Each
    shard's time is the minimum over ``repeats`` updates, which filters out other jobs' noise."""
    from sparkdl.strategies.parameter_server.layout import TableSpec as _TableSpec
    from sparkdl.strategies.parameter_server.layout import make_layout
    from sparkdl.strategies.parameter_server.shard import Shard as _Shard

    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    spec = _TableSpec(
        0,
        torch.float32,
        tuple(tuple(p.shape) for p in params),
        (0,) * len(params),
        1,
        make_layout(layout, sizes, ranks),
    )
    wire_order = torch.cat([params[i].detach().reshape(-1) for i in spec.layout.order])
    template = torch.optim.Adam(params, lr=1e-4)
    busiest = 0.0
    for rank in range(ranks):
        low, high = spec.shard_bounds(rank)
        if high == low:
            continue
        shard = _Shard(spec, rank, 1, None, 60.0, wire_order[low:high], template)
        grad = torch.randn(high - low) * 1e-3
        shard.push(0, 0, [math.nan], grad)  # allocates Adam's state
        best = math.inf
        for clock in range(1, repeats + 1):
            started = time.perf_counter()
            shard.push(0, clock, [math.nan], grad)
            best = min(best, time.perf_counter() - started)
        busiest = max(busiest, best)
    return busiest * 1000


def layout_part(repeats: int = 15) -> None:
    from sparkdl.strategies.parameter_server import balanced_layout, tensor_layout

    torch.set_num_threads(1)
    models = layout_models()
    print("\nLargest shard over the mean shard (1.00 = even; the slowest server sets the pace):\n")
    print("| model | params | tensors | 2 ranks: balanced / tensors | 4 ranks | 8 ranks |")
    print("|---|---|---|---|---|---|")
    for name, model in models.items():
        sizes = [p.numel() for p in model.parameters()]
        cells = []
        for ranks in (2, 4, 8):
            cells.append(
                f"{balanced_layout(sizes, ranks).imbalance():.2f} / {tensor_layout(sizes, ranks).imbalance():.2f}"
            )
        print(f"| {name} | {sum(sizes) / 1e6:.2f}M | {len(sizes)} | " + " | ".join(cells) + " |")
    print(f"\nThe busiest server's time for one Adam update of its shard, ms (min of {repeats}, one thread):\n")
    print("| model | 2 ranks: balanced / tensors | 4 ranks | 8 ranks |")
    print("|---|---|---|---|")
    for name in ("MLP 1M", "MLP 10M", "small CNN", "embedding 50k x 128 + head"):
        cells = [
            f"{busiest_server_ms(models[name], r, 'balanced', repeats):.1f} / {busiest_server_ms(models[name], r, 'tensors', repeats):.1f}"
            for r in (2, 4, 8)
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


# --------------------------------------------------------------------------------------------
# digits
# --------------------------------------------------------------------------------------------


def digits_mlp() -> torch.nn.Module:
    """The model of the test suite (tests/models.py); defined here so Spark ships it by value."""
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def split_digits():
    """The test suite's split: features scaled to [0, 1], a fixed 80/20 permutation."""
    from sklearn.datasets import load_digits

    features, labels = load_digits(return_X_y=True)
    features = (features / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(labels))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return (features[train], labels[train].astype(np.int64)), (features[test], labels[test].astype(np.int64))


def _digits_loop(epochs: int, lr: float, slow_step_s: float, test_x: np.ndarray, test_y: np.ndarray):
    def train(ctx: Any) -> Dict[str, Any]:
        import time as _time

        import torch as _torch
        import torch.distributed as _dist

        _torch.manual_seed(0)
        model = ctx.prepare_model(digits_mlp())
        optimizer = ctx.prepare_optimizer(_torch.optim.Adam(model.parameters(), lr=lr))
        tx, ty = _torch.from_numpy(test_x), _torch.from_numpy(test_y)
        curve = []
        staleness = []
        train_seconds = 0.0
        steps = 0
        for _ in range(epochs):
            started = _time.perf_counter()
            for features, labels in ctx.epoch_batches():
                optimizer.zero_grad()
                _torch.nn.functional.cross_entropy(model(features), labels).backward()
                optimizer.step()
                steps += 1
                if ctx.rank == 1 and slow_step_s:
                    _time.sleep(slow_step_s)
            train_seconds += _time.perf_counter() - started
            if hasattr(optimizer, "epoch_metrics"):
                staleness.append(optimizer.epoch_metrics()["staleness"])
            with _torch.no_grad():  # evaluation is not timed
                curve.append((train_seconds, float((model(tx).argmax(1) == ty).float().mean())))
        final = ctx.final_module(model)
        with _torch.no_grad():
            final_accuracy = float((final(tx).argmax(1) == ty).float().mean())
        facts = (steps / train_seconds, max(staleness) if staleness else None)
        gathered = [None] * ctx.world_size
        _dist.all_gather_object(gathered, facts)
        return {
            "curve": curve,
            "final_accuracy": final_accuracy,
            "steps_per_sec": [g[0] for g in gathered],
            "staleness": max((g[1] or 0) for g in gathered) if staleness else None,
        }

    return train


def digits_part(epochs: int, target: float, lr: float, slow_step_s: float, repeats: int) -> None:
    from _spark import local_cluster

    spark = local_cluster("sparkdl-benchmark-parameter-server")
    try:
        (train_x, train_y), (test_x, test_y) = split_digits()
        df = spark.createDataFrame(
            [(f.astype(float).tolist(), int(y)) for f, y in zip(train_x, train_y)], "features array<double>, label long"
        )

        def run(strategy: sparkdl.Strategy, slow: float) -> Dict[str, Any]:
            return sparkdl.run(
                _digits_loop(epochs, lr, slow, test_x, test_y),
                num_workers=2,
                strategy=strategy,
                data=df,
                feature_cols=["features"],
                label_col="label",
                batch_size=32,
                seed=0,
                progress=False,
            )

        run(sparkdl.AllReduce(), 0.0)  # untimed: materializes the DataFrame, starts the Python workers
        configs = [("AllReduce()", sparkdl.AllReduce())] + [
            (f"ParameterServer(max_staleness={s})", sparkdl.ParameterServer(max_staleness=s)) for s in (0, 2, 8, None)
        ]
        for slow in (0.0, slow_step_s):
            title = "equal workers" if not slow else f"rank 1 sleeps {slow * 1000:.0f} ms every step"
            print(
                f"\nDigits, 2 workers, batch 32 per worker, Adam lr={lr}, {epochs} epochs, {title}; "
                f"target test accuracy {target:.2f} (median of {repeats} run(s)):\n"
            )
            print(
                "| strategy | s to target (rank 0) | epochs to target | final acc (servers' model) | steps/s rank 0 / rank 1 | max staleness |"
            )
            print("|---|---|---|---|---|---|")
            for name, strategy in configs:
                results = [run(strategy, slow) for _ in range(repeats)]
                reached = [
                    next(((t, e + 1) for e, (t, a) in enumerate(r["curve"]) if a >= target), None) for r in results
                ]
                times = [x[0] for x in reached if x is not None]
                epochs_needed = [x[1] for x in reached if x is not None]
                to_target = (
                    f"{statistics.median(times):.2f}"
                    if len(times) == len(results)
                    else f"not reached in {len([x for x in reached if x is None])}/{len(results)}"
                )
                epochs_cell = f"{statistics.median(epochs_needed):g}" if len(epochs_needed) == len(results) else "-"
                accuracy = statistics.median(r["final_accuracy"] for r in results)
                rates = [statistics.median(r["steps_per_sec"][k] for r in results) for k in range(2)]
                stale = results[0]["staleness"]
                print(
                    f"| {name} | {to_target} | {epochs_cell} | {accuracy:.3f} | {rates[0]:.0f} / {rates[1]:.0f} | {'-' if stale is None else max(r['staleness'] for r in results)} |"
                )
    finally:
        spark.stop()


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["all", "wire", "layout", "digits"], default="all")
    parser.add_argument("--repeats", type=int, default=3, help="wire repeats (digits uses --digits-repeats)")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--slow-step-s", type=float, default=0.02)
    parser.add_argument("--digits-repeats", type=int, default=1)
    args = parser.parse_args(list(argv))
    print(
        f"# ParameterServer benchmark ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, torch {torch.__version__})"
    )
    if args.part in ("all", "layout"):
        layout_part()
    if args.part in ("all", "wire"):
        wire_part(args.repeats)
    if args.part in ("all", "digits"):
        digits_part(args.epochs, args.target, args.lr, args.slow_step_s, args.digits_repeats)


if __name__ == "__main__":
    main(sys.argv[1:])
