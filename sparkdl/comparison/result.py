"""What ``sparkdl.compare`` returns: one :class:`ComparisonRow` per strategy, figured from that
strategy's ``fit`` history, and the :class:`Comparison` of them with its table, JSON document and
loss-vs-time plot. No Spark here: everything is computed from per-epoch history records."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from sparkdl import filesystem
from sparkdl._driver.progress import validation_figures
from sparkdl.errors import ConfigError
from sparkdl.plotting import save_figure

History = Sequence[Mapping[str, Any]]

#: What the JSON document says it is; ``Comparison.from_json`` checks it.
KIND = "sparkdl-compare"
JSON_NAME = "compare.json"
PNG_NAME = "compare.png"
_NONE = "—"


def steady_epochs(history: History) -> List[Mapping[str, Any]]:
    """The epochs throughput is measured on: all but the first (which also pays for the data
    stream's start), or the only one."""
    return list(history[1:]) if len(history) > 1 else list(history)


def samples_per_sec(records: History) -> Optional[float]:
    """Samples over seconds, summed over the records (not a mean of per-epoch rates)."""
    seconds = sum(float(r["seconds"]) for r in records)
    return sum(int(r["samples"]) for r in records) / seconds if records and seconds > 0 else None


def rank_samples_per_sec(records: History, num_workers: int) -> List[float]:
    """Each rank's samples over its seconds across the records. Every rank takes the same steps,
    so a rank's samples per epoch are ``samples / num_workers`` and its seconds are those over
    ``rank<r>_samples_per_sec``."""
    rates = []
    for rank in range(num_workers):
        key = f"rank{rank}_samples_per_sec"
        if not records or any(not r.get(key) for r in records):
            return []
        samples = [int(r["samples"]) / num_workers for r in records]
        rates.append(sum(samples) / sum(n / float(r[key]) for n, r in zip(samples, records)))
    return rates


def comm_bytes_per_sample(history: History, num_workers: int) -> Optional[float]:
    """Model-sync bytes all ranks sent per training sample, over the whole budget. ``comm_bytes``
    is one rank's (the mean over ranks) and ``samples`` is every rank's, hence ``num_workers``."""
    samples = sum(int(r["samples"]) for r in history)
    return sum(float(r["comm_bytes"]) for r in history) * num_workers / samples if samples else None


def loss_curve(history: History) -> List[Dict[str, Any]]:
    """One point per epoch: training seconds so far (the sum of the epochs' ``seconds``, rank 0's
    training time without start-up and validation passes), the epoch's loss and its validation
    figures."""
    points, elapsed = [], 0.0
    keys = validation_figures(history)
    for record in history:
        elapsed += float(record["seconds"])
        point = {"epoch": record["epoch"], "seconds": elapsed, "loss": record["loss"]}
        point.update({key: record[key] for key in keys if key in record})
        points.append(point)
    return points


def time_to_target(curve: Sequence[Mapping[str, Any]], target_loss: Optional[float]) -> Optional[Mapping[str, Any]]:
    """The first curve point whose training loss is at or below ``target_loss`` (None: never, or
    no target). The resolution is one epoch: the loss is known at epochs' ends only."""
    if target_loss is None:
        return None
    return next((point for point in curve if point["loss"] <= target_loss), None)


@dataclasses.dataclass(frozen=True)
class ComparisonRow:
    """One strategy's figures after the budget (every field None but ``error`` when it failed).

    Attributes:
        label: what the table calls the strategy, e.g. ``ModelAveraging(sync_every=4)``.
        strategy: the strategy's settings (``Strategy.describe()``).
        status: ``"ok"`` or ``"failed"``.
        error: why the fit failed (``Type: message``).
        samples_per_sec: steady-state throughput, over ``steady_epochs``.
        steady_epochs: the epochs ``samples_per_sec`` and ``rank_samples_per_sec`` cover.
        rank_samples_per_sec: each rank's throughput over those epochs.
        comm_bytes_per_sample: model-sync bytes all ranks sent per training sample.
        loss: the last epoch's training loss (mean over its samples).
        validation: the last epoch's ``val_loss`` and ``val_<metric>`` (empty without validation).
        time_to_target_s: training seconds until the loss first reached the target (None: never).
        target_epoch: the epoch at which it did.
        train_seconds: rank 0's training loop, start to end (``run_info["train_seconds"]``).
        fit_seconds: the whole ``fit`` call (data preparation and launch included).
        curve: :func:`loss_curve` of the history.
        history: the fit's ``model.history``.
    """

    label: str
    strategy: Dict[str, Any]
    status: str = "ok"
    error: Optional[str] = None
    samples: Optional[int] = None
    samples_per_sec: Optional[float] = None
    steady_epochs: List[int] = dataclasses.field(default_factory=list)
    rank_samples_per_sec: List[float] = dataclasses.field(default_factory=list)
    comm_bytes_per_sample: Optional[float] = None
    loss: Optional[float] = None
    validation: Dict[str, float] = dataclasses.field(default_factory=dict)
    time_to_target_s: Optional[float] = None
    target_epoch: Optional[int] = None
    train_seconds: Optional[float] = None
    fit_seconds: Optional[float] = None
    curve: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    history: List[Dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_history(
        cls,
        label: str,
        strategy: Mapping[str, Any],
        history: History,
        *,
        num_workers: int,
        target_loss: Optional[float] = None,
        train_seconds: Optional[float] = None,
        fit_seconds: Optional[float] = None,
    ) -> "ComparisonRow":
        """The row of a finished fit, from its ``model.history``."""
        if not history:
            raise ConfigError(f"{label}: the fit returned no epoch history, so there is nothing to compare")
        steady = steady_epochs(history)
        curve = loss_curve(history)
        reached = time_to_target(curve, target_loss)
        last = history[-1]
        return cls(
            label=label,
            strategy=dict(strategy),
            samples=sum(int(r["samples"]) for r in history),
            samples_per_sec=samples_per_sec(steady),
            steady_epochs=[int(r["epoch"]) for r in steady],
            rank_samples_per_sec=rank_samples_per_sec(steady, num_workers),
            comm_bytes_per_sample=comm_bytes_per_sample(history, num_workers),
            loss=float(last["loss"]),
            validation={key: last[key] for key in validation_figures([last])},
            time_to_target_s=reached["seconds"] if reached else None,
            target_epoch=reached["epoch"] if reached else None,
            train_seconds=train_seconds,
            fit_seconds=fit_seconds,
            curve=curve,
            history=[dict(r) for r in history],
        )

    @classmethod
    def failed(
        cls, label: str, strategy: Mapping[str, Any], error: Any, fit_seconds: Optional[float] = None
    ) -> "ComparisonRow":
        """The row of a fit that raised ``error`` (an exception or its text)."""
        text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
        return cls(label=label, strategy=dict(strategy), status="failed", error=text, fit_seconds=fit_seconds)

    def to_json(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """The strategies trained on the same data, model, optimizer and seed for the same budget.

    Attributes:
        rows: one per strategy, in the order they ran (failed ones included, marked).
        settings: what every run shared: model, optimizer, loss, data, workers, batch size,
            epochs (the budget), seed, target loss, and the slowed rank if any.
        versions: sparkdl, torch, pyspark, pyarrow, python.
        created_at: when the comparison finished (UTC, ISO 8601).
    """

    rows: List[ComparisonRow]
    settings: Dict[str, Any]
    versions: Dict[str, str] = dataclasses.field(default_factory=dict)
    created_at: str = dataclasses.field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))

    @property
    def ok(self) -> bool:
        """Every strategy's fit succeeded."""
        return all(row.ok for row in self.rows)

    @property
    def failures(self) -> List[ComparisonRow]:
        return [row for row in self.rows if not row.ok]

    def row(self, label: str) -> ComparisonRow:
        """The row of the strategy labelled ``label``."""
        for row in self.rows:
            if row.label == label:
                return row
        raise KeyError(f"no strategy labelled {label!r}; labels: {', '.join(r.label for r in self.rows)}")

    def to_json(self) -> Dict[str, Any]:
        """Every row (its curve and history included), the settings and the versions."""
        status = "succeeded" if self.ok else f"failed: {', '.join(r.label for r in self.failures)}"
        return {
            "kind": KIND,
            "status": status,
            "created_at": self.created_at,
            "settings": self.settings,
            "rows": [row.to_json() for row in self.rows],
            "versions": self.versions,
        }

    @classmethod
    def from_json(cls, document: Mapping[str, Any]) -> "Comparison":
        """Reads back what :meth:`to_json` (or ``compare.json``) holds."""
        if document.get("kind") != KIND:
            raise ConfigError(f"not a sparkdl compare document (kind={document.get('kind')!r}, expected {KIND!r})")
        rows = [ComparisonRow(**row) for row in document["rows"]]
        return cls(
            rows=rows,
            settings=dict(document["settings"]),
            versions=dict(document.get("versions") or {}),
            created_at=document.get("created_at", ""),
        )

    def table(self, style: str = "markdown") -> str:
        """The comparison as text: a heading line, the slowed rank when one was, and one row per
        strategy. ``style`` is ``"markdown"`` (a GitHub table) or ``"plain"`` (aligned columns)."""
        if style not in ("markdown", "plain"):
            raise ConfigError(f"style={style!r} must be 'markdown' or 'plain'")
        header, cells = self._cells()
        lines = [self._heading()]
        slowed = self.settings.get("slowed")
        if slowed:
            lines.append(
                f"slowed worker ON: rank {slowed['rank']} sleeps {slowed['seconds_per_step']:g} s before every training step "
                f"(a simulated straggler)"
            )
        lines.append("")
        if style == "markdown":
            lines.append("| " + " | ".join(header) + " |")
            lines.append("|---|" + "---:|" * (len(header) - 1))
            lines += ["| " + " | ".join(row) + " |" for row in cells]
        else:
            widths = [max(len(column[i]) for column in [header, *cells]) for i in range(len(header))]
            lines += [
                "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *cells]
            ]
        failed = self.failures
        if failed:
            lines.append("")
            lines += [f"{row.label} failed: {row.error}" for row in failed]
        return "\n".join(lines)

    def _heading(self) -> str:
        s = self.settings
        workers, batch = s.get("num_workers"), s.get("batch_size")
        # The rows per optimizer step: what the learning rate is tuned for (docs/recovery.md, on_resize).
        global_batch = workers * batch if isinstance(workers, int) and isinstance(batch, int) else "?"
        return (
            f"{workers} workers, batch {batch}/worker (global batch {global_batch}), {s.get('epochs')} epoch(s) per strategy "
            f"(equal samples), seed {s.get('seed')}; samples/s over epochs {_epochs(s.get('epochs'))}; time = training seconds "
            f"(sum of epoch times, rank 0)"
        )

    def _cells(self):
        s = self.settings
        epochs, target = s.get("epochs"), s.get("target_loss")
        validation = validation_figures([row.validation for row in self.rows if row.ok])
        header = [
            "strategy",
            f"samples/s (epochs {_epochs(epochs)})",
            "per-rank samples/s",
            "comm bytes/sample",
            f"loss after {epochs} epoch(s)",
            *validation,
        ]
        if target is not None:
            header.append(f"time to loss ≤ {target:g}")
        header += ["train s", "fit s"]
        cells = []
        for row in self.rows:
            if not row.ok:
                first = (row.error or "").splitlines()[0] if row.error else ""
                reason = first if len(first) <= 80 else first[:77] + "..."
                cells.append(
                    [row.label, f"FAILED ({reason})"]
                    + [_NONE] * (len(header) - 3)
                    + [_number(row.fit_seconds, "{:.1f}")]
                )
                continue
            reached = (
                _NONE if row.time_to_target_s is None else f"{row.time_to_target_s:.2f} s (epoch {row.target_epoch})"
            )
            cells.append(
                [
                    row.label,
                    _number(row.samples_per_sec, "{:,.0f}"),
                    " / ".join(f"{r:,.0f}" for r in row.rank_samples_per_sec) or _NONE,
                    _number(row.comm_bytes_per_sample, "{:,.1f}"),
                    _number(row.loss, "{:.4f}"),
                ]
                + [_number(row.validation.get(key), "{:.4f}") for key in validation]
                + ([reached] if target is not None else [])
                + [_number(row.train_seconds, "{:.1f}"), _number(row.fit_seconds, "{:.1f}")]
            )
        return header, cells

    def plot(self, path: Optional[str] = None) -> Any:
        """Loss against training seconds, one line per strategy (validation loss dashed, the
        target loss as a horizontal line); written to ``path`` (a path or URL; PNG by its
        suffix) when given.

        Returns:
            The matplotlib ``Figure``.

        Raises:
            ConfigError: matplotlib is not installed, or no strategy finished an epoch.
        """
        check_plotting()
        from matplotlib.figure import Figure  # no pyplot: no global figure list, no GUI backend

        rows = [row for row in self.rows if row.ok and row.curve]
        if not rows:
            raise ConfigError("nothing to plot: no strategy finished an epoch (see the rows' errors)")
        figure = Figure(figsize=(7.5, 4.2))
        axis = figure.subplots()
        for index, row in enumerate(rows):
            colour = f"C{index % 10}"
            xs = [p["seconds"] for p in row.curve]
            axis.plot(xs, [p["loss"] for p in row.curve], "-", marker="o", markersize=3, color=colour, label=row.label)
            if any("val_loss" in p for p in row.curve):
                points = [(p["seconds"], p["val_loss"]) for p in row.curve if "val_loss" in p]
                axis.plot(*zip(*points), "--", color=colour, label=f"{row.label} validation")
        target = self.settings.get("target_loss")
        if target is not None:
            axis.axhline(target, color="grey", linestyle=":", label=f"target loss {target:g}")
        axis.set_xlabel("training seconds (sum of epoch times, rank 0)")
        axis.set_ylabel("loss")
        slowed = self.settings.get("slowed")
        title = f"loss vs time, {self.settings.get('num_workers')} workers, {self.settings.get('epochs')} epoch(s) each"
        axis.set_title(
            title + (f"; rank {slowed['rank']} slowed {slowed['seconds_per_step']:g} s/step" if slowed else ""),
            fontsize="medium",
        )
        axis.legend(fontsize="small")
        figure.tight_layout()
        if path is not None:
            save_figure(figure, path, dpi=100)
        return figure

    def save(self, output_dir: str, plot: bool = True) -> Dict[str, Optional[str]]:
        """Writes ``compare.json`` (and ``compare.png`` when ``plot`` and some strategy finished)
        into ``output_dir``, a path or URL; returns their paths (``png`` None when none was drawn)."""
        json_path = filesystem.url_join(output_dir, JSON_NAME)
        filesystem.write_file(json_path, json.dumps(self.to_json(), indent=2, default=_jsonable).encode())
        png_path = None
        if plot and any(row.ok and row.curve for row in self.rows):
            png_path = filesystem.url_join(output_dir, PNG_NAME)
            self.plot(png_path)
        return {"json": json_path, "png": png_path}


def check_plotting() -> None:
    """Raises ConfigError saying what to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "the compare plot (compare.png) needs matplotlib: pip install 'sparkdl-torch[plot]' (or pass plot=False / --no-plot)"
        ) from exc


def _epochs(epochs: Any) -> str:
    return "2–" + str(epochs) if isinstance(epochs, int) and epochs > 2 else ("2" if epochs == 2 else "1")


def _number(value: Optional[float], fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return _NONE
    return fmt.format(value)


def _jsonable(value: Any) -> Any:
    return str(value)
