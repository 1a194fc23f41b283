"""Which interface a rank's collectives use (sparkdl._net.interfaces): the choice on described
hosts, the user's variables checked, and this machine's real interfaces read."""

from __future__ import annotations

import socket

import pytest

from sparkdl._net.interfaces import Interface, choose_interface, collective_environment, local_interfaces
from sparkdl.errors import ConfigError

LO = Interface("lo", ("127.0.0.1", "::1"), up=True, loopback=True)
ETH0 = Interface("eth0", ("198.18.0.2",), up=True, loopback=False)
ETH1 = Interface("eth1", ("198.19.0.2",), up=True, loopback=False)
DOCKER0 = Interface("docker0", ("198.19.255.1",), up=True, loopback=False)
HOST = [DOCKER0, ETH0, ETH1, LO]


def test_the_interface_holding_the_executors_spark_address_wins_over_any_other():
    # 198.18.0.2 is not this machine's: the route to the driver cannot be taken, the address can.
    choice = choose_interface("198.18.0.2", "198.18.0.1", HOST)
    assert (choice.name, choice.address) == ("eth0", "198.18.0.2") and "Spark address 198.18.0.2" in choice.reason


def test_a_loopback_spark_address_is_taken_only_when_the_driver_is_on_loopback_too():
    # One machine (local-cluster): loopback is right.
    assert choose_interface("127.0.0.1", "127.0.0.1", HOST).name == "lo"
    # A name resolving to loopback on a cluster says nothing about where the other hosts reach
    # this one; a host with nothing but loopback then gets no choice rather than a wrong one.
    # (connect() on a UDP socket only picks a route: nothing is sent to 198.18.0.1.)
    assert choose_interface("localhost", "198.18.0.1", [LO]) is None


def test_without_a_local_spark_address_the_route_to_the_driver_decides():
    machine = local_interfaces()
    choice = choose_interface("no-such-host.invalid", "127.0.0.1", machine)
    assert choice is not None and choice.name == "lo" and "route to the driver" in choice.reason


def test_unset_variables_are_set_and_a_users_valid_one_is_kept():
    values, choice = collective_environment(
        "198.18.0.2", "198.18.0.1", {"NCCL_SOCKET_IFNAME": "eth"}, rank=1, interfaces=HOST
    )
    assert values == {"GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"} and choice.name == "eth0"
    values, choice = collective_environment(
        "198.18.0.2",
        "198.18.0.1",
        {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "=eth1", "TP_SOCKET_IFNAME": "eth1"},
        rank=1,
        gpu=True,
        interfaces=HOST,
    )
    assert values == {} and choice is None


@pytest.mark.parametrize(
    "variable, value, gpu, unknown",
    [
        ("GLOO_SOCKET_IFNAME", "ens5", False, "ens5"),
        ("GLOO_SOCKET_IFNAME", "eth0,ens5", False, "ens5"),
        ("GLOO_SOCKET_IFNAME", "eth", False, "eth"),  # gloo takes exact names, not NCCL's prefixes
        ("NCCL_SOCKET_IFNAME", "ib", True, "ib"),
        ("NCCL_SOCKET_IFNAME", "=eth", True, "eth"),
    ],
)
def test_a_users_variable_naming_a_missing_interface_is_a_config_error_naming_host_and_interfaces(
    variable, value, gpu, unknown
):
    with pytest.raises(ConfigError) as info:
        collective_environment("198.18.0.3", "198.18.0.1", {variable: value}, rank=2, gpu=gpu, interfaces=HOST)
    message = str(info.value)
    assert message.startswith(f"{variable}={value} names interface(s) {unknown} that rank 2's host 198.18.0.3")
    assert (
        "eth0 (198.18.0.2)" in message
        and "lo (127.0.0.1, ::1)" in message
        and f"spark.executorEnv.{variable}" in message
    )


def test_variables_a_cpu_rank_does_not_read_are_not_checked():
    # NCCL's variable on a CPU task, and NCCL's exclusion lists, cannot fail a run.
    collective_environment("198.18.0.2", "198.18.0.1", {"NCCL_SOCKET_IFNAME": "ib0"}, rank=0, interfaces=HOST)
    collective_environment(
        "198.18.0.2", "198.18.0.1", {"NCCL_SOCKET_IFNAME": "^docker,lo"}, rank=0, gpu=True, interfaces=HOST
    )


def test_this_machines_interfaces_are_read_with_their_addresses():
    interfaces = {interface.name: interface for interface in local_interfaces()}
    assert "127.0.0.1" in interfaces["lo"].addresses and interfaces["lo"].loopback and interfaces["lo"].up
    assert set(interfaces) >= {name for _index, name in socket.if_nameindex()}
