"""Fitted ShardedEmbedding tables as files (``ParameterServer(tables_dir=...)``), without Spark:

* three ranks over real gloo and real PS connections train a table, then ``final_module``
  writes each rank's rows; the files-backed lookup equals the whole-table path (``gather``)
  bit for bit, for touched and untouched ids, on every rank, and in a fresh model loaded from
  the state dict (which carries a reference, not rows);
* each part holds only its rank's rows, sorted; nothing went through rank 0;
* a missing part file, another table's files: a DataError naming the file and the table;
* a saved model's tables are copied and referred to relatively; a table on another filesystem
  is copied to a local directory once per process.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sparkdl.errors import ConfigError, DataError
from sparkdl.strategies.parameter_server import ParameterServer, ShardedEmbedding, table_files
from sparkdl.strategies.parameter_server.rows import initial_rows, owners
from sparkdl.strategies.parameter_server.runtime import ParameterServerRuntime
from sparkdl.strategies.parameter_server.table_files import TableFiles, TableInfo
from tests.gloo import cpu_env, join_group, save_results, spawn_ranks

ROWS, DIM, WORLD = 5000, 3, 3


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.items = ShardedEmbedding(ROWS, DIM, mode="sum", optimizer="adam", lr=0.05, init_std=0.3, seed=4)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.items(ids)).squeeze(1)


def _gather(message: str) -> List[str]:
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, message)
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    join_group(rank, port, WORLD)
    tables_dir = os.path.join(out_dir, "tables")
    strategy = ParameterServer(max_staleness=0, timeout_s=30, tables_dir=tables_dir)
    runtime = ParameterServerRuntime(strategy, cpu_env(rank, port, WORLD), _gather, "127.0.0.1")
    try:
        torch.manual_seed(0)
        net = runtime.prepare_model(_Net())
        optimizer = runtime.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.01))
        generator = torch.Generator().manual_seed(rank)
        for _ in range(6):
            ids = torch.randint(0, ROWS // 2, (32, 4), generator=generator)  # the upper half stays untouched
            optimizer.zero_grad()
            net(ids).pow(2).mean().backward()
            optimizer.step()
        dist.barrier()  # every push is in
        held = runtime.sparse.shard(0).held_ids()
        whole = runtime.sparse.gather(0)  # the whole-table path, streamed to rank 0
        runtime.final_module(net)
        net.eval()
        probe = torch.arange(ROWS).view(-1, 1)
        results: Dict[str, Any] = {
            "held": held,
            "whole": whole,
            "weight": net.items._buffers.get("weight"),
            "files_url": net.items.table_files.url,
            "lookup": net.items(probe),  # mode="sum" over bags of one: the rows
            "state": net.state_dict(),
        }
    finally:
        runtime.close()
    save_results(results, out_dir, rank)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> List[Dict[str, Any]]:
    return spawn_ranks(_worker, WORLD, str(tmp_path_factory.mktemp("table_files")))


def test_every_rank_looks_ids_up_in_the_files_exactly_as_in_the_gathered_table(fitted):
    whole = fitted[0]["whole"]
    assert whole.shape == (ROWS, DIM)
    touched = torch.unique(torch.cat([r["held"] for r in fitted]))
    assert 0 < len(touched) < ROWS // 2 + 1 and int(touched.max()) < ROWS // 2
    initial = initial_rows(4, 0, torch.arange(ROWS), DIM, 0.3, torch.float32)
    assert not torch.equal(whole[touched], initial[touched])  # the touched rows trained
    for result in fitted:
        assert result["weight"] is None  # no rank holds the table
        assert torch.equal(result["lookup"], whole)  # touched and untouched rows, bit for bit
        assert result["files_url"] == fitted[0]["files_url"]


def test_each_part_holds_its_ranks_rows_sorted_and_the_manifest_describes_the_table(fitted):
    url = fitted[0]["files_url"]
    directory = url[len("file://") :]
    manifest = json.loads(open(os.path.join(directory, "manifest.json")).read())
    assert manifest["num_rows"] == ROWS and manifest["dim"] == DIM and manifest["dtype"] == "float32"
    assert manifest["world_size"] == WORLD and manifest["seed"] == 4 and manifest["init_std"] == 0.3
    assert [p["rank"] for p in manifest["parts"]] == [0, 1, 2]
    whole = fitted[0]["whole"]
    for rank, part in enumerate(manifest["parts"]):
        ids = np.load(os.path.join(directory, part["ids"]), mmap_mode="r")
        values = np.load(os.path.join(directory, part["values"]), mmap_mode="r")
        assert len(ids) == part["rows"] == len(fitted[rank]["held"])
        assert np.all(np.diff(ids) > 0)  # sorted, distinct
        assert bool((owners(torch.from_numpy(np.array(ids)), WORLD) == rank).all())
        assert torch.equal(torch.from_numpy(np.array(values)), whole[torch.from_numpy(np.array(ids))])
    assert manifest["rows_stored"] == sum(len(r["held"]) for r in fitted)


def test_a_fresh_model_loads_the_reference_not_rows_and_can_load_the_full_table_when_asked(fitted):
    state = fitted[1]["state"]
    assert "items.weight" not in state and state["items.table_files"].dtype == torch.uint8
    fresh = _Net()  # what the driver and a loaded TorchModel build
    fresh.load_state_dict(state)
    fresh.eval()
    ids = torch.tensor([[0, 7, 4999], [2, 2, 3]])
    whole = fitted[0]["whole"]
    assert torch.equal(fresh.items(ids), whole[ids].sum(1))
    copied = pickle.loads(pickle.dumps(fresh))  # how executors get a module: the reference only
    assert "_parts" not in copied.items.table_files.__getstate__()
    assert torch.equal(copied.items(ids), whole[ids].sum(1))
    fresh.train()
    with pytest.raises(ConfigError, match="holds a fitted table"):
        fresh(ids)
    fresh.eval()
    assert torch.equal(fresh.items.load_full_table(), whole)  # explicit: the table in memory
    assert torch.equal(fresh.state_dict()["items.weight"], whole) and fresh.items.table_files is None


# ---- one process: bad files, saving, other filesystems -------------------------------------------


def _small_table(directory: str, world: int = 2) -> TableInfo:
    info = TableInfo("emb", 0, 100, 2, "float32", 1, 0.5)
    ids = np.array([3, 50, 7, 99, 64, 12], dtype=np.int64)
    values = np.arange(len(ids) * 2, dtype=np.float32).reshape(-1, 2) + 100
    owner = owners(torch.from_numpy(ids), world).numpy()
    parts = []
    for rank in range(world):
        mine = owner == rank
        parts.append(table_files.write_part(directory, rank, ids[mine], lambda at, v=values[mine]: v[at], info))
    table_files.write_manifest(directory, info, world, parts)
    return info


def _expected(info: TableInfo, ids: torch.Tensor) -> torch.Tensor:
    stored = {3: 0, 50: 1, 7: 2, 99: 3, 64: 4, 12: 5}
    out = initial_rows(info.seed, info.table, ids, info.dim, info.init_std, torch.float32)
    for i, row in enumerate(ids.tolist()):
        if row in stored:
            out[i] = torch.tensor([100.0 + 2 * stored[row], 101.0 + 2 * stored[row]])
    return out


def test_a_lookup_takes_stored_rows_and_computes_the_others(tmp_path):
    info = _small_table(str(tmp_path))
    ids = torch.tensor([99, 0, 3, 3, 12, 98, 64])
    assert torch.equal(TableFiles(str(tmp_path), info).rows(ids), _expected(info, ids))
    assert torch.equal(TableFiles(str(tmp_path), info).full_table(), _expected(info, torch.arange(100)))


def test_a_missing_part_or_another_tables_files_is_a_data_error_naming_them(tmp_path):
    info = _small_table(str(tmp_path))
    module = ShardedEmbedding(100, 2, init_std=0.5, seed=1).eval()
    module.attach_files(TableFiles(str(tmp_path), info))
    os.remove(tmp_path / "part-00001.values.npy")
    with pytest.raises(
        DataError,
        match=r"ShardedEmbedding 'emb' \(table 0, 100 rows\): cannot read its part file "
        r".*part-00001\.values\.npy",
    ):
        module(torch.tensor([1, 2]))
    other = TableFiles(str(tmp_path), TableInfo("emb", 0, 100, 2, "float32", 2, 0.5))  # another seed
    with pytest.raises(DataError, match="hold another table"):
        other.rows(torch.tensor([1]))
    with pytest.raises(DataError, match="cannot read its table files' manifest"):
        TableFiles(str(tmp_path / "nowhere"), info).rows(torch.tensor([1]))


def test_the_fits_completeness_check_finds_a_part_this_host_cannot_see_without_reading_rows(tmp_path):
    info = _small_table(str(tmp_path))
    files = TableFiles(str(tmp_path), info)
    files.check_complete()  # every part there
    assert files._parts is None  # nothing mapped or copied: only the manifest read and the files stat'ed
    os.remove(tmp_path / "part-00001.ids.npy")  # what another host's rank wrote to its own local disk
    with pytest.raises(DataError, match=r"part files not found at .*part-00001\.ids\.npy"):
        files.check_complete()


def test_saving_copies_the_files_and_refers_to_them_relatively(tmp_path):
    info = _small_table(str(tmp_path / "run"))
    state = {"emb.table_files": table_files.encode_reference(str(tmp_path / "run"), info), "head": torch.ones(1)}
    saved = table_files.save_tables(state, str(tmp_path / "model"))
    assert table_files.decode_reference(saved["emb.table_files"])[0] == "tables/table-0"
    assert sorted(os.listdir(tmp_path / "model" / "tables" / "table-0")) == sorted(os.listdir(tmp_path / "run"))
    os.rename(tmp_path / "model", tmp_path / "moved")  # a saved model can move (MLflow downloads it)
    resolved = table_files.resolve_tables(saved, str(tmp_path / "moved"))
    url, _ = table_files.decode_reference(resolved["emb.table_files"])
    ids = torch.arange(100)
    assert torch.equal(TableFiles(url, info).rows(ids), _expected(info, ids))
    assert table_files.save_tables({"w": torch.ones(1)}, str(tmp_path / "x"))["w"].item() == 1.0  # no tables
    again = table_files.save_tables(resolved, str(tmp_path / "moved"))  # where it was loaded from: as it is
    assert table_files.decode_reference(again["emb.table_files"])[0] == "tables/table-0"
    shutil.rmtree(tmp_path / "moved" / "tables")  # what write().overwrite() onto that directory does first
    with pytest.raises(DataError, match="cannot read its table files' manifest"):
        table_files.save_tables(resolved, str(tmp_path / "moved"))


def test_a_table_on_another_filesystem_is_copied_here_once_per_process(tmp_path):
    import fsspec

    memory = fsspec.filesystem("memory")
    info = _small_table(str(tmp_path))
    for name in os.listdir(tmp_path):
        memory.pipe(f"/tables/t0/{name}", (tmp_path / name).read_bytes())
    files = TableFiles("memory://tables/t0", info)
    ids = torch.tensor([99, 0, 3, 12, 98])
    assert torch.equal(files.rows(ids), _expected(info, ids))
    local = table_files.local_copy("memory://tables/t0")
    assert local == table_files.local_copy("memory://tables/t0") and os.path.isdir(local)
    assert sorted(os.listdir(local)) == sorted(os.listdir(tmp_path))


# ---- the driver's check before a fit launches ------------------------------------------------------


def test_tables_too_large_to_return_whole_are_refused_with_the_setting_that_writes_them_sharded(tmp_path):
    from sparkdl._driver.table_return import check_table_return

    model = torch.nn.Sequential(ShardedEmbedding(20_000_000, 16), torch.nn.Linear(16, 1))  # 1.2 GiB of rows
    heaps = {"spark.driver.memory": "6g", "spark.executor.memory": "3g"}
    with pytest.raises(ConfigError, match=r"take 1\.2 GiB.*1/8 of spark\.executor\.memory=3g allows \(384\.0 MiB\)"):
        check_table_return(model, ParameterServer(), heaps.get)
    with pytest.raises(ConfigError, match=r"spark\.driver\.maxResultSize=100m allows.*ParameterServer\(tables_dir="):
        check_table_return(model, ParameterServer(), {**heaps, "spark.driver.maxResultSize": "100m"}.get)
    # The recommendation example's 305 MB of tables with its 3 GB / 6 GB heaps, as it runs.
    check_table_return(torch.nn.Sequential(ShardedEmbedding(20_000_000, 4)), ParameterServer(), heaps.get)
    check_table_return(torch.nn.Linear(2, 1), ParameterServer(), {}.get)  # no tables: nothing to return
    check_table_return(model, ParameterServer(tables_dir=str(tmp_path)), {}.get)  # sharded: any size
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"ParameterServer\(tables_dir=\.\.\.\)=.*cannot be written"):
        check_table_return(model, ParameterServer(tables_dir=str(tmp_path / "file")), {}.get)


# ---- MLflow: the logged model carries its tables ------------------------------------------------------


class _SmallNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = ShardedEmbedding(100, 2, init_std=0.5, seed=1)

    def forward(self, item: torch.Tensor) -> torch.Tensor:
        return self.emb(item).sum(-1)


def test_an_mlflow_model_carries_its_table_files_and_predicts_from_them(tmp_path, monkeypatch):
    import mlflow
    import pandas as pd

    from sparkdl.model import TorchModel
    from sparkdl.tracking import load_model, log_model

    info = _small_table(str(tmp_path / "run"))
    net = _SmallNet()
    net.emb.attach_files(TableFiles(str(tmp_path / "run"), info))
    rows = pd.DataFrame({"item": np.array([3, 0, 99, 12], dtype=np.int64)})
    model = TorchModel.from_state(net.state_dict(), model=_SmallNet, inputs={"item": "item"}, example=rows)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    try:
        mlflow.set_experiment("sparkdl-tables")
        logged = log_model(model)
        for name in os.listdir(tmp_path / "run"):
            os.remove(tmp_path / "run" / name)  # the logged model holds its own copy
        expected = _expected(info, torch.tensor([3, 0, 99, 12])).sum(-1).double().numpy()
        np.testing.assert_array_equal(mlflow.pyfunc.load_model(logged.model_uri).predict(rows), expected)
        back = load_model(logged.model_uri)  # downloaded; its table files stay while it is used
        assert torch.equal(
            back.module.emb.rows(torch.tensor([3, 0, 99, 12])).sum(-1).double(), torch.from_numpy(expected)
        )
    finally:
        mlflow.set_tracking_uri(None)
