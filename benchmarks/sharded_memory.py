"""Peak memory per rank and samples/s: ShardedDataParallel (FSDP2) against AllReduce (DDP), in
one run, side by side.

    .venv/bin/python benchmarks/sharded_memory.py [--steps 8] [--batch-size 32] [--width 4096]

What is measured: sparkdl's strategy runtimes (the same ``prepare_model`` /
``prepare_optimizer`` / ``final_module`` calls the training loop makes) in 2 real gloo processes
on this machine, one thread each, without Spark: the trainer's memory, not Spark's. Each side
runs in a fresh pair of processes, so each process's RSS high-water mark (``VmHWM`` in
``/proc/self/status``) belongs to that side alone. The model is an MLP of ~50M float32 parameters
(``--width 4096``: 2048→4096→4096→4096→2048, 50.3M), trained with Adam (two moments per
parameter) on random batches.

Columns, per rank (the larger of the two ranks):

* ``baseline``: RSS after ``import torch`` and joining the process group (the interpreter and
  torch's libraries), before any model exists.
* ``train peak``: VmHWM after the warm-up and timed steps, before the result is gathered; and
  ``above baseline``, the part the model, its gradients, the optimizer state and the
  collectives' buffers account for.
* ``with result``: VmHWM after ``final_module`` (for the sharded run, the full module gathered
  on every rank).
* ``samples/s``: both ranks' samples over the timed steps (after ``--warmup`` steps).

A script that prints figures, not a test; the machine may be shared, so read the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import tempfile
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

WORLD = 2


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"{field} not in /proc/self/status")


def _mlp(width: int):
    import torch

    half = width // 2
    return torch.nn.Sequential(
        torch.nn.Linear(half, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, half),
    )


def _rank(rank: int, port: int, out_dir: str, side: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import sparkdl
    from sparkdl.strategies.base import DistEnv

    torch.set_num_threads(1)
    if "lo" in {name for _, name in socket.if_nameindex()}:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    timeout = datetime.timedelta(seconds=600)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timeout)
    baseline = _status_mib("VmRSS")
    strategy = (
        sparkdl.AllReduce()
        if side == "allreduce"
        else sparkdl.ShardedDataParallel(reshard_after_forward=side == "sharded")
    )
    env = DistEnv(
        rank=rank,
        world_size=WORLD,
        device=torch.device("cpu"),
        backend="gloo",
        master_addr="127.0.0.1",
        master_port=port,
    )
    runtime = strategy.create_runtime(env)
    torch.manual_seed(0)
    model = runtime.prepare_model(_mlp(args.width))
    optimizer = runtime.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(rank)
    half = args.width // 2
    x = torch.randn(args.batch_size, half, generator=gen)
    y = torch.randn(args.batch_size, half, generator=gen)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    dist.barrier()
    seconds = time.perf_counter() - started
    train_peak = _status_mib("VmHWM")
    final = runtime.final_module(model)
    params = sum(p.numel() for p in final.parameters())
    result = {
        "baseline": baseline,
        "train_peak": train_peak,
        "with_result": _status_mib("VmHWM"),
        "seconds": seconds,
        "samples": WORLD * args.batch_size * args.steps,
        "params": params,
        "comm_bytes_per_step": runtime.comm_bytes / (args.warmup + args.steps),
    }
    torch.save(result, os.path.join(out_dir, f"{side}-{rank}.pt"))
    dist.destroy_process_group()


def _worker(rank: int, port: int, out_dir: str, side: str, args: argparse.Namespace) -> None:
    from tests.gloo import exit_without_finalizing

    _rank(rank, port, out_dir, side, args)
    exit_without_finalizing()  # its figures are saved and its group destroyed


def _run_side(side: str, args: argparse.Namespace) -> List[Dict[str, Any]]:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    out_dir = tempfile.mkdtemp(prefix=f"sharded-bench-{side}-")
    store = dist.TCPStore(
        "127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=600)
    )
    mp.spawn(_worker, args=(store.port, out_dir, side, args), nprocs=WORLD, join=True)
    del store
    return [torch.load(os.path.join(out_dir, f"{side}-{r}.pt")) for r in range(WORLD)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    sides = {
        "allreduce": "AllReduce() (DDP)",
        "sharded": "ShardedDataParallel()",
        "sharded-keep": "ShardedDataParallel(reshard_after_forward=False)",
    }
    results = {side: _run_side(side, args) for side in sides}
    params = results["allreduce"][0]["params"]
    print(
        f"# {datetime.date.today()} — MLP of {params / 1e6:.1f}M float32 parameters, Adam, 2 gloo ranks x 1 thread, "
        f"batch {args.batch_size}/rank, {args.warmup} warm-up + {args.steps} timed steps"
    )
    print(
        f"# model {params * 4 / 2**20:.0f} MiB; + grads + Adam's 2 moments = {params * 16 / 2**20:.0f} MiB unsharded\n"
    )
    print(
        "| strategy | baseline MiB | train peak MiB | above baseline | ratio to DDP | with result MiB | samples/s | ratio | comm MB/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    ddp = results["allreduce"]
    ddp_above = max(r["train_peak"] - r["baseline"] for r in ddp)
    ddp_rate = ddp[0]["samples"] / max(r["seconds"] for r in ddp)
    for side, label in sides.items():
        ranks = results[side]
        above = max(r["train_peak"] - r["baseline"] for r in ranks)
        rate = ranks[0]["samples"] / max(r["seconds"] for r in ranks)
        print(
            f"| `{label}` | {max(r['baseline'] for r in ranks):.0f} | {max(r['train_peak'] for r in ranks):.0f} | {above:.0f} "
            f"| {above / ddp_above:.2f} | {max(r['with_result'] for r in ranks):.0f} | {rate:.1f} | {rate / ddp_rate:.2f} "
            f"| {ranks[0]['comm_bytes_per_step'] / 1e6:.0f} |"
        )


if __name__ == "__main__":
    main()
