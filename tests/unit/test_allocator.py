"""sparkdl._task.allocator in fresh interpreters (the thresholds are per process): a 1 MiB block,
which glibc maps on its own at its start-up threshold, comes from the heap once the task raised
the thresholds, and a user's own allocator settings are left alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

#: The probe imports tests.malloc_probe: the interpreters start in the repository.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")

PROBE = r"""
import json, sys
from sparkdl._task.allocator import keep_step_memory
from tests.malloc_probe import mapped_blocks_added

kept = keep_step_memory() if sys.argv[1] == "keep" else None
print(json.dumps({"kept": kept, "mapped_blocks_added": mapped_blocks_added(1 << 20)}))
"""


def _probe(mode: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    environment.update(env)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        env=environment,
        cwd=REPO_ROOT,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fresh_process_maps_a_large_block_of_its_own_and_a_task_keeps_it_in_the_heap():
    assert _probe("plain") == {"kept": None, "mapped_blocks_added": 1}  # glibc's start-up threshold
    assert _probe("keep") == {"kept": True, "mapped_blocks_added": 0}


def test_the_users_own_allocator_settings_are_left_alone():
    # glibc's own tunable for the threshold, at its start-up value: the task must not override it.
    assert _probe("keep", MALLOC_MMAP_THRESHOLD_="131072") == {"kept": False, "mapped_blocks_added": 1}
    assert _probe("keep", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")["kept"] is False
