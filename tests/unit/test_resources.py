"""``sparkdl.Resources``: what a training task may ask for, validated when the config is built."""

from __future__ import annotations

import inspect

import pytest

import sparkdl
from sparkdl._driver.settings import RunSettings
from sparkdl.cli._train import build_parser
from sparkdl.errors import ConfigError
from sparkdl.resources import Resources, check_resources, memory_mb


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"cpus": 0}, r"cpus=0\) must be a number of cores > 0"),
        ({"cpus": -1.5}, r"must be a number of cores > 0"),
        ({"cpus": True}, r"must be a number of cores > 0"),
        ({"cpus": float("inf")}, r"must be a finite number"),
        ({"gpus": 0.5}, r"whole number of GPUs >= 0: NCCL runs one rank per GPU"),
        ({"gpus": -1}, r"whole number of GPUs"),
        ({"memory": "lots"}, r"memory='lots' must be a size such as '8g'"),
        ({"memory": 0}, r"memory=0 must be a size"),
        ({}, r"asks for nothing"),
    ],
)
def test_a_request_that_cannot_be_met_is_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        Resources(**fields)


def test_describe_and_memory_in_spark_units():
    assert Resources(cpus=4, gpus=1).describe() == "4 CPUs, 1 GPU per task"
    assert Resources(cpus=0.5).describe() == "0.5 CPUs per task"
    assert Resources(cpus=1, memory="8g").describe() == "1 CPU, executor memory >= 8192 MiB per task"
    assert [memory_mb(v) for v in ("512m", "8g", "1024", "1.5g", "2gb", 300)] == [512, 8192, 1024, 1536, 2048, 300]
    assert Resources(memory="8g").requests_profile is False  # memory alone is checked, not requested
    assert Resources(gpus=0).requests_profile is True


def test_the_cli_form_and_a_mapping_build_the_same_request():
    assert Resources.parse("cpus=4,gpus=1,memory=8g") == Resources(cpus=4, gpus=1, memory="8g")
    assert Resources.parse(" cpus = 0.5 ") == Resources(cpus=0.5)
    assert check_resources({"cpus": 2}) == Resources(cpus=2)
    assert check_resources(None) is None
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['cores'\]"):
        check_resources({"cores": 2})
    with pytest.raises(ConfigError, match=r"expected cpus=N,gpus=N,memory=SIZE"):
        Resources.parse("cores=4")
    with pytest.raises(ConfigError, match=r"gpus='one' is not a number"):
        Resources.parse("gpus=one")
    with pytest.raises(ConfigError, match=r"must be sparkdl.Resources"):
        check_resources(4)


def test_every_entry_point_takes_resources_into_the_launch_config():
    settings = RunSettings.from_arguments({"num_workers": 2, "resources": {"cpus": 2, "gpus": 1}}, with_data=False)
    assert settings.launch.resources == Resources(cpus=2, gpus=1)
    estimator = sparkdl.TorchEstimator(model=lambda: None, resources=sparkdl.Resources(cpus=3))
    assert estimator.settings.launch.resources == Resources(cpus=3)
    with pytest.raises(ConfigError, match=r"cpus=-1\) must be"):
        sparkdl.TorchEstimator(model=lambda: None, resources={"cpus": -1})


def test_the_cli_parses_resources_and_reports_a_bad_one_as_usage(capsys):
    parser = build_parser()
    common = ["--data", "x", "--model", "m:f", "--label", "y", "--output", "o"]
    assert parser.parse_args([*common, "--resources", "cpus=2,gpus=1"]).resources == Resources(cpus=2, gpus=1)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([*common, "--resources", "cpus=0"])
    assert exited.value.code == 2
    assert "argument --resources: Resources(cpus=0) must be a number of cores > 0" in capsys.readouterr().err


def test_what_spark_cannot_schedule_is_refused_with_the_setting_to_change():
    from pyspark import TaskContext

    from sparkdl._driver.resource_profile import check_supported

    with pytest.raises(ConfigError, match=r"local mode \(local\[2\]\) cannot schedule.*set spark.task.cpus"):
        check_supported(Resources(cpus=2), "local[2]", "false")
    with pytest.raises(ConfigError, match=r"needs spark.dynamicAllocation.enabled=false"):
        check_supported(Resources(cpus=2), "spark://h:7077", "true")
    from pyspark.sql import DataFrame

    if "profile" not in inspect.signature(DataFrame.mapInArrow).parameters:  # PySpark 3.5 (the petastorm stack)
        with pytest.raises(ConfigError, match=r"resources= needs PySpark 4.0 or later .*set spark.task.cpus"):
            check_supported(Resources(cpus=2), "local-cluster[2,1,1024]", None)
        return
    check_supported(Resources(cpus=2), "local-cluster[2,1,1024]", None)  # standalone: supported
    if hasattr(TaskContext, "cpuAmount"):  # PySpark 4.3 (the latest stack)
        check_supported(Resources(cpus=0.5), "spark://h:7077", "false")
    else:  # PySpark 4.0 (the petastorm stack): whole CPUs only, named
        with pytest.raises(ConfigError, match=r"fractional task CPUs need Spark 4.3 or later \(this is PySpark 4\."):
            check_supported(Resources(cpus=0.5), "spark://h:7077", "false")
    check_supported(Resources(cpus=3), "spark://h:7077", "false")
