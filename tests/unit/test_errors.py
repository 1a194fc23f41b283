"""Error records and the driver's message: pure, no Spark."""

import dataclasses
import pickle

from sparkdl.errors import RankFailure, TrainingError, format_failures


def _failure(rank, message="boom", exc_type="ValueError"):
    return RankFailure(
        rank=rank,
        exc_type=exc_type,
        message=message,
        traceback=f"Traceback...\n{exc_type}: {message}\n",
        phase="training epoch 2",
    )


def test_first_failure_is_the_headline_with_its_traceback():
    text = format_failures([_failure(1), _failure(0, "connection reset", "RuntimeError")])
    assert text.splitlines()[0] == "training failed on rank 1 while training epoch 2: ValueError: boom"
    assert "also rank 0: RuntimeError: connection reset" in text
    assert "Traceback from rank 1:" in text


def test_a_self_explained_failure_keeps_its_traceback_out_of_the_message():
    error = TrainingError([_failure(1, "loss is nan at epoch 1, step 3 on rank 1", "NonFiniteLossError")])
    assert "Traceback" not in str(error) and len(str(error).splitlines()) == 2
    assert "TrainingError.remote_traceback" in str(error)
    assert error.remote_traceback.startswith("Traceback...")


def test_identical_failures_are_grouped():
    text = format_failures([_failure(2), _failure(0), _failure(1)])
    assert text.startswith("training failed on ranks 0, 1, 2 while")
    assert "also rank" not in text


def test_job_level_failure_has_no_rank():
    text = format_failures([RankFailure(-1, "SparkJobFailed", "No module named 'models'", "tb", "launching")])
    assert text.startswith("training failed on the Spark job, before any rank started while launching")
    assert "Traceback from the executor" in text


def test_training_error_pickles_with_its_records():
    error = TrainingError([_failure(1)], hint="raise timeout_s")
    copy = pickle.loads(pickle.dumps(error))
    assert copy.rank == 1 and copy.exc_type == "ValueError"
    assert str(copy) == str(error) and "raise timeout_s" in str(copy)


def test_record_round_trips_through_json_shape():
    try:
        raise KeyError("missing")
    except KeyError as exc:
        record = RankFailure.from_exception(3, exc, phase="rendezvous")
    again = RankFailure.from_json(record.to_json())
    assert again == record
    assert "raise KeyError" in again.traceback


def test_a_failure_names_the_host_its_rank_ran_on_and_survives_json():
    failure = RankFailure.from_exception(1, ValueError("boom"), phase="rendezvous", host="sparkdl-h2 (198.18.0.3)")
    assert RankFailure.from_json(failure.to_json()) == failure
    other = RankFailure(
        rank=0, exc_type="PeerLostError", message="lost rank 1", traceback="", host="sparkdl-h1 (198.18.0.2)"
    )
    lines = str(TrainingError([failure, other])).splitlines()
    assert lines[0] == "training failed on rank 1 while rendezvous: ValueError: boom"
    assert lines[1] == "(rank 1 ran on host sparkdl-h2 (198.18.0.3))"
    assert "  also rank 0 on host sparkdl-h1 (198.18.0.2): PeerLostError: lost rank 1" in lines


def test_settings_every_failing_rank_rejected_are_raised_as_a_config_error_too():
    from sparkdl.errors import ConfigError, RankConfigError, raised_from

    setting = RankFailure(
        rank=0, exc_type="ConfigError", message="GLOO_SOCKET_IFNAME=ens5 ...", traceback="", host="h1"
    )
    error = raised_from(TrainingError([setting, dataclasses.replace(setting, rank=1)]))
    assert isinstance(error, RankConfigError) and isinstance(error, ConfigError) and isinstance(error, TrainingError)
    assert error.rank == 0 and type(pickle.loads(pickle.dumps(error))) is RankConfigError
    mixed = TrainingError([setting, RankFailure(rank=1, exc_type="ValueError", message="x", traceback="")])
    assert raised_from(mixed) is mixed


def test_a_rank_number_and_host_in_the_headline_do_not_keep_identical_failures_apart():
    def script_exit(rank, host):
        message = f"the launched script t.py exited with status 3 on rank {rank} (host {host}); its last lines of output:\n  | same line"
        return RankFailure(
            rank=rank,
            exc_type="ScriptExitError",
            message=message,
            traceback="",
            phase="running t.py",
            host=f"h{rank} ({host})",
        )

    text = format_failures([script_exit(1, "10.0.0.2"), script_exit(0, "10.0.0.1")])
    assert text.startswith(
        "training failed on ranks 0, 1 while running t.py: ScriptExitError: the launched script t.py exited with status 3 on ranks 0, 1"
    )
    assert text.count("exited with status 3") == 1 and text.count("same line") == 1 and "also" not in text
    assert "rank 1 on host h1 (10.0.0.2), rank 0 on host h0 (10.0.0.1)" in text
    # Different last lines are different failures: the other one in a line, without its output.
    other = dataclasses.replace(
        script_exit(0, "10.0.0.1"), message=script_exit(0, "10.0.0.1").message.replace("same line", "other line")
    )
    text = format_failures([script_exit(1, "10.0.0.2"), other])
    assert text.startswith("training failed on rank 1 while") and "other line" not in text
    assert (
        "  also rank 0 on host h0 (10.0.0.1): ScriptExitError: the launched script t.py exited with status 3 on rank 0 (host 10.0.0.1)"
        in text
    )


def test_rank_errors_of_a_public_class_are_raised_as_that_class_and_never_retried():
    from sparkdl._driver.policy import Decision, FailurePolicy
    from sparkdl._task.frameworks import ProcessSpawnError
    from sparkdl.data.dataset import EmptyDatasetError
    from sparkdl.errors import ConfigError, DataError, RankConfigError, RankDataError, raised_from

    spawn = RankFailure.from_exception(0, ProcessSpawnError("nprocs=2 ..."), host="h0")
    assert spawn.category == "ConfigError" and RankFailure.from_json(spawn.to_json()) == spawn
    empty = RankFailure.from_exception(1, EmptyDatasetError("no rows"), host="h1")
    # A rank whose collective broke because its peer failed is a consequence, not a cause.
    lost = RankFailure(rank=1, exc_type="DistBackendError", message="[gloo] Connection closed by peer", traceback="")
    error = raised_from(TrainingError([spawn, lost]))
    assert isinstance(error, RankConfigError) and isinstance(error, ConfigError) and error.rank == 0
    assert "rank 0" in str(error) and "h0" in str(error) and "ProcessSpawnError" in error.remote_traceback
    data = raised_from(TrainingError([empty]))
    assert (
        isinstance(data, RankDataError)
        and isinstance(data, DataError)
        and type(pickle.loads(pickle.dumps(data))) is RankDataError
    )
    policy = FailurePolicy(max_failures=5)
    for failure in (spawn, empty, RankFailure(rank=0, exc_type="ConfigError", message="x", traceback="")):
        assert policy.decide(TrainingError([failure]), 1) is Decision.RAISE
    assert (
        policy.decide(TrainingError([RankFailure(rank=0, exc_type="RuntimeError", message="x", traceback="")]), 1)
        is Decision.RETRY
    )
