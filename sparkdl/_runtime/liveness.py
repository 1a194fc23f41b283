"""What a rank is doing, how far it got and how long the parts of its steps take: what its
heartbeat tells the driver's watchdog (sparkdl._driver.watchdog)."""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

from sparkdl._runtime.drain import DrainNotice

#: The parts of a training step a rank times for the watchdog's "auto" bound
#: (sparkdl._driver.watchdog): waiting for its batch, and forward, backward, sync and optimizer.
LOAD, COMPUTE = "load", "compute"


class Liveness:
    """What a rank is doing and how far it got; a heartbeat thread reports both to the driver's
    watchdog, which only counts ``progress`` that moves (a blocked rank's heartbeats go on).

    It also times the parts of the training steps (``step_part``), so that the driver can judge
    a standstill against the run's own pace: a phase begun with ``step_part`` ends at the next
    ``advance``, and the longest of each part is kept. Written by the training thread, read by
    the heartbeat thread: a reading a step late is harmless.
    """

    def __init__(self) -> None:
        self.progress = 0
        self.phase = "starting"
        #: Set when the driver asks the run to drain (sparkdl._runtime.drain).
        self.drain = DrainNotice()
        #: LOAD or COMPUTE while inside a training step, else None.
        self.step_part: Optional[str] = None
        self.steps = 0  # training steps begun (COMPUTE parts)
        self.slowest: Dict[str, float] = {LOAD: 0.0, COMPUTE: 0.0}
        self._since = time.monotonic()

    def advance(self, phase: Optional[str] = None, step_part: Optional[str] = None) -> None:
        """Counts as progress; ``phase`` names what the rank does from now on, ``step_part``
        says which part of a training step that is (None: no part of one)."""
        now = time.monotonic()
        if self.step_part is not None:
            self.slowest[self.step_part] = max(self.slowest[self.step_part], now - self._since)
        self._since = now
        self.step_part = step_part
        if step_part == COMPUTE:
            self.steps += 1
        self.progress += 1
        if phase is not None:
            self.phase = phase

    def beat(self) -> Dict[str, Any]:
        """The heartbeat's fields."""
        return {
            "progress": self.progress,
            "phase": self.phase,
            "step_part": self.step_part,
            "steps": self.steps,
            "slowest_load_s": self.slowest[LOAD],
            "slowest_compute_s": self.slowest[COMPUTE],
        }
