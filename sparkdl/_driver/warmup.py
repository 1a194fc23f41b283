"""Warm Python workers: the executors import torch and sparkdl before the first launch needs them.

The first barrier stage of a Spark application pays for new Python workers on the executors:
the executor's first Python task, forking a worker and importing torch, pyarrow, sparkdl's task
side and torch._dynamo (which the first optimizer built in a process imports): about 10 s on a
loaded 2-core machine, against 0.4 s for a later fit. Spark reuses a worker for later tasks
(``spark.python.worker.reuse``, on by default), so a small job that only imports those — one
task per rank, through ``mapInArrow``, the kind of Python worker the barrier stage uses, on
classic sessions and Spark Connect alike — moves that cost out of the first fit:

* :func:`warm_up` (public as ``sparkdl.warm_up``), called when the session is created (a
  notebook's first cell, a job's start), runs it while the user's own code goes on;
* ``fit``/``run`` on a DataFrame start it themselves, in the background, while the driver
  materializes the DataFrame. (With data read in place the driver's preparation is too short to
  hide it behind: the warm-up job would only run before the barrier stage instead of inside it.)

The driver's own first-fit imports (pyarrow.dataset, the launcher) run beside the job, on a
thread of their own. (Its optimizer check imports no torch._dynamo: sparkdl._driver.preflight.)

Once per application; best effort: a failure is logged at debug level and fails nothing.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterator, Optional, Set

logger = logging.getLogger("sparkdl")

#: The Spark job group of the warm-up job on a classic session.
JOB_GROUP = "sparkdl-warm-up"

_lock = threading.Lock()
_warmed: Set[str] = set()


def warm_up(spark: Any = None, num_workers: Optional[int] = None, wait: bool = False) -> None:
    """Starts the executors' Python workers and imports torch and sparkdl in them, once per
    application, in the background; the driver imports what its first fit needs meanwhile.

    Args:
        spark: the session (default: the active one).
        num_workers: tasks to warm (default: every task slot of the cluster).
        wait: block until the workers are warm.
    """
    if spark is None:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
        if spark is None:
            return
    key = _application(spark)
    with _lock:
        if key is None or key in _warmed:
            return
        _warmed.add(key)
    tasks = num_workers or _slots(spark)
    threads = [
        threading.Thread(target=_run, args=(spark, max(1, int(tasks))), name="sparkdl-warm-up", daemon=True),
        # The driver's part runs beside the job (which only waits on the JVM), not before it.
        threading.Thread(target=_import_driver_side, name="sparkdl-warm-up-driver", daemon=True),
    ]
    for thread in threads:
        thread.start()
    if wait:
        for thread in threads:
            thread.join()


def _slots(spark: Any) -> int:
    """Every task slot of a classic session's cluster; 2 when a Connect client cannot ask."""
    from sparkdl._spark import is_connect

    if is_connect(spark):
        return 2
    try:
        jsc = spark.sparkContext._jsc.sc()
        return max(1, int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile())))
    except Exception:  # noqa: BLE001 - executors not registered yet
        return spark.sparkContext.defaultParallelism


def _application(spark: Any) -> Any:
    from sparkdl._spark import is_connect

    try:
        if is_connect(spark):
            return f"connect:{spark.session_id}"
        return f"classic:{spark.sparkContext.applicationId}"
    except Exception:  # noqa: BLE001 - a stopped session: nothing to warm
        return None


def _run(spark: Any, tasks: int) -> None:
    from sparkdl._spark import is_connect

    try:
        if not is_connect(spark):
            spark.sparkContext.setJobGroup(JOB_GROUP, "sparkdl: starting the executors' Python workers")
        spark.range(0, tasks, 1, tasks).mapInArrow(_import_task_side, "ready int").collect()
    except Exception as exc:  # noqa: BLE001 - only an optimization
        logger.debug("warming the executors' Python workers failed: %s", exc)


def _import_driver_side() -> None:
    """What the driver's first fit imports: pyarrow.dataset (inspecting the data; it imports
    pandas) and the launcher. Once per process; a failure here fails nothing (the fit imports
    them again)."""
    try:
        import pyarrow.dataset  # noqa: F401

        import sparkdl._driver.preflight  # noqa: F401
        import sparkdl._driver.stage  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - only an optimization
        logger.debug("importing the driver side ahead of the first fit failed: %s", exc)


def _import_task_side(batches: Iterator[Any]) -> Iterator[Any]:
    import pyarrow as pa
    import torch._dynamo  # noqa: F401 - torch.optim's first optimizer imports it (add_param_group): 1.5 s

    import sparkdl._task.entry  # noqa: F401 - torch, the channel, the store
    import sparkdl.context  # noqa: F401 - the data path, the strategies
    import sparkdl.data.readers.arrow  # noqa: F401

    for _ in batches:
        pass
    yield pa.RecordBatch.from_pydict({"ready": [1]}, schema=pa.schema([("ready", pa.int32())]))
