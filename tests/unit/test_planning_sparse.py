"""``sparkdl plan`` for models with sparse tables: the table's cost model worked by hand, the
parameter server's prediction with it (bytes per step, memory per rank, "does not fit"), and the
calibration's estimate of the bytes per step against what a real 2-rank gloo run sends."""

from __future__ import annotations

import re
from typing import Any, List

import pytest
import torch
import torch.distributed as dist

from sparkdl._net.frames import TAG_BYTES
from sparkdl.planning.models import Measured, StrategyShape, predict
from sparkdl.planning.report import Plan
from sparkdl.planning.sparse_calibration import bind_counting
from sparkdl.planning.sparse_cost import FRAME_BYTES, SparseTable
from sparkdl.strategies.parameter_server import ParameterServer, ShardedEmbedding
from sparkdl.strategies.parameter_server.runtime import ParameterServerRuntime
from sparkdl.strategies.parameter_server.wire import HEADER
from tests.gloo import cpu_env, join_group, save_results, spawn_ranks

MB = 10**6
#: 1M rows of dim 16, float32, Adagrad; a step pulls and pushes 100 unique rows in one lookup.
TABLE = SparseTable("items", 1_000_000, 16, 4, 16 * 4, pulled_rows=100, pushed_rows=100, lookups=1)
DENSE = Measured(
    batch_size=32,
    local_step_s=0.010,
    compute_step_s=0.009,
    data_rows_per_s=100_000,
    param_bytes=1 * MB,
    grad_bytes=1 * MB,
    optimizer_bytes=2 * MB,
    largest_unit_bytes=MB,
    bandwidth=125 * MB,
    latency_s=50e-6,
)
PS = StrategyShape("parameter_server", "ParameterServer")


def test_a_frame_costs_the_wire_format_header_and_tag():
    assert FRAME_BYTES == HEADER.size + TAG_BYTES


def test_bytes_per_step_are_the_remote_unique_rows_and_four_frames_on_two_ranks():
    # Half the rows are remote: 50 ids out and 50 rows back (pull), 50 ids and gradient rows out
    # (push), each id 8 bytes and each row 64; a pull and a push, each a request and a reply.
    assert TABLE.frames_per_step(2) == pytest.approx(4, abs=1e-9)
    assert TABLE.wire_bytes(2) == pytest.approx(4 * FRAME_BYTES + 2 * 50 * (8 + 64))
    # On 8 ranks 7/8 of the rows are remote; 100 rows reach each of the 7 others (1 - (7/8)^100 ~ 1).
    assert TABLE.wire_bytes(8) == pytest.approx(28 * FRAME_BYTES + 2 * 100 * 7 / 8 * 72, rel=1e-6)
    assert TABLE.wire_bytes(1) == 0
    # Not the table: a hundred rows of a million cost bytes of a hundred rows.
    assert TABLE.wire_bytes(2) < 1e-3 * TABLE.num_rows * TABLE.row_bytes


def test_a_lookup_of_few_rows_reaches_fewer_ranks():
    sparse = SparseTable("t", 10**6, 8, 4, 0, pulled_rows=2, pushed_rows=2, lookups=1)
    # Two rows on 64 ranks reach at most two of them: 63 * (1 - (63/64)^2) pulls, 63 pushes.
    reached = 63 * (1 - (63 / 64) ** 2)
    assert sparse.frames_per_step(64) == pytest.approx(2 * reached + 2 * 63)
    assert reached < 2


def test_memory_per_rank_is_its_share_of_rows_state_and_index():
    # 500k rows each: 64 bytes of values, 64 of Adagrad sums, 24 of index; a step's 100 rows and grads.
    assert TABLE.memory_bytes(2) == pytest.approx(500_000 * (64 + 64 + 24) + 2 * 100 * 64)
    assert TABLE.memory_bytes(4) < TABLE.memory_bytes(2) / 1.9


def test_the_parameter_server_prediction_adds_the_tables_bytes_and_shards():
    measured = Measured(**{**vars(DENSE), "sparse_tables": (TABLE,)})
    dense, sparse = predict(DENSE, PS, 2), predict(measured, PS, 2)
    assert sparse.wire_bytes_per_step == int(dense.wire_bytes_per_step + TABLE.wire_bytes(2))
    assert sparse.memory_per_rank_bytes == int(dense.memory_per_rank_bytes + TABLE.memory_bytes(2))
    # Two more round trips a step (the lookup's pull, the push) and the rows' bytes.
    expected = dense.step_s + TABLE.wire_bytes(2) / DENSE.bandwidth + 2 * 2 * DENSE.latency_s
    assert sparse.step_s == pytest.approx(expected)
    assert sparse.fits is None  # no budget known: nothing checked


def test_a_table_over_the_budget_does_not_fit_until_enough_ranks_share_it():
    budget = 100 * MB  # the table's rows and sums alone are 128 MB, 152 MB with the index
    measured = Measured(**{**vars(DENSE), "sparse_tables": (TABLE,), "memory_budget_bytes": budget})
    predictions = [predict(measured, PS, n) for n in (1, 2, 4)]
    assert [p.fits for p in predictions] == [False, True, True]
    plan = Plan(measured, predictions, {}, [])
    rows = [line for line in plan.table().splitlines() if re.match(r"ParameterServer +\d", line)]
    assert ["does not fit" in row for row in rows] == [True, False, False]
    assert any("does not fit the memory budget" in line and "on 1 workers (157 MB" in line for line in plan.summary())


# ---- the calibration's estimate against a real 2-rank run ----------------------------------

ROWS, DIM, STEPS, BATCH = 200_000, 8, 6, 512


def _batches() -> List[torch.Tensor]:
    """Two id columns of one table per sample, Zipf-like (a few hot ids, a long tail)."""
    generator = torch.Generator().manual_seed(5)
    weights = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64)
    return [
        torch.multinomial(weights, 2 * BATCH, replacement=True, generator=generator).view(BATCH, 2)
        for _ in range(STEPS)
    ]


class _TwoColumns(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = ShardedEmbedding(ROWS, DIM, optimizer="adagrad", lr=0.1)
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # Two lookups of one table a step (a user's item and a candidate item): two pulls, one push.
        return self.head(torch.cat([self.items(ids[:, 0]), self.items(ids[:, 1])], dim=1))


def _gather(message: str) -> List[str]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, message)
    return out


def _real_worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, 2)
    runtime = ParameterServerRuntime(
        ParameterServer(max_staleness=0, timeout_s=30), cpu_env(rank, port, 2), _gather, "127.0.0.1"
    )
    try:
        net = runtime.prepare_model(_TwoColumns())
        optimizer = runtime.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.01))
        steps = []
        for ids in _batches():  # both ranks the same batches: each its own measurement of them
            before = runtime.sparse_wire_bytes
            optimizer.zero_grad()
            net(ids).pow(2).mean().backward()
            optimizer.step()
            steps.append(runtime.sparse_wire_bytes - before)
        dist.barrier()
        save_results({"bytes": steps}, out_dir, rank)
    finally:
        runtime.close()


def _estimate() -> SparseTable:
    """What the calibration's counting gives for the same batches (its own code, one process)."""
    net = _TwoColumns()
    (source,) = bind_counting(net)
    for ids in _batches():
        net(ids).pow(2).mean().backward()
        source.end_step()
    return source.table()


def test_the_estimated_bytes_per_step_match_a_real_two_rank_run(tmp_path):
    estimate = _estimate()
    assert estimate.lookups == 2 and estimate.pushed_rows < estimate.pulled_rows  # hot ids in both columns
    measured = [sum(r["bytes"]) / STEPS for r in spawn_ranks(_real_worker, 2, str(tmp_path))]
    # The model takes half of each lookup's rows as remote; the hash splits a few hundred rows
    # within a few percent of half.
    for per_step in measured:
        assert per_step == pytest.approx(estimate.wire_bytes(2), rel=0.05), (per_step, estimate)


def test_the_calibration_counts_each_step_of_a_table_and_its_optimizer_state():
    table = _estimate()
    assert (table.num_rows, table.dim, table.value_bytes, table.state_bytes_per_row) == (ROWS, DIM, 4, DIM * 4)
    batches = _batches()
    pulled = sum(len(torch.unique(ids[:, 0])) + len(torch.unique(ids[:, 1])) for ids in batches) / STEPS
    pushed = sum(len(torch.unique(ids)) for ids in batches) / STEPS
    assert (table.pulled_rows, table.pushed_rows) == (pytest.approx(pulled), pytest.approx(pushed))


def test_a_memory_budget_is_read_as_spark_reads_sizes_and_a_bad_one_fails_before_spark(tmp_path, capsys):
    from sparkdl.cli._plan import plan_main
    from sparkdl.planning.units import memory_bytes

    assert [memory_bytes(v) for v in ("4g", "512m", "4GB", 1000, None)] == [4 << 30, 512 << 20, 4 << 30, 1000, None]
    argv = ["--model", "torch.nn:Linear", "--data", str(tmp_path / "none.parquet"), "--features", "x"]
    argv += ["--label", "y", "--output", str(tmp_path / "out"), "--memory-budget", "lots"]
    assert plan_main(argv) == 2
    assert "--memory-budget='lots': give a size such as '4g'" in capsys.readouterr().err
