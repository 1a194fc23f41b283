"""The environment ``torchrun`` gives its processes, for the user's code in a barrier task.

Every task is one torchrun "node" of one process: ``LOCAL_RANK=0``, ``LOCAL_WORLD_SIZE=1`` and
``GROUP_RANK=RANK``. ``MASTER_ADDR``/``MASTER_PORT`` name the launch's rendezvous store (the
driver's :class:`~sparkdl._net.rendezvous_store.StoreServer`): in a ``sparkdl.run`` function the process group
exists already; in a child of ``sparkdl.launch`` the runner's ``env://`` handler turns them into an
authenticated :class:`~sparkdl._net.rendezvous_client.StoreClient` (:mod:`sparkdl._task.runner`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Mapping, Optional

#: Every variable :func:`torchrun_environment` sets (and :func:`environment` restores).
TORCHRUN_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)


def torchrun_environment(
    rank: int, world_size: int, master: tuple, run_id: str, restart_count: int = 0, max_restarts: int = 0
) -> Dict[str, str]:
    """The variables torchrun sets for ``rank`` of ``world_size``, one process per node.

    ``TORCHELASTIC_RUN_ID`` is set because Lightning recognizes torchrun by it; the restart
    count is the launch attempt minus one (a relaunch after a failure is torchrun's restart).
    """
    host, port = master[0], int(master[1])
    values = {
        "RANK": rank,
        "WORLD_SIZE": world_size,
        "LOCAL_RANK": 0,
        "LOCAL_WORLD_SIZE": 1,
        "GROUP_RANK": rank,
        "GROUP_WORLD_SIZE": world_size,
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": world_size,
        "ROLE_NAME": "default",
        "MASTER_ADDR": host,
        "MASTER_PORT": port,
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": restart_count,
        "TORCHELASTIC_MAX_RESTARTS": max_restarts,
    }
    return {name: str(value) for name, value in values.items()}


@contextlib.contextmanager
def environment(values: Mapping[str, Optional[str]]) -> Iterator[None]:
    """Sets ``values`` in ``os.environ`` (None removes a name) and restores every one of them
    afterwards: a reused Python worker must not carry one job's rank into the next task."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
