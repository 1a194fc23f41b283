"""The training stage's own Spark resource profile, built from :class:`~sparkdl.resources.Resources`.

Spark runs a stage with a *task* resource profile (``TaskResourceProfile``) on the executors the
application already has when dynamic allocation is off, on standalone, YARN and Kubernetes; local
mode cannot. So one application runs its ETL at ``spark.task.cpus`` and the barrier stage at, say,
4 cores and a GPU per task. What cannot be honoured is refused here, before launch, with the
setting to change: the profile is built and checked once, and the slot count
(:func:`~sparkdl._driver.cluster.check_slots`) counts slots *for it*.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Dict, List, Optional, Tuple

from sparkdl._spark import Session
from sparkdl.errors import ConfigError, InsufficientSlotsError
from sparkdl.resources import Resources, memory_mb


@dataclasses.dataclass(frozen=True)
class StageProfile:
    """What the barrier stage runs with: the resources asked for and Spark's profile of them."""

    resources: Resources
    #: pyspark's ``ResourceProfile`` for ``mapInArrow(..., profile=)``; None when only memory was asked.
    profile: Any = None
    #: The same profile in the driver's JVM, registered so the scheduler can count its slots
    #: (None over Spark Connect, whose client cannot ask the scheduler).
    java: Any = None
    #: The task CPUs and GPUs the profile asks for, defaults filled in from the application's.
    task_cpus: float = 1.0
    task_gpus: int = 0

    @property
    def id(self) -> Optional[int]:
        return None if self.profile is None else int(self.profile.id)

    def describe(self) -> str:
        """``the training stage's resource profile (id 1: 4 CPUs, 1 GPU per task)``."""
        which = f"id {self.id}: " if self.id is not None else ""
        return f"the training stage's resource profile ({which}{self.resources.describe()})"

    def run_info(self) -> Dict[str, Any]:
        return {
            "resource_profile_id": self.id,
            "task_cpus": self.task_cpus,
            "task_gpus": self.task_gpus,
            **({"min_executor_memory_mb": self.resources.memory_mb} if self.resources.memory is not None else {}),
        }


def stage_profile(session: Session, resources: Optional[Resources]) -> Optional[StageProfile]:
    """Builds (and on a classic session registers) the training stage's resource profile.

    Raises:
        ConfigError: the cluster manager or the Spark version cannot run a stage with its own
            task resources (local mode, dynamic allocation on, fractional CPUs before Spark 4.3).
        InsufficientSlotsError: the executors have less memory than ``resources.memory``.
    """
    if resources is None:
        return None
    _check_memory(session, resources)
    default_cpus = float(session.conf("spark.task.cpus", "1") or "1")
    default_gpus = _number(session.conf("spark.task.resource.gpu.amount"))
    cpus = resources.cpus if resources.cpus is not None else default_cpus
    gpus = resources.gpus if resources.gpus is not None else int(default_gpus)
    if not resources.requests_profile:
        return StageProfile(resources, task_cpus=cpus, task_gpus=gpus)
    check_supported(resources, session.master or "", session.conf("spark.dynamicAllocation.enabled", "false"))
    if gpus and not _number(session.conf("spark.executor.resource.gpu.amount")):
        raise InsufficientSlotsError(
            f"{resources!r} asks for {gpus} GPU(s) per task, but this application's executors have none "
            f"(spark.executor.resource.gpu.amount is not set): start the application with "
            f"spark.executor.resource.gpu.amount and, on standalone, spark.worker.resource.gpu.amount and "
            f"spark.worker.resource.gpu.discoveryScript (docs/resources.md)"
        )
    # One profile per application and amounts: a grid search's fits share it (each new profile
    # is another id in Spark's UI and another entry its scheduler keeps).
    key = (_application(session), float(cpus), int(gpus))
    known = _profiles.get(key)
    if known is not None:
        return dataclasses.replace(known, resources=resources)
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    requests = TaskResourceRequests().cpus(cpus if not float(cpus).is_integer() else int(cpus))
    if gpus:
        requests = requests.resource("gpu", float(gpus))
    profile = ResourceProfileBuilder().require(requests).build
    stage = StageProfile(resources, profile, task_cpus=cpus, task_gpus=gpus)
    _check_executor_amounts(session, stage)
    java = None
    if not session.connect:
        java = profile._java_resource_profile
        try:
            # Registered now, so maxNumConcurrentTasks can count its slots before the stage exists.
            session.spark.sparkContext._jsc.sc().resourceProfileManager().addResourceProfile(java)
        except Exception as exc:  # noqa: BLE001 - Spark's own refusal, in the user's terms
            reason = str(exc).strip().splitlines()
            spark_says = next((line for line in reason if "Exception:" in line), reason[0] if reason else "")
            raise ConfigError(
                f"Spark refused the training stage's resource profile for {resources!r}: {spark_says.strip()}"
            ) from None
    stage = StageProfile(resources, profile, java, task_cpus=cpus, task_gpus=gpus)
    _profiles[key] = stage
    return stage


#: The profiles built so far, per (application, task CPUs, task GPUs).
_profiles: Dict[Tuple[str, float, int], StageProfile] = {}


def _application(session: Session) -> str:
    """This application's id (a Connect client's: its session id, whose server may restart)."""
    if not session.connect:
        return str(session.spark.sparkContext.applicationId)
    return f"connect:{getattr(session.spark, 'session_id', id(session.spark))}"


def check_supported(resources: Resources, master: str, dynamic_allocation: Optional[str]) -> None:
    """Whether this PySpark, under ``master`` with ``spark.dynamicAllocation.enabled`` as given,
    can run a stage with the task resource profile ``resources`` asks for.

    Raises:
        ConfigError: naming what to change.
    """
    if re.match(r"local(\[|$)", master):
        raise ConfigError(
            f"resources={resources!r} runs the training stage with a Spark resource profile of its own, which "
            f"local mode ({master}) cannot schedule (Spark supports task resource profiles on standalone, YARN and "
            f"Kubernetes). Drop resources= and set spark.task.cpus / spark.task.resource.gpu.amount for the whole "
            f"application, or run on a cluster (local-cluster[...] for tests)"
        )
    if (dynamic_allocation or "false").strip().lower() == "true":
        raise ConfigError(
            "resources= needs spark.dynamicAllocation.enabled=false: barrier stages cannot run with dynamic "
            "allocation, and a task resource profile runs on the executors the application has"
        )
    from pyspark.sql import DataFrame

    if "profile" not in inspect.signature(DataFrame.mapInArrow).parameters:
        raise ConfigError(
            "resources= needs PySpark 4.0 or later (mapInArrow(..., profile=)): upgrade PySpark, or set "
            "spark.task.cpus / spark.task.resource.gpu.amount for the whole application"
        )
    if resources.cpus is not None and not float(resources.cpus).is_integer() and not _has_fractional_cpus():
        import pyspark

        raise ConfigError(
            f"Resources(cpus={resources.cpus:g}): fractional task CPUs need Spark 4.3 or later (this is PySpark "
            f"{pyspark.__version__}): give a whole number of cores"
        )


def _check_executor_amounts(session: Session, stage: StageProfile) -> None:
    """More CPUs or GPUs per task than one executor has: no executor could ever run it (Spark
    refuses to register such a profile, in its own terms)."""
    limits = []
    cores = _number(session.conf("spark.executor.cores"))
    if cores and stage.task_cpus > cores:
        limits.append(f"spark.executor.cores={cores:g}")
    executor_gpus = _number(session.conf("spark.executor.resource.gpu.amount"))
    if stage.task_gpus and stage.task_gpus > executor_gpus:
        limits.append(f"spark.executor.resource.gpu.amount={executor_gpus:g}")
    if limits:
        offers = "" if session.connect else f"; they offer {executor_offers(session.spark.sparkContext)}"
        raise InsufficientSlotsError(
            f"{stage.describe()} asks for more than one executor has ({', '.join(limits)}{offers}): ask for less "
            f"per task with resources=, or start the application with larger executors"
        )


def _has_fractional_cpus() -> bool:
    from pyspark import TaskContext

    return hasattr(TaskContext, "cpuAmount")


def _check_memory(session: Session, resources: Resources) -> None:
    if resources.memory is None:
        return
    configured = session.conf("spark.executor.memory", "1g") or "1g"
    have = memory_mb(configured)
    if have < resources.memory_mb:
        raise InsufficientSlotsError(
            f"resources={resources!r} needs executors with at least {resources.memory_mb} MiB, but this application's "
            f"have {have} MiB (spark.executor.memory={configured}). Spark cannot give one stage more executor memory "
            f"without dynamic allocation, which barrier stages cannot use: raise spark.executor.memory when the "
            f"application starts, or lower Resources(memory=...)"
        )


def _number(value: Optional[str]) -> float:
    try:
        return float(value) if value is not None else 0.0
    except ValueError:
        return 0.0


def executor_offers(sc: Any) -> str:
    """What the live executors offer, for a message: ``2 executors with 1 core and no GPUs each``."""
    try:
        summaries = sc._jsc.sc().statusStore().executorList(True)
        offers: List[str] = []
        iterator = summaries.iterator()
        while iterator.hasNext():
            executor = iterator.next()
            if executor.id() == "driver":
                continue
            gpus = 0
            resources = executor.resources()
            if resources.contains("gpu"):
                gpus = len(resources.apply("gpu").addresses())
            offers.append(f"{executor.totalCores()} core(s), {gpus} GPU(s)")
    except Exception:  # noqa: BLE001 - a message detail: the slot count itself decided
        return "unknown executors"
    if not offers:
        return "no executors"
    counts: Dict[str, int] = {}
    for offer in offers:
        counts[offer] = counts.get(offer, 0) + 1
    return "; ".join(f"{n} executor(s) with {offer} each" for offer, n in sorted(counts.items()))


def stage_profile_ids(sc: Any, tag: str) -> List[int]:
    """The resource profile ids Spark's status store (what its listener and UI show) recorded for
    the stages of the jobs tagged ``tag``."""
    store, tracker = sc._jsc.sc().statusStore(), sc._jsc.sc().statusTracker()
    found = []
    for job in tracker.getJobIdsForTag(tag):
        info = tracker.getJobInfo(job)
        for stage in info.get().stageIds() if info.isDefined() else ():
            found.append(int(store.lastStageAttempt(stage).resourceProfileId()))
    return sorted(set(found))
