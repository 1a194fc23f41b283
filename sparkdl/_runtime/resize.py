"""What a run does to its optimization when it trains on fewer workers than ``num_workers``
(``on_resize=``): the choices, their validation per strategy, and their arithmetic.

``batch_size`` is per worker, so on M of the N planned workers the global batch would be
M·b instead of N·b. ``on_resize`` says what happens then (docs/recovery.md, "Batch size and
learning rate"):

* ``"keep_global_batch"``: each optimizer step takes ⌈N/M⌉ micro-batches per worker (gradient
  accumulation; the gradient synchronizes only on the last). When M divides N, the global batch
  and the steps per epoch are the N-worker run's; otherwise the global batch is ⌈N/M⌉·M·b, the
  nearest at or above N·b (a warning and ``run_info["resize"]`` say so). The losses are scaled
  by 1/(micro-batches the step takes), so the gradient is the mean over the rows it took.
* ``"scale_lr"``: the linear scaling rule (Goyal et al., 2017): every param group's ``lr`` is
  multiplied by M/N (on a resume, M/(the checkpoint's workers)).
* ``"none"``: the global batch is M·b with the same learning rate.

Plain arithmetic, no process group: the driver validates with it, the task applies it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

from sparkdl.errors import ConfigError

KEEP_GLOBAL_BATCH = "keep_global_batch"
SCALE_LR = "scale_lr"
NO_CHANGE = "none"
ON_RESIZE_CHOICES = (KEEP_GLOBAL_BATCH, SCALE_LR, NO_CHANGE)


def check_on_resize(value: Optional[str]) -> Optional[str]:
    """``value`` if it is a known choice or None (the strategy's default); else a ConfigError."""
    if value is not None and value not in ON_RESIZE_CHOICES:
        choices = ", ".join(repr(c) for c in ON_RESIZE_CHOICES)
        raise ConfigError(
            f"on_resize={value!r} is not a choice: use one of {choices}, or None for the strategy's default"
        )
    return value


def on_resize_for(value: Optional[str], strategy: Any) -> str:
    """The run's choice for ``strategy``: its default for None; a ConfigError for a choice the
    strategy refuses (its ``on_resize_choices``, the first being its default), with its reason."""
    check_on_resize(value)
    choices: Tuple[str, ...] = tuple(getattr(strategy, "on_resize_choices", ON_RESIZE_CHOICES))
    if value is None:
        return choices[0]
    if value not in choices:
        name = type(strategy).__name__
        reason = getattr(strategy, "on_resize_reason", "")
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(
            f"on_resize={value!r} does not apply to {name}{': ' + reason if reason else ''}; "
            f"use on_resize={allowed} (or leave it unset)"
        )
    return value


@dataclasses.dataclass(frozen=True)
class ResizePlan:
    """One attempt's resize arithmetic.

    Args:
        on_resize: the run's choice (validated).
        planned_workers: ``num_workers`` as asked.
        world_size: the workers this attempt runs on.
        batch_size: rows per micro-batch per worker (None: a run without data).
    """

    on_resize: str = NO_CHANGE
    planned_workers: int = 1
    world_size: int = 1
    batch_size: Optional[int] = None

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on each worker: ⌈N/M⌉ with ``keep_global_batch`` on
        fewer workers than planned, else 1."""
        if self.on_resize != KEEP_GLOBAL_BATCH or self.world_size >= self.planned_workers:
            return 1
        return math.ceil(self.planned_workers / self.world_size)

    @property
    def global_batch_size(self) -> Optional[int]:
        """Rows per optimizer step over all workers (a full step)."""
        if self.batch_size is None:
            return None
        return self.batch_size * self.world_size * self.accumulation_steps

    @property
    def planned_global_batch_size(self) -> Optional[int]:
        return None if self.batch_size is None else self.batch_size * self.planned_workers

    def lr_factor(self, from_workers: int) -> float:
        """What ``scale_lr`` multiplies ``lr`` by when an optimizer tuned for ``from_workers``
        workers trains on this attempt's (1.0 for the other choices)."""
        if self.on_resize != SCALE_LR or from_workers == self.world_size:
            return 1.0
        return self.world_size / from_workers

    def describe(self) -> Dict[str, Any]:
        """What ``run_info["resize"]`` records."""
        return {
            "on_resize": self.on_resize,
            "planned_workers": self.planned_workers,
            "workers": self.world_size,
            "accumulation_steps": self.accumulation_steps,
            "global_batch_size": self.global_batch_size,
            "planned_global_batch_size": self.planned_global_batch_size,
        }

    def warning(self) -> Optional[str]:
        """The line rank 0 logs when the run does not train with the planned global batch."""
        if self.world_size >= self.planned_workers or self.batch_size is None:
            return None
        n, m, k = self.planned_workers, self.world_size, self.accumulation_steps
        if self.on_resize == KEEP_GLOBAL_BATCH:
            if n % m == 0:
                return None
            return (
                f"on_resize='keep_global_batch' on {m} of num_workers={n}: {n} is not a multiple of {m}, so each step "
                f"takes {k} micro-batches per worker: a global batch of {self.global_batch_size} rows, the nearest at "
                f"or above the planned {self.planned_global_batch_size} (and fewer steps per epoch)"
            )
        if self.on_resize == NO_CHANGE:
            return (
                f"on_resize='none' on {m} of num_workers={n}: the global batch is {self.global_batch_size} rows "
                f"instead of {self.planned_global_batch_size}, with the same learning rate"
            )
        return None


def accumulation_windows(batches: Iterable[Any], count: int, accumulation: int) -> Iterator[Tuple[Any, float, bool]]:
    """``(batch, loss_scale, last)`` for ``count`` batches taken ``accumulation`` at a time: an
    optimizer step after each ``last``, its micro-batches' losses scaled by 1/(its micro-batches)
    so the accumulated gradient is their mean; the last window of a pass may be shorter."""
    for index, batch in enumerate(batches):
        start = index - index % accumulation
        size = max(1, min(accumulation, count - start))
        yield batch, 1.0 / size, index - start == size - 1 or index + 1 >= count


def scale_learning_rate(optimizer: Any, factor: float) -> None:
    """Multiplies every param group's ``lr`` (and ``initial_lr``, the base an LR scheduler built
    afterwards starts from) by ``factor``."""
    if factor == 1.0:
        return
    for group in optimizer.param_groups:
        for key in ("lr", "initial_lr"):
            if key in group:
                value = group[key]
                group[key] = value * factor if not hasattr(value, "mul_") else value.mul_(factor)
