"""A model too large for a task's Python memory is refused before launch; a rank whose
allocation fails under Spark's limit says which limit and what to change."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import sparkdl
from sparkdl._driver.memory_check import check_model_memory, dense_bytes
from sparkdl._task.out_of_memory import explain_out_of_memory
from sparkdl.errors import ConfigError


class _Wide(torch.nn.Module):
    """8 M float32 parameters and a 1 M-float buffer: 34.3 MiB."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4000, 2000)
        self.register_buffer("table", torch.zeros(1_000_000))


def _conf(**settings: str):
    named = {key.replace("_", "."): value for key, value in settings.items()}
    return named.get


def test_dense_bytes_counts_parameters_and_buffers_but_not_sharded_embedding_rows():
    assert dense_bytes(_Wide()) == (4000 * 2000 + 2000 + 1_000_000) * 4

    class WithTable(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.items = sparkdl.ShardedEmbedding(50_000_000, 64)
            self.head = torch.nn.Linear(64, 1)

    assert dense_bytes(WithTable()) == (64 + 1) * 4


def test_weights_and_gradients_over_a_tasks_python_memory_are_refused_naming_the_setting():
    needed = 2 * dense_bytes(_Wide())  # 68.7 MiB
    with pytest.raises(ConfigError) as refused:
        check_model_memory(_Wide(), "allreduce", 2, _conf(spark_executor_pyspark_memory="64m"))
    text = str(refused.value)
    assert "_Wide's parameters and buffers take 34.3 MiB" in text
    assert "at least 68.7 MiB, more than the 64.0 MiB" in text and "spark.executor.pyspark.memory=64m" in text
    assert "sparkdl.ShardedEmbedding" in text and "ShardedDataParallel" in text
    # The budget is a task's share: two concurrent tasks of an executor split it.
    with pytest.raises(ConfigError, match="shared by 2 concurrent tasks"):
        check_model_memory(
            _Wide(), "allreduce", 2, _conf(spark_executor_pyspark_memory="128m", spark_executor_cores="2")
        )
    assert needed < 128 << 20
    check_model_memory(_Wide(), "allreduce", 2, _conf(spark_executor_pyspark_memory="128m"))  # fits


def test_a_python_memory_limit_without_pyarrows_system_allocator_is_warned_about_once(caplog, monkeypatch):
    from sparkdl._driver import memory_check

    monkeypatch.setattr(memory_check, "_warned", set())
    with caplog.at_level("WARNING", logger="sparkdl"):
        memory_check.warn_of_pyarrow_reservations(_conf(spark_executor_pyspark_memory="1g"))
        memory_check.warn_of_pyarrow_reservations(_conf(spark_executor_pyspark_memory="1g"))  # said already
    assert caplog.text.count("spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL=system") == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="sparkdl"):
        memory_check.warn_of_pyarrow_reservations(
            {"spark.executor.pyspark.memory": "2g", "spark.executorEnv.ARROW_DEFAULT_MEMORY_POOL": "system"}.get
        )
        memory_check.warn_of_pyarrow_reservations(_conf(spark_executor_memory="1g"))  # no Python limit
    assert caplog.text == ""


def test_no_python_memory_setting_means_no_limit_to_check_and_sharded_parameters_count_their_share():
    check_model_memory(_Wide(), "allreduce", 2, _conf(spark_executor_memory="16m"))  # the JVM's, not Python's
    check_model_memory(_Wide(), "sharded", 4, _conf(spark_executor_pyspark_memory="64m"))  # 18.5 MiB a rank
    with pytest.raises(ConfigError, match="its share on each of the ranks"):
        check_model_memory(_Wide(), "sharded", 1, _conf(spark_executor_pyspark_memory="64m"))


_ALLOCATE_UNDER_A_LIMIT = textwrap.dedent(
    """
    import json, os, resource, sys
    import torch
    from sparkdl._task.out_of_memory import explain_out_of_memory
    # What Spark's Python worker does with spark.executor.pyspark.memory: cap the address space.
    with open("/proc/self/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    limit = size + (256 << 20)
    os.environ["PYSPARK_EXECUTOR_MEMORY_MB"] = str(limit >> 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    found = {}
    for name, allocate in (
        ("torch", lambda: torch.empty(1 << 30, dtype=torch.uint8)),
        ("python", lambda: bytearray(1 << 30)),
    ):
        try:
            allocate()
        except BaseException as exc:
            told = explain_out_of_memory(exc, rank=3)
            found[name] = [type(exc).__name__, type(told).__name__, str(told), told.__cause__ is exc]
    print(json.dumps(found))
    """
)


def test_an_allocation_failing_under_sparks_python_limit_names_the_limit_and_what_to_change():
    # A child process: the limit must not bind the test runner.
    done = subprocess.run([sys.executable, "-c", _ALLOCATE_UNDER_A_LIMIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(found) == {"torch", "python"}
    assert found["torch"][0] == "RuntimeError" and found["python"][0] == "MemoryError"
    for raised, told, text, chained in found.values():
        assert told == "ConfigError" and chained, text
        assert text.startswith("rank 3 ran out of memory: each Python worker may use ")
        assert "its share of spark.executor.pyspark.memory" in text and "resident at its peak" in text
        assert "raise spark.executor.pyspark.memory" in text and "sparkdl.ShardedEmbedding" in text
        assert f"The allocation failed with {raised}" in text


def test_other_errors_pass_through_and_a_gpu_out_of_memory_gets_the_gpus_remedies():
    other = ValueError("a wrong shape")
    assert explain_out_of_memory(other, 0) is other
    unrelated = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    assert explain_out_of_memory(unrelated, 0) is unrelated
    from sparkdl.strategies.parameter_server.wire import ParameterServerError

    served = ParameterServerError(
        "parameter server on rank 0: ran out of memory serving rank 1: Unable to allocate 9 MiB for an array", 0
    )
    told = explain_out_of_memory(served, 1)
    assert isinstance(told, ConfigError) and told.__cause__ is served
    assert str(told).startswith("rank 1's request found a parameter server out of memory")
    assert "raise spark.executor.pyspark.memory" in str(told) and "Unable to allocate 9 MiB" in str(told)
    lost = ParameterServerError("rank 2's worker left the parameter server on rank 0", 2)
    assert explain_out_of_memory(lost, 1) is lost
    gpu = explain_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 1)
    assert isinstance(gpu, ConfigError)
    assert str(gpu).startswith("rank 1 ran out of GPU memory: lower batch_size")
    assert "Tried to allocate 2.00 GiB" in str(gpu)
