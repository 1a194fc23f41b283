"""sparkdl.compare without Spark: the figures a row takes from a history, time to target, the table,
the JSON document, the plot, the simulated straggler, and every bad setting. (The Spark runs:
tests/integration/test_compare.py.)"""

from __future__ import annotations

import json
import math
import pickle
import time

import pytest
import torch

import sparkdl
from sparkdl.cli import sparkdl_main
from sparkdl.comparison import CompareSettings
from sparkdl.comparison.result import Comparison, ComparisonRow, loss_curve, time_to_target
from sparkdl.comparison.strategies import SlowedModel, default_strategies, labelled_strategies, parse_strategies


def _history(losses, seconds, samples=1000, comm=5000, rates=((600.0, 400.0))):
    return [
        {
            "epoch": i + 1,
            "loss": loss,
            "samples": samples,
            "seconds": s,
            "samples_per_sec": samples / s,
            "comm_bytes": comm,
            "rank0_samples_per_sec": rates[0],
            "rank1_samples_per_sec": rates[1],
        }
        for i, (loss, s) in enumerate(zip(losses, seconds))
    ]


SETTINGS = {"num_workers": 2, "batch_size": 32, "epochs": 3, "seed": 0, "target_loss": 1.0, "slowed": None}


def test_a_row_takes_steady_throughput_comm_per_sample_and_the_final_loss_from_the_history():
    history = _history([2.0, 1.2, 0.8], [4.0, 1.0, 3.0], comm=5000)
    row = ComparisonRow.from_history("AllReduce()", {"name": "allreduce"}, history, num_workers=2, target_loss=1.0)
    assert row.steady_epochs == [2, 3]
    assert row.samples_per_sec == pytest.approx(2000 / 4.0)  # epochs 2-3: samples over seconds, not a mean of rates
    assert row.comm_bytes_per_sample == pytest.approx(3 * 5000 * 2 / 3000)  # every rank's bytes over every sample
    assert row.loss == 0.8 and row.samples == 3000
    assert row.rank_samples_per_sec == pytest.approx([600.0, 400.0])
    # Cumulative training seconds: 4, 5, 8; the loss first reaches 1.0 at epoch 3.
    assert [p["seconds"] for p in row.curve] == pytest.approx([4.0, 5.0, 8.0])
    assert (row.time_to_target_s, row.target_epoch) == (pytest.approx(8.0), 3)
    one = ComparisonRow.from_history("x", {}, history[:1], num_workers=2)
    assert one.steady_epochs == [1] and one.samples_per_sec == pytest.approx(250.0)


def test_time_to_target_is_the_first_point_at_or_below_it_or_none():
    curve = loss_curve(_history([2.0, 1.0, 0.5, 1.5], [1.0, 1.0, 1.0, 1.0]))
    assert time_to_target(curve, 1.0)["epoch"] == 2  # "at or below": equal counts
    assert time_to_target(curve, 0.4) is None
    assert time_to_target(curve, None) is None


def test_per_rank_rates_weigh_epochs_by_their_time():
    history = _history([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    history[1]["rank1_samples_per_sec"], history[2]["rank1_samples_per_sec"] = 100.0, 300.0
    row = ComparisonRow.from_history("x", {}, history, num_workers=2)
    # 500 samples per epoch on rank 1: (500 + 500) / (5 s + 5/3 s) = 150, the harmonic mean.
    assert row.rank_samples_per_sec[1] == pytest.approx(150.0)


def _comparison(slowed=None):
    rows = [
        ComparisonRow.from_history(
            "AllReduce()",
            {"name": "allreduce"},
            _history([2.0, 1.2, 0.9], [1.0, 1.0, 1.0], comm=6000),
            num_workers=2,
            target_loss=1.0,
            train_seconds=3.5,
            fit_seconds=4.0,
        ),
        ComparisonRow.from_history(
            "ModelAveraging(sync_every=4)",
            {"name": "model_averaging", "sync_every": 4},
            _history([2.0, 1.4, 1.1], [0.5, 0.5, 0.5], comm=1500),
            num_workers=2,
            target_loss=1.0,
        ),
        ComparisonRow.failed("ParameterServer()", {"name": "parameter_server"}, RuntimeError("rank 1 lost\nmore"), 1.5),
    ]
    return Comparison(rows=rows, settings={**SETTINGS, "slowed": slowed}, versions={"sparkdl": sparkdl.__version__})


def test_table_has_one_row_per_strategy_marks_failures_and_says_when_a_worker_was_slowed():
    comparison = _comparison()
    text = comparison.table()
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(lines) == 1 + 3  # header + one per strategy, the failed one kept
    assert "time to loss ≤ 1" in lines[0] and "samples/s (epochs 2–3)" in lines[0]
    assert "| AllReduce() | 1,000 | 600 / 400 | 12.0 | 0.9000 |" in text and "3.00 s (epoch 3)" in text
    ma = next(line for line in lines if line.startswith("| ModelAveraging"))
    assert ma.split(" | ")[5] == "—"  # never reached the target
    assert (
        "FAILED (RuntimeError: rank 1 lost)" in text and "ParameterServer() failed: RuntimeError: rank 1 lost" in text
    )
    assert "slowed worker" not in text
    slowed = _comparison({"rank": 1, "seconds_per_step": 0.02}).table("plain")
    assert "slowed worker ON: rank 1 sleeps 0.02 s" in slowed and "| " not in slowed
    assert not comparison.ok and [r.label for r in comparison.failures] == ["ParameterServer()"]
    with pytest.raises(sparkdl.ConfigError, match="style="):
        comparison.table("html")


def test_json_holds_every_row_and_curve_point_and_reads_back(tmp_path):
    comparison = _comparison({"rank": 0, "seconds_per_step": 0.1})
    paths = comparison.save(str(tmp_path))
    document = json.load(open(paths["json"]))
    assert document["kind"] == "sparkdl-compare" and document["status"] == "failed: ParameterServer()"
    assert [r["label"] for r in document["rows"]] == [r.label for r in comparison.rows]
    assert len(document["rows"][0]["curve"]) == 3 and document["rows"][2]["status"] == "failed"
    assert document["settings"]["slowed"] == {"rank": 0, "seconds_per_step": 0.1}
    again = Comparison.from_json(document)
    assert again.rows == comparison.rows and again.table() == comparison.table()
    with open(paths["png"], "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(sparkdl.ConfigError, match="not a sparkdl compare document"):
        Comparison.from_json({"kind": "metrics"})


def test_the_plot_names_the_plot_extra_when_matplotlib_is_missing(monkeypatch, tmp_path):
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it gives: ImportError
    with pytest.raises(sparkdl.ConfigError, match=r"pip install 'sparkdl-torch\[plot\]'"):
        _comparison().plot(str(tmp_path / "x.png"))
    with pytest.raises(sparkdl.ConfigError, match=r"sparkdl-torch\[plot\]"):  # before anything trains
        sparkdl.compare(model=lambda: torch.nn.Linear(2, 2), data="/nowhere", output_dir=str(tmp_path))
    assert not (tmp_path / "x.png").exists()


def test_strategies_as_objects_mapping_or_text_get_labels():
    labels = [label for label, _ in labelled_strategies(None)]
    assert labels == [
        "AllReduce()",
        "ModelAveraging(sync_every=4)",
        "ModelAveraging(sync_every=16)",
        "ElasticAveraging()",
        "ParameterServer()",
        "ParameterServer(max_staleness=2)",
    ]
    assert len(default_strategies()) == 6
    parsed = parse_strategies(
        "allreduce, model_averaging:sync_every=4:warmup_steps=2,parameter_server:max_staleness=null"
    )
    assert [label for label, _ in parsed] == [
        "AllReduce()",
        "ModelAveraging(sync_every=4, warmup_steps=2)",
        "ParameterServer()",
    ]
    assert parsed[1][1] == sparkdl.ModelAveraging(sync_every=4, warmup_steps=2)
    mapping = labelled_strategies({"sync": sparkdl.AllReduce(), "local": sparkdl.ModelAveraging(sync_every=8)})
    assert [label for label, _ in mapping] == ["sync", "local"]
    twice = labelled_strategies([sparkdl.AllReduce(), sparkdl.AllReduce()])
    assert [label for label, _ in twice] == ["AllReduce()", "AllReduce() #2"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"strategies": "allreduce,frobnicate"}, r"unknown strategy 'frobnicate'.*valid names: .*allreduce"),
        ({"strategies": "model_averaging:every=4"}, r"model_averaging:every=4.*sync_every"),
        ({"strategies": "model_averaging:sync_every=0"}, r"ModelAveraging.sync_every=0"),
        ({"strategies": "allreduce,,model_averaging"}, "empty entry"),
        ({"strategies": []}, "strategies= is empty"),
        ({"strategies": [torch.nn.Linear(1, 1)]}, "is not a sparkdl strategy"),
        ({"epochs": 0}, r"epochs=0 must be a positive integer \(the budget"),
        ({"target_loss": math.nan}, "target_loss=nan must be a finite number"),
        ({"target_loss": math.inf}, "target_loss=inf must be a finite number"),
        (
            {"slow_rank": 2, "num_workers": 2},
            r"slow_rank=2 must be a rank of the run: an integer from 0 to 1 \(num_workers=2\)",
        ),
        ({"slow_rank": -1}, "slow_rank=-1"),
        ({"slow_rank": 0, "slow_s": -0.1}, r"slow_s=-0.1 must be a number of seconds >= 0"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_setting(kwargs, match):
    with pytest.raises(sparkdl.ConfigError, match=match):
        CompareSettings(**kwargs)


def test_compare_refuses_a_strategy_or_checkpoints_before_training():
    with pytest.raises(sparkdl.ConfigError, match="checkpoint_dir="):
        sparkdl.compare(model=lambda: torch.nn.Linear(2, 2), data="/nowhere", checkpoint_dir="/tmp/x")
    with pytest.raises(sparkdl.ConfigError, match="slow_rank=5"):
        sparkdl.compare(model=lambda: torch.nn.Linear(2, 2), data="/nowhere", slow_rank=5)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--strategies", "allreduce,nope"], "--strategies: unknown strategy 'nope'"),
        (["--epochs", "0"], "--epochs 0 must be a positive integer"),
        (["--target-loss", "nan"], "--target-loss nan must be a finite number"),
        (["--slow-rank", "2"], "--slow-rank 2 must be a rank of the run"),
        (["--slow-rank", "0", "--slow-seconds", "-1"], "--slow-seconds -1"),
        (["--slow-seconds", "1"], "--slow-seconds needs --slow-rank"),
    ],
)
def test_cli_bad_input_exits_2_naming_the_option_before_spark_starts(extra, match, tmp_path, capsys):
    started = time.time()
    code = sparkdl_main(
        [
            "compare",
            "--data",
            str(tmp_path),
            "--model",
            "tests.models:digits_mlp",
            "--features",
            "features",
            "--label",
            "label",
            "--num-workers",
            "2",
            "--output",
            str(tmp_path / "out"),
            *extra,
        ]
    )
    assert code == 2
    assert match in capsys.readouterr().err
    assert time.time() - started < 30  # no Spark session was started for a typo


def test_slowed_model_keeps_the_state_dict_pickles_and_sleeps_only_on_its_rank_in_training():
    import torch.distributed as dist

    from tests.models import digits_mlp

    slowed = SlowedModel(digits_mlp, rank=0, seconds=0.3)
    assert list(slowed().state_dict()) == list(digits_mlp().state_dict())
    module = pickle.loads(pickle.dumps(slowed))()
    x = torch.zeros(2, 64)

    def timed(m):
        started = time.perf_counter()
        m(x)
        return time.perf_counter() - started

    assert timed(module) < 0.3  # no process group (the driver's own checks): no sleep
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert timed(module) >= 0.3  # rank 0 in training mode: the straggler's sleep
        assert timed(SlowedModel(digits_mlp, rank=1, seconds=0.3)()) < 0.3  # another rank is not slowed
        assert timed(module.eval()) < 0.3  # validation passes are not slowed
    finally:
        dist.destroy_process_group()


def test_comm_bytes_of_a_collective_are_what_one_rank_sends_and_nothing_alone():
    from sparkdl.strategies.base import allreduce_bytes_sent, broadcast_bytes_sent

    # A ring allreduce of S bytes: each rank sends 2(n-1)/n S; two ranks S; a lone rank nothing.
    assert [allreduce_bytes_sent(1200, n) for n in (1, 2, 3, 4)] == [0, 1200, 1600, 1800]
    assert [broadcast_bytes_sent(1200, n, is_root=True) for n in (1, 2, 4)] == [0, 1200, 1200]
    assert broadcast_bytes_sent(1200, 4, is_root=False) == 0


def test_a_data_path_that_does_not_exist_is_one_message_before_spark_starts(tmp_path, capsys, monkeypatch):
    from sparkdl.cli import _compare

    def no_spark(*args, **kwargs):
        raise AssertionError("Spark was started for a --data path that does not exist")

    monkeypatch.setattr(_compare, "spark_session", no_spark)
    missing = tmp_path / "missing"
    code = sparkdl_main(
        [
            "compare",
            "--data",
            str(missing),
            "--model",
            "tests.models:digits_mlp",
            "--features",
            "features",
            "--label",
            "label",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.splitlines() == [f"sparkdl compare: --data: no dataset at 'file://{missing}': the path does not exist"]
    assert not (tmp_path / "out").exists()


def test_compare_checks_the_data_once_before_any_strategy_trains(tmp_path, monkeypatch):
    fits = []
    monkeypatch.setattr(sparkdl.TorchEstimator, "fit", lambda self, data: fits.append(data))
    with pytest.raises(sparkdl.DataError, match="the path does not exist"):
        sparkdl.compare(
            model=lambda: torch.nn.Linear(64, 10),
            data=str(tmp_path / "missing"),
            strategies=[sparkdl.AllReduce(), sparkdl.ModelAveraging(sync_every=4)],
        )
    assert fits == []
