"""What the driver does about the hosts a run's ranks are on, while the stage runs (classic
sessions: both ask the SparkContext's scheduler): pass Spark's decommissioning of an executor on
to the ranks, and drop the executors of a host that went silent."""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Sequence, Set

from sparkdl._driver.monitor import JobMonitor
from sparkdl._net.rendezvous_store import StoreServer
from sparkdl._spark import Session

logger = logging.getLogger("sparkdl")


def watch_decommissioning(
    session: Session, monitor: JobMonitor, rendezvous_store: StoreServer, stop: threading.Event
) -> None:
    """Once a second: is Spark decommissioning an executor a rank runs on? Then the run drains
    (sparkdl._runtime.drain): the notice goes into the launch's rendezvous store, where every rank's
    heartbeat reads it. A decommissioning executor no longer counts as alive on its host, so the
    executors seen on each rank's host are remembered from the checks before."""
    from sparkdl._runtime.drain import DRAIN_KEY

    scheduler = session.spark.sparkContext._jsc.sc().taskScheduler()
    seen: Dict[str, set] = {}  # a rank's executor address -> the executors seen alive there
    while not stop.wait(1.0):
        for rank, address in sorted(monitor.addresses.items()):
            try:
                alive = scheduler.getExecutorsAliveOnHost(address)
                if alive.isDefined():
                    found = alive.get().iterator()
                    while found.hasNext():
                        seen.setdefault(address, set()).add(found.next())
                going = sorted(
                    executor for executor in seen.get(address, ()) if scheduler.isExecutorDecommissioned(executor)
                )
            except Exception:  # noqa: BLE001 - the session may be stopping; the stage's own outcome decides
                logger.debug("could not ask Spark about decommissioning on %s", address, exc_info=True)
                continue
            if going:
                monitor.decommissioned.add(address)
                reason = f"Spark is decommissioning executor {going[0]} on {monitor.hosts.get(rank) or address}, where rank {rank} runs"
                logger.warning("%s: the ranks checkpoint at their next agreement and the run resumes from it", reason)
                rendezvous_store.publish(DRAIN_KEY, reason.encode("utf-8"))
                return


def stop_using_host(session: Session, address: str) -> None:
    """Asks Spark to drop the executors at ``address``: until Spark notices a silent host itself
    (``spark.network.timeout``, 120 s), it would still count their slots, and a relaunch would
    wait for a task it can never start there. Over Spark Connect there is no SparkContext to ask."""
    if session.connect:
        return
    jsc = session.spark.sparkContext._jsc.sc()
    for executor in _alive_on(jsc, address):
        # Marks it pending removal at once: maxNumConcurrentTasks stops counting its slots.
        killed = jsc.killExecutor(executor)
        logger.warning(
            "executor %s on %s: asked Spark to drop it (%s)", executor, address, "done" if killed else "refused"
        )


def _alive_on(jsc: Any, address: str) -> List[str]:
    """The executors Spark lists as alive at ``address``."""
    alive = jsc.taskScheduler().getExecutorsAliveOnHost(address)  # Option[Set[String]]
    executors = []
    if alive.isDefined():
        found = alive.get().iterator()
        while found.hasNext():
            executors.append(found.next())
    return executors


def hosts_with_executors(session: Session, addresses: Sequence[str]) -> Set[str]:
    """Those of ``addresses`` where Spark still lists a live executor."""
    jsc = session.spark.sparkContext._jsc.sc()
    return {address for address in set(addresses) if address and _alive_on(jsc, address)}
