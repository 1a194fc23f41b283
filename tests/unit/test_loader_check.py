"""``benchmarks/gpu_check.py --loader-only`` on the CPU, without pyspark: a row per decode
worker count and epoch kind, with rates and CPU time per row."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_loader_only_reports_each_worker_count_for_the_first_and_the_cached_epochs(tmp_path):
    script = os.path.join(REPO_ROOT, "benchmarks", "gpu_check.py")
    output = tmp_path / "loader.json"
    argv = [script, "--loader-only", "--device", "cpu", "--tiny", "--workers", "2", "--epochs", "2"]
    argv += ["--data", str(tmp_path / "data"), "--json", str(output)]
    code = f"import sys, runpy; sys.modules['pyspark'] = None; sys.argv = {argv!r}; runpy.run_path({script!r}, run_name='__main__')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(output.read_text())
    rows = {(row["epoch"], row["workers"]): row for row in report["loader_workers"]}
    assert set(rows) == {("first", 1), ("first", 2), ("later", 1), ("later", 2)}
    for (_, workers), row in rows.items():
        assert row["rows_per_s"] > 0 and row["cpu_us_per_row"] > 0
        assert row["rows_per_s_per_worker"] == row["rows_per_s"] / workers
        # 64 float32 features and an int64 label a row.
        assert abs(row["mb_per_s"] - row["rows_per_s"] * (64 * 4 + 8) / 1e6) < 1e-6 * row["mb_per_s"]
    assert rows[("first", 1)]["scaling"] == 1.0 and rows[("later", 1)]["scaling"] == 1.0
    assert "| later (shard cache) | 2 |" in done.stdout and "CPU-µs/row" in done.stdout
