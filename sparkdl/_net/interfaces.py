"""Which network interface a rank's collectives use.

gloo and NCCL do not ask Spark where a task lives: unless ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` name an interface, gloo binds the address the machine's host name
resolves to. On a Debian or Ubuntu host that is 127.0.1.1 (``/etc/hosts``), so the other hosts
are told to connect to their own loopback and the rendezvous fails; on a host with a second
network (a container bridge, a storage or management network) the collectives silently run
over whichever network the name points at, while Spark and sparkdl's store, channel and
parameter server use the cluster's.

So every rank names the interface itself (:func:`collective_environment`): the one that holds
the executor's own Spark address (what the driver and the other executors reach it by), else
the one the kernel would send from to reach the driver. A variable the user set (for example
``spark.executorEnv.GLOO_SOCKET_IFNAME``) is kept, after checking that the interfaces it names
exist on this host; one that does not is a :class:`~sparkdl.errors.ConfigError` raised before
the rendezvous, naming the variable, the host and the interfaces it has.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import ipaddress
import socket
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from sparkdl.errors import ConfigError

#: The variables torch's backends read their interface from: gloo (CPU collectives), NCCL
#: (GPU collectives; also its bootstrap), TensorPipe (torch.distributed.rpc).
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")


@dataclasses.dataclass(frozen=True)
class Interface:
    name: str
    addresses: Tuple[str, ...]
    up: bool
    loopback: bool


@dataclasses.dataclass(frozen=True)
class InterfaceChoice:
    """The interface a rank's collectives use, and why."""

    name: str
    address: str
    reason: str


def local_interfaces() -> List[Interface]:
    """This host's interfaces with their IPv4 and IPv6 addresses (``getifaddrs``); interfaces
    without an address are listed too (with none)."""
    by_name: Dict[str, Dict] = {}
    for name, flags, address in _getifaddrs():
        entry = by_name.setdefault(name, {"addresses": [], "flags": 0})
        entry["flags"] |= flags
        if address is not None and address not in entry["addresses"]:
            entry["addresses"].append(address)
    for _index, name in _if_names():
        by_name.setdefault(name, {"addresses": [], "flags": 0})
    return [
        Interface(name, tuple(entry["addresses"]), bool(entry["flags"] & _IFF_UP), bool(entry["flags"] & _IFF_LOOPBACK))
        for name, entry in sorted(by_name.items())
    ]


def choose_interface(
    own_host: str, driver_host: str, interfaces: Optional[Sequence[Interface]] = None
) -> Optional[InterfaceChoice]:
    """The interface that carries this executor's Spark address ``own_host`` (an address or a
    name), else the one the route to ``driver_host`` leaves by; None when neither is local.

    A loopback answer is taken only when the driver is reached over loopback too (one machine):
    a host name that resolves to 127.0.1.1 says nothing about where the other hosts reach us.
    """
    interfaces = list(local_interfaces() if interfaces is None else interfaces)
    route_source = _route_source(driver_host)
    driver_is_local = route_source is not None and _is_loopback(route_source)
    for address in _addresses_of(own_host):
        if _is_loopback(address) and not driver_is_local:
            continue
        found = _holding(interfaces, address)
        if found is not None:
            return InterfaceChoice(found.name, address, f"it holds this executor's Spark address {own_host}")
    if route_source is not None:
        found = _holding(interfaces, route_source)
        if found is not None:
            return InterfaceChoice(
                found.name, route_source, f"the route to the driver ({driver_host}) leaves from {route_source}"
            )
    return None


def collective_environment(
    own_host: str,
    driver_host: str,
    environ: Mapping[str, str],
    rank: int,
    gpu: bool = False,
    interfaces: Optional[Sequence[Interface]] = None,
) -> Tuple[Dict[str, str], Optional[InterfaceChoice]]:
    """The interface variables to set for this rank's collectives, and the interface chosen.

    Variables already in ``environ`` are the user's: never overridden, and checked when this
    rank's backend reads them (gloo's always: every group has a CPU side; NCCL's on a GPU).

    Raises:
        ConfigError: a variable the user set names an interface this host does not have.
    """
    interfaces = list(local_interfaces() if interfaces is None else interfaces)
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if gpu else ("GLOO_SOCKET_IFNAME",):
        value = environ.get(variable)
        if value:
            _check_user_setting(variable, value, interfaces, rank, own_host)
    missing = [variable for variable in INTERFACE_VARIABLES if not environ.get(variable)]
    if not missing:
        return {}, None
    choice = choose_interface(own_host, driver_host, interfaces)
    if choice is None:
        return {}, None
    return {variable: choice.name for variable in missing}, choice


def describe(interfaces: Sequence[Interface]) -> str:
    """``eth0 (198.18.0.2), lo (127.0.0.1), docker0 (down)``: what an error shows of a host."""
    parts = []
    for interface in interfaces:
        detail = ", ".join(interface.addresses) or "no address"
        parts.append(f"{interface.name} ({detail}{'' if interface.up else ', down'})")
    return "; ".join(parts) or "none"


def _check_user_setting(variable: str, value: str, interfaces: Sequence[Interface], rank: int, host: str) -> None:
    names = [interface.name for interface in interfaces]
    if variable == "NCCL_SOCKET_IFNAME" and value.startswith("^"):
        return  # an exclusion list: any interface not named is allowed, none needs to exist
    wanted = [entry.strip() for entry in value.split(",") if entry.strip()]
    unknown = []
    for entry in wanted:
        if variable == "NCCL_SOCKET_IFNAME":
            # NCCL matches prefixes ("eth" = eth0, eth1...) unless the name starts with "=".
            exact = entry.startswith("=")
            entry = entry.lstrip("=")
            matched = any(name == entry if exact else name.startswith(entry) for name in names)
        else:
            matched = entry in names
        if not matched:
            unknown.append(entry)
    if unknown:
        raise ConfigError(
            f"{variable}={value} names interface(s) {', '.join(unknown)} that rank {rank}'s host {host} "
            f"({socket.gethostname()}) does not have; its interfaces: {describe(interfaces)}. Unset {variable} "
            f"(spark.executorEnv.{variable}, or the executors' environment) to let sparkdl pick the interface that "
            f"carries each executor's Spark address, or name one every host has"
        )


def _addresses_of(host: str) -> List[str]:
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    addresses: List[str] = []
    for *_ignored, sockaddr in found:
        address = sockaddr[0].split("%", 1)[0]
        if address not in addresses:
            addresses.append(address)
    return addresses


def _route_source(host: str) -> Optional[str]:
    """The local address the kernel would send from to reach ``host`` (a UDP socket's
    ``connect`` picks the route and sends nothing)."""
    for address in _addresses_of(host):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((address, 9))
                return probe.getsockname()[0].split("%", 1)[0]
        except OSError:
            continue
    return None


def _holding(interfaces: Sequence[Interface], address: str) -> Optional[Interface]:
    for interface in interfaces:
        if address in interface.addresses:
            return interface
    return None


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


_IFF_UP = 0x1
_IFF_LOOPBACK = 0x8


def _if_names() -> List[Tuple[int, str]]:
    try:
        return socket.if_nameindex()
    except OSError:
        return []


class _SockAddr(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [
    ("next", ctypes.POINTER(_IfAddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockAddr)),
    ("netmask", ctypes.POINTER(_SockAddr)),
    ("broadaddr", ctypes.POINTER(_SockAddr)),
    ("data", ctypes.c_void_p),
]


def _getifaddrs() -> List[Tuple[str, int, Optional[str]]]:
    """(interface, flags, address or None) for every entry of libc's ``getifaddrs`` (Linux's
    sockaddr layout: family in the first two bytes); empty where libc has none."""
    libc_name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        getifaddrs, freeifaddrs = libc.getifaddrs, libc.freeifaddrs
    except (OSError, AttributeError, TypeError):
        return []
    head = ctypes.POINTER(_IfAddrs)()
    if getifaddrs(ctypes.byref(head)) != 0:
        return []
    entries = []
    try:
        node = head
        while node:
            item = node.contents
            address = None
            if item.addr:
                family = item.addr.contents.family
                raw = bytes(item.addr.contents.data)
                if family == socket.AF_INET:
                    address = socket.inet_ntop(socket.AF_INET, raw[2:6])
                elif family == socket.AF_INET6:
                    address = socket.inet_ntop(socket.AF_INET6, raw[6:22])
            entries.append((item.name.decode(errors="replace"), int(item.flags), address))
            node = item.next
    finally:
        freeifaddrs(head)
    return entries
