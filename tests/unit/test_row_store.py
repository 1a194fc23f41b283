"""The compact row store of a sparse table's shard: the same slots and rows as a dict of
``id -> slot`` would give, across growth of the arrays and rehashes of the index, and the index
within its bytes per row."""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from sparkdl.strategies.parameter_server.row_store import RowStore
from sparkdl.strategies.parameter_server.rows import RowOptimizer, initial_rows

DIM = 3


def _initial(ids: torch.Tensor) -> torch.Tensor:
    return initial_rows(7, 0, ids, DIM, 0.1, torch.float32)


def _batches(seed: int, count: int, size: int, high: int):
    generator = np.random.default_rng(seed)
    for _ in range(count):
        yield torch.from_numpy(generator.choice(high, size=size, replace=False).astype(np.int64))


def test_slots_match_a_dict_through_growth_and_rehashes():
    store = RowStore(DIM, torch.float32, RowOptimizer("adagrad", initial_accumulator=0.5))
    reference: Dict[int, int] = {}
    # Ids sharing their low 20 bits (the rows of one rank of a power-of-two world share low
    # bits of another hash): the buckets must not crowd.
    for ids in _batches(0, 60, 700, 5000):
        ids = ids << 20
        slots = store.slots_for(ids, _initial)
        for row in ids.tolist():
            reference.setdefault(row, len(reference))
        assert slots.tolist() == [reference[row] for row in ids.tolist()]
    assert store.count == len(reference) == len(set(reference))
    assert store.ids().tolist() == list(reference)
    held = store.export()
    assert torch.equal(held["values"], _initial(store.ids()))
    assert torch.equal(held["state.sum"], torch.full((store.count, DIM), 0.5))
    assert store.lookup(np.array([-5, 1 << 40, 3 << 20])).tolist()[:2] == [-1, -1]


def test_update_changes_only_the_rows_given_as_a_dense_table_would():
    optimizer = RowOptimizer("adam", lr=0.1)
    store = RowStore(DIM, torch.float64, optimizer)
    ids = torch.tensor([9, 4, 1000, 77])
    dense = _initial(torch.arange(1001)).to(torch.float64)
    state = optimizer.new_state(1001, DIM, torch.float64)
    store.slots_for(torch.arange(1001), lambda new: _initial(new).to(torch.float64))
    for step in range(3):
        grads = torch.randn(len(ids), DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        store.update(store.slots_for(ids, _initial), grads)
        rows, picked = dense[ids], {key: value[ids] for key, value in state.items()}
        optimizer.apply(rows, picked, grads)
        dense[ids] = rows
        for key, value in picked.items():
            state[key][ids] = value
    assert not torch.equal(dense, _initial(torch.arange(1001)).to(torch.float64))
    assert torch.equal(store.rows(store.slots_for(torch.arange(1001), _initial)), dense)
    held = store.export()
    assert all(torch.equal(held[f"state.{key}"], value) for key, value in state.items())
    assert held["state.step"].sum().item() == 3 * len(ids)


def test_load_replaces_every_row_and_the_index_finds_them():
    store = RowStore(DIM, torch.float32, RowOptimizer("sgd"))
    store.slots_for(torch.arange(500), _initial)
    ids = torch.tensor([12345, 3, 999_999_999_999])
    store.load(ids, torch.arange(9.0).view(3, DIM), {})
    assert store.count == 3 and store.lookup(np.array([3, 12345, 0, 999_999_999_999])).tolist() == [1, 0, -1, 2]
    assert torch.equal(store.rows(torch.tensor([2, 0])), torch.tensor([[6.0, 7.0, 8.0], [0.0, 1.0, 2.0]]))


def test_index_costs_16_to_24_bytes_a_held_row():
    store = RowStore(16, torch.float32, RowOptimizer("adagrad"))
    for ids in _batches(1, 25, 4096, 10**9):
        store.slots_for(ids, lambda new: torch.zeros(len(new), 16))
    rows = store.count
    buckets = store.nbytes - store.capacity * (8 + 2 * 16 * 4)
    assert 8 * rows <= buckets <= 16 * rows
    assert rows <= store.capacity <= 1.25 * rows + 64


def test_growth_stops_at_the_rows_a_rank_can_likely_own_and_goes_past_only_when_it_must():
    from sparkdl.strategies.parameter_server.row_store import likely_most_rows
    from sparkdl.strategies.parameter_server.rows import owners

    num_rows, world = 200_000, 2
    bound = likely_most_rows(num_rows, world)
    owned = [int((owners(torch.arange(num_rows), world) == rank).sum()) for rank in range(world)]
    assert max(owned) <= bound < num_rows // world + 3_000  # mean + 6 sd: about 2,700 past the half
    assert likely_most_rows(10, 4) == 10  # never more than the table
    store = RowStore(DIM, torch.float32, RowOptimizer("sgd"), most_rows=1_000)
    store.slots_for(torch.arange(900), _initial)
    store.slots_for(torch.arange(900, 990), _initial)  # a quarter more would be 1,125
    assert store.capacity == 1_000
    store.slots_for(torch.arange(990, 1_200), _initial)  # past the bound: grows as it must
    assert store.capacity >= 1_200
    assert torch.equal(store.export()["values"], _initial(torch.arange(1_200)))


_GROW_UNDER_A_LIMIT = """
import json, resource
import torch
from sparkdl.strategies.parameter_server.row_store import RowStore
from sparkdl.strategies.parameter_server.rows import RowOptimizer, initial_rows

def initial(ids):
    return initial_rows(7, 0, ids, 64, 0.1, torch.float32)

store = RowStore(64, torch.float32, RowOptimizer("adagrad"))
store.slots_for(torch.arange(1000), initial)
with open("/proc/self/status") as status:
    size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), size + (256 << 20)))  # as Spark's Python memory limit
try:
    store.slots_for(torch.arange(1000, 2_000_000), initial)  # 2M rows x 512 bytes: past the limit
    outcome = "grew"
except MemoryError as exc:
    outcome = str(exc)
held = store.export()
again = store.slots_for(torch.arange(0, 1000, 7), initial)  # rows held still found
print(json.dumps({
    "outcome": outcome,
    "count": store.count,
    "values_intact": bool(torch.equal(held["values"], initial(torch.arange(1000)))),
    "found": again.tolist() == list(range(0, 1000, 7)),
}))
"""


def test_a_shard_that_may_not_grow_raises_memory_error_and_keeps_its_rows():
    import json
    import subprocess
    import sys

    # A child process: the address-space limit must not bind the test runner.
    done = subprocess.run([sys.executable, "-c", _GROW_UNDER_A_LIMIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["outcome"].startswith("cannot map "), result
    assert "rows of a sparse table's shard" in result["outcome"]
    assert result["count"] == 1000 and result["values_intact"] and result["found"], result
