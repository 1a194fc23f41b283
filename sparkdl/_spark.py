"""The Spark session sparkdl launches on: a classic session or a Spark Connect client.

Everything that differs between the two lives here, so the launcher, the DataFrame cache and
``TorchModel.transform`` have one code path:

* **Launch.** Both run the barrier stage as ``spark.range(n, numPartitions=n).mapInArrow(fn,
  barrier=True)`` (as PySpark's TorchDistributor does); each task returns its result as Arrow
  bytes. Job tags cancel it (``SparkSession.addTag``/``interruptTag`` on Connect, ``SparkContext``
  job tags with interrupt-on-cancel on a classic session).
* **Where the tasks reach the client.** The progress and error channel is a server in *this*
  process. On a classic session that is the Spark driver (``spark.driver.host``). A Connect client
  is not the driver: the channel binds to the address this machine uses to reach the Connect
  server (the interface that routes to the cluster), or to ``spark.sparkdl.clientHost`` when set
  (a notebook behind NAT must name an address the executors can reach).
* **Slots.** A classic session asks the scheduler how many tasks can run at once; a Connect client
  cannot, so the launcher fails the stage when no task starts within ``slot_wait_s`` (Spark
  would otherwise retry the barrier stage's slot check for about ten minutes).
* **Configuration** is read with ``spark.conf.get``, which both serve.
* **One PySpark warning is silenced.** PySpark 4.1+ warns "PySpark does not yet fully support
  pandas >= 3.0.0" (a ``FutureWarning`` from ``require_minimum_pandas_version``) the first time a
  job with Python functions is planned (sparkdl's warm-up, cache and launch: ``mapInArrow``) or
  its test helpers are imported (a session's first steps), so every demo, CLI and notebook run
  began with it, before any line of the user's. sparkdl runs and is tested on pandas 3 (the
  latest stack); the filter, installed by ``import sparkdl``, hides that one message from
  pyspark's modules and nothing else.
"""

from __future__ import annotations

import socket
import urllib.parse
import warnings
from typing import Any, Callable, Iterator, List, Optional, Tuple

#: Where a Spark Connect client's channel listens (an address the executors can reach).
CLIENT_HOST_CONF = "spark.sparkdl.clientHost"
#: The start of PySpark's warning about pandas 3 (pyspark/sql/pandas/utils.py).
PANDAS3_WARNING = r"PySpark does not yet fully support pandas >= 3"


def quiet_pandas3_warning() -> None:
    """Hides PySpark's pandas-3 ``FutureWarning`` (that message, from pyspark modules, only)."""
    warnings.filterwarnings("ignore", message=PANDAS3_WARNING, category=FutureWarning, module=r"pyspark(\.|$)")


def task_threads(context: Any) -> int:
    """Torch/OpenMP threads for a Spark task: its exact CPU amount rounded down, at least one.

    ``TaskContext.cpus()`` rounds a fractional amount (``spark.task.cpus=1.5``, or a resource
    profile's) up, which would run more threads than the task has cores; PySpark 4.3's
    ``cpuAmount()`` is exact. Older PySpark has whole amounts only, so ``cpus()`` is exact there.
    """
    exact = getattr(context, "cpuAmount", None)
    amount = float(exact()) if exact is not None else float(context.cpus() or 1)
    return max(1, int(amount))


def is_connect(spark: Any) -> bool:
    """True for a Spark Connect client session."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


class Session:
    """One SparkSession, classic or Connect, as the launcher uses it."""

    def __init__(self, spark: Any) -> None:
        self.spark = spark
        self.connect = is_connect(spark)
        quiet_pandas3_warning()  # again: a warnings.catch_warnings() block may have undone the import's

    def conf(self, key: str, default: Optional[str] = None) -> Optional[str]:
        try:
            value = self.spark.conf.get(key, default)
        except Exception:  # noqa: BLE001 - Connect raises for keys the server does not know
            return default
        return value if value is not None else default

    @property
    def master(self) -> str:
        if not self.connect:
            return self.spark.sparkContext.master
        return self.conf("spark.master", "") or ""

    def channel_host(self) -> str:
        """The address the progress channel binds to: one every executor can reach."""
        configured = self.conf(CLIENT_HOST_CONF)
        if configured:
            return configured
        if not self.connect:
            return self.conf("spark.driver.host") or "127.0.0.1"
        return _route_to(_connect_server(self.spark))

    def run_barrier(
        self, num_workers: int, task: Callable[[], List[Tuple[int, bytes]]], description: str, profile: Any = None
    ) -> List[Tuple[int, bytes]]:
        """Runs ``task`` on ``num_workers`` barrier tasks (with the pyspark ``ResourceProfile``
        ``profile`` when given: stage-level scheduling); returns every (rank, bytes) they returned."""
        import pyarrow as pa

        def run_partition(batches: Iterator[Any]) -> Iterator[Any]:
            for _ in batches:  # the partition's one row: its index
                pass
            results = task()
            yield pa.RecordBatch.from_pydict(
                {"rank": [rank for rank, _ in results], "value": [value for _, value in results]},
                schema=pa.schema([("rank", pa.int32()), ("value", pa.binary())]),
            )

        # profile= only when asked for: PySpark before 4.0 has no such argument.
        extra = {} if profile is None else {"profile": profile}
        frame = self.spark.range(0, num_workers, 1, num_workers).mapInArrow(
            run_partition, "rank int, value binary", barrier=True, **extra
        )
        self._set_description(description)
        try:
            return [(row["rank"], bytes(row["value"])) for row in frame.collect()]
        finally:
            self._set_description(None)

    def add_tag(self, tag: str) -> None:
        if self._session_tags():
            self.spark.addTag(tag)
        else:
            sc = self.spark.sparkContext
            sc.addJobTag(tag)
            sc.setInterruptOnCancel(True)

    def cancel(self, tag: str) -> None:
        if self._session_tags():
            self.spark.interruptTag(tag)
        else:
            self.spark.sparkContext.cancelJobsWithTag(tag)

    def remove_tag(self, tag: str) -> None:
        if self._session_tags():
            self.spark.removeTag(tag)
        else:
            self.spark.sparkContext.removeJobTag(tag)

    def _session_tags(self) -> bool:
        # Classic sessions keep SparkContext's job tags with interrupt-on-cancel: a session tag's
        # interrupt does not kill a task blocked in Python (a hung rank the watchdog cancels).
        return self.connect

    def _set_description(self, description: Optional[str]) -> None:
        if not self.connect:
            self.spark.sparkContext.setJobDescription(description)


def _connect_server(spark: Any) -> Tuple[str, int]:
    """Host and port of the Connect server a client session talks to."""
    client = getattr(spark, "client", None)
    url = getattr(client, "_builder", None)
    endpoint = getattr(url, "endpoint", None) or getattr(url, "url", None)
    if isinstance(endpoint, str):
        parsed = urllib.parse.urlparse(endpoint if "//" in endpoint else f"sc://{endpoint}")
        if parsed.hostname:
            return parsed.hostname, parsed.port or 15002
    return "127.0.0.1", 15002


def _route_to(address: Tuple[str, int]) -> str:
    """The local address this machine uses to reach ``address`` (no packet is sent: a UDP
    socket's connect only picks the route)."""
    host, port = address
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
