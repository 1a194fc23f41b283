"""ParameterServer without Spark: settings, server optimizers, shards, and the runtime on gloo.

Rebuilding the user's optimizer over a shard and the shard's SSP waits are tested directly (the
pure SSP clock rule and the layouts have their own files, ``test_ps_clock.py`` and
``test_ps_layout.py``). The runtime is tested on a real two-rank gloo process group started once
per module with ``torch.multiprocessing.spawn`` (its servers, clients, staleness waits and
collectives are all real); the ranks save what they saw and the tests compare it with exact
references — e.g. with plain SGD the servers' final parameters must equal the initial ones minus
every gradient either rank pushed times the learning rate in force for its group at that push.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import threading
import traceback
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparkdl
from sparkdl.errors import ConfigError
from sparkdl.strategies.base import DistEnv, strategy_from_name
from sparkdl.strategies.parameter_server import ParameterServer, ParameterServerError, balanced_layout
from sparkdl.strategies.parameter_server.layout import TableSpec
from sparkdl.strategies.parameter_server.runtime import ParameterServerRuntime
from sparkdl.strategies.parameter_server.shard import Shard, build_server_optimizer
from tests.gloo import exit_without_finalizing

# ---- the strategy's settings ---------------------------------------------------------------


def test_defaults_registration_and_description():
    strategy = sparkdl.ParameterServer()
    assert (strategy.max_staleness, strategy.timeout_s, strategy.layout) == (None, 300.0, "balanced")
    assert strategy_from_name("parameter_server", max_staleness=2) == ParameterServer(max_staleness=2)
    assert strategy.describe() == {
        "name": "parameter_server",
        "max_staleness": None,
        "timeout_s": 300.0,
        "layout": "balanced",
        "tables_dir": None,
    }
    assert ParameterServer.identical_final_weights


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_staleness": -1}, "max_staleness=-1 must be None"),
        ({"max_staleness": 1.5}, "max_staleness=1.5 must be None"),
        ({"max_staleness": True}, "max_staleness=True must be None"),
        ({"timeout_s": 0}, "timeout_s=0 must be a number of seconds > 0"),
        ({"timeout_s": math.inf}, "timeout_s=inf"),
        ({"layout": "random"}, "layout='random' must be one of 'balanced', 'tensors'"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParameterServer(**kwargs)


# ---- the server's copy of the user's optimizer -------------------------------------------------


def test_server_optimizer_keeps_type_and_per_group_hyperparameters():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    user = torch.optim.AdamW(
        [{"params": [a], "lr": 0.1, "weight_decay": 0.5}, {"params": [b]}], lr=0.01, betas=(0.8, 0.9), foreach=True
    )
    x, y = torch.zeros(3), torch.zeros(2)
    server = build_server_optimizer(user, [(0, [x]), (1, [y])])
    assert type(server) is torch.optim.AdamW
    assert [g["lr"] for g in server.param_groups] == [0.1, 0.01]
    assert [g["weight_decay"] for g in server.param_groups] == [0.5, 0.01]
    assert server.param_groups[1]["betas"] == (0.8, 0.9)
    assert server.defaults["foreach"] is None  # device flags are left to torch's CPU defaults


def test_server_optimizer_rejects_lbfgs():
    user = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ConfigError, match="cannot run LBFGS on the servers"):
        build_server_optimizer(user, [(0, [torch.zeros(2)])])


def test_a_split_shard_steps_exactly_like_the_whole_model_for_elementwise_optimizers():
    torch.manual_seed(0)
    weight, bias = torch.randn(5, 4), torch.randn(5)
    grads = [(torch.randn(5, 4), torch.randn(5)) for _ in range(4)]
    whole = [torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())]
    reference = torch.optim.Adam(whole, lr=0.01)
    for gw, gb in grads:
        whole[0].grad, whole[1].grad = gw, gb
        reference.step()
    sizes = [20, 5]
    layout = balanced_layout(sizes, 3)  # cuts the weight matrix across shards
    flat = torch.cat([weight.reshape(-1), bias])
    spec = TableSpec(0, torch.float32, ((5, 4), (5,)), (0, 0), 1, layout)
    shards = [Shard(spec, k, 3, None, 5.0, flat[layout.bounds[k] : layout.bounds[k + 1]], reference) for k in range(3)]
    for step, (gw, gb) in enumerate(grads):
        g = torch.cat([gw.reshape(-1), gb])
        for k, shard in enumerate(shards):
            shard.push(0, step, [math.nan], g[layout.bounds[k] : layout.bounds[k + 1]].clone())
    result = torch.cat([s.values for s in shards])
    expected = torch.cat([whole[0].detach().reshape(-1), whole[1].detach()])
    assert torch.allclose(result, expected, atol=1e-7)


def test_a_read_waits_for_the_slowest_worker_and_wakes_on_its_push():
    spec = TableSpec(0, torch.float32, ((4,),), (0,), 1, balanced_layout([4], 1))
    shard = Shard(spec, 0, 2, 0, 30.0, torch.zeros(4), torch.optim.SGD([torch.zeros(1)], lr=1.0))
    shard.push(0, 0, [math.nan], torch.ones(4))
    out = torch.empty(4)
    result: Dict[str, Any] = {}

    def read() -> None:
        result["staleness"] = shard.read_into(out, 0, 1)

    reader = threading.Thread(target=read)
    reader.start()
    shard.push(1, 0, [math.nan], torch.full((4,), 2.0))
    reader.join(30)
    assert not reader.is_alive()
    # Bulk-synchronous: the read at clock 1 includes both workers' first pushes.
    assert result["staleness"] == (0, 1)
    assert torch.equal(out, torch.full((4,), -3.0))


def test_a_read_blocked_by_a_lost_worker_fails_naming_it():
    spec = TableSpec(0, torch.float32, ((4,),), (0,), 1, balanced_layout([4], 1))
    shard = Shard(spec, 0, 3, 1, 30.0, torch.zeros(4), torch.optim.SGD([torch.zeros(1)], lr=1.0))
    for c in range(2):
        shard.push(0, c, [math.nan], torch.ones(4))
    shard.push(1, 0, [math.nan], torch.ones(4))
    shard.depart(2, clean=False, reason="disconnected without saying bye")
    with pytest.raises(ParameterServerError) as info:
        shard.read_into(torch.empty(4), 0, 2)
    assert info.value.peer_rank == 2
    assert "rank 2's worker left the parameter server on rank 0 (disconnected without saying bye) at clock 0" in str(
        info.value
    )


# ---- the runtime on a real two-rank process group ---------------------------------------------

WORLD = 2
STEPS = 9


class _Net(torch.nn.Module):
    """Float32 parameters in two optimizer groups, one float64 parameter (a second table), and
    BatchNorm buffers (not on the servers: averaged by final_module)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.head = torch.nn.Linear(3, 2)
        self.scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.linear(x))) * self.scale.float()


def _gather(message: str) -> List[str]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, message)
    return out


def _runtime(rank: int, port: int, **kwargs: Any) -> ParameterServerRuntime:
    env = DistEnv(rank, WORLD, torch.device("cpu"), "gloo", "127.0.0.1", port)
    return ParameterServerRuntime(ParameterServer(**kwargs), env, _gather, "127.0.0.1")


def _batch(rank: int, step: int):
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)


#: The bound the runtime scenarios run under.
BOUND = 2


def _let_rank0_run_ahead(runtime: ParameterServerRuntime, own_clock: int) -> None:
    """Rank 1, before each step: waits until rank 0 has pushed as far ahead of it as the bound
    lets it (``own_clock + BOUND + 1`` pushes to this rank's shard of table 0). An event (the
    shard's condition variable), not a sleep: rank 0 is always ahead by the most the bound allows,
    and without the bound its reads would be more than ``BOUND`` clocks stale.

    Table 0 reaching ``c`` means rank 0 finished step ``c - 1`` on every table, so the other
    tables are at ``c - 1`` or more: enough for rank 1's read at ``own_clock + 1`` to be fresh
    everywhere until the cap at ``STEPS``. Before rank 1's last step that is not enough (rank 0's
    last push to table 1 may still be on its way: a read of staleness 1), and waiting on table
    1's clock instead can deadlock (rank 0 may be held in table 0's read), so the last step waits
    for rank 0 to have finished all of its steps (``_rank0_finished``)."""
    if own_clock == STEPS - 1:
        dist.barrier()  # matched by rank 0's _rank0_finished
        return
    shard = runtime.state.shard(0)
    target = min(own_clock + BOUND + 1, STEPS)
    with shard.cond:
        reached = shard.cond.wait_for(lambda: shard.clock.clocks[0] >= target, timeout=60)
    assert reached, f"rank 0 stopped at clock {shard.clock.clocks[0]} on rank 1's shard, expected {target}"


def _rank0_finished() -> None:
    """Rank 0, after its last step: tells rank 1 (waiting before its last step) that every push
    of rank 0's is in. Rank 0 is never held back then: rank 1 is only one clock behind."""
    dist.barrier()


def _sgd_scenario(rank: int, port: int, layout: str, slow_rank1: bool = False) -> Dict[str, Any]:
    runtime = _runtime(rank, port, max_staleness=BOUND, timeout_s=60, layout=layout)
    try:
        torch.manual_seed(100 + rank)  # different initial weights: prepare_model must fix that
        net = runtime.prepare_model(_Net())
        initial = {k: v.detach().clone() for k, v in net.named_parameters()}
        groups = [
            {"params": [net.linear.weight, net.linear.bias, net.scale], "lr": 0.1},
            {"params": [*net.norm.parameters(), *net.head.parameters()], "lr": 0.05},
        ]
        optimizer = runtime.prepare_optimizer(torch.optim.SGD(groups))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        pushes = []
        for step in range(STEPS):
            if slow_rank1 and rank == 1:
                _let_rank0_run_ahead(runtime, step)
            x, y = _batch(rank, step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            pushes.append(
                {
                    name: (p.grad.detach().clone(), optimizer.param_groups[group_of[id(p)]]["lr"])
                    for name, p in net.named_parameters()
                }
            )
            optimizer.step()
            scheduler.step()
        if slow_rank1 and rank == 0:
            _rank0_finished()
        metrics = optimizer.epoch_metrics()
        buffers_before = {k: v.detach().clone() for k, v in net.named_buffers()}
        final = runtime.final_module(net)
        return {
            "initial": initial,
            "pushes": pushes,
            "final": {k: v.detach().clone() for k, v in final.state_dict().items()},
            "buffers_before": buffers_before,
            "metrics": metrics,
            "local_optimizer_state": len(optimizer.state),
            "tables": len(runtime.tables),
            "comm_bytes": runtime.comm_bytes,
        }
    finally:
        runtime.close()


def _checkpoint_scenario(rank: int, port: int) -> Dict[str, Any]:
    runtime = _runtime(rank, port, max_staleness=0, timeout_s=60)
    try:
        torch.manual_seed(7)
        net = runtime.prepare_model(torch.nn.Linear(6, 3))
        optimizer = runtime.prepare_optimizer(torch.optim.Adam(net.parameters(), lr=0.01))

        def train(steps: int, offset: int) -> None:
            for step in range(steps):
                x, _ = _batch(rank, offset + step)
                optimizer.zero_grad()
                net(torch.cat([x, x[:, :2]], 1)).pow(2).mean().backward()
                optimizer.step()

        train(3, 0)
        saved = runtime.state_dict()
        # Read from the snapshot, not the live shard: the other worker may already be pushing
        # its next steps once state_dict's closing barrier has passed.
        shard_steps_saved = max(float(v["step"]) for v in saved["tables"][0]["optimizer"]["state"].values())
        train(3, 3)
        shard_steps_later = _adam_steps(runtime)
        runtime.load_state_dict(saved)
        table = runtime.tables[0]
        low, high = table.spec.shard_bounds(rank)
        local = torch.cat([p.detach().reshape(-1) for p in table.params])
        return {
            "saved_values": saved["tables"][0]["values"],
            "local_after_load": local[low:high].clone(),
            "local_full": local.clone(),
            "worker_clock": table.clock,
            "adam_steps": (shard_steps_saved, shard_steps_later, _adam_steps(runtime)),
        }
    finally:
        runtime.close()


def _adam_steps(runtime: ParameterServerRuntime) -> float:
    shard = runtime.state.shard(0)
    return max(float(s["step"]) for s in shard.optimizer.state.values())


def _peer_lost_scenario(rank: int, port: int) -> Dict[str, Any]:
    runtime = _runtime(rank, port, max_staleness=0, timeout_s=60)
    runtime.peer_loss_grace_s = 0.0  # no launcher here to name the dead rank first
    net = runtime.prepare_model(torch.nn.Linear(4, 2))
    optimizer = runtime.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    result: Dict[str, Any] = {}
    try:
        for step in range(100):
            if rank == 1 and step == 2:
                # What a killed process looks like to the others: sockets closed, no BYE.
                for client in runtime._clients.values():
                    client._sock.close()
                    client._closed = True
                runtime._server.close()
                result["died_at"] = step
                break
            x, y = _batch(rank, step)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
    except ParameterServerError as exc:
        result.update(error=str(exc), peer_rank=exc.peer_rank, step=step)
    finally:
        runtime.close()
    return result


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    results: Dict[str, Any] = {}
    try:
        for name, scenario in [
            # Rank 1 is the slow worker here: the staleness bound is what holds rank 0 back.
            ("sgd_balanced", lambda: _sgd_scenario(rank, port, "balanced", slow_rank1=True)),
            ("sgd_tensors", lambda: _sgd_scenario(rank, port, "tensors")),
            ("checkpoint", lambda: _checkpoint_scenario(rank, port)),
            ("peer_lost", lambda: _peer_lost_scenario(rank, port)),  # last: it breaks the pairing
        ]:
            try:
                results[name] = scenario()
            except Exception:  # noqa: BLE001 - recorded, so the test shows it
                results[name] = {"exception": traceback.format_exc()}
                break
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    exit_without_finalizing()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def recordings(tmp_path_factory) -> List[Dict[str, Any]]:
    out_dir = str(tmp_path_factory.mktemp("ps"))
    mp.spawn(_worker, args=(_free_port(), out_dir), nprocs=WORLD, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


def _scenario(recordings, name: str) -> List[Dict[str, Any]]:
    per_rank = [r[name] for r in recordings]
    for rank, result in enumerate(per_rank):
        assert "exception" not in result, f"rank {rank}:\n{result.get('exception')}"
    return per_rank


@pytest.mark.parametrize("layout", ["balanced", "tensors"])
def test_servers_apply_every_pushed_gradient_exactly_once_with_its_groups_lr(recordings, layout):
    ranks = _scenario(recordings, f"sgd_{layout}")
    # prepare_model broadcast rank 0's weights, whatever each rank's seed.
    for name, value in ranks[1]["initial"].items():
        assert torch.equal(value, ranks[0]["initial"][name]), name
    for name, start in ranks[0]["initial"].items():
        expected = start.clone()
        for rank in ranks:
            for push in rank["pushes"]:
                grad, lr = push[name]
                expected -= lr * grad
        assert torch.allclose(ranks[0]["final"][name], expected, atol=1e-6), name
    # The StepLR schedule on the worker reached the servers (lr halved after 4 steps).
    assert [p["linear.weight"][1] for p in ranks[0]["pushes"]] == [0.1] * 4 + [0.05] * 4 + [0.025]


@pytest.mark.parametrize("layout", ["balanced", "tensors"])
def test_every_rank_returns_identical_weights_with_averaged_buffers(recordings, layout):
    ranks = _scenario(recordings, f"sgd_{layout}")
    for name, value in ranks[0]["final"].items():
        assert torch.equal(value, ranks[1]["final"][name]), name
    mean_running = (
        ranks[0]["buffers_before"]["norm.running_mean"] + ranks[1]["buffers_before"]["norm.running_mean"]
    ) / 2
    assert torch.allclose(ranks[0]["final"]["norm.running_mean"], mean_running)
    assert not torch.equal(
        ranks[0]["buffers_before"]["norm.running_mean"], ranks[1]["buffers_before"]["norm.running_mean"]
    )


def test_staleness_bound_metrics_tables_and_traffic(recordings):
    ranks = _scenario(recordings, "sgd_balanced")
    # Rank 1 let rank 0 run as far ahead as it could: rank 0's reads reached the bound exactly
    # (without the bound's wait they are more stale: 4 in a run with it disabled); rank 1, the slowest,
    # always read fresh values.
    assert ranks[0]["metrics"]["staleness"] == BOUND, ranks[0]["metrics"]
    assert ranks[1]["metrics"]["staleness"] == 0, ranks[1]["metrics"]
    for rank in ranks:
        assert rank["metrics"]["updates_per_sec"] > 0
        assert rank["local_optimizer_state"] == 0  # the worker never steps locally
        assert rank["tables"] == 2  # float32 and float64 parameters travel as separate tables
        assert rank["comm_bytes"] > 0


def test_state_dict_is_a_consistent_cut_and_load_restores_it(recordings):
    ranks = _scenario(recordings, "checkpoint")
    for rank in ranks:
        # Adam's step count on the shard: 3 steps x 2 workers at the checkpoint, 12 later,
        # back to 6 after loading.
        assert rank["adam_steps"] == (6.0, 12.0, 6.0)
        assert torch.equal(rank["local_after_load"], rank["saved_values"])
        assert rank["worker_clock"] == 3
    # Each rank's replica was refreshed from both restored shards: identical everywhere.
    assert torch.equal(ranks[0]["local_full"], ranks[1]["local_full"])


def test_a_rank_that_dies_fails_the_other_with_an_error_naming_it(recordings):
    survivor, dead = _scenario(recordings, "peer_lost")
    assert dead["died_at"] == 2
    assert survivor["peer_rank"] == 1, survivor
    assert "rank 1" in survivor["error"]
    # Bulk-synchronous: the survivor could not have run more than one step past the loss.
    assert survivor["step"] <= 3


# ---- what the strategy takes from DistEnv (no pyspark) --------------------------------------


def test_create_runtime_takes_its_address_and_all_gather_from_the_env():
    sent: List[Dict[str, Any]] = []

    def gather(message: str) -> List[str]:
        sent.append(json.loads(message))
        return [message]  # one rank: everyone's messages are its own

    env = DistEnv(
        0, 1, torch.device("cpu"), "gloo", "127.0.0.1", 1, peer_addresses=("127.0.0.1:40000",), all_gather=gather
    )
    runtime = ParameterServer(timeout_s=10).create_runtime(env)
    try:
        assert sent[0]["host"] == "127.0.0.1" and len(bytes.fromhex(sent[0]["secret"])) == 32
    finally:
        runtime.close()
    bare = DistEnv(0, 1, torch.device("cpu"), "gloo", "127.0.0.1", 1)
    with pytest.raises(RuntimeError, match="DistEnv.peer_addresses and DistEnv.all_gather"):
        ParameterServer().create_runtime(bare)
