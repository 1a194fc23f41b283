"""What each training task asks Spark for: :class:`Resources`, the training stage's own task
resource profile.

Without it the barrier stage runs with the application's defaults (``spark.task.cpus``,
``spark.task.resource.gpu.amount``), which the ETL that prepares the data shares: to train at 4
cores or 1 GPU per task, the whole application would run fat tasks. With it, only the training
stage runs with a Spark ``ResourceProfile`` of these amounts (stage-level scheduling, Spark ≥ 4.0
for ``mapInArrow(..., profile=)``; standalone, YARN and Kubernetes with dynamic allocation off,
which barrier stages need anyway). Plain data: it travels to the tasks with the launch config.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Union

from sparkdl.errors import ConfigError

_MEMORY_UNITS = {"k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}


@dataclasses.dataclass(frozen=True)
class Resources:
    """The resources of one training task (one rank).

    Args:
        cpus: CPU cores per task; fractional amounts (``0.5``: two ranks share a core) need
            Spark ≥ 4.3. The task's torch and OpenMP threads follow the exact amount, rounded
            down, at least one. None keeps ``spark.task.cpus``.
        gpus: GPUs per task, a whole number (NCCL runs one rank per GPU); the executors must have
            them (``spark.executor.resource.gpu.amount`` and a discovery script). None keeps
            ``spark.task.resource.gpu.amount``.
        memory: the least executor memory training needs, as ``"8g"``/``"512m"`` or MiB. Spark
            can change an executor's memory per stage only with dynamic allocation, which barrier
            stages cannot use, so this is checked against ``spark.executor.memory`` before launch,
            not requested.
    """

    cpus: Optional[float] = None
    gpus: Optional[int] = None
    memory: Union[str, int, None] = None

    def __post_init__(self) -> None:
        if self.cpus is not None:
            if isinstance(self.cpus, bool) or not isinstance(self.cpus, (int, float)) or not self.cpus > 0:
                raise ConfigError(f"Resources(cpus={self.cpus!r}) must be a number of cores > 0 (e.g. 4, or 0.5)")
            if not math.isfinite(self.cpus):
                raise ConfigError(f"Resources(cpus={self.cpus!r}) must be a finite number of cores")
        if self.gpus is not None and (isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 0):
            raise ConfigError(
                f"Resources(gpus={self.gpus!r}) must be a whole number of GPUs >= 0: NCCL runs one rank per GPU, "
                f"so a fraction of a GPU per rank cannot train"
            )
        if self.memory is not None:
            memory_mb(self.memory)  # fails now, naming the value
        if self.cpus is None and self.gpus is None and self.memory is None:
            raise ConfigError("Resources() asks for nothing: give cpus=, gpus= or memory= (or pass resources=None)")

    @property
    def memory_mb(self) -> Optional[int]:
        return None if self.memory is None else memory_mb(self.memory)

    @property
    def requests_profile(self) -> bool:
        """Whether the stage needs a resource profile of its own (memory alone is only checked)."""
        return self.cpus is not None or self.gpus is not None

    def describe(self) -> str:
        """``4 CPUs, 1 GPU, 8192 MiB`` — for messages and run_info."""
        parts = []
        if self.cpus is not None:
            parts.append(f"{self.cpus:g} CPU{'' if self.cpus == 1 else 's'}")
        if self.gpus is not None:
            parts.append(f"{self.gpus} GPU{'' if self.gpus == 1 else 's'}")
        if self.memory is not None:
            parts.append(f"executor memory >= {self.memory_mb} MiB")
        return ", ".join(parts) + " per task"

    @classmethod
    def parse(cls, text: str) -> "Resources":
        """``cpus=4,gpus=1,memory=8g`` (the CLI's ``--resources``)."""
        fields = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in ("cpus", "gpus", "memory"):
                raise ConfigError(f"--resources {text!r}: expected cpus=N,gpus=N,memory=SIZE (e.g. cpus=4,gpus=1)")
            value = value.strip()
            try:
                fields[key] = float(value) if key == "cpus" else int(value) if key == "gpus" else value
            except ValueError:
                raise ConfigError(f"--resources {text!r}: {key}={value!r} is not a number") from None
        if "cpus" in fields and float(fields["cpus"]).is_integer():
            fields["cpus"] = int(fields["cpus"])
        return cls(**fields)


def memory_mb(value: Union[str, int]) -> int:
    """MiB in a Spark memory size (``"8g"``, ``"512m"``, ``"1024"`` = MiB, as Spark reads
    ``spark.executor.memory``) or an int of MiB."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt])?(?:i?b)?\s*", str(value).lower())
    if isinstance(value, bool) or not match or float(match.group(1)) <= 0:
        raise ConfigError(f"memory={value!r} must be a size such as '8g' or '512m', or MiB as an integer > 0")
    return max(1, int(float(match.group(1)) * _MEMORY_UNITS[match.group(2) or "m"]))


def check_resources(value: object) -> Optional[Resources]:
    """``resources=`` as given to the estimator, ``run``, ``launch``: a :class:`Resources`, a
    mapping of its fields, or None."""
    if value is None or isinstance(value, Resources):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"cpus", "gpus", "memory"})
        if unknown:
            raise ConfigError(f"resources={value!r}: unknown field(s) {unknown}; use cpus=, gpus=, memory=")
        return Resources(**value)
    if isinstance(value, str):
        return Resources.parse(value)
    raise ConfigError(f"resources={value!r} must be sparkdl.Resources(cpus=..., gpus=..., memory=...) or None")
