"""Device selection from Spark's GPU assignment, its restore, and the copy-ahead feed, without
Spark and without a GPU: the CUDA-available paths get ``cuda_available``/``device_count`` and
fake CUDA calls passed in. The real-Spark side is tests/integration/test_gpu_scheduling.py."""

from __future__ import annotations

import math
import threading
from typing import Any, Dict, List, Optional

import pytest
import torch

from sparkdl._driver import LaunchConfig
from sparkdl._runtime.device import (
    CUDA_VISIBLE_DEVICES,
    DeviceAssignment,
    check_assignments,
    check_gpu_request,
    physical_ids,
    select_device,
    selected,
)
from sparkdl._runtime.device_feed import DeviceFeed
from sparkdl._runtime.host_batches import Prefetcher
from sparkdl.errors import ConfigError

SETTINGS = (
    "spark.executor.resource.gpu.amount",
    "spark.task.resource.gpu.amount",
    "spark.executor.resource.gpu.discoveryScript",
)


# ---- select_device ---------------------------------------------------------------------------


def test_cuda_task_uses_exactly_the_gpu_spark_assigned():
    chosen = select_device({"gpu": ["1"]}, None, cuda_available=True, device_count=2)
    assert chosen.device == torch.device("cuda", 1)
    assert chosen.spark_addresses == ("1",) and chosen.physical_ids == ("1",)
    assert chosen.warning is None
    assert select_device({"gpu": ["0"]}, True, True, 2).device == torch.device("cuda", 0)


def test_addresses_are_ordinals_among_the_executors_visible_gpus():
    # Executor started with CUDA_VISIBLE_DEVICES=4,6: Spark's "1" is physical GPU 6, which this
    # process (seeing 4 and 6) calls cuda:1; a child process needs CUDA_VISIBLE_DEVICES=6.
    chosen = select_device({"gpu": ["1"]}, True, True, 2, visible_devices="4,6")
    assert chosen.device == torch.device("cuda", 1)
    assert chosen.physical_ids == ("6",) and chosen.visible_devices == "6"
    assert "physical 6" in chosen.note
    assert physical_ids(["0", "1"], " 4, 6 ") == ("4", "6")
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES='4,6' makes only 2 GPU"):
        select_device({"gpu": ["2"]}, True, True, 2, visible_devices="4,6")


@pytest.mark.parametrize("address", ["GPU-1f2e", "01", "-1", ""])
def test_non_ordinal_addresses_are_a_config_error_naming_the_discovery_script(address):
    with pytest.raises(ConfigError, match="discoveryScript"):
        select_device({"gpu": [address]}, None, True, 2)


def test_use_gpu_true_without_a_spark_gpu_names_the_settings():
    with pytest.raises(ConfigError) as raised:
        select_device({}, True, cuda_available=True, device_count=8)
    assert all(setting in str(raised.value) for setting in SETTINGS)


def test_auto_without_a_spark_gpu_is_cpu_and_never_grabs_unassigned_gpus():
    quiet = select_device({"gpu": []}, None, cuda_available=False, device_count=0)
    assert quiet.device == torch.device("cpu") and quiet.warning is None
    # torch sees GPUs, but Spark did not give this task one: another task may own them.
    loud = select_device({}, None, cuda_available=True, device_count=4)
    assert loud.device == torch.device("cpu")
    assert "torch sees 4 CUDA device(s) but Spark assigned no GPU" in loud.warning
    assert "use_gpu=False" in loud.warning


def test_use_gpu_false_is_cpu_even_with_an_assigned_gpu():
    chosen = select_device({"gpu": ["0"]}, False, cuda_available=True, device_count=1)
    assert chosen.device == torch.device("cpu")
    assert "use_gpu=False" in chosen.note and "stay unused" in chosen.note


def test_spark_gpu_without_cuda_in_torch():
    with pytest.raises(
        ConfigError, match=r"Spark assigned GPU 1 to this task, but torch has no CUDA: .*CPU-only build"
    ):
        select_device({"gpu": ["1"]}, True, cuda_available=False, device_count=0)
    with pytest.raises(ConfigError, match=r"torch \(CUDA 12.4\) finds no usable CUDA device"):
        select_device({"gpu": ["1"]}, True, cuda_available=False, device_count=0, cuda_build="12.4")
    fallback = select_device({"gpu": ["1"]}, None, cuda_available=False, device_count=0)
    assert fallback.device == torch.device("cpu")
    assert fallback.spark_addresses == ("1",)
    assert "Spark assigned GPU 1 to this task, but torch has no CUDA" in fallback.warning
    assert "use_gpu=True makes this an error" in fallback.warning


def test_an_address_torch_cannot_see_is_an_error_not_a_silent_other_gpu():
    with pytest.raises(ConfigError, match="torch sees only 1 CUDA device"):
        select_device({"gpu": ["1"]}, None, cuda_available=True, device_count=1)


def test_several_gpus_per_task_train_on_the_first_and_say_so():
    chosen = select_device({"gpu": ["2", "3"]}, None, True, 4)
    assert chosen.device == torch.device("cuda", 2)
    assert chosen.physical_ids == ("2", "3")
    assert "spark.task.resource.gpu.amount=1" in chosen.warning


@pytest.mark.parametrize("value", ["yes", 1, 0])
def test_use_gpu_must_be_a_bool_or_none(value):
    with pytest.raises(ConfigError, match="use_gpu"):
        select_device({}, value, False, 0)
    with pytest.raises(ConfigError, match="use_gpu"):
        LaunchConfig(num_workers=1, use_gpu=value)


# ---- driver and cross-rank checks ------------------------------------------------------------


def test_driver_check_fails_fast_when_tasks_request_no_gpu():
    for amount in (None, "0", "zero"):
        with pytest.raises(ConfigError) as raised:
            check_gpu_request({"spark.task.resource.gpu.amount": amount}.get, True)
        assert all(setting in str(raised.value) for setting in SETTINGS)
    check_gpu_request({"spark.task.resource.gpu.amount": "1"}.get, True)
    check_gpu_request({}.get, None)  # auto: each task decides from what it got
    check_gpu_request({}.get, False)


def _peer(kind: str, uuid: Optional[str] = None, address: str = "0", host: str = "10.0.0.1") -> Dict[str, Any]:
    return {"type": kind, "uuid": uuid, "address": address, "host": host}


def test_ranks_must_agree_on_the_device_kind():
    check_assignments([_peer("cpu"), _peer("cpu")])
    check_assignments([_peer("cuda", "GPU-a"), _peer("cuda", "GPU-b", host="10.0.0.2")])
    with pytest.raises(ConfigError, match=r"rank 0: cuda, rank 1: cpu"):
        check_assignments([_peer("cuda", "GPU-a"), _peer("cpu")])


def test_two_ranks_on_one_gpu_are_an_error_naming_both():
    # Fractional spark.task.resource.gpu.amount, or two workers on one host that discovered the
    # same GPUs: NCCL cannot run two ranks of one group on one GPU.
    with pytest.raises(ConfigError, match=r"ranks 0 and 2 were both given the same GPU \(GPU-a"):
        check_assignments([_peer("cuda", "GPU-a"), _peer("cuda", "GPU-b", "1"), _peer("cuda", "GPU-a")])


# ---- selected(): set and restore ---------------------------------------------------------------


class FakeCuda:
    def __init__(self, current: int) -> None:
        self.current = current
        self.calls: List[int] = []

    def current_device(self) -> int:
        return self.current

    def set_device(self, index: int) -> None:
        self.calls.append(index)
        self.current = index


def _cuda(index: int) -> DeviceAssignment:
    return DeviceAssignment("cuda", index, (str(index),), (str(index),), f"cuda:{index}")


def test_selected_sets_the_device_and_restores_it_even_after_an_error():
    cuda = FakeCuda(current=0)
    with selected(_cuda(1), environ={}, cuda=cuda) as device:
        assert device == torch.device("cuda", 1) and cuda.current == 1
    assert cuda.current == 0 and cuda.calls == [1, 0]
    with pytest.raises(RuntimeError, match="boom"):
        with selected(_cuda(3), environ={}, cuda=cuda):
            raise RuntimeError("boom")
    assert cuda.current == 0


def test_selected_never_narrows_cuda_visible_devices_and_undoes_user_changes():
    environ = {CUDA_VISIBLE_DEVICES: "4,6"}
    with selected(_cuda(1), environ=environ, cuda=FakeCuda(0)):
        assert environ[CUDA_VISIBLE_DEVICES] == "4,6"  # the executor's value, unchanged
        environ[CUDA_VISIBLE_DEVICES] = "6"  # user code in the task narrows it
    assert environ == {CUDA_VISIBLE_DEVICES: "4,6"}  # the next task of this worker maps from the executor's
    unset: Dict[str, str] = {}
    with selected(DeviceAssignment("cpu", None, (), (), "cpu"), environ=unset, cuda=None):
        unset[CUDA_VISIBLE_DEVICES] = "0"
    assert unset == {}


def test_selected_on_the_cpu_makes_no_cuda_call():
    class NoCuda:
        def current_device(self) -> int:
            raise AssertionError("CUDA touched on a CPU task")

        set_device = current_device

    with selected(DeviceAssignment("cpu", None, ("0",), ("0",), "cpu"), environ={}, cuda=NoCuda()) as device:
        assert device == torch.device("cpu")


# ---- DeviceFeed: copy the next batch ahead ----------------------------------------------------


class Source:
    """Host batches; ``ready`` says how many are available without waiting."""

    def __init__(self, count: int, ready: int, log: List[str]) -> None:
        self.items = [(torch.full((2,), float(i)), torch.tensor([i])) for i in range(count)]
        self.taken = 0
        self.ready = ready
        self.log = log
        self.closed = False

    def next(self):
        self.log.append(f"next {self.taken}")
        self.taken += 1
        self.ready = max(self.ready, self.taken)
        return self.items[self.taken - 1]

    def poll(self):
        if self.taken < self.ready and self.taken < len(self.items):
            self.log.append(f"poll {self.taken}")
            self.taken += 1
            return self.items[self.taken - 1]
        return None

    def close(self) -> None:
        self.closed = True


class FakeCopier:
    def __init__(self, log: List[str]) -> None:
        self.log = log

    def start(self, batch):
        index = int(batch[1].item())
        self.log.append(f"copy {index}")
        return batch, index

    def finish(self, batch, token) -> None:
        self.log.append(f"wait {token}")


def test_the_next_batch_is_copied_while_the_current_one_trains():
    log: List[str] = []
    feed = DeviceFeed(Source(3, ready=3, log=log), torch.device("cuda", 0), copier=FakeCopier(log))
    first = feed.next()
    assert int(first[1]) == 0
    # Batch 1's copy started before batch 0 was handed to the training step.
    assert log == ["next 0", "copy 0", "wait 0", "poll 1", "copy 1"]
    log.clear()
    assert int(feed.next()[1]) == 1 and log == ["wait 1", "poll 2", "copy 2"]


def test_a_batch_that_is_not_ready_is_not_waited_for_early():
    log: List[str] = []
    source = Source(3, ready=1, log=log)
    feed = DeviceFeed(source, torch.device("cuda", 0), copier=FakeCopier(log))
    assert int(feed.next()[1]) == 0
    assert log == ["next 0", "copy 0", "wait 0"]  # batch 1 not ready: step 0 starts without it
    log.clear()
    assert int(feed.next()[1]) == 1
    assert log == ["next 1", "copy 1", "wait 1"]
    feed.close()
    assert source.closed


def test_on_the_cpu_the_feed_passes_the_prefetched_batches_through():
    log: List[str] = []
    source = Source(2, ready=2, log=log)
    feed = DeviceFeed(source, torch.device("cpu"))
    assert [feed.next()[0] is source.items[i][0] for i in range(2)] == [True, True]
    assert log == ["next 0", "next 1"]  # no copies, no polling: today's behaviour


def test_prefetcher_poll_returns_ready_batches_without_waiting():
    import numpy as np

    gate = threading.Event()

    def produce():
        yield np.zeros((2, 3), np.float32), np.zeros(2, np.int64)
        gate.wait()
        yield np.ones((2, 3), np.float32), None

    prefetcher = Prefetcher(produce(), pin=False, device=torch.device("cpu"))
    try:
        features, labels = prefetcher.next()
        assert features.sum() == 0 and labels is not None
        assert prefetcher.poll() is None  # the second batch is held back: poll must not block
        gate.set()
        prefetcher._thread.join(timeout=30)  # the source is exhausted: everything is queued now
        features, labels = prefetcher.poll()
        assert features.sum() == 6 and labels is None
        with pytest.raises(StopIteration):
            prefetcher.poll()
    finally:
        prefetcher.close()


# ---- benchmarks/gpu_check.py on the CPU --------------------------------------------------------


def test_gpu_check_runs_end_to_end_on_the_cpu_without_pyspark(tmp_path):
    """The device check must run where there is no Spark: pyspark is made unimportable here."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    script = os.path.join(REPO_ROOT, "benchmarks", "gpu_check.py")
    output = tmp_path / "check.json"
    argv = [
        script,
        "--device",
        "cpu",
        "--tiny",
        "--steps",
        "12",
        "--warmup",
        "2",
        "--threads",
        "1",
        "--data",
        str(tmp_path / "data"),
        "--json",
        str(output),
    ]
    code = f"import sys, runpy; sys.modules['pyspark'] = None; sys.argv = {argv!r}; runpy.run_path({script!r}, run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(output.read_text())
    assert [run["precision"] for run in report["runs"]] == ["32", "bf16-mixed"]
    for run in report["runs"]:
        assert run["steps"] == 12 and run["skipped"] == 0
        assert 0 < run["busy_fraction"] <= 1 and run["samples_per_s"] > 0 and math.isfinite(run["loss"])
    assert report["loader"]["samples_per_s"] > 0 and report["h2d"]["pinned_gbps"] is None
    assert "| bf16-mixed |" in done.stdout and "verdict:" in done.stdout
    assert all(run["pinned_ring"] is None for run in report["runs"])  # the CPU pins nothing
    # The inference part: sparkdl's scorer over every row, per autocast, and the feed alone.
    scoring = report["scoring"]
    assert [run["precision"] for run in scoring["runs"]] == ["fp32", "bf16"]
    assert all(run["rows"] == report["sizes"]["rows"] and run["rows_per_s"] > 0 for run in scoring["runs"])
    assert scoring["feed"]["rows_per_s"] > 0 and "feed headroom" in done.stdout
