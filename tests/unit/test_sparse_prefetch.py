"""A forward's sparse lookups pulled together before it runs (``prefetch.py``), on real runtimes
over real gloo groups and real parameter-server connections:

* two ranks, three tables (two looked up with the model's inputs, one with ids the model
  computes): the same rows, losses and bytes as the same run with the prefetch detached
  (row-wise SGD and barriers around each step's pulls, so that two runs are comparable), and
  every forward after the first served for the two input tables only;
* a table looked up with two inputs: both lookups prefetched, in order;
* ids changed in place after the prefetch, or a routing that changes: a plain pull, the
  binding dropped and learned again;
* ``pull_many`` over more reply bytes than a peer may owe at once: the replies are read in
  several rounds, and the rows equal the per-table pulls.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

from sparkdl.strategies.parameter_server import ParameterServer, ShardedEmbedding
from sparkdl.strategies.parameter_server.runtime import ParameterServerRuntime
from sparkdl.strategies.parameter_server.sparse_worker import PIPELINED_REPLY_BYTES
from tests.gloo import cpu_env, join_group, save_results, spawn_ranks

ROWS, DIM, STEPS = 5000, 4, 6


def _gather(message: str) -> List[str]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, message)
    return out


def _runtime(rank: int, port: int, world: int) -> ParameterServerRuntime:
    return ParameterServerRuntime(
        ParameterServer(max_staleness=0, timeout_s=30), cpu_env(rank, port, world), _gather, "127.0.0.1"
    )


class _ThreeTables(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tables = torch.nn.ModuleDict(
            {
                name: ShardedEmbedding(ROWS, DIM, mode="sum", optimizer="sgd", lr=0.2, seed=3)
                for name in ("user", "item", "hashed")
            }
        )
        self.head = torch.nn.Linear(3 * DIM, 1)

    def forward(self, batch: Dict[str, torch.Tensor], item: torch.Tensor) -> torch.Tensor:
        user = self.tables["user"](batch["user"])  # an input, inside a dict
        items = self.tables["item"](item)  # an input, as a keyword argument
        hashed = self.tables["hashed"]((batch["user"] * 7 + 1) % ROWS)  # computed here: never prefetched
        return self.head(torch.cat([user, items, hashed], dim=1)).squeeze(1)


def _batches(rank: int) -> List[Any]:
    generator = torch.Generator().manual_seed(rank)
    return [
        (
            {"user": torch.randint(0, ROWS, (16, 3), generator=generator)},
            torch.randint(0, 50, (16, 2), generator=generator),  # a few hot items: rows shared by the ranks
            torch.randn(16, generator=generator),
        )
        for _ in range(STEPS)
    ]


def _train(rank: int, port: int, prefetch: bool) -> Dict[str, Any]:
    runtime = _runtime(rank, port, 2)
    try:
        torch.manual_seed(0)
        net = runtime.prepare_model(_ThreeTables())
        if not prefetch:
            runtime.sparse.close()  # detaches the hooks: every lookup pulls on its own
        optimizer = runtime.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.05))
        losses = []
        for batch, item, y in _batches(rank):
            optimizer.zero_grad()
            out = net(batch, item=item)
            # Barriers make the run repeatable: no rank's pull may see the other's push of the
            # same step. (Staleness 0 bounds what a read may miss, not what it may already see.)
            dist.barrier()
            loss = torch.nn.functional.mse_loss(out, y)
            loss.backward()
            optimizer.step()
            dist.barrier()
            losses.append(loss.item())
        dist.barrier()  # both ranks' pushes are in
        served = runtime.sparse._prefetches[0] if prefetch else None
        return {
            "losses": losses,
            "rows": {name: table.rows(torch.arange(ROWS)) for name, table in net.tables.items()},
            "bytes": runtime.sparse_wire_bytes,
            "served": served.served_lookups if served else None,
            "bound": sorted(served.bindings) if served else None,
        }
    finally:
        dist.barrier()  # no server closes while the other rank still reads rows from it
        runtime.close()


def _changed_ids(rank: int, port: int) -> Dict[str, Any]:
    """One rank: a forward whose ids change in place after the prefetch, and one whose routing
    changes (the table looked up with another input), each against a plain lookup."""
    runtime = _runtime(rank, port, 1)
    try:
        table = ShardedEmbedding(ROWS, DIM, init_std=1.0, seed=5)

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.table = table
                self.bump = False

            def forward(self, first: torch.Tensor, second: torch.Tensor, use_second: bool = False) -> torch.Tensor:
                if self.bump:
                    first.add_(1)  # in place, after the pre-hook pulled rows for the old ids
                return self.table(second if use_second else first)

        net = runtime.prepare_model(Net())
        prefetch = runtime.sparse._prefetches[0]
        first, second = torch.tensor([1, 2, 3]), torch.tensor([10, 11])
        out: Dict[str, Any] = {}
        with torch.no_grad():
            net(first, second)  # learns: the table reads argument 0
            out["bound"] = dict(prefetch.bindings)
            net(first, second)
            out["served_after_learning"] = prefetch.served_forwards
            net.bump = True
            out["bumped"] = net(first, second)
            out["bumped_expected"] = table.rows(first)
            out["bound_after_bump"] = dict(prefetch.bindings)
            net.bump = False
            net(first, second)  # learns again
            out["rerouted"] = net(first, second, use_second=True)
            out["rerouted_expected"] = table.rows(second)
            out["bound_after_reroute"] = dict(prefetch.bindings)
            out["served"] = prefetch.served_forwards
        return out
    finally:
        runtime.close()


def _shared_table(rank: int, port: int) -> Dict[str, Any]:
    """One rank: one table looked up twice per forward, with two inputs (a table shared by two
    id columns): both lookups are prefetched, in order, each with its own rows."""
    runtime = _runtime(rank, port, 1)
    try:
        table = ShardedEmbedding(ROWS, DIM, init_std=1.0, seed=6)

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.table = table

            def forward(self, user: torch.Tensor, friend: torch.Tensor) -> torch.Tensor:
                return torch.cat([self.table(user), self.table(friend)], dim=1)

        net = runtime.prepare_model(Net())
        prefetch = runtime.sparse._prefetches[0]
        user, friend = torch.tensor([[1, 2]]), torch.tensor([[7, 2]])
        with torch.no_grad():
            first = net(user, friend)  # learns both places
            second = net(user, friend)
        return {
            "bound": dict(prefetch.bindings),
            "served": prefetch.served_lookups,
            "equal": torch.equal(first, second),
            "expected": torch.equal(second, torch.cat([table.rows(user), table.rows(friend)], dim=1)),
        }
    finally:
        runtime.close()


def _pull_many(rank: int, port: int) -> Dict[str, Any]:
    runtime = _runtime(rank, port, 2)
    try:
        tables = [ShardedEmbedding(200_000, 16, seed=k) for k in range(3)]
        runtime.prepare_model(torch.nn.ModuleList(tables))
        generator = torch.Generator().manual_seed(7)
        lookups = [(k, torch.unique(torch.randint(0, 200_000, (12_000,), generator=generator))) for k in range(3)]
        together = runtime.sparse.pull_many(lookups)
        one_by_one = [runtime.sparse.pull_rows(k, ids) for k, ids in lookups]
        dist.barrier()
        return {
            "equal": all(torch.equal(a, b) for a, b in zip(together, one_by_one)),
            "reply_bytes": [len(ids) * 16 * 4 // 2 for _, ids in lookups],  # about half is remote
        }
    finally:
        runtime.close()


def _pair_worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, 2)
    save_results(
        {"with": _train(rank, port, True), "without": _train(rank, port, False), "many": _pull_many(rank, port)},
        out_dir,
        rank,
    )


def _single_worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, 1)
    save_results({"changed": _changed_ids(rank, port), "shared": _shared_table(rank, port)}, out_dir, rank)


@pytest.fixture(scope="module")
def pair_run(tmp_path_factory) -> List[Dict[str, Any]]:
    return spawn_ranks(_pair_worker, 2, str(tmp_path_factory.mktemp("prefetch_pair")))


def test_prefetched_lookups_give_the_same_training_and_bytes_as_pulls_one_by_one(pair_run):
    for rank, result in enumerate(pair_run):
        got, plain = result["with"], result["without"]
        # Input tables bound (ModuleDict order: user 0, item 1); the computed ids never are.
        assert got["bound"] == [0, 1], rank
        # Every forward after the first had both input tables' rows before it started; the
        # computed table's were pulled during the forward.
        assert got["served"] == 2 * (STEPS - 1)
        assert got["bytes"] == plain["bytes"] > 0  # the same rows moved, only fewer waits
        assert got["losses"] == pytest.approx(plain["losses"], rel=1e-5, abs=1e-6)
        for name, rows in plain["rows"].items():
            assert torch.allclose(got["rows"][name], rows, atol=1e-6), name
    assert not torch.equal(pair_run[0]["with"]["rows"]["item"], pair_run[0]["with"]["rows"]["user"])


def test_pull_many_beyond_what_a_peer_may_owe_reads_its_replies_in_rounds(pair_run):
    for result in pair_run:
        assert sum(result["many"]["reply_bytes"]) > 2 * PIPELINED_REPLY_BYTES  # several rounds were needed
        assert result["many"]["equal"]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Dict[str, Any]:
    return spawn_ranks(_single_worker, 1, str(tmp_path_factory.mktemp("prefetch_single")))[0]


def test_a_table_looked_up_with_two_inputs_gets_both_lookups_prefetched_in_order(single_run):
    shared = single_run["shared"]
    assert shared["bound"] == {0: [("args", 0), ("args", 1)]}
    assert shared["served"] == 2  # both lookups of the second forward
    assert shared["equal"] and shared["expected"]


def test_ids_changed_in_place_or_rerouted_are_pulled_plainly_and_the_binding_is_learned_again(single_run):
    got = single_run["changed"]
    assert got["bound"] == {0: [("args", 0)]}
    assert got["served_after_learning"] == 1
    assert torch.equal(got["bumped"], got["bumped_expected"])  # the rows of the ids as changed
    # The unused prefetch dropped the binding; the plain lookup of the same argument bound it again.
    assert got["bound_after_bump"] == {0: [("args", 0)]}
    assert torch.equal(got["rerouted"], got["rerouted_expected"])
    assert got["bound_after_reroute"] == {0: [("args", 1)]}  # learned from the rerouted forward
    assert got["served"] == 2  # the forward after learning, and the relearned one
