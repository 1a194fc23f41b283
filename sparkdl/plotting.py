"""Loss and validation metrics per epoch, one line per run: what ``sparkdl inspect --plot`` writes
and what a notebook shows (``sparkdl.plot_history(model)``). Needs matplotlib
(``pip install 'sparkdl-torch[plot]'``); nothing else in sparkdl imports it. :func:`save_figure`
writes any figure (compare.png and plan.png too) to a path or URL."""

from __future__ import annotations

import io
import os
import urllib.parse
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from sparkdl._driver.progress import validation_figures
from sparkdl.errors import ConfigError

History = Sequence[Mapping[str, Any]]
Runs = Union[Any, History, Mapping[str, Any]]


def plot_history(runs: Runs, path: Optional[str] = None, title: Optional[str] = None) -> Any:
    """Draws training loss (solid) and ``val_loss`` (dashed) per epoch, and each ``val_<metric>``
    in a panel of its own, one colour per run.

    Args:
        runs: a :class:`~sparkdl.TorchModel`, a history (a list of per-epoch dicts), or a mapping
            ``label -> model or history`` to compare runs (say, one per strategy).
        path: also write the figure there, a path or URL (PNG, or any format matplotlib knows
            by the suffix).
        title: the figure's title.

    Returns:
        The matplotlib ``Figure``: a notebook displays it when it is the cell's value.
    """
    try:
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ConfigError(
            "plotting needs matplotlib: pip install 'sparkdl-torch[plot]' (or pip install matplotlib)"
        ) from exc
    labelled = _labelled_histories(runs)
    metrics = [
        key
        for key in validation_figures([record for history in labelled.values() for record in history])
        if key != "val_loss"
    ]
    figure, axes = plt.subplots(1, 1 + len(metrics), figsize=(5 * (1 + len(metrics)), 3.4), squeeze=False)
    loss_axis, metric_axes = axes[0][0], axes[0][1:]
    for index, (label, history) in enumerate(labelled.items()):
        colour = f"C{index % 10}"
        _line(loss_axis, history, "loss", f"{label} training" if len(labelled) > 1 else "training", colour, "-")
        _line(
            loss_axis, history, "val_loss", f"{label} validation" if len(labelled) > 1 else "validation", colour, "--"
        )
        for axis, metric in zip(metric_axes, metrics):
            _line(axis, history, metric, label, colour, "-")
    loss_axis.set_ylabel("loss")
    for axis, name in [(loss_axis, "loss")] + list(zip(metric_axes, metrics)):
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_title(name)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize="small")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    if path is not None:
        save_figure(figure, path, dpi=100)
    # Out of pyplot's list of open figures: a notebook shows the returned figure once (not once more
    # at the cell's end), and a long-lived process does not keep every figure it drew.
    plt.close(figure)
    return figure


def save_figure(figure: Any, path: str, dpi: int = 100) -> str:
    """Writes a matplotlib figure to a path or URL (anything :mod:`sparkdl.filesystem` opens),
    in the format its suffix names (PNG without one); returns ``path``. The image is drawn in
    memory, then written whole: an object store gets one complete object."""
    from sparkdl import filesystem  # pyarrow: imported to write a figure, not with this module

    name = urllib.parse.urlparse(path).path if filesystem.is_url(path) else path
    image_format = os.path.splitext(name)[1][1:].lower() or "png"
    buffer = io.BytesIO()
    figure.savefig(buffer, format=image_format, dpi=dpi)
    filesystem.write_file(path, buffer.getvalue())
    return path


def _labelled_histories(runs: Runs) -> Dict[str, List[Mapping[str, Any]]]:
    if isinstance(runs, Mapping):
        labelled = {str(label): _history_of(run) for label, run in runs.items()}
    else:
        labelled = {"run": _history_of(runs)}
    if not labelled or not any(labelled.values()):
        raise ConfigError("nothing to plot: the runs have no per-epoch history (did the fit finish an epoch?)")
    return labelled


def _history_of(run: Any) -> List[Mapping[str, Any]]:
    history = getattr(run, "history", run)
    if isinstance(history, Mapping) and "history" in history:  # a metrics.json document
        history = history["history"]
    if not isinstance(history, Sequence) or not all(isinstance(record, Mapping) for record in history):
        raise ConfigError(
            f"cannot plot {type(run).__name__}: pass a TorchModel, its .history (a list of per-epoch dicts) or a dict of them"
        )
    return list(history)


def _line(axis: Any, history: History, key: str, label: str, colour: str, style: str) -> None:
    points = [(record["epoch"], record[key]) for record in history if _is_number(record.get(key)) and "epoch" in record]
    if points:
        epochs, values = zip(*points)
        axis.plot(epochs, values, style, marker="o", markersize=3, color=colour, label=label)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
