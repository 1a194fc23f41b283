"""What an executor imports for a barrier task, and the lazily imported public surface.

A task unpickles the stage's closure, which imports sparkdl's task side; Python runs
``sparkdl/__init__`` and ``sparkdl/_task/__init__`` first. If those imported the whole
public surface, every executor's first task would also load pyspark.ml, pandas and the driver's
side of a launch (about half a second per worker of a cold fit's start-up: benchmarks/startup.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import sparkdl

#: The modules a fit's task payload refers to: the task entry point, the training loop, the
#: strategies, the Arrow reader, the dataset description and the batching spec.
TASK_MODULES = (
    "sparkdl._task.entry",
    "sparkdl._task.config",
    "sparkdl._task.fit_loop",
    "sparkdl.strategies",
    "sparkdl.data.readers.arrow",
    "sparkdl.data.dataset",
    "sparkdl.data.batching",
    "sparkdl.data.plan",
)
#: Driver-only modules a task must not load.
DRIVER_ONLY = (
    "pandas",
    "pyspark.ml",
    "pyspark.sql",
    "matplotlib",
    "sparkdl.estimator",
    "sparkdl._driver",
    "sparkdl.comparison",
)


def test_a_task_imports_none_of_the_driver_side():
    code = f"import json, sys\nfor name in {TASK_MODULES!r}: __import__(name)\nprint(json.dumps(sorted(m for m in {DRIVER_ONLY!r} if m in sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    assert loaded == [], f"a task's imports load driver-side modules: {loaded}"


@pytest.mark.parametrize("name", sparkdl.__all__)
def test_every_public_name_resolves_and_is_listed(name):
    value = getattr(sparkdl, name)
    assert value.__name__ == name
    assert name in dir(sparkdl)


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="no attribute 'TorchEstimater'"):
        sparkdl.TorchEstimater  # noqa: B018 - the access is the test


def test_after_the_warm_up_a_tasks_first_optimizer_step_does_not_import_torch_dynamo():
    # torch.optim's add_param_group imports torch._dynamo on its first call: 1.5 s of a cold fit.
    code = (
        "import json, sys\n"
        "from sparkdl._driver.warmup import _import_task_side\n"
        "list(_import_task_side(iter(())))\n"
        f"for name in {TASK_MODULES!r}: __import__(name)\n"
        "before = set(sys.modules)\n"
        "import torch\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
        "torch.nn.functional.cross_entropy(model(torch.randn(3, 4)), torch.tensor([0, 1, 1])).backward()\n"
        "optimizer.step()\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    imported = json.loads(
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    )
    assert not [name for name in imported if name.startswith("torch._dynamo")], (
        f"the first step still imports: {imported[:10]}"
    )


def test_after_the_warm_up_the_drivers_first_checks_import_neither_torch_dynamo_nor_pyarrow_dataset(tmp_path):
    # The optimizer check builds the driver's first optimizer; inspecting data imports pyarrow.dataset.
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"x": np.arange(8, dtype=np.float32), "label": np.arange(8) % 2}), str(tmp_path / "part-0.parquet")
    )
    code = (
        "import json, sys\n"
        "import torch\n"
        "from sparkdl._driver.warmup import _import_driver_side\n"
        "_import_driver_side()\n"
        "before = set(sys.modules)\n"
        "from sparkdl._driver.preflight import check_optimizer\n"
        "from sparkdl.data.dataset import inspect_dataset\n"
        f"inspect_dataset({str(tmp_path)!r}, ['x'], 'label')\n"
        "check_optimizer(lambda params: torch.optim.Adam(params), torch.nn.Linear(1, 2))\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    imported = json.loads(
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    )
    late = [name for name in imported if name.startswith(("torch._dynamo", "pyarrow.dataset", "pandas"))]
    assert not late, f"the first fit's checks still import: {late[:10]}"


def test_the_drivers_optimizer_check_imports_no_torch_dynamo_and_leaves_optimizers_as_they_were():
    # Without a warm-up: the check builds the process's first optimizer (1-3 s of torch._dynamo
    # otherwise); the next optimizer built in the process goes through torch's own wrapper again.
    code = (
        "import json, sys\n"
        "import torch\n"
        "from sparkdl._driver.preflight import check_optimizer\n"
        "module = torch.nn.Linear(4, 2)\n"
        "check_optimizer(lambda params: torch.optim.Adam(params, lr=1e-3), module)\n"
        "after_check = 'torch._dynamo' in sys.modules\n"
        "method = torch.optim.Optimizer.add_param_group.__wrapped__\n"
        "left = getattr(method, '__dynamo_disable', None) is not None\n"
        "torch.optim.SGD(module.parameters(), lr=0.1)\n"
        "cached = getattr(method, '__dynamo_disable', None)\n"
        "print(json.dumps([after_check, left, 'torch._dynamo' in sys.modules, cached is not None and cached is not method]))"
    )
    after_check, left, later, wrapped = json.loads(
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    )
    assert not after_check, "the driver's optimizer check imported torch._dynamo"
    assert not left, "the check left its cached value on Optimizer.add_param_group"
    assert later and wrapped, "a later optimizer no longer goes through torch._disable_dynamo"
