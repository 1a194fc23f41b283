"""The record of a DataFrame's copy kept beside the checkpoints (what makes a new driver reuse it
or not), its directory's privacy and clean-up, and which checkpoint dirs keep one. The Spark
side (the copy, the fingerprint, a second driver resuming on it) is
tests/integration/test_resume_new_driver.py."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from sparkdl._driver import dataframe_copy
from sparkdl.checkpoint import CheckpointConfig
from sparkdl.data import kept_copy
from sparkdl.data.kept_copy import CopyRecord
from sparkdl.errors import ConfigError
from sparkdl.filesystem import filesystem_and_path
from tests.fsspec_only import register

RECORD = CopyRecord(
    copy="df-0123456789ab-even",
    columns=("id", "features", "label"),
    layout=("features",),
    schema=(("id", "float"), ("features", "array<float>"), ("label", "bigint")),
    rows=256,
    content="123456789012345678901:-42",
)


def test_a_record_reads_back_as_written_and_a_damaged_or_other_format_one_is_none():
    assert CopyRecord.from_json(RECORD.to_json()) == RECORD
    other_format = RECORD.to_json().replace(b'"format": 1', b'"format": 2')
    assert other_format != RECORD.to_json() and CopyRecord.from_json(other_format) is None
    elsewhere = RECORD.to_json().replace(b"df-0123456789ab-even", b"../../elsewhere")
    for damaged in (b"", b"{", b"[]", b'{"format": 1}', RECORD.to_json()[:-20], elsewhere):
        assert CopyRecord.from_json(damaged) is None, damaged


def test_a_record_says_which_columns_types_or_layout_differ():
    same = RECORD.differs(RECORD.columns, RECORD.layout, RECORD.schema)
    assert same is None
    fewer = RECORD.differs(("id", "label"), (), (("id", "float"), ("label", "bigint")))
    assert fewer == "the run reads the columns ['id', 'label'], the copy holds ['id', 'features', 'label']"
    retyped = (("id", "double"), ("features", "array<float>"), ("label", "bigint"))
    assert RECORD.differs(RECORD.columns, RECORD.layout, retyped) == (
        "the columns' types differ (id double; the copy has id float, features array<float>, label bigint)"
    )
    unpacked = RECORD.differs(RECORD.columns, (), RECORD.schema)
    assert unpacked.startswith("the reader stores array columns [] as float32 bytes, the copy ['features']")


def test_a_record_says_whether_rows_are_its_own():
    assert RECORD.holds(256, RECORD.content) is None
    assert RECORD.holds(255, RECORD.content) == "it has 255 rows, the copy 256"
    assert RECORD.holds(256, "1:1") == "it has 256 rows like the copy, but not the same values"


def test_the_copys_local_directory_is_made_private_and_one_others_could_read_is_refused(tmp_path):
    checkpoints = tmp_path / "ckpt"
    directory = f"file://{checkpoints}/{kept_copy.DIRECTORY}"
    fs, root = filesystem_and_path(directory)
    kept_copy._make_directory(fs, root, directory)
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
    kept_copy._make_directory(fs, root, directory)  # a resume finds it: still ours, still private
    os.chmod(root, 0o750)
    with pytest.raises(ConfigError, match=r"has mode 750: other users have access.*use a checkpoint_dir whose"):
        kept_copy._make_directory(fs, root, directory)
    os.rmdir(root)
    os.symlink(tmp_path, root)
    with pytest.raises(ConfigError, match="is not a directory"):
        kept_copy._make_directory(fs, root, directory)


def test_a_sweep_keeps_the_record_and_the_named_copy_only_and_remove_copy_deletes_all(tmp_path):
    root = tmp_path / "ckpt" / kept_copy.DIRECTORY
    for name in ("df-old", "df-kept", "df-partial-even"):
        (root / name).mkdir(parents=True)
        (root / name / "part-0.parquet").write_bytes(b"rows")
    (root / kept_copy.RECORD).write_bytes(RECORD.to_json())
    (root / f"{kept_copy.RECORD}.tmp-1234").write_bytes(b"half")
    fs, path = filesystem_and_path(f"file://{root}")
    kept_copy._sweep(fs, path, keep="df-kept")
    assert sorted(os.listdir(root)) == ["df-kept", kept_copy.RECORD]
    (tmp_path / "ckpt" / "ckpt-000000000007").mkdir()  # the checkpoints are not the copy's to delete
    assert kept_copy.remove_copy(f"file://{tmp_path / 'ckpt'}") is True
    assert os.listdir(tmp_path / "ckpt") == ["ckpt-000000000007"]
    assert kept_copy.remove_copy(f"file://{tmp_path / 'ckpt'}") is False


def test_only_file_checkpoints_executors_see_keep_the_copy(tmp_path, caplog):
    assert dataframe_copy.copy_root(None) is None
    assert dataframe_copy.copy_root(CheckpointConfig(str(tmp_path / "ckpt"))) == f"file://{tmp_path / 'ckpt'}"
    assert os.path.isdir(tmp_path / "ckpt")  # checked writable, as the launch does
    assert dataframe_copy.copy_root(CheckpointConfig("memory://run/ckpt")) is None  # executors never see it
    register(str(tmp_path / "store"))  # a filesystem this process registered: the tasks cannot open its URLs
    with caplog.at_level(logging.WARNING, logger="sparkdl"):
        assert dataframe_copy.copy_root(CheckpointConfig("sparkdltest://ckpt")) is None
    assert "is on a filesystem registered in this driver only" in caplog.text
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"^checkpoint_dir='file://.*/a-file/ckpt' cannot be written"):
        dataframe_copy.copy_root(CheckpointConfig(str(blocker / "ckpt")))


def test_removing_after_a_run_ignores_runs_without_a_copy(tmp_path):
    dataframe_copy.remove_after_run(None)
    dataframe_copy.remove_after_run(CheckpointConfig(str(tmp_path / "never-made")))
    assert not os.path.exists(tmp_path / "never-made")
    (tmp_path / "ckpt" / kept_copy.DIRECTORY / "df-1").mkdir(parents=True)
    dataframe_copy.remove_after_run(CheckpointConfig(str(tmp_path / "ckpt")))
    assert os.listdir(tmp_path / "ckpt") == []


def test_a_copy_is_copied_file_by_file_as_links_on_one_disk_and_bytes_elsewhere(tmp_path):
    source = tmp_path / "cache" / "df-1"
    source.mkdir(parents=True)
    for name, data in (("part-00000.snappy.parquet", b"rows 0"), ("part-00001.snappy.parquet", b"rows 1")):
        (source / name).write_bytes(data)
    kept_copy._copy_files(f"file://{source}", f"file://{tmp_path / 'ckpt' / 'df-2'}")
    for name in os.listdir(source):  # the same names and bytes: a checkpoint's positions index the same rows
        assert os.path.samefile(source / name, tmp_path / "ckpt" / "df-2" / name)
    # A store only fsspec knows, whose open() makes no directories: the bytes, through pyarrow.
    register(str(tmp_path / "store"))
    kept_copy._copy_files(f"file://{source}", "sparkdltest://ckpt/dataframe-copy/df-3")
    target = tmp_path / "store" / "ckpt" / "dataframe-copy" / "df-3"
    copied = {name: (target / name).read_bytes() for name in os.listdir(target)}
    assert copied == {"part-00000.snappy.parquet": b"rows 0", "part-00001.snappy.parquet": b"rows 1"}
    assert not os.path.samefile(source / "part-00000.snappy.parquet", target / "part-00000.snappy.parquet")
