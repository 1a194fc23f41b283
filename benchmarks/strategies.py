"""Compares sparkdl's strategies on digits: throughput, model-sync traffic, accuracy.

Starts its own ``local-cluster[2,1,1024]`` Spark application (two executors, one core each),
trains the same MLP with every strategy (same epochs, batch size, seeds and optimizer) and prints
a markdown table. Run from the repository root::

    .venv/bin/python benchmarks/strategies.py            # defaults: --epochs 10 --repeats 3

``--part diloco`` compares DiLoCo (``ModelAveraging(outer_optimizer=OuterSGD(lr=0.7, momentum=0.9,
nesterov=True))``) with plain ``ModelAveraging`` at the same τ ∈ {16, 64} and with AllReduce, on
equal samples (``--diloco-epochs``, default 30: 660 steps per rank, so τ = 64 gets 10 syncs and
the final one); ``--part all`` runs both tables.

Columns: samples/s is the steady state (the mean of the per-epoch throughput over epochs 2..N,
averaged over repeats); comm bytes/epoch is what one rank put into model-sync collectives per
epoch (the history's ``comm_bytes``, mean over epochs); test accuracy is after the fixed number
of epochs on a held-out 20% of digits. Timing is wall clock on whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from typing import List, Sequence, Tuple

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
# Executors must run this interpreter and everything stays on loopback; set before the JVM starts.
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"

import torch  # noqa: E402

import sparkdl  # noqa: E402


def digits_mlp() -> torch.nn.Module:
    """The model of the test suite (tests/models.py); defined here so Spark ships it by value."""
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def strategies() -> List[Tuple[str, sparkdl.Strategy]]:
    """(label, strategy) in table order; AllReduce first, as the baseline of the ratio column."""
    return [
        ("AllReduce()", sparkdl.AllReduce()),
        ("ModelAveraging(sync_every=1)", sparkdl.ModelAveraging(sync_every=1)),
        ("ModelAveraging(sync_every=4)", sparkdl.ModelAveraging(sync_every=4)),
        ("ModelAveraging(sync_every=8)", sparkdl.ModelAveraging(sync_every=8)),
        ("ModelAveraging(sync_every=16)", sparkdl.ModelAveraging(sync_every=16)),
        ("ElasticAveraging(sync_every=4)", sparkdl.ElasticAveraging(sync_every=4)),
    ]


def split_digits():
    """The test suite's split: features scaled to [0, 1], a fixed 80/20 permutation."""
    from sklearn.datasets import load_digits

    features, labels = load_digits(return_X_y=True)
    features = (features / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(labels))
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return (features[train], labels[train].astype(np.int64)), (features[test], labels[test].astype(np.int64))


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="fits per strategy, seeds seed..seed+repeats-1; throughput and accuracy are averaged",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--part", choices=("strategies", "diloco", "all"), default="strategies", help="which table(s) to measure"
    )
    parser.add_argument("--diloco-epochs", type=int, default=30, help="epochs of every fit of the DiLoCo table")
    args = parser.parse_args(list(argv))

    from _spark import local_cluster

    spark = local_cluster("sparkdl-benchmark-strategies")
    try:
        (train_x, train_y), (test_x, test_y) = split_digits()
        df = spark.createDataFrame(
            [(f.astype(float).tolist(), int(y)) for f, y in zip(train_x, train_y)], "features array<double>, label long"
        )

        def fit(strategy: sparkdl.Strategy, epochs: int, seed: int = args.seed) -> sparkdl.TorchModel:
            return sparkdl.TorchEstimator(
                model=digits_mlp,
                optimizer=functools.partial(torch.optim.Adam, lr=args.lr),
                strategy=strategy,
                num_workers=2,
                batch_size=args.batch_size,
                epochs=epochs,
                seed=seed,
                progress=False,
            ).fit(df)

        # Untimed: materializes the DataFrame and starts the executors' Python workers, so the
        # first strategy measured does not pay for them.
        fit(sparkdl.AllReduce(), 1)

        if args.part in ("strategies", "all"):
            print(strategy_table(fit, args, test_x, test_y))
        if args.part in ("diloco", "all"):
            print(diloco_table(fit, args, test_x, test_y))
    finally:
        spark.stop()


def strategy_table(fit, args: argparse.Namespace, test_x: np.ndarray, test_y: np.ndarray) -> str:
    """The original table: every strategy of strategies(), --epochs each."""
    rows = []
    for name, strategy in strategies():
        throughput: List[float] = []
        scores: List[float] = []
        comm: List[float] = []
        for repeat in range(args.repeats):
            started = time.time()
            # A different seed per repeat: accuracy differences of a point are within the
            # spread between seeds on a 360-row test set, so compare means.
            model = fit(strategy, args.epochs, seed=args.seed + repeat)
            steady = [h["samples_per_sec"] for h in model.history[1:]] or [model.history[0]["samples_per_sec"]]
            throughput.append(statistics.mean(steady))
            comm.append(statistics.mean(h["comm_bytes"] for h in model.history))
            with torch.no_grad():
                predicted = model.module(torch.from_numpy(test_x)).argmax(1).numpy()
            scores.append(float((predicted == test_y).mean()))
            print(f"  {name}: {time.time() - started:.1f}s, accuracy {scores[-1]:.4f}", file=sys.stderr)
        rows.append(
            (
                name,
                statistics.mean(throughput),
                statistics.mean(comm),
                statistics.mean(scores),
                min(scores),
                max(scores),
            )
        )
    return table(rows, args)


def table(rows: Sequence[tuple], args: argparse.Namespace) -> str:
    baseline = rows[0][2]
    lines = [
        f"digits, 2 workers (local-cluster[2,1,1024]), batch {args.batch_size}/worker, {args.epochs} epochs, "
        f"Adam lr={args.lr}, seeds {args.seed}..{args.seed + args.repeats - 1} (one fit each), torch {torch.__version__}",
        "",
        "| strategy | samples/s (steady) | comm bytes/epoch/rank | AllReduce bytes / these | test accuracy, mean (min–max) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, speed, comm, score, low, high in rows:
        ratio = f"{baseline / comm:.1f}" if comm else "n/a"
        lines.append(f"| {name} | {speed:,.0f} | {comm:,.0f} | {ratio} | {score:.4f} ({low:.3f}–{high:.3f}) |")
    return "\n".join(lines)


#: DiLoCo's outer optimizer (Douillard et al., 2023): Nesterov momentum 0.9, outer lr 0.7.
DILOCO_OUTER = sparkdl.OuterSGD(lr=0.7, momentum=0.9, nesterov=True)
DILOCO_TAUS = (16, 64)


def diloco_strategies() -> List[Tuple[str, sparkdl.Strategy]]:
    """(label, strategy) of the DiLoCo table; AllReduce first, as the baseline."""
    rows: List[Tuple[str, sparkdl.Strategy]] = [("AllReduce()", sparkdl.AllReduce())]
    for tau in DILOCO_TAUS:
        rows.append((f"ModelAveraging(sync_every={tau})", sparkdl.ModelAveraging(sync_every=tau)))
        rows.append(
            (
                f"DiLoCo: ModelAveraging(sync_every={tau}, outer_optimizer=OuterSGD(0.7, 0.9, nesterov))",
                sparkdl.ModelAveraging(sync_every=tau, outer_optimizer=DILOCO_OUTER),
            )
        )
    return rows


def diloco_table(fit, args: argparse.Namespace, test_x: np.ndarray, test_y: np.ndarray) -> str:
    """DiLoCo against plain averaging at the same τ and AllReduce, all on --diloco-epochs epochs."""
    epochs = args.diloco_epochs
    # Bytes one average (or one AllReduce step) sends: the MLP's float32 parameters.
    sync_bytes = sum(p.numel() * p.element_size() for p in digits_mlp().parameters())
    features, labels = torch.from_numpy(test_x), torch.from_numpy(test_y)
    rows = []
    for name, strategy in diloco_strategies():
        scores: List[float] = []
        test_losses: List[float] = []
        train_losses: List[float] = []
        comm: List[float] = []
        syncs: List[float] = []
        for repeat in range(args.repeats):
            started = time.time()
            model = fit(strategy, epochs, seed=args.seed + repeat)
            with torch.no_grad():
                output = model.module(features)
            scores.append(float((output.argmax(1) == labels).double().mean()))
            test_losses.append(float(torch.nn.functional.cross_entropy(output, labels)))
            train_losses.append(model.history[-1]["loss"])
            comm.append(statistics.mean(h["comm_bytes"] for h in model.history))
            # Measured, not assumed: the epochs' sync bytes over the bytes of one sync; the
            # final average in final_module comes after the last epoch's record (+1 when the
            # last step was not a sync step).
            syncs.append(sum(h["comm_bytes"] for h in model.history) / sync_bytes)
            print(
                f"  {name}: {time.time() - started:.1f}s, accuracy {scores[-1]:.4f}, test loss {test_losses[-1]:.4f}",
                file=sys.stderr,
            )
        rows.append(
            (
                name,
                statistics.mean(syncs),
                statistics.mean(comm),
                statistics.mean(train_losses),
                statistics.mean(test_losses),
                statistics.mean(scores),
                min(scores),
                max(scores),
            )
        )
    baseline = rows[0][2]
    lines = [
        f"digits, 2 workers (local-cluster[2,1,1024]), batch {args.batch_size}/worker, {epochs} epochs "
        f"(equal samples for every row), inner Adam lr={args.lr}, DiLoCo outer SGD lr={DILOCO_OUTER.lr} "
        f"momentum={DILOCO_OUTER.momentum} nesterov, seeds {args.seed}..{args.seed + args.repeats - 1}, torch {torch.__version__}",
        "",
        "| strategy | syncs in the epochs (steps for AllReduce) | comm bytes/epoch/rank | AllReduce bytes / these | last-epoch train loss | test loss | test accuracy, mean (min–max) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, count, per_epoch, train_loss, test_loss, score, low, high in rows:
        lines.append(
            f"| {name} | {count:,.0f} | {per_epoch:,.0f} | {baseline / per_epoch:.1f} | {train_loss:.4f} | {test_loss:.4f} | {score:.4f} ({low:.3f}–{high:.3f}) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
