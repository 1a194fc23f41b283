"""What encrypting sparkdl's own traffic costs: the parameter server and the progress channel with
``encrypt=False`` (every frame integrity-protected, AES-GCM's GMAC; payloads in clear) and
``encrypt=True`` (every frame AES-256-GCM encrypted), side by side in one run::

    .venv/bin/python benchmarks/encryption_cost.py [--repeats 3] [--messages 20000]

Parts:

* **AES-GCM on one core** — sealing and opening one 8 MiB frame with :mod:`sparkdl._net.frames`,
  in place, as the parameter server does: the ceiling the wire figures are measured against.
* **parameter server** — the wire part of ``benchmarks/parameter_server.py``: two processes
  each running a real ParameterServer runtime (its server thread plus a worker) on a gloo
  process group, both pushing fixed random gradients as fast as they can (fully asynchronous,
  SGD, balanced layout) for MLPs of about 1M and 10M parameters; here once with
  ``DistEnv.encrypt=False`` and once with ``True`` per repeat (alternating which goes first, as
  the machine is shared). Reported: worker steps/s and the bytes/s both ranks put on the wire
  (pushes and replies, MB/s), the median over the repeats, and encrypted over integrity-only.
* **channel** — one task-side client streaming progress-sized JSON messages (about 100 bytes)
  and 4 KiB log lines to a driver-side server on loopback, as fast as it can; messages/s from
  the first send until the server has handed the last one to its callback.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import statistics
import sys
import threading
import time
from typing import Any, Dict, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

# The wire part's model sizes and helpers, so both benchmarks measure the same thing.
from parameter_server import MODELS, _free_port, _gather, loopback_bandwidth, mlp  # noqa: E402

import sparkdl  # noqa: E402
from sparkdl._net.channel import ChannelClient, ChannelServer, new_secret  # noqa: E402
from sparkdl._net.frames import FrameOpener, FrameSealer  # noqa: E402
from sparkdl.strategies.parameter_server.wire import byte_view  # noqa: E402

STEPS = {"1M": 200, "10M": 30}


# --------------------------------------------------------------------------------------------
# AES-GCM on one core
# --------------------------------------------------------------------------------------------


def crypto_part(repeats: int) -> None:
    payload = torch.randn(2 << 20)  # 8 MiB
    view = byte_view(payload)
    print("\n## AES-GCM on one core (sparkdl._net.frames, one 8 MiB frame, in place)\n")
    print("| mode | seal GB/s | open GB/s |")
    print("|---|---|---|")
    for encrypt in (False, True):
        sealer, opener = FrameSealer(b"k" * 32, encrypt), FrameOpener(b"k" * 32, encrypt)
        scratch = sealer.scratch()
        seal_rates, open_rates = [], []
        for _ in range(max(repeats, 3)):
            started = time.perf_counter()
            frame = sealer.begin(b"header")
            for start in range(0, len(view), len(scratch)):
                frame.update(view[start : start + len(scratch)], scratch)
            frame.finalize()
            seal_rates.append(len(view) / (time.perf_counter() - started))
            # Opening: the receive side's pass over a body already in its buffer (decrypted or
            # authenticated in place). Only the cost counts here, so no tag is checked.
            started = time.perf_counter()
            opening = opener.begin(b"header")
            opening.update_into(view)
            open_rates.append(len(view) / (time.perf_counter() - started))
        label = "encrypt (AES-256-GCM)" if encrypt else "integrity (GMAC)"
        print(f"| {label} | {statistics.median(seal_rates) / 1e9:.2f} | {statistics.median(open_rates) / 1e9:.2f} |")


# --------------------------------------------------------------------------------------------
# parameter server
# --------------------------------------------------------------------------------------------


def _ps_worker(rank: int, port: int, jobs: List[Dict[str, Any]], out: Any) -> None:
    """``benchmarks/parameter_server.py``'s ``_wire_worker`` for PS jobs, with ``encrypt``."""
    import torch.distributed as dist

    from sparkdl.strategies.base import DistEnv
    from sparkdl.strategies.parameter_server.runtime import ParameterServerRuntime
    from tests.gloo import exit_without_finalizing

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300)
    )
    try:
        for job in jobs:
            env = DistEnv(rank, 2, torch.device("cpu"), "gloo", "127.0.0.1", port, encrypt=job["encrypt"])
            torch.manual_seed(0)
            model = mlp(MODELS[job["model"]])
            grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]
            runtime = ParameterServerRuntime(
                sparkdl.ParameterServer(max_staleness=None, layout="balanced"), env, _gather, "127.0.0.1"
            )
            try:
                model = runtime.prepare_model(model)
                optimizer = runtime.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-4))
                for p, g in zip(model.parameters(), grads):
                    p.grad = g
                for _ in range(2):  # warm-up: allocate the buffers
                    optimizer.step()
                dist.barrier()
                bytes_before = runtime.comm_bytes
                started = time.perf_counter()
                for _ in range(job["steps"]):
                    for p, g in zip(model.parameters(), grads):
                        p.grad = g
                    optimizer.step()
                seconds = time.perf_counter() - started
                sent = runtime.comm_bytes - bytes_before
                dist.barrier()
                runtime.final_module(model)
                out.put(
                    {**job, "rank": rank, "steps_per_sec": job["steps"] / seconds, "bytes": sent, "seconds": seconds}
                )
            finally:
                runtime.close()
    finally:
        dist.destroy_process_group()
    exit_without_finalizing()  # the results are on the SimpleQueue already


def ps_part(repeats: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    # (model, encrypt, repeat) -> the two ranks' results
    runs: Dict[Tuple[str, bool, int], List[Dict[str, Any]]] = {}
    two_way: List[float] = []
    for repeat in range(repeats):
        two_way.append(loopback_bandwidth(both_ways=True, total_bytes=1 << 30))
        order = (False, True) if repeat % 2 == 0 else (True, False)
        jobs = [
            {"model": name, "encrypt": encrypt, "steps": STEPS[name], "repeat": repeat}
            for name in MODELS
            for encrypt in order
        ]
        queue = ctx.SimpleQueue()
        torch.multiprocessing.start_processes(
            _ps_worker, args=(_free_port(), jobs, queue), nprocs=2, join=True, start_method="spawn"
        )
        while not queue.empty():
            result = queue.get()
            runs.setdefault((result["model"], result["encrypt"], result["repeat"]), []).append(result)
    print(f"\n## Parameter server on loopback (2 ranks, SGD, balanced layout; median of {repeats} repeats)\n")
    print(
        f"Two-way loopback bandwidth (plain sendall loops, measured before each repeat): "
        f"{statistics.median(two_way) / 1e9:.2f} GB/s ({', '.join(f'{b / 1e9:.2f}' for b in two_way)}).\n"
    )
    print(
        "| model | params | integrity only: steps/s | MB/s | encrypted: steps/s | MB/s | encrypted / integrity (MB/s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in MODELS:
        params = sum(p.numel() for p in mlp(MODELS[name]).parameters())
        cells = {}
        for encrypt in (False, True):
            pairs = [runs[(name, encrypt, r)] for r in range(repeats)]
            steps = statistics.median(statistics.mean(x["steps_per_sec"] for x in pair) for pair in pairs)
            rate = statistics.median(sum(x["bytes"] / x["seconds"] for x in pair) for pair in pairs)
            cells[encrypt] = (steps, rate)
        # The ratio per repeat (both modes ran back to back), then its median.
        ratios = [
            sum(x["bytes"] / x["seconds"] for x in runs[(name, True, r)])
            / sum(x["bytes"] / x["seconds"] for x in runs[(name, False, r)])
            for r in range(repeats)
        ]
        (s0, r0), (s1, r1) = cells[False], cells[True]
        print(
            f"| {name} | {params / 1e6:.2f}M | {s0:.1f} | {r0 / 1e6:.0f} | {s1:.1f} | {r1 / 1e6:.0f} | {statistics.median(ratios):.2f} |"
        )


# --------------------------------------------------------------------------------------------
# channel
# --------------------------------------------------------------------------------------------


def _channel_rate(encrypt: bool, message: Dict[str, Any], count: int) -> float:
    done = threading.Event()
    received = [0]

    def on_message(rank: int, msg: Dict[str, Any]) -> None:
        received[0] += 1
        if received[0] == count:
            done.set()

    secret = new_secret()
    with ChannelServer("127.0.0.1", secret, on_message, encrypt=encrypt) as server:
        with ChannelClient(server.address, secret, rank=0, encrypt=encrypt) as client:
            for _ in range(100):  # warm-up
                client.send(message)
            while received[0] < 100:
                time.sleep(0.001)
            received[0] = 0
            started = time.perf_counter()
            for _ in range(count):
                client.send(message)
            if not done.wait(120):
                raise RuntimeError(f"only {received[0]} of {count} messages arrived")
            return count / (time.perf_counter() - started)


def channel_part(repeats: int, messages: int) -> None:
    shapes = {
        "progress (~100 B)": {
            "kind": "progress",
            "epoch": 3,
            "step": 1234,
            "loss": 0.123456789,
            "samples_per_sec": 4567.8,
        },
        "log line (4 KiB)": {"kind": "log", "line": "x" * 4096},
    }
    print(f"\n## Progress channel on loopback (one client, {messages} messages; median of {repeats})\n")
    print("| message | integrity only: msgs/s | encrypted: msgs/s | encrypted / integrity |")
    print("|---|---|---|---|")
    for label, message in shapes.items():
        rates: Dict[bool, List[float]] = {False: [], True: []}
        for repeat in range(repeats):
            for encrypt in (False, True) if repeat % 2 == 0 else (True, False):
                rates[encrypt].append(_channel_rate(encrypt, message, messages))
        plain, enc = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"| {label} | {plain:,.0f} | {enc:,.0f} | {enc / plain:.2f} |")


def main(argv: Sequence[str] = ()) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--part", choices=["all", "crypto", "ps", "channel"], default="all")
    args = parser.parse_args(list(argv))
    import cryptography

    print(
        f"# Encryption cost ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"cryptography {cryptography.__version__})"
    )
    if args.part in ("all", "crypto"):
        crypto_part(args.repeats)
    if args.part in ("all", "ps"):
        ps_part(args.repeats)
    if args.part in ("all", "channel"):
        channel_part(args.repeats, args.messages)


if __name__ == "__main__":
    main(sys.argv[1:])
