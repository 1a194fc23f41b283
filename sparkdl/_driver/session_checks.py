"""What the Spark session's own settings rule out, refused before anything is read or launched.

Every entry point that launches ranks (``fit``, ``sparkdl.run``, ``sparkdl.launch``,
``sparkdl.compare``, ``sparkdl.plan``, the spark-submit job) calls :func:`check_session` first:
it reads a few settings (no Spark job), so a user on a platform's defaults hears what to change
in well under a second, not after a DataFrame has been materialized and a barrier stage refused.

* **Dynamic allocation.** EMR and Dataproc turn ``spark.dynamicAllocation.enabled`` on by
  default, and Spark refuses to run a barrier stage under it (SPARK-24942: the tasks must all start
  at once, on executors that stay). Spark ignores the setting in local mode (``local``,
  ``local[N]``), so only a cluster master is refused, as Spark itself would.
* **Encryption** (:func:`sparkdl._net.policy.security_policy`): under Spark's encryption without
  ``spark.sparkdl.allowUnencryptedCollectives`` nothing may train, so nothing is materialized.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from sparkdl._driver.memory_check import warn_of_pyarrow_reservations
from sparkdl._net.policy import security_policy
from sparkdl._spark import Session
from sparkdl.errors import ConfigError

DYNAMIC_ALLOCATION_CONF = "spark.dynamicAllocation.enabled"

#: Masters under which Spark ignores dynamic allocation (``Utils.isLocalMaster``).
_LOCAL_MASTER = re.compile(r"local(\[[^\]]*\])?$")


def check_dynamic_allocation(conf_get: Callable[[str], Optional[str]], master: Callable[[], str]) -> None:
    """Refuses ``spark.dynamicAllocation.enabled=true`` on a cluster master (``master()``, read
    only when the setting is on).

    Raises:
        ConfigError: naming the setting, why a barrier stage cannot run under it, and the
            per-application fix (it is read when the SparkContext starts: a running session
            cannot change it).
    """
    value = conf_get(DYNAMIC_ALLOCATION_CONF)
    if value is None or str(value).strip().lower() != "true" or _LOCAL_MASTER.match(master().strip()):
        return
    raise ConfigError(
        f"{DYNAMIC_ALLOCATION_CONF}=true: Spark cannot run sparkdl's training stage under dynamic allocation: it is "
        f"a barrier stage, whose tasks must all start at once on executors that stay (SPARK-24942; EMR and Dataproc "
        f"turn dynamic allocation on by default). Turn it off for this application when it starts: spark-submit "
        f"--conf {DYNAMIC_ALLOCATION_CONF}=false (Dataproc: gcloud dataproc jobs submit pyspark --properties "
        f"{DYNAMIC_ALLOCATION_CONF}=false), or SparkSession.builder.config('{DYNAMIC_ALLOCATION_CONF}', 'false') "
        f"before the session exists (a running session cannot change it), and give it executors for num_workers "
        f"tasks with spark.executor.instances (docs/platforms/emr-dataproc.md)"
    )


def check_session(spark: Any = None) -> None:
    """Refuses now what the launch would refuse later because of the session's settings:
    dynamic allocation on a cluster, Spark's encryption without unencrypted collectives accepted.
    ``spark`` None: the active session; no session: nothing to check yet (the launch needs one
    and says so).

    Raises:
        ConfigError: as :func:`check_dynamic_allocation` and
            :func:`sparkdl._net.policy.security_policy`.
    """
    if spark is None:
        try:
            from pyspark.sql import SparkSession

            spark = SparkSession.getActiveSession()
        except Exception:  # noqa: BLE001 - no Spark here: the launch reports that itself
            return
        if spark is None:
            return
    session = spark if isinstance(spark, Session) else Session(spark)
    check_dynamic_allocation(session.conf, lambda: session.master)
    security_policy(session.conf)
    warn_of_pyarrow_reservations(session.conf)
