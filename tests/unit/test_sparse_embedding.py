"""ShardedEmbedding on the parameter server, without Spark: its rows, its row-wise optimizers, its
wire traffic and its sharding, on real runtimes over real gloo groups and real PS connections.

* exactness: one worker, ``max_staleness=0``, against a plain single-process run of the same
  model (torch's sparse SGD and Adagrad; lazy Adam written out below), for every optimizer;
* bytes on the wire per step: exactly what the batch's unique rows take, with a 1,000,000-row table;
* two ranks: each holds about half of the touched rows (by hash), and training converges;
* bad ids: a DataError naming the table and the id.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist

import sparkdl
from sparkdl._net.frames import TAG_BYTES
from sparkdl.errors import ConfigError, DataError
from sparkdl.strategies.parameter_server import ParameterServer, ShardedEmbedding
from sparkdl.strategies.parameter_server.embedding import check_sharded_embeddings
from sparkdl.strategies.parameter_server.rows import initial_rows, owners
from sparkdl.strategies.parameter_server.runtime import ParameterServerRuntime
from sparkdl.strategies.parameter_server.shard import ServerState
from sparkdl.strategies.parameter_server.sparse_worker import SparseTables
from sparkdl.strategies.parameter_server.wire import HEADER
from tests.gloo import cpu_env, join_group, save_results, spawn_ranks

# ---- pure pieces: owners, initial rows, settings -----------------------------------------------


def test_owners_balance_zipf_ids_and_initial_rows_do_not_depend_on_the_ranks():
    generator = torch.Generator().manual_seed(0)
    # Zipf-like: most lookups hit the smallest ids.
    zipf = (torch.rand(20_000, generator=generator) ** 4 * 1_000_000).long()
    for world in (2, 3, 8):
        counts = torch.bincount(owners(zipf, world), minlength=world).double()
        assert counts.max() / counts.mean() < 1.25, (world, counts)
    ids = torch.tensor([0, 7, 999_999, 123_456])
    rows = initial_rows(3, 1, ids, 16, 0.5, torch.float32)
    # Row by row, in any order or company: the same values.
    assert torch.equal(initial_rows(3, 1, ids[[2]], 16, 0.5, torch.float32)[0], rows[2])
    assert not torch.equal(initial_rows(3, 2, ids, 16, 0.5, torch.float32), rows)  # another table
    assert not torch.equal(initial_rows(4, 1, ids, 16, 0.5, torch.float32), rows)  # another seed
    many = initial_rows(0, 0, torch.arange(5000), 16, 0.5, torch.float64)
    assert abs(float(many.mean())) < 0.01 and abs(float(many.std()) - 0.5) < 0.01


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_rows": 0, "dim": 4}, "num_rows=0 must be a positive integer"),
        ({"num_rows": 10, "dim": 2.5}, "dim=2.5 must be a positive integer"),
        ({"num_rows": 10, "dim": 4, "mode": "max"}, "mode='max' must be one of None, 'sum', 'mean'"),
        ({"num_rows": 10, "dim": 4, "optimizer": "rmsprop"}, "optimizer='rmsprop' must be one of 'sgd'"),
        ({"num_rows": 10, "dim": 4, "lr": -1}, "lr=-1 must be a finite number >= 0"),
        ({"num_rows": 10, "dim": 4, "betas": (0.9, 1.0)}, r"betas=\(0.9, 1.0\) must be two numbers"),
        ({"num_rows": 10, "dim": 4, "dtype": torch.float16}, "dtype=torch.float16 must be"),
        ({"num_rows": 10, "dim": 4, "eps": -1e-8}, "eps=-1e-08 must be None"),
        ({"num_rows": 10, "dim": 4, "betas": 0.9}, "betas=0.9 must be two numbers"),
    ],
)
def test_bad_settings_fail_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ShardedEmbedding(**kwargs)


def test_a_table_is_never_materialized_and_is_a_public_name():
    table = sparkdl.ShardedEmbedding(10**12, 256)  # 1 PB as a dense table: built at once, holds nothing
    assert list(table.parameters()) == [] and list(table.buffers()) == []
    with pytest.raises(ConfigError, match="strategy=sparkdl.ParameterServer"):
        table(torch.tensor([1]))  # outside a ParameterServer run its rows would never train


def _model_with_a_table() -> torch.nn.Module:
    return torch.nn.Sequential(ShardedEmbedding(100, 4, mode="sum"), torch.nn.Linear(4, 1))


def test_what_this_slice_does_not_cover_is_refused_before_launch():
    model = _model_with_a_table()
    with pytest.raises(ConfigError, match=r"ShardedEmbedding tables \('0'\).*use strategy=sparkdl.ParameterServer"):
        check_sharded_embeddings(model, "allreduce")
    check_sharded_embeddings(model, "parameter_server")  # checkpoints too: test_sparse_checkpoint.py
    check_sharded_embeddings(torch.nn.Linear(2, 1), "allreduce")  # dense models: as before
    # sparkdl plan predicts such a model under ParameterServer only: asked for others alone, it
    # refuses before it reads data or launches (test_planning_sparse.py covers its sparse model).
    with pytest.raises(ConfigError, match=r"train under ParameterServer only: plan it with strategies="):
        sparkdl.plan(
            _model_with_a_table,
            "/nonexistent/data.parquet",
            strategies="allreduce",
            feature_cols=["x"],
            bandwidth="1Gbit",
            latency="50us",
        )


def test_a_fitted_table_loads_into_a_fresh_model_and_serves_lookups_only():
    fitted = _model_with_a_table()
    weight = torch.randn(100, 4)
    fitted[0].materialize(weight)
    state = fitted.state_dict()
    assert torch.equal(state["0.weight"], weight)
    fresh = _model_with_a_table()  # what the driver and a loaded TorchModel build
    fresh.load_state_dict(state)
    fresh.eval()
    ids = torch.tensor([[1, 2], [99, 99]])
    assert torch.equal(fresh[0](ids), weight[ids].sum(1))
    fresh.train()
    with pytest.raises(ConfigError, match="holds a fitted table"):
        fresh(ids)  # training it here would silently not update it


# ---- one rank's tables without a network: bad ids --------------------------------------------


def _local_tables(module: ShardedEmbedding, name: str = "items") -> SparseTables:
    tables = SparseTables(0, 1, ServerState(0, 1, 10.0), {}, 0, 10.0)
    tables.bind(name, module)
    return tables


@pytest.mark.parametrize(
    "ids, message",
    [
        (torch.tensor([3, 100]), r"ShardedEmbedding 'items' \(table 0, 100 rows\): id 100 is out of range \[0, 100\)"),
        (torch.tensor([-5, 3]), r"id -5 is out of range \[0, 100\)"),
        (torch.tensor([1.0, 2.0]), r"'items' \(table 0, 100 rows\) takes integer row ids, got torch.float32"),
        (torch.tensor([True]), "takes integer row ids, got torch.bool"),
    ],
)
def test_bad_ids_raise_a_data_error_naming_the_table_and_the_id(ids, message):
    module = ShardedEmbedding(100, 4)
    _local_tables(module)
    with pytest.raises(DataError, match=message):
        module(ids)
    assert module.pending == []


def test_a_bag_lookup_sums_the_pulled_rows_and_touches_only_those():
    module = ShardedEmbedding(1000, 3, mode="mean", init_std=1.0, seed=5)
    tables = _local_tables(module)
    ids = torch.tensor([[1, 2, 2], [999, 1, 1]])
    out = module(ids)
    expected = initial_rows(5, 0, torch.arange(1000), 3, 1.0, torch.float32)[ids].mean(1)
    assert torch.allclose(out, expected)
    assert tables.shard(0).rows_held == 3
    assert [len(ids) for ids, _ in module.pending] == [3]  # unique rows, pulled once each


# ---- exactness: one worker, staleness 0, against plain torch ------------------------------------

ROWS, DIM, STEPS = 40, 4, 8


class _Net(torch.nn.Module):
    def __init__(self, embedding: torch.nn.Module) -> None:
        super().__init__()
        self.embedding = embedding
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.embedding(ids)
        if rows.dim() == 3:  # the reference's plain nn.Embedding: sum each bag here
            rows = rows.sum(1)
        return self.head(rows).squeeze(1)


def _batches() -> List[Any]:
    generator = torch.Generator().manual_seed(11)
    return [
        (torch.randint(0, ROWS, (6, 3), generator=generator), torch.randn(6, generator=generator)) for _ in range(STEPS)
    ]


def _settings(name: str) -> Dict[str, Any]:
    return {"optimizer": name, "lr": {"sgd": 0.1, "adagrad": 0.3, "adam": 0.05}[name], "init_std": 0.5, "seed": 9}


def _gather(message: str) -> List[str]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, message)
    return out


def _runtime(rank: int, port: int, world: int, **kwargs: Any) -> ParameterServerRuntime:
    return ParameterServerRuntime(ParameterServer(**kwargs), cpu_env(rank, port, world), _gather, "127.0.0.1")


def _exact_worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, 1)
    results = {}
    for name in ("sgd", "adagrad", "adam"):
        runtime = _runtime(rank, port, 1, max_staleness=0, timeout_s=30)
        try:
            torch.manual_seed(0)
            net = runtime.prepare_model(_Net(ShardedEmbedding(ROWS, DIM, mode="sum", **_settings(name))))
            head = {k: v.detach().clone() for k, v in net.head.state_dict().items()}
            optimizer = runtime.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.05))
            for ids, y in _batches():
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(net(ids), y).backward()
                optimizer.step()
            held = runtime.sparse.shard(0).rows_held  # before rows() below touches every row
            results[name] = {
                "head0": head,
                "held": held,
                "prefetched": runtime.sparse._prefetches[0].served_forwards,
                "table": net.embedding.rows(torch.arange(ROWS)),
                "head": {k: v.detach().clone() for k, v in net.head.state_dict().items()},
            }
        finally:
            runtime.close()
    save_results(results, out_dir, rank)


def _lazy_adam(weight: torch.Tensor, grad: torch.Tensor, state: Dict[str, torch.Tensor], lr: float) -> None:
    """Adam with a step count per row, applied to the rows the sparse gradient touches only."""
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    grad = grad.coalesce()
    for row, g in zip(grad.indices()[0].tolist(), grad.values()):
        state["step"][row] += 1
        t = float(state["step"][row])
        state["m"][row] = beta1 * state["m"][row] + (1 - beta1) * g
        state["v"][row] = beta2 * state["v"][row] + (1 - beta2) * g * g
        m_hat = state["m"][row] / (1 - beta1**t)
        v_hat = state["v"][row] / (1 - beta2**t)
        weight[row] -= lr * m_hat / (v_hat.sqrt() + eps)


def _reference(name: str, head0: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    settings = _settings(name)
    embedding = torch.nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        embedding.weight.copy_(initial_rows(9, 0, torch.arange(ROWS), DIM, 0.5, torch.float32))
    net = _Net(embedding)
    net.head.load_state_dict(head0)
    dense = torch.optim.SGD(net.head.parameters(), lr=0.05)
    lr = settings["lr"]
    sparse = {
        "sgd": lambda: torch.optim.SGD([embedding.weight], lr=lr),
        "adagrad": lambda: torch.optim.Adagrad([embedding.weight], lr=lr),
    }
    table_optimizer = sparse[name]() if name in sparse else None
    adam_state = {"step": torch.zeros(ROWS), "m": torch.zeros(ROWS, DIM), "v": torch.zeros(ROWS, DIM)}
    for ids, y in _batches():
        dense.zero_grad()
        embedding.weight.grad = None
        torch.nn.functional.mse_loss(net(ids), y).backward()
        dense.step()
        if table_optimizer is not None:
            table_optimizer.step()
        else:
            with torch.no_grad():
                _lazy_adam(embedding.weight, embedding.weight.grad, adam_state, lr)
    return {"table": embedding.weight.detach(), "head": net.head.state_dict()}


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory) -> Dict[str, Any]:
    return spawn_ranks(_exact_worker, 1, str(tmp_path_factory.mktemp("sparse_exact")))[0]


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_one_worker_at_staleness_0_matches_a_plain_run_with_the_same_row_optimizer(exact_run, name):
    got = exact_run[name]
    expected = _reference(name, got["head0"])
    # Every forward after the first took its rows from the prefetch (prefetch.py): exactness
    # covers that path, not only the per-lookup pull.
    assert got["prefetched"] == STEPS - 1
    touched = torch.unique(torch.cat([ids.reshape(-1) for ids, _ in _batches()]))
    assert got["held"] == len(touched)  # untouched rows were never materialized on the server
    initial = initial_rows(9, 0, torch.arange(ROWS), DIM, 0.5, torch.float32)
    assert not torch.allclose(got["table"][touched], initial[touched])  # the rows did train
    assert torch.allclose(got["table"], expected["table"], atol=1e-6, rtol=1e-5), (
        (got["table"] - expected["table"]).abs().max()
    )
    for key, value in expected["head"].items():
        assert torch.allclose(got["head"][key], value, atol=1e-6, rtol=1e-5), key


# ---- two ranks: bytes per step, sharding, convergence --------------------------------------------

BIG_ROWS, BIG_DIM = 1_000_000, 16


def _bytes_scenario(rank: int, port: int) -> Dict[str, Any]:
    runtime = _runtime(rank, port, 2, max_staleness=0, timeout_s=30)
    try:
        net = runtime.prepare_model(_BigNet())
        optimizer = runtime.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.01))
        generator = torch.Generator().manual_seed(rank)
        steps = []
        for unique in (100, 100, 200, 50):
            distinct = torch.randperm(BIG_ROWS, generator=generator)[:unique]
            ids = distinct[torch.randint(0, unique, (4 * unique,), generator=generator)]
            ids[:unique] = distinct  # every distinct id occurs, most of them several times
            before = runtime.sparse_wire_bytes
            optimizer.zero_grad()
            net(ids.view(-1, 4)).pow(2).mean().backward()
            optimizer.step()
            steps.append({"ids": distinct, "bytes": runtime.sparse_wire_bytes - before})
        held = runtime.sparse.shard(0).rows_held
        dist.barrier()  # no server closes while the other rank still pushes to it
        return {"steps": steps, "held": held}
    finally:
        runtime.close()


class _BigNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = ShardedEmbedding(BIG_ROWS, BIG_DIM, mode="sum", optimizer="adam", lr=0.01)
        self.head = torch.nn.Linear(BIG_DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.items(ids))


TOUCHED, TASK_ROWS = 400, 5000


def _converge_scenario(rank: int, port: int) -> Dict[str, Any]:
    """Each id has a hidden value; the target of a bag is the sum of its ids' values. The model
    (a 1-wide table with Adagrad) must learn them from both ranks' batches."""
    runtime = _runtime(rank, port, 2, max_staleness=1, timeout_s=30)
    try:
        table = ShardedEmbedding(TASK_ROWS, 1, mode="sum", optimizer="adagrad", lr=0.3, init_std=0.0)
        scale = torch.nn.Linear(1, 1, bias=False)  # a fixed dense part: the table alone must learn
        torch.nn.init.ones_(scale.weight)
        net = runtime.prepare_model(torch.nn.Sequential(table, scale))
        hidden = torch.randn(TASK_ROWS, generator=torch.Generator().manual_seed(42))
        pool = torch.randperm(TASK_ROWS, generator=torch.Generator().manual_seed(43))[:TOUCHED]
        generator = torch.Generator().manual_seed(100 + rank)
        optimizer = runtime.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.0))
        losses = []
        for _ in range(100):
            ids = pool[torch.randint(0, TOUCHED, (32, 4), generator=generator)]
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(net(ids).squeeze(1), hidden[ids].sum(1))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        dist.barrier()  # both ranks' pushes are in
        owned = sorted(runtime.sparse.shard(0).held_ids().tolist())
        final = table.rows(pool).squeeze(1)
        runtime.final_module(net)  # rank 0's table becomes the complete one, streamed from both shards
        return {
            "losses": losses,
            "owned": owned,
            "final": final,
            "complete": net[0]._buffers.get("weight"),
            "pool": pool,
            "error": float((final - hidden[pool]).abs().mean()),
            "initial_error": float(hidden[pool].abs().mean()),
        }
    finally:
        runtime.close()


def _pair_worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, 2)
    results = {"bytes": _bytes_scenario(rank, port), "converge": _converge_scenario(rank, port)}
    save_results(results, out_dir, rank)


@pytest.fixture(scope="module")
def pair_run(tmp_path_factory) -> List[Dict[str, Any]]:
    return spawn_ranks(_pair_worker, 2, str(tmp_path_factory.mktemp("sparse_pair")))


def test_bytes_per_step_are_those_of_the_unique_rows_not_of_the_table(pair_run):
    frame = HEADER.size + TAG_BYTES
    table_bytes = BIG_ROWS * BIG_DIM * 4
    results = [r["bytes"] for r in pair_run]
    for rank, result in enumerate(results):
        for step in result["steps"]:
            remote = int((owners(step["ids"], 2) != rank).sum())
            # Pull: the ids out, their rows back; push: ids and gradient rows out, an empty ack back.
            expected = 4 * frame + remote * (8 + BIG_DIM * 4) + remote * (8 + BIG_DIM * 4)
            assert step["bytes"] == expected, (rank, step["bytes"], expected)
            assert step["bytes"] < table_bytes / 1000
        hundred, _, two_hundred, _ = (s["bytes"] for s in result["steps"])
        assert 1.6 < (two_hundred - 4 * frame) / (hundred - 4 * frame) < 2.5  # proportional to the rows
    # Each rank stores only rows it owns that some batch touched: a few hundred of the million.
    touched = torch.unique(torch.cat([s["ids"] for r in results for s in r["steps"]]))
    assert sum(r["held"] for r in results) == len(touched)


def test_two_ranks_each_hold_about_half_the_rows_and_training_converges(pair_run):
    results = [r["converge"] for r in pair_run]
    owned = [set(r["owned"]) for r in results]
    assert not owned[0] & owned[1] and len(owned[0] | owned[1]) == TOUCHED
    assert all(0.4 * TOUCHED < len(o) < 0.6 * TOUCHED for o in owned), [len(o) for o in owned]
    for result in results:
        first, last = sum(result["losses"][:5]) / 5, sum(result["losses"][-5:]) / 5
        assert last < 0.05 * first, (first, last)
        assert result["error"] < 0.3 * result["initial_error"], result["error"]  # it learned each id's value
    assert torch.equal(results[0]["final"], results[1]["final"])  # one table, whoever reads it
    complete, pool = results[0]["complete"], results[0]["pool"]
    assert results[1]["complete"] is None  # only rank 0 assembles the table
    assert complete.shape == (TASK_ROWS, 1) and torch.equal(complete[pool, 0], results[0]["final"])
    untouched = torch.ones(TASK_ROWS, dtype=torch.bool)
    untouched[pool] = False
    assert torch.equal(complete[untouched], torch.zeros(int(untouched.sum()), 1))  # init_std=0: never trained
