"""A training task's CPU flushes subnormal floats to zero (spark.sparkdl.flushDenormals): x86
computes on them in microcode, and a fit whose gradients underflow crawled (4.5x slower steps)."""

import pytest
import torch

from sparkdl._task.config import FLUSH_DENORMALS_CONF, flush_denormals
from sparkdl._task.entry import _task_cpu
from sparkdl.errors import ConfigError

SUBNORMAL = 1e-39  # below float32's smallest normal number, 1.18e-38


def survives() -> float:
    return float(torch.tensor([SUBNORMAL], dtype=torch.float32).mul(1.0))


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("", True), ("true", True), (" FALSE ", False)])
def test_the_setting_defaults_to_flushing(value, expected):
    assert flush_denormals(value) is expected


def test_a_bad_value_names_the_setting():
    with pytest.raises(ConfigError, match=f"{FLUSH_DENORMALS_CONF}='yes' must be true"):
        flush_denormals("yes")


def test_the_task_flushes_while_it_runs_and_leaves_the_worker_as_it_found_it():
    assert survives() == pytest.approx(SUBNORMAL, rel=1e-3)
    with _task_cpu(1, flush_denormals=True):
        if not torch.set_flush_denormal(True):  # the CPU has no such flag (not x86 with SSE): nothing to test
            pytest.fail("this CPU cannot flush subnormals; sparkdl's CI machines can")
        assert survives() == 0.0
    assert survives() == pytest.approx(SUBNORMAL, rel=1e-3)
    with _task_cpu(1, flush_denormals=False):
        assert survives() == pytest.approx(SUBNORMAL, rel=1e-3)
