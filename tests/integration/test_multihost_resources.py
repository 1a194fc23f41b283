"""``resources=`` on a standalone cluster of namespace hosts with (fake) GPUs: two worker hosts
with 2 cores and one GPU each, each discovered by the worker's discovery script at a different
address per host, as on a real cluster whose machines number their GPUs differently. The
application's default tasks take 1 core and no GPU (its ETL); the training stage asks for 2 cores
and 1 GPU per task with its own resource profile.

torch here has no CUDA: what is real is Spark's scheduling (the worker's discovery, the
executors' GPU resources, the profile's slots and assignment) and what sparkdl makes of it on
each rank. Needs root (CAP_NET_ADMIN), as CI has.
"""

from __future__ import annotations

import stat

import pytest

from tests.integration.test_multihost import WORKERS, _drive, cluster_up

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

#: The GPU address each worker host's discovery script reports.
GPU_OF_HOST = {"sparkdl-h1": "3", "sparkdl-h2": "7"}


def _discovery_script(directory) -> str:
    script = directory / "discover_gpus.sh"
    cases = "".join(
        f'  {host}) echo \'{{"name": "gpu", "addresses": ["{address}"]}}\' ;;\n'
        for host, address in GPU_OF_HOST.items()
    )
    script.write_text(
        f'#!/bin/bash\ncase "$(hostname)" in\n{cases}  *) echo \'{{"name": "gpu", "addresses": []}}\' ;;\nesac\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(script)


def test_training_runs_with_its_own_cpus_and_gpu_per_task_while_etl_keeps_the_default(tmp_path):
    script = _discovery_script(tmp_path)
    with cluster_up(
        "sdr",
        str(tmp_path / "cluster"),
        "--hosts",
        "3",
        "--cores",
        "2",
        "--spark-conf",
        "spark.worker.resource.gpu.amount=1",
        "--spark-conf",
        f"spark.worker.resource.gpu.discoveryScript={script}",
    ) as (env, _state):
        (line,) = _drive(
            env,
            tmp_path / "out",
            "resources",
            conf=["spark.executor.cores=2", "spark.executor.resource.gpu.amount=1"],
        )
    assert line["ok"], f"{line.get('error')}\n{line.get('traceback', '')}"
    ranks = line["ranks"]
    # One rank per worker host, each with the GPU its own host's worker discovered.
    assert sorted(rank["host"] for rank in ranks) == WORKERS, ranks
    for rank in ranks:
        assert rank["gpus"] == [GPU_OF_HOST[rank["host"]]], ranks
        assert rank["spark_addresses"] == rank["gpus"], ranks  # sparkdl selected that assignment
        # 2 CPUs per task from the profile (the application's default is 1): 2 threads.
        assert rank["cpus"] == 2 and rank["torch_threads"] == 2 and rank["omp"] == "2", ranks
    # Spark's status store (its listener's and UI's data): the ETL around the fit ran with the
    # default profile, the training stage with its own.
    assert line["etl_before"] == [0] and line["etl_after"] == [0], line
    (profile,) = line["train_profiles"]
    assert profile != 0, line
    # TorchModel.transform with the same Resources: its stage ran with that profile, each
    # scoring task on its host's GPU with 2 torch threads, and every row was scored.
    assert line["scored"] == 200, line
    assert profile in line["score_profiles"] and 0 not in line["score_profiles"][1:], line
    builds = line["score_builds"]
    assert builds and all(len(b["resources"]["gpu"]) == 1 and b["threads"] == 2 for b in builds), builds
    # Two 2-core executors: 4 default slots (1 CPU), 2 for the profile (2 CPUs and the one GPU).
    assert line["slots"] == {"default": 4, "profile": 2}, line
    too_big = line["too_big"]
    assert too_big is not None and too_big["seconds"] < 15, too_big
    assert "(id " in too_big["error"] and "4 CPUs, 1 GPU per task)" in too_big["error"], too_big
    assert (
        "more than one executor has (spark.executor.cores=2; they offer 2 executor(s) with 2 core(s), 1 GPU(s) each)"
        in too_big["error"]
    ), too_big
