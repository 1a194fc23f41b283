"""The rank's heartbeat: its progress counter and phase to the driver's watchdog, at a fixed rate.

A thread of the task's (:mod:`sparkdl._task.entry` starts and stops it). Each beat also reads the
driver's drain notice from the rendezvous store (a host going away: the fit loop checkpoints and
stops, :mod:`sparkdl._runtime.drain`), and a channel that closed under it ends the process: the
driver cancelled the run or died, and a rank blocked in user code would hold its slot for good.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

from sparkdl._net.channel import ChannelClient, ChannelError


class Heartbeat:
    """Sends the rank's progress counter and phase to the driver's watchdog at a fixed rate."""

    def __init__(self, client: ChannelClient, liveness: Any, interval_s: float) -> None:
        self._client = client
        self._liveness = liveness
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkdl-heartbeat", daemon=True)
        self._rendezvous: Any = None

    def watch_drain(self, rendezvous_client: Any) -> None:
        """From now on each beat also reads the driver's drain notice from the rendezvous store."""
        self._rendezvous = rendezvous_client

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._client.send({"kind": "heartbeat", **self._liveness.beat()})
            except ChannelError:
                if self._stop.is_set():
                    return
                # The run's channel is gone: the driver (or Connect client) cancelled the run or
                # died. A rank blocked in user code would never notice, and a cancel does not
                # always kill a task stuck in Python (Spark Connect's interrupt does not), so the
                # rank ends its process rather than hold its task slot for good.
                sys.stderr.write("[sparkdl] the driver's channel closed while this rank was running: exiting\n")
                sys.stderr.flush()
                os._exit(70)
            self._read_drain_notice()
            if self._stop.wait(self._interval_s):
                return

    def _read_drain_notice(self) -> None:
        from sparkdl._runtime.drain import DRAIN_KEY

        client, notice = self._rendezvous, self._liveness.drain
        if client is None or notice.requested():
            return
        try:
            if client.check([DRAIN_KEY]):
                notice.request(client.get(DRAIN_KEY).decode("utf-8", "replace"))
        except Exception:  # noqa: BLE001 - a store gone with the driver is the channel's to report
            pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
