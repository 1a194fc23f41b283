"""The session settings that rule a launch out, refused before any data is touched."""

import pytest

from sparkdl._driver.session_checks import DYNAMIC_ALLOCATION_CONF, check_dynamic_allocation
from sparkdl.errors import ConfigError


def conf(value):
    return {DYNAMIC_ALLOCATION_CONF: value}.get


@pytest.mark.parametrize("master", ["spark://m:7077", "yarn", "k8s://https://api:6443", "local-cluster[2,1,1024]"])
@pytest.mark.parametrize("value", ["true", "TRUE", " true "])
def test_dynamic_allocation_on_a_cluster_is_refused_with_the_setting_and_the_fix(master, value):
    with pytest.raises(ConfigError) as info:
        check_dynamic_allocation(conf(value), lambda: master)
    message = str(info.value)
    assert message.startswith("spark.dynamicAllocation.enabled=true:")
    assert "barrier" in message and "SPARK-24942" in message
    assert "--conf spark.dynamicAllocation.enabled=false" in message
    assert "a running session cannot change it" in message


@pytest.mark.parametrize("value", [None, "false", "False", ""])
def test_dynamic_allocation_off_or_unset_passes(value):
    check_dynamic_allocation(conf(value), lambda: "yarn")


@pytest.mark.parametrize("master", ["local", "local[2]", "local[*]", "local[4,3]"])
def test_local_mode_passes_because_spark_ignores_dynamic_allocation_there(master):
    check_dynamic_allocation(conf("true"), lambda: master)
