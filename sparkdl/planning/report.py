"""What ``sparkdl.plan`` returns: :class:`Plan` — the calibration, a prediction per strategy and
worker count, where each strategy stops scaling — as one table, ``plan.json`` and a plot."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from sparkdl import filesystem
from sparkdl.errors import ConfigError
from sparkdl.planning.models import Measured, Prediction, stops_scaling

#: Scaling efficiency below which a strategy "stops scaling" in the summary.
EFFICIENCY_FLOOR = 0.8

#: What a plan does not predict: it models time, not how many samples reach a given loss.
STATISTICAL_EFFICIENCY = (
    "samples-to-accuracy is not predicted: a larger global batch or a longer averaging period can need more samples "
    "to reach the same loss, which only training shows (pair the plan with `sparkdl compare`)"
)


@dataclasses.dataclass
class Plan:
    """The predictions of one calibration.

    Attributes:
        measured: what the models used (the calibration, with ``bandwidth``/``latency`` as given).
        predictions: one per strategy and worker count.
        calibration: the raw figures of the calibration stages (hosts, device, threads...).
        notes: what to keep in mind reading it (loopback measured, stated figures...).
    """

    measured: Measured
    predictions: List[Prediction]
    calibration: Dict[str, Any]
    notes: List[str] = dataclasses.field(default_factory=list)

    @property
    def strategies(self) -> List[str]:
        seen: List[str] = []
        for prediction in self.predictions:
            if prediction.strategy not in seen:
                seen.append(prediction.strategy)
        return seen

    def label(self, strategy: str) -> str:
        """The plan's label that ``strategy`` names: the label itself (``"ModelAveraging(sync_every=8)"``),
        or a family or registered name that names exactly one of the plan's strategies
        (``"ModelAveraging"``, ``"model_averaging"``, ``"DiLoCo"``, ``"sharded"``), case, ``_``
        and spaces aside.

        Raises:
            ConfigError: no label, or several, match; the message lists the plan's labels.
        """
        labels = self.strategies
        if strategy in labels:
            return strategy
        wanted = _loose(strategy)
        matches = [label for label in labels if _loose(label.split("(", 1)[0]).startswith(wanted)] if wanted else []
        if len(matches) == 1:
            return matches[0]
        known = ", ".join(repr(label) for label in labels)
        if matches:
            raise ConfigError(
                f"strategy {strategy!r} names several of this plan's strategies ({', '.join(map(repr, matches))}): "
                f"give one of them whole; the plan's strategies: {known}"
            )
        raise ConfigError(f"strategy {strategy!r} is not in this plan; its strategies: {known}")

    def of(self, strategy: str) -> List[Prediction]:
        """``strategy``'s predictions by worker count (``strategy`` as :meth:`label` takes it)."""
        label = self.label(strategy)
        return sorted((p for p in self.predictions if p.strategy == label), key=lambda p: p.workers)

    def stops_scaling(self, strategy: str) -> Optional[Prediction]:
        """The first worker count where ``strategy``'s efficiency falls under 80% (None: it keeps
        scaling to the largest count of the sweep). ``strategy``: a label of the plan, or a family
        or registered name that names exactly one (``"AllReduce"``, ``"ModelAveraging"``,
        ``"diloco"``).

        Raises:
            ConfigError: ``strategy`` is not one of the plan's strategies (the message lists them).
        """
        return stops_scaling(self.of(strategy), EFFICIENCY_FLOOR)

    def summary(self) -> List[str]:
        """One sentence per strategy: where it stops scaling, and why."""
        lines = []
        for strategy in self.strategies:
            stop = self.stops_scaling(strategy)
            largest = self.of(strategy)[-1]
            if stop is None:
                lines.append(
                    f"{strategy} keeps scaling to {largest.workers} workers ({largest.efficiency:.0%} efficiency, "
                    f"{largest.samples_per_s:,.0f} samples/s)"
                )
            else:
                lines.append(
                    f"{strategy} stops scaling at {stop.workers} workers: {stop.efficiency:.0%} efficiency "
                    f"({stop.samples_per_s:,.0f} samples/s), its communication {stop.comm_bound}-bound"
                )
            over = [p for p in self.of(strategy) if p.fits is False]
            if over:
                budget = self.measured.memory_budget_bytes or 0
                lines.append(
                    f"{strategy} does not fit the memory budget ({budget / 1e6:,.0f} MB per rank) on "
                    f"{', '.join(str(p.workers) for p in over)} workers ({over[0].memory_per_rank_bytes / 1e6:,.0f} MB "
                    f"per rank on {over[0].workers})"
                )
        return lines

    def table(self, workers: Optional[Sequence[int]] = None) -> str:
        """The plan as text: a row per strategy and worker count (``workers``: only these)."""
        m = self.measured
        head = [
            f"calibration: {m.local_step_s * 1e3:.2f} ms per step of the slowest rank ({m.compute_step_s * 1e3:.2f} ms compute, "
            f"data path {m.data_rows_per_s:,.0f} rows/s), batch {m.batch_size}, model {m.param_bytes / 1e6:.2f} MB, "
            f"optimizer state {m.optimizer_bytes / 1e6:.2f} MB; link {m.bandwidth * 8 / 1e9:.3g} Gbit/s, "
            f"latency {m.latency_s * 1e6:.0f} us ({m.backend})",
            *(
                [
                    "each synchronization beyond its transfer: "
                    + ", ".join(f"{label} {seconds * 1e3:.1f} ms" for label, seconds in m.sync_overhead_s.items())
                ]
                if m.sync_overhead_s
                else []
            ),
            "",
            f"{'strategy':<34} {'workers':>7} {'step ms':>9} {'samples/s':>12} {'efficiency':>10} "
            f"{'wire MB/step':>12} {'MB/rank':>9}  bound",
        ]
        rows = []
        for strategy in self.strategies:
            for p in self.of(strategy):
                if workers is not None and p.workers not in workers:
                    continue
                rows.append(
                    f"{strategy:<34} {p.workers:>7} {p.step_s * 1e3:>9.2f} {p.samples_per_s:>12,.0f} "
                    f"{p.efficiency:>10.0%} {p.wire_bytes_per_step / 1e6:>12.3f} {p.memory_per_rank_bytes / 1e6:>9.1f}  "
                    f"{p.bound}{'; does not fit' if p.fits is False else ''}"
                )
        tail = ["", *self.summary(), *(f"note: {n}" for n in [*self.notes, STATISTICAL_EFFICIENCY])]
        return "\n".join([*head, *rows, *tail])

    def to_json(self) -> Dict[str, Any]:
        return {
            "measured": dataclasses.asdict(self.measured),
            "calibration": self.calibration,
            "predictions": [p.to_json() for p in self.predictions],
            "stops_scaling": {
                s: (dataclasses.asdict(stop) if (stop := self.stops_scaling(s)) else None) for s in self.strategies
            },
            "summary": self.summary(),
            "notes": [*self.notes, STATISTICAL_EFFICIENCY],
        }

    def save(self, directory: str, plot: bool = True) -> List[str]:
        """Writes ``plan.json`` (and ``plan.png``, samples/s against workers per strategy, when
        ``plot`` and matplotlib is there) into ``directory``, a path or URL; returns the paths written."""
        written = [filesystem.url_join(directory, "plan.json")]
        filesystem.write_json(written[0], self.to_json())
        if plot:
            written.append(self.plot(filesystem.url_join(directory, "plan.png")))
        return written

    def plot(self, path: str) -> str:
        """Draws samples/s against workers per strategy and writes it to ``path`` (a path or URL); returns ``path``."""
        from matplotlib.figure import Figure  # no pyplot: no global figure list, no GUI backend

        from sparkdl.plotting import save_figure

        figure = Figure(figsize=(8, 5))
        axis = figure.subplots()
        for strategy in self.strategies:
            points = self.of(strategy)
            axis.plot([p.workers for p in points], [p.samples_per_s for p in points], marker="o", label=strategy)
        largest = max(p.workers for p in self.predictions)
        alone = self.measured.batch_size / max(self.measured.local_step_s, 1e-12)
        axis.plot([1, largest], [alone, alone * largest], linestyle=":", color="grey", label="linear scaling")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("workers")
        axis.set_ylabel("predicted samples/s")
        axis.set_title(f"link {self.measured.bandwidth * 8 / 1e9:.3g} Gbit/s, batch {self.measured.batch_size}/worker")
        axis.legend(fontsize="small")
        axis.grid(True, which="both", alpha=0.3)
        figure.tight_layout()
        return save_figure(figure, path, dpi=110)


def _loose(name: str) -> str:
    """A name compared loosely: lower case, without ``_``, ``-`` and spaces."""
    return "".join(ch for ch in name.lower() if ch not in "_- ")
