"""Driver-side progress display (console path; no Spark)."""

import io
import logging
import os
import sys
import threading

from sparkdl._driver.progress import ProgressDisplay, format_epoch


def test_epoch_lines_name_the_epoch_and_the_figures(capsys):
    display = ProgressDisplay(enabled=True, total_epochs=10)
    display.epoch({"epoch": 3, "loss": 0.123456, "samples_per_sec": 41234.5, "seconds": 0.5, "comm_bytes": 1000})
    line = capsys.readouterr().out.strip()
    assert line == "[sparkdl] epoch 3/10  loss 0.1235  samples_per_sec 4.123e+04  seconds 0.5  comm_bytes 1000"
    assert display.records[0]["epoch"] == 3


def test_disabled_display_prints_nothing_but_feeds_the_callback(capsys):
    seen = []
    display = ProgressDisplay(enabled=False, callback=seen.append)
    display.epoch({"epoch": 1, "loss": 1.0})
    display.metrics(1, {"step": 5})
    assert capsys.readouterr().out == ""
    assert seen == [{"epoch": 1, "loss": 1.0}, {"rank": 1, "step": 5}]


def test_a_failing_callback_does_not_stop_the_display(caplog, capsys):
    def broken(record):
        raise RuntimeError("dashboard down")

    display = ProgressDisplay(enabled=True, callback=broken)
    with caplog.at_level(logging.ERROR, logger="sparkdl"):
        display.epoch({"epoch": 1, "loss": 2.0})
    assert "epoch 1" in capsys.readouterr().out
    assert any("progress callback failed" in r.getMessage() for r in caplog.records)


def test_format_without_total():
    assert format_epoch({"epoch": 2, "loss": 0.5, "val_loss": 0.7}) == "[sparkdl] epoch 2  loss 0.5  val_loss 0.7"
    record = {"epoch": 3, "loss": 0.5, "val_samples": 360, "val_top5": 0.99, "val_accuracy": 0.9, "val_loss": 0.7}
    assert format_epoch(record) == "[sparkdl] epoch 3  loss 0.5  val_loss 0.7  val_accuracy 0.9  val_top5 0.99"


def test_the_line_shows_the_shard_cache_when_a_rank_keeps_its_shard_in_memory():
    line = format_epoch({"epoch": 2, "loss": 0.5, "samples_per_sec": 9000.0, "cache_mb": 38.2}, 3)
    assert line == "[sparkdl] epoch 2/3  loss 0.5  samples_per_sec 9000  cache_mb 38.2"


def test_lines_from_several_ranks_never_run_together(monkeypatch):
    # The channel hands each rank's messages to the display on its own thread. A stream whose
    # write() gives up the GIL stands for a busy terminal: a line written in two pieces (print()
    # writes the newline apart) would let another rank's line in between.
    class YieldingStream(io.StringIO):
        def write(self, text):
            os.sched_yield()
            return super().write(text)

    stream = YieldingStream()
    monkeypatch.setattr(sys, "stdout", stream)
    display = ProgressDisplay(enabled=True)
    expected = {f"[sparkdl rank {rank}] step={step}" for rank in range(4) for step in range(200)}

    def rank_messages(rank):
        for step in range(200):
            display.metrics(rank, {"step": step})

    threads = [threading.Thread(target=rank_messages, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(stream.getvalue().splitlines()) == sorted(expected)
