"""Checkpoints and elastic resumes of ShardedEmbedding tables, without Spark: real runtimes over
real gloo groups and real PS connections.

Two ranks train a model with an Adagrad and a lazy-Adam table, record what their servers hold
(read from the shards themselves), save, and train on. The checkpoint is then loaded on 2 ranks
(a same-size resume, in the same group),
on 1 rank and on 3 ranks (elastic: each new rank takes from the old parts the rows it owns under
the new hashing). Every saved row's value and optimizer state must come back bit for bit, on its
new owner, and training must continue.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

from sparkdl.strategies.parameter_server import ParameterServer, ShardedEmbedding
from sparkdl.strategies.parameter_server.embedding import check_sharded_embeddings
from sparkdl.strategies.parameter_server.rows import RowOptimizer, owners
from sparkdl.strategies.parameter_server.runtime import ParameterServerRuntime
from sparkdl.strategies.parameter_server.sparse_checkpoint import check_table_state, reshard_tables
from sparkdl.strategies.parameter_server.sparse_shard import SparseSpec
from tests.gloo import cpu_env, join_group, save_results, spawn_ranks

ROWS, DIM, SAVED_STEPS, MORE_STEPS = 300, 4, 6, 3
OLD_WORLD = 2


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = ShardedEmbedding(ROWS, DIM, mode="sum", optimizer="adagrad", lr=0.2, seed=1)
        self.items = ShardedEmbedding(ROWS, DIM, mode="sum", optimizer="adam", lr=0.05, seed=2)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.users(ids) + self.items(ids)).squeeze(1)


def _gather(message: str) -> List[str]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, message)
    return out


def _start(rank: int, port: int, world: int) -> Tuple[ParameterServerRuntime, torch.nn.Module, Any]:
    runtime = ParameterServerRuntime(
        ParameterServer(max_staleness=0, timeout_s=30), cpu_env(rank, port, world), _gather, "127.0.0.1"
    )
    torch.manual_seed(0)
    net = runtime.prepare_model(_Net())
    return runtime, net, runtime.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.05))


def _train(net: torch.nn.Module, optimizer: Any, seed: int, steps: int) -> List[float]:
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, ROWS // 2, (8, 3), generator=generator)  # half the rows: some never touched
        optimizer.zero_grad()
        loss = (net(ids) - 1.0).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _held(runtime: ParameterServerRuntime) -> List[Dict[int, Dict[str, torch.Tensor]]]:
    """What each table's shard on this rank holds, read from the shard itself, by row id."""
    dist.barrier()  # every push is in
    tables: List[Dict[int, Dict[str, torch.Tensor]]] = []
    for table in range(len(runtime.sparse.specs)):
        shard = runtime.sparse.shard(table)
        with shard.cond:
            held = shard.store.export()
        state = {key[len("state.") :]: value for key, value in held.items() if key.startswith("state.")}
        tables.append(
            {
                row: {"value": held["values"][slot], **{k: v[slot] for k, v in state.items()}}
                for slot, row in enumerate(held["ids"].tolist())
            }
        )
    # Every rank has read before any trains on: a peer's next pull would create rows here (CI, once).
    dist.barrier()
    return tables


def _save_worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, OLD_WORLD)
    runtime, net, optimizer = _start(rank, port, OLD_WORLD)
    try:
        _train(net, optimizer, 10 + rank, SAVED_STEPS)
        held = _held(runtime)
        part = runtime.state_dict()
        torch.save(part, os.path.join(out_dir, f"part{rank}.pt"))
    finally:
        runtime.close()
    # A same-size resume in the same group: new servers, the rank's own part.
    runtime, net, optimizer = _start(rank, port, OLD_WORLD)
    try:
        runtime.load_state_dict(part)
        restored = _held(runtime)
        _train(net, optimizer, 20 + rank, MORE_STEPS)
        resumed = _held(runtime)
        dist.barrier()
    finally:
        runtime.close()
    save_results({"held": held, "part": part, "restored": restored, "resumed": resumed}, out_dir, rank)


def _resume_worker(parts_dir: str, world: int, rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, world)
    parts = [torch.load(os.path.join(parts_dir, f"part{r}.pt"), weights_only=True) for r in range(OLD_WORLD)]
    runtime, net, optimizer = _start(rank, port, world)
    try:
        _, strategy = runtime.reshard_state([({}, part) for part in parts], OLD_WORLD)
        del parts
        runtime.load_state_dict(strategy)
        restored = _held(runtime)
        clocks = list(runtime.sparse.clocks)
        losses = _train(net, optimizer, 30 + rank, MORE_STEPS)
        after = _held(runtime)
        dist.barrier()
    finally:
        runtime.close()
    dense = ParameterServerRuntime(ParameterServer(), cpu_env(rank, port, world), _gather, "127.0.0.1")
    try:
        linear = dense.prepare_model(torch.nn.Linear(2, 1))
        dense.prepare_optimizer(torch.optim.SGD(linear.parameters(), lr=0.1))
        dense_keys = sorted(dense.state_dict())
        dist.barrier()
    finally:
        dense.close()
    save_results(
        {"restored": restored, "clocks": clocks, "losses": losses, "after": after, "dense_keys": dense_keys},
        out_dir,
        rank,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Tuple[str, List[Dict[str, Any]]]:
    out = tmp_path_factory.mktemp("sparse_save")
    return str(out), spawn_ranks(_save_worker, OLD_WORLD, str(out))


def _union(per_rank: List[List[Dict[int, Dict[str, torch.Tensor]]]], table: int) -> Dict[int, Dict[str, torch.Tensor]]:
    out: Dict[int, Dict[str, torch.Tensor]] = {}
    for tables in per_rank:
        assert not set(out) & set(tables[table])  # a row lives on one rank only
        out.update(tables[table])
    return out


def _assert_identical(got: Dict[int, Dict[str, torch.Tensor]], expected: Dict[int, Dict[str, torch.Tensor]]) -> None:
    assert sorted(got) == sorted(expected)
    for row, fields in expected.items():
        assert sorted(got[row]) == sorted(fields)
        for key, value in fields.items():
            assert torch.equal(got[row][key], value), (row, key)


def test_each_rank_saves_only_the_rows_it_owns_with_their_optimizer_state(saved):
    _, results = saved
    for rank, result in enumerate(results):
        sparse = result["part"]["sparse"]
        assert [table["optimizer"] for table in sparse] == ["adagrad", "adam"]
        for table, state in enumerate(sparse):
            assert len(state["ids"]) == len(result["held"][table]) > 0
            assert bool((owners(state["ids"], OLD_WORLD) == rank).all())
            assert state["clocks"] == [SAVED_STEPS] * OLD_WORLD and state["worker_clock"] == SAVED_STEPS
        adam = sparse[1]["state"]
        assert set(adam) == {"exp_avg", "exp_avg_sq", "step"} and int(adam["step"].max()) > 1  # per-row counts
    touched = len(_union([r["held"] for r in results], 0))
    assert 0 < touched < ROWS // 2 + 1  # rows never touched are not saved


def test_a_same_size_resume_restores_every_row_and_training_continues(saved):
    _, results = saved
    for result in results:
        for table in range(2):
            _assert_identical(result["restored"][table], result["held"][table])
            # The clocks went on from the checkpoint's (a push at another clock fails the step),
            # and the steps after the resume updated the rows they touched.
            after, before = result["resumed"][table], result["restored"][table]
            assert set(before) <= set(after)
            assert any(not torch.equal(after[row]["value"], before[row]["value"]) for row in before)


@pytest.mark.parametrize("world", [1, 3])
def test_an_elastic_resume_puts_every_saved_row_and_its_state_on_its_new_owner(saved, world, tmp_path):
    parts_dir, results = saved
    resumed = spawn_ranks(functools.partial(_resume_worker, parts_dir, world), world, str(tmp_path))
    for table in range(2):
        expected = _union([r["held"] for r in results], table)
        _assert_identical(_union([r["restored"] for r in resumed], table), expected)
        for rank, result in enumerate(resumed):
            ids = torch.tensor(sorted(result["restored"][table]), dtype=torch.int64)
            assert bool((owners(ids, world) == rank).all())
    for result in resumed:
        assert result["clocks"] == [SAVED_STEPS, SAVED_STEPS]
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        # Training went on: the rows of the new batches changed, new rows were created.
        changed = [r for r, f in result["after"][0].items() if r in result["restored"][0]]
        assert any(not torch.equal(result["after"][0][r]["value"], result["restored"][0][r]["value"]) for r in changed)
        assert result["dense_keys"] == ["format", "rank", "tables", "world_size"]  # no sparse entry without tables


def _spec(optimizer: str = "adagrad") -> SparseSpec:
    return SparseSpec(0, "t", 50, 2, torch.float32, 0, 0.1, RowOptimizer(optimizer))


def test_a_checkpoint_of_other_tables_or_row_optimizers_is_refused():
    spec = _spec()
    state = {
        "fingerprint": spec.fingerprint(),
        "optimizer": "adagrad",
        "ids": torch.tensor([3, 7]),
        "values": torch.zeros(2, 2),
        "state": {"sum": torch.ones(2, 2)},
        "clocks": [4, 4],
        "worker_clock": 4,
    }
    check_table_state(spec, state)
    with pytest.raises(ValueError, match="trained with optimizer='adagrad', this run uses optimizer='adam'"):
        check_table_state(_spec("adam"), state)
    with pytest.raises(ValueError, match="holds another table"):
        check_table_state(SparseSpec(0, "t", 60, 2, torch.float32, 0, 0.1, RowOptimizer()), state)
    with pytest.raises(ValueError, match="a row is saved twice"):
        reshard_tables([spec], [[state], [state]], 0, 1)
    with pytest.raises(ValueError, match="holds 1 sparse tables, this run has 2"):
        reshard_tables([spec, spec], [[state]], 0, 1)


def test_checkpoints_of_sparse_tables_are_no_longer_refused_before_launch():
    model = torch.nn.Sequential(ShardedEmbedding(100, 4, mode="sum"), torch.nn.Linear(4, 1))
    check_sharded_embeddings(model, "parameter_server")
