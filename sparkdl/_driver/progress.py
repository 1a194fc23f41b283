"""Live progress on the driver, in a console or a notebook, fed by the tasks' channel messages."""

from __future__ import annotations

import html
import logging
import sys
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

logger = logging.getLogger("sparkdl")

ProgressCallback = Callable[[Dict[str, Any]], None]


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython  # type: ignore[import-not-found]
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel")


class ProgressDisplay:
    """Shows one line per epoch as soon as rank 0 reports it.

    In a Jupyter kernel it keeps one updating table instead of a growing log; elsewhere it prints
    lines to stdout (``spark-submit`` and Airflow capture them). ``callback`` also receives every
    epoch record, so users can feed their own dashboards.
    """

    def __init__(
        self, enabled: bool = True, callback: Optional[ProgressCallback] = None, total_epochs: Optional[int] = None
    ) -> None:
        self.enabled = enabled
        self.callback = callback
        self.total_epochs = total_epochs
        self.records: List[Dict[str, Any]] = []
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._handle = None
        if enabled and _in_notebook():
            from IPython.display import HTML, display  # type: ignore[import-not-found]

            self._handle = display(HTML("<i>sparkdl: starting training…</i>"), display_id=True)

    def epoch(self, record: Dict[str, Any]) -> None:
        with self._lock:
            self.records.append(record)
            if self.enabled:
                if self._handle is not None:
                    self._update_notebook()
                else:
                    self._write(format_epoch(record, self.total_epochs))
        if self.callback is not None:
            try:
                self.callback(dict(record))
            except Exception:  # noqa: BLE001 - a user's display bug must not kill the run
                logger.exception("progress callback failed")

    def metrics(self, rank: int, metrics: Dict[str, Any]) -> None:
        if self.enabled and self._handle is None:
            shown = "  ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
            self._write(f"[sparkdl rank {rank}] {shown}")
        if self.callback is not None:
            try:
                self.callback({"rank": rank, **metrics})
            except Exception:  # noqa: BLE001
                logger.exception("progress callback failed")

    def output(self, rank: int, lines: Sequence[Tuple[str, str]]) -> None:
        """Lines a rank's code printed, ``(stream, text)``, printed with the rank's prefix
        to the driver's stdout or stderr (``progress=False`` keeps them in the executors' logs only)."""
        if not self.enabled:
            return
        for stream, text in lines:
            self._write(f"[sparkdl rank {rank}] {text}", sys.stderr if stream == "stderr" else sys.stdout)

    def _write(self, line: str, stream: Any = None) -> None:
        """One line, written whole: the ranks' messages arrive on several threads, and print()
        writes the newline separately, so two ranks' lines could run together."""
        stream = sys.stdout if stream is None else stream
        with self._write_lock:
            stream.write(line + "\n")
            stream.flush()

    def _update_notebook(self) -> None:
        from IPython.display import HTML  # type: ignore[import-not-found]

        keys = ["epoch", "loss", "samples", "samples_per_sec", "seconds", "comm_bytes"]
        extra = sorted({k for r in self.records for k in r} - set(keys))
        head = "".join(f"<th>{html.escape(k)}</th>" for k in keys + extra)
        rows = "".join(
            "<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(k, '')))}</td>" for k in keys + extra) + "</tr>"
            for r in self.records
        )
        self._handle.update(HTML(f"<table><tr>{head}</tr>{rows}</table>"))


def format_epoch(record: Dict[str, Any], total_epochs: Optional[int] = None) -> str:
    epoch = record.get("epoch", "?")
    of = f"/{total_epochs}" if total_epochs else ""
    parts = [f"[sparkdl] epoch {epoch}{of}"]
    # global_batch: rows per optimizer step over all workers (on_resize, sparkdl._runtime.resize).
    for key in (
        "loss",
        *validation_figures([record]),
        "global_batch",
        "samples_per_sec",
        "seconds",
        "comm_bytes",
        "cache_mb",
    ):
        if key in record:
            parts.append(f"{key} {_fmt(record[key])}")
    return "  ".join(parts)


def validation_figures(history: Sequence[Mapping[str, Any]]) -> List[str]:
    """The validation figures the records hold, ``val_loss`` first, then each ``val_<metric>``
    by name; ``val_samples`` is a row count, not a figure."""
    keys = {key for record in history for key in record if key.startswith("val_") and key != "val_samples"}
    return sorted(keys, key=lambda key: (key != "val_loss", key))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)
