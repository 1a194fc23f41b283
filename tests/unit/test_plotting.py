"""Runs at a glance: `sparkdl inspect` with several runs side by side and `--plot`, and
sparkdl.plot_history (what the notebook shows); real matplotlib, real PNG files."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image as PILImage

import sparkdl
from sparkdl import cli
from sparkdl.errors import ConfigError
from sparkdl.plotting import plot_history


def _history(losses, accuracies):
    return [
        {
            "epoch": e + 1,
            "loss": loss,
            "val_loss": loss * 1.1,
            "val_accuracy": acc,
            "val_samples": 360,
            "samples_per_sec": 100.0 + e,
            "seconds": 0.5,
        }
        for e, (loss, acc) in enumerate(zip(losses, accuracies))
    ]


def _write_run(directory, strategy, history, wall=10.0):
    directory.mkdir()
    (directory / "metrics.json").write_text(
        json.dumps(
            {
                "status": "succeeded",
                "exit_code": 0,
                "wall_seconds": wall,
                "history": history,
                "run": {
                    "num_workers": 2,
                    "strategy": {"name": strategy},
                    "dataset": {"rows": 1797},
                    "attempts": [{}],
                    "steps": {"resumed_at": 0},
                },
            }
        )
    )
    return str(directory)


@pytest.fixture()
def two_runs(tmp_path):
    first = _write_run(tmp_path / "a", "allreduce", _history([2.0, 1.0, 0.5], [0.5, 0.8, 0.93]), wall=12.0)
    second = _write_run(tmp_path / "b", "model_averaging", _history([2.2, 1.4, 0.9], [0.4, 0.7, 0.85]), wall=9.5)
    return first, second


def test_a_run_table_shows_the_validation_metrics_per_epoch(two_runs, capsys):
    assert cli.sparkdl_main(["inspect", two_runs[0]]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.strip().startswith("epoch"))
    assert header.split()[:4] == ["epoch", "loss", "val_loss", "val_accuracy"]
    last = next(line for line in text.splitlines() if line.strip().startswith("3 "))
    assert last.split()[:4] == ["3", "0.5000", "0.5500", "0.9300"]


def test_several_runs_are_compared_in_one_table(two_runs, capsys):
    assert cli.sparkdl_main(["inspect", *two_runs]) == 0
    text = capsys.readouterr().out
    table = text[text.index("runs compared (last epoch):\n") :].splitlines()[1:]
    assert table[0].split()[:5] == ["run", "epochs", "final", "loss", "val_loss"]
    rows = {line.split(" (")[0]: line.split(")", 1)[1].split() for line in table[1:]}
    assert rows == {
        "allreduce": ["3", "0.5000", "0.5500", "0.9300", "101", "12.0"],
        "model_averaging": ["3", "0.9000", "0.9900", "0.8500", "101", "9.5"],
    }


def test_plot_writes_a_png_of_loss_and_each_validation_metric(two_runs, tmp_path, capsys):
    png = tmp_path / "runs.png"
    assert cli.sparkdl_main(["inspect", *two_runs, "--plot", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    with PILImage.open(png) as image:
        assert image.format == "PNG" and image.size == (1000, 340)  # two panels of 5 x 3.4 in at 100 dpi
        colours = {colour for _, colour in image.convert("RGB").getcolors(maxcolors=1 << 20)}
    tab_blue, tab_orange = (31, 119, 180), (255, 127, 14)  # matplotlib's C0 and C1: one per run
    assert {tab_blue, tab_orange} <= colours


def test_plot_history_draws_one_line_per_run_and_series():
    runs = {"allreduce": _history([2.0, 1.0], [0.5, 0.9]), "parameter_server": _history([3.0, 2.0], [0.3, 0.6])}
    figure = plot_history(runs, title="digits")
    loss_axis, accuracy_axis = figure.axes
    assert [line.get_label() for line in loss_axis.get_lines()] == [
        "allreduce training",
        "allreduce validation",
        "parameter_server training",
        "parameter_server validation",
    ]
    assert list(loss_axis.get_lines()[2].get_ydata()) == [3.0, 2.0]
    assert accuracy_axis.get_title() == "val_accuracy"
    assert [list(line.get_ydata()) for line in accuracy_axis.get_lines()] == [[0.5, 0.9], [0.3, 0.6]]


def test_plot_history_takes_a_model_and_refuses_what_has_no_history():
    model = sparkdl.TorchModel(
        torch.nn.Linear(3, 2),
        history=[{"epoch": 1, "loss": 1.5}, {"epoch": 2, "loss": 0.7}],
        feature_cols=["x"],
        output_shape=[2],
    )
    figure = plot_history(model)
    assert len(figure.axes) == 1 and list(figure.axes[0].get_lines()[0].get_ydata()) == [1.5, 0.7]
    with pytest.raises(ConfigError, match="no per-epoch history"):
        plot_history([])
    with pytest.raises(ConfigError, match="cannot plot int"):
        plot_history(3)


def test_plot_refuses_a_dataset(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"x": [1.0, 2.0]}), str(tmp_path / "part-0.parquet"))
    assert cli.sparkdl_main(["inspect", str(tmp_path), "--plot", str(tmp_path / "p.png")]) == 2
    assert "is a dataset: several paths and --plot take runs" in capsys.readouterr().err


def test_runs_of_the_same_strategy_and_directory_name_are_all_drawn(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    first = _write_run(tmp_path / "x" / "run", "allreduce", _history([2.0, 1.0], [0.5, 0.9]))
    second = _write_run(tmp_path / "y" / "run", "allreduce", _history([3.0, 2.0], [0.3, 0.6]))
    png = tmp_path / "both.png"
    assert cli.sparkdl_main(["inspect", first, second, "--plot", str(png)]) == 0
    with PILImage.open(png) as image:
        colours = {colour for _, colour in image.convert("RGB").getcolors(maxcolors=1 << 20)}
    assert {(31, 119, 180), (255, 127, 14)} <= colours  # two runs, two colours
