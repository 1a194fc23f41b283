"""The launch's child side without Spark: two real child processes rendezvous through env:// into
sparkdl's authenticated store (sparkdl._task.script.run_child + runner), and the torchrun
environment is set and restored."""

from __future__ import annotations

import os
import socket
import threading

from sparkdl._net.channel import new_secret
from sparkdl._net.rendezvous_store import StoreServer
from sparkdl._task.environment import environment, torchrun_environment
from sparkdl._task.script import ChildFailure, LaunchTarget, run_child

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import datetime, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
try:  # torch's own TCPStore client pointed at sparkdl's store: refused at the handshake
    dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=3))
    tcpstore = "connected"
except Exception as exc:
    tcpstore = type(exc).__name__
print("sum", value.item(), "tcpstore", tcpstore, "argv", sys.argv[1:])
dist.destroy_process_group()
sys.exit(int(sys.argv[1]) if os.environ["RANK"] == "1" else 0)
"""


def _launch_two(tmp_path, exit_code_of_rank1: int):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    secret = new_secret()
    server = StoreServer("127.0.0.1", secret, 30.0)
    target = LaunchTarget("script", str(script), "sparkdl-test", script=str(script), args=(str(exit_code_of_rank1),))
    messages, outcomes = {0: [], 1: []}, {}

    def rank_main(rank: int) -> None:
        # TORCH_CPP_LOG_LEVEL: the refused TCPStore probe's retry and timeout logs (C++ stack traces on
        # stderr, a separate pipe read by its own thread) would otherwise crowd out the stdout line
        env = dict(
            os.environ,
            PYTHONPATH=REPO_ROOT,
            SPARKDL_LAUNCHED="1",
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            TORCH_CPP_LOG_LEVEL="FATAL",
        )
        env.update(torchrun_environment(rank, 2, server.address, "sparkdl-test"))
        if "lo" in {name for _, name in socket.if_nameindex()}:
            env["GLOO_SOCKET_IFNAME"] = "lo"
        try:
            outcomes[rank] = run_child(
                target,
                rank=rank,
                host="127.0.0.1",
                script_path=str(script),
                env=env,
                secret=secret,
                spec={"store": list(server.address), "encrypt": False, "rank": rank, "world_size": 2},
                data=None,
                send=messages[rank].append,
                advance=lambda phase: None,
            )
        except ChildFailure as exc:
            outcomes[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        server.close()
    return outcomes, messages


def test_env_rendezvous_reaches_the_authenticated_store_and_output_is_forwarded(tmp_path):
    outcomes, messages = _launch_two(tmp_path, 0)
    assert outcomes[0].exit_code == 0, outcomes
    results = [line for line in outcomes[0].last_lines if line.startswith("sum 3.0 tcpstore ")]
    assert len(results) == 1 and "connected" not in results[0], outcomes[0].last_lines
    forwarded = [text for message in messages[1] if message["kind"] == "output" for stream, text in message["lines"]]
    assert any(text.startswith("sum 3.0") for text in forwarded)


def test_a_rank_whose_child_exits_non_zero_fails_with_its_status_and_last_line(tmp_path):
    outcomes, _ = _launch_two(tmp_path, 7)
    assert outcomes[0].exit_code == 0
    failure = outcomes[1]
    assert isinstance(failure, ChildFailure) and failure.exc_type == "ScriptExitError"
    assert "exited with status 7 on rank 1" in str(failure) and "sum 3.0" in str(failure)


def test_the_environment_is_restored(monkeypatch):
    monkeypatch.setenv("RANK", "before")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    values = torchrun_environment(1, 2, ("10.0.0.1", 1234), "run")
    with environment(values):
        assert os.environ["RANK"] == "1" and os.environ["WORLD_SIZE"] == "2" and os.environ["MASTER_PORT"] == "1234"
        assert (
            os.environ["LOCAL_RANK"] == "0"
            and os.environ["GROUP_RANK"] == "1"
            and os.environ["TORCHELASTIC_RUN_ID"] == "run"
        )
    assert os.environ["RANK"] == "before" and "WORLD_SIZE" not in os.environ
