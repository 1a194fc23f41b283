"""Spark's GPU scheduling, for real, with fake GPUs: executors discover GPUs through a discovery
script, tasks request them, and sparkdl must honour exactly that assignment.

torch here has no CUDA, so the CUDA branch itself is unit-tested (tests/unit/test_device.py);
this test runs the selection, its errors and fallbacks, the cross-rank check and the restore of
the task's environment inside real Spark barrier tasks (gpu_scheduling_app.py, a separate Spark
application with GPU resources).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

import sparkdl
from sparkdl.errors import ConfigError
from tests.conftest import REPO_ROOT

APP = os.path.join(REPO_ROOT, "tests", "integration", "gpu_scheduling_app.py")
PHYSICAL = {"0": "4", "1": "6"}  # the executors' CUDA_VISIBLE_DEVICES=4,6


def _discovery_script(directory) -> str:
    """Like Spark's own tests' fake scripts, but the first worker to run it claims GPU 0 and the
    second GPU 1 (mkdir is atomic), so the two tasks get different addresses."""
    claims = directory / "claims"
    claims.mkdir()
    script = directory / "discover_gpus.sh"
    script.write_text(
        "#!/bin/bash\n"
        f'if mkdir "{claims}/gpu0" 2>/dev/null; then\n'
        '  echo \'{"name": "gpu", "addresses": ["0"]}\'\n'
        "else\n"
        '  echo \'{"name": "gpu", "addresses": ["1"]}\'\n'
        "fi\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(script)


def _what_failed(stderr: str) -> str:
    """The app's Python traceback and the JVM's exception lines, without the JVM's stack frames
    (a stopped application's worker threads print long stacks that would hide the cause)."""
    lines = [
        line for line in stderr.splitlines() if not line.lstrip().startswith("at ") and not line.startswith("\tat ")
    ]
    text = "\n".join(lines)
    start = text.rfind("Traceback (most recent call last)")
    return text[start : start + 6000] if start >= 0 else text[-6000:]


@pytest.fixture(scope="module")
def gpu_app(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpu-scheduling")
    output = directory / "results.json"
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run(
        [sys.executable, APP, _discovery_script(directory), str(output)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 0, (done.stdout[-3000:], _what_failed(done.stderr))
    return json.loads(output.read_text())


@pytest.mark.slow
def test_each_rank_sees_the_gpu_spark_assigned_and_falls_back_to_cpu_without_cuda(gpu_app):
    ranks = gpu_app["auto"]
    assert [r["rank"] for r in ranks] == [0, 1]
    # Spark gave the two tasks different GPUs, and sparkdl's choice is exactly Spark's.
    assert sorted(r["resources"]["gpu"][0] for r in ranks) == ["0", "1"]
    for rank in ranks:
        address = rank["resources"]["gpu"][0]
        assert rank["spark_addresses"] == rank["resources"]["gpu"] == [address]
        assert rank["physical_ids"] == [PHYSICAL[address]] and rank["visible_devices"] == PHYSICAL[address]
        # torch is a CPU build: use_gpu=None trains on the CPU, over gloo, and says why.
        assert rank["device"] == "cpu" and rank["backend"] == "gloo"
        assert rank["warning"].startswith(
            f"Spark assigned GPU {address} (physical {PHYSICAL[address]} through the executor's CUDA_VISIBLE_DEVICES) "
            f"to this task, but torch has no CUDA"
        )
        # sparkdl selects a GPU with set_device; it never narrows the variable in the task.
        assert rank["env_in_task"] == "4,6"
    # The fallback warning reached the driver from both ranks.
    for index in (0, 1):
        assert any(
            m.startswith("WARNING") and f"[rank {index}]" in m and "torch has no CUDA" in m
            for m in gpu_app["auto_logs"]
        )


@pytest.mark.slow
def test_the_task_environment_is_restored_for_the_next_task_of_the_worker(gpu_app):
    trained_in = {r["pid"] for r in gpu_app["auto"]}
    after = {entry["pid"]: entry["env"] for entry in gpu_app["after"]}
    reused = trained_in & set(after)
    assert reused, f"no Python worker was reused (train {trained_in}, after {set(after)})"
    # train_fn changed CUDA_VISIBLE_DEVICES; the next task of the same worker sees the executor's.
    assert all(after[pid] == "4,6" for pid in reused)


@pytest.mark.slow
def test_use_gpu_true_without_cuda_fails_once_with_a_clear_error(gpu_app):
    required = gpu_app["required"]
    assert required is not None
    assert required["types"][0] == "ConfigError"
    assert "but torch has no CUDA" in required["message"] and "CPU-only build" in required["message"]
    # A configuration error is not retried: max_failures=2 would add "(attempt 3; max_failures=2)".
    assert "(attempt" not in required["message"] and "max_failures" not in required["message"]


@pytest.mark.slow
def test_use_gpu_false_ignores_assigned_gpus_and_precision_reaches_the_tasks(gpu_app):
    for rank in gpu_app["cpu_bf16"]:
        assert rank["device"] == "cpu" and rank["warning"] is None
        assert "use_gpu=False" in rank["note"] and "stay unused" in rank["note"]
        assert rank["precision"] == "bf16-mixed" and rank["autocast_dtype"] == str(torch.bfloat16)


@pytest.mark.spark
def test_scoring_tasks_get_the_gpu_spark_assigns_and_use_gpu_true_without_cuda_is_a_clear_error(gpu_app):
    # Each scoring task was given one of the two GPUs (the application asks one per task); with
    # a CPU build of torch, unset useGpu falls back to the CPU and scores every row.
    assert gpu_app["inference_rows"] == 64
    builds = gpu_app["inference_builds"]
    assert builds and all(len(b["resources"].get("gpu", [])) == 1 for b in builds), builds
    assert {a for b in builds for a in b["resources"]["gpu"]} <= {"0", "1"}, builds
    message = gpu_app["inference_required"]
    assert message is not None and "torch has no CUDA" in message and "install a CUDA build of torch" in message


def test_use_gpu_true_on_an_application_without_gpu_resources_fails_before_launch(spark):
    with pytest.raises(ConfigError) as raised:
        sparkdl.run(lambda ctx: None, num_workers=2, use_gpu=True, spark=spark, progress=False)
    for setting in (
        "spark.task.resource.gpu.amount",
        "spark.executor.resource.gpu.amount",
        "spark.executor.resource.gpu.discoveryScript",
    ):
        assert setting in str(raised.value)
