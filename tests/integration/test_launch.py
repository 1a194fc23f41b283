"""sparkdl.launch: plain DDP scripts and functions, unchanged, on barrier tasks; sparkdl.shard_dataset."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

import sparkdl

pytestmark = pytest.mark.spark

TORCHRUN = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
]

DDP_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
import sparkdl

out_dir = sys.argv[1]
env = {k: os.environ.get(k) for k in %(vars)r}
dist.init_process_group("gloo")  # env:// as torchrun's scripts do
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
dataset = sparkdl.shard_dataset()
steps = 0
for features, labels in torch.utils.data.DataLoader(dataset, batch_size=None):
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(features), labels)
    loss.backward()
    optimizer.step()
    steps += 1
sparkdl.report(script_loss=float(loss), script_rank=rank)
with open("/proc/self/cmdline", "rb") as handle:
    argv = handle.read().split(b"\\0")[:-1]
facts = {"env": env, "steps": steps, "len": len(dataset), "argv": [a.decode() for a in argv], "pid": os.getpid(),
         "secret_fd": os.environ.get("SPARKDL_SECRET_FD"), "world": dist.get_world_size()}
with open(os.path.join(out_dir, "rank%%d.json" %% rank), "w") as handle:
    json.dump(facts, handle)
print("checksum %%.8f" %% sum(p.double().sum().item() for p in model.parameters()))
print("done rank %%d after %%d steps" %% (rank, steps), file=sys.stderr)
dist.destroy_process_group()
""" % {"vars": TORCHRUN}


def test_a_plain_ddp_script_runs_unchanged(spark, digits_df, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    received = []
    result = sparkdl.launch(
        str(script),
        str(tmp_path),
        num_workers=2,
        data=digits_df,
        feature_cols=["features"],
        label_col="label",
        batch_size=32,
        spark=spark,
        progress=received.append,
    )
    facts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert isinstance(result, sparkdl.ScriptResult) and result.exit_code == 0
    assert any(line.startswith("checksum ") for line in result.last_lines)
    assert "done rank 0 after" in result.output
    # Both ranks trained the same balanced number of steps on the uneven 1437-row shards.
    assert facts[0]["steps"] == facts[1]["steps"] == facts[0]["len"] == 1437 // 64
    for rank, fact in enumerate(facts):
        env = fact["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == (
            str(rank),
            "2",
            "0",
            "1",
            str(rank),
        )
        assert env["MASTER_ADDR"] and int(env["MASTER_PORT"]) > 0 and env["TORCHELASTIC_RUN_ID"].startswith("sparkdl-")
        assert fact["world"] == 2
        # The secret never reaches the child's command line (nor its environment's fd name).
        assert fact["argv"][1:3] == ["-m", "sparkdl._task.runner"] and len(fact["argv"]) == 4, fact["argv"]
        assert fact["secret_fd"] is None
    assert facts[0]["env"]["TORCHELASTIC_RUN_ID"] == facts[1]["env"]["TORCHELASTIC_RUN_ID"]
    captured = capsys.readouterr()
    checksums = {
        r: [line for line in captured.out.splitlines() if line.startswith(f"[sparkdl rank {r}] checksum ")]
        for r in range(2)
    }
    assert len(checksums[0]) == 1 and len(checksums[1]) == 1, captured.out
    # DDP kept the replicas identical: the same weights on both ranks.
    assert checksums[0][0].split()[-1] == checksums[1][0].split()[-1]
    assert "[sparkdl rank 1] done rank 1 after" in captured.err
    reports = sorted((r["rank"], r["script_rank"]) for r in received if "script_loss" in r)
    assert reports == [(0, 0), (1, 1)]


def _callable_target(scale, out_dir):
    import torch.distributed as dist

    import sparkdl

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    sparkdl.report(callable_rank=dist.get_rank())
    with open(os.path.join(out_dir, f"pid{dist.get_rank()}"), "w") as handle:
        handle.write(str(os.getpid()))
    dist.destroy_process_group()
    from tests.malloc_probe import mapped_blocks_added

    return {
        "sum": value.item() * scale,
        "rank": int(os.environ["RANK"]),
        "pid": os.getpid(),
        "mapped_blocks_added": mapped_blocks_added(1 << 20),
    }


def test_a_callable_target_returns_rank_zeros_value(spark, tmp_path):
    value = sparkdl.launch(_callable_target, 10, str(tmp_path), num_workers=2, spark=spark, progress=False)
    assert value["sum"] == 30.0 and value["rank"] == 0
    assert value["pid"] != os.getpid()  # it ran in a child, not in the task's (or the driver's) process
    # The child raised glibc's thresholds as a fit's task does (sparkdl._task.allocator): a 1 MiB
    # block comes from its heap, where a fresh process would map it on its own.
    assert value["mapped_blocks_added"] == 0


FAILING_SCRIPT = """
import os, sys, time
with open(os.path.join(sys.argv[1], "pid" + os.environ["RANK"]), "w") as handle:
    handle.write(str(os.getpid()))
if os.environ["RANK"] == "1":
    print("rank 1 gives up now")
    sys.exit(3)
import threading
threading.Event().wait()  # rank 0 is busy (no store, no peer involved) until its task is killed
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_script_that_fails_on_one_rank_fails_the_launch_and_leaves_no_process(spark, tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(FAILING_SCRIPT)
    with pytest.raises(sparkdl.TrainingError) as raised:
        sparkdl.launch(str(script), str(tmp_path), num_workers=2, spark=spark, progress=False, timeout_s=60)
    error = raised.value
    assert error.rank == 1 and error.exc_type == "ScriptExitError"
    assert "exited with status 3 on rank 1" in str(error) and "rank 1 gives up now" in str(error)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling /proc: another process's death has no event to wait on
    assert not [pid for pid in pids if _alive(pid)], "a launched child outlived its failed launch"


def test_a_script_the_executors_cannot_see_fails_fast(spark, tmp_path):
    started = time.monotonic()
    missing = str(tmp_path / "nowhere" / "train.py")
    with pytest.raises(sparkdl.TrainingError) as raised:
        sparkdl.launch(missing, num_workers=2, spark=spark, progress=False)
    message = str(raised.value)
    assert "cannot see the launch script" in message and missing in message and "--files" in message
    assert raised.value.rank in (0, 1) and f"rank {raised.value.rank} on host" in message
    assert time.monotonic() - started < 30


def test_run_sets_the_torchrun_environment_and_the_shard_dataset_resumes(spark, digits_df):
    def train_fn(ctx):
        import torch.distributed as dist

        env = {k: os.environ.get(k) for k in TORCHRUN}
        dataset = ctx.shard_dataset()
        same = dataset is sparkdl.shard_dataset()
        it = iter(dataset)
        for _ in range(3):
            next(it)
        state = dataset.state_dict()
        fourth = next(it)
        dataset.load_state_dict(state)
        again = next(iter(dataset))
        rest = sum(1 for _ in dataset)  # the epoch's remaining batches after the 4th
        full = sum(1 for _ in torch.utils.data.DataLoader(dataset, batch_size=None))
        try:
            list(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1))
            worker_error = None
        except RuntimeError as exc:
            worker_error = str(exc)
        try:
            next(ctx.epoch_batches())
            both = None
        except RuntimeError as exc:
            both = str(exc)
        facts = {
            "env": env,
            "same": same,
            "len": len(dataset),
            "exact": torch.equal(fourth[0], again[0]) and torch.equal(fourth[1], again[1]),
            "rest": rest,
            "full": full,
            "worker_error": worker_error,
            "both": both,
            "initialized": dist.is_initialized(),
        }
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, facts)
        return gathered

    facts = sparkdl.run(
        train_fn,
        num_workers=2,
        data=digits_df,
        feature_cols=["features"],
        label_col="label",
        batch_size=32,
        spark=spark,
        progress=False,
    )
    steps = 1437 // 64
    for rank, fact in enumerate(facts):
        assert (
            fact["env"]["RANK"] == str(rank) and fact["env"]["WORLD_SIZE"] == "2" and fact["env"]["LOCAL_RANK"] == "0"
        )
        assert fact["env"]["MASTER_PORT"] and fact["env"]["TORCHELASTIC_RUN_ID"]
        assert fact["same"] and fact["len"] == steps and fact["exact"] and fact["initialized"]
        assert fact["rest"] == steps - 4 and fact["full"] == steps
        assert "DataLoader worker" in fact["worker_error"] and "num_workers=0" in fact["worker_error"]
        assert "not both" in fact["both"]
    assert all(os.environ.get(k) is None or k == "MASTER_ADDR" for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"))


def test_shard_dataset_and_report_outside_a_task():
    with pytest.raises(RuntimeError, match="only inside a sparkdl task"):
        sparkdl.shard_dataset()
    with pytest.warns(RuntimeWarning, match="outside a sparkdl task"):
        sparkdl.reporting._warned = False
        sparkdl.report(loss=1.0)


CLI_SCRIPT = """
import os, sys
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "args", sys.argv[1:])
sys.exit(4 if os.environ["RANK"] == "0" else 0)
"""


def test_the_cli_exits_with_the_scripts_status(tmp_path):
    """`sparkdl launch` in its own (local[2]) application: one run."""
    import subprocess

    script = tmp_path / "cli_train.py"
    script.write_text(CLI_SCRIPT)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=repo, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from sparkdl.cli import sparkdl_main; sys.exit(sparkdl_main())",
            "launch",
            "--master",
            "local[2]",
            "--num-workers",
            "2",
            str(script),
            "--",
            "--lr",
            "0.1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 4, done.stderr[-3000:]
    assert "[sparkdl rank 1] rank 1 of 2 args ['--lr', '0.1']" in done.stdout, done.stdout[-3000:]
    assert "exited with status 4 on rank 0" in done.stderr


RANK1_FAILS = """
import os, sys, time
rank = os.environ["RANK"]
for i in range(4):
    print("rank %s step %d" % (rank, i))
if rank == "1":
    print("rank 1 gives up", file=sys.stderr)
    sys.exit(3)
time.sleep(600)  # rank 0 works on until its task is killed
"""


def test_the_cli_reports_a_failed_rank_in_one_paragraph(tmp_path):
    """`sparkdl launch` where rank 1 exits 3: stderr holds the failure once (rank, status, last
    lines), none of Spark's task-failure warnings (their Java stacks repeat it) nor the channel's
    internal lines. Spark's own start-up lines are the rest."""
    import subprocess

    script = tmp_path / "rank1_fails.py"
    script.write_text(RANK1_FAILS)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=repo, PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from sparkdl.cli import sparkdl_main; sys.exit(sparkdl_main())",
            "launch",
            "--master",
            "local[2]",
            "--num-workers",
            "2",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    err = done.stderr
    assert done.returncode == 3, err[-3000:]
    assert err.count("exited with status 3 on rank 1") == 1, err
    paragraph = err[err.index("sparkdl launch: training failed on rank 1") :]
    assert "rank 1 step 3" in paragraph and "rank 1 gives up" in paragraph, err
    lines = err.splitlines()
    assert not [line for line in lines if line.startswith("\tat ") or "at org.apache" in line], err
    assert "TaskSetManager" not in err and "PythonException" not in err and "without saying bye" not in err, err
    assert len(lines) < 30, f"{len(lines)} lines on stderr:\n{err}"
    # Local mode: the executor's console is this one; each line of the ranks' output is shown once.
    assert done.stdout.count("[sparkdl rank 1] rank 1 step 2") == 1 and "rank 1 step 2" not in err.replace(
        paragraph, ""
    ), done.stdout


BOTH_FAIL = """
import torch.distributed as dist, sys
dist.init_process_group("gloo")
dist.barrier()  # both ranks fail at the same moment
print("giving up after the barrier")
sys.exit(3)
"""


def test_identical_failures_of_several_ranks_are_reported_once(spark, tmp_path):
    script = tmp_path / "both_fail.py"
    script.write_text(BOTH_FAIL)
    with pytest.raises(sparkdl.TrainingError) as raised:
        sparkdl.launch(str(script), num_workers=2, spark=spark, progress=False, timeout_s=120)
    text = str(raised.value)
    assert {f.rank for f in raised.value.failures} == {0, 1}, text
    assert text.startswith("training failed on ranks 0, 1 while running"), text
    assert "exited with status 3 on ranks 0, 1" in text and text.count("exited with status 3") == 1, text
    assert text.count("giving up after the barrier") == 1 and "also rank" not in text, text


def _spawns_its_own_workers():
    import torch.multiprocessing as mp

    mp.spawn(print, nprocs=2)


def test_a_launched_function_that_spawns_its_own_workers_fails_fast_naming_the_rank(spark):
    started = time.monotonic()
    with pytest.raises(sparkdl.TrainingError) as caught:
        sparkdl.launch(_spawns_its_own_workers, num_workers=2, spark=spark, progress=False, timeout_s=120)
    message = str(caught.value)
    assert "ProcessSpawnError" in message and "nprocs=2" in message and "LOCAL_WORLD_SIZE=1" in message, message
    assert "rank 0" in message or "rank 1" in message, message
    # Failed at the spawn call, not after a hang until timeout_s.
    assert time.monotonic() - started < 60
