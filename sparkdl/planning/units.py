"""Link speeds, latencies and memory as people write them: ``10Gbit``, ``100mbit``, ``1.25GB/s``;
``50us``, ``0.2ms``, ``1e-4`` (seconds); ``4g``, ``512m`` (as Spark's memory settings)."""

from __future__ import annotations

import re
from typing import Optional, Union

from sparkdl.errors import ConfigError

_BITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def bandwidth_bytes(value: Union[str, float, None], name: str = "bandwidth") -> Optional[float]:
    """Bytes per second in ``10Gbit``, ``10Gb/s``, ``10Gbps`` (bits, as links are sold),
    ``1.25GB/s`` (an upper-case B: bytes), or a number of bytes per second."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value > 0:
            return float(value)
    else:
        match = re.fullmatch(
            r"\s*(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*(?:([kKmMgGtT]?)(bit|Bit|b|B)(?:ps|/s)?)?\s*", str(value)
        )
        if match and float(match.group(1)) > 0:
            number, prefix, unit = float(match.group(1)), (match.group(2) or "").lower(), match.group(3)
            if unit is None:
                return number  # bytes per second
            return number * _BITS[prefix] / (1 if unit == "B" else 8)
    raise ConfigError(f"{name}={value!r}: give a link speed such as '10Gbit', '100mbit' or '1.25GB/s'")


def latency_seconds(value: Union[str, float, None], name: str = "latency") -> Optional[float]:
    """Seconds in ``50us``, ``0.2ms``, ``1e-4`` (seconds)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value >= 0:
            return float(value)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*(s|ms|us|µs|ns)?\s*", str(value).lower())
        if match:
            return float(match.group(1)) * _SECONDS[match.group(2) or "s"]
    raise ConfigError(f"{name}={value!r}: give a latency such as '50us' or '0.2ms'")


_MEMORY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def memory_bytes(value: Union[str, int, None], name: str = "memory_budget") -> Optional[int]:
    """Bytes in ``4g``, ``512m``, ``4GB``, ``2048k`` (binary units, as Spark reads its memory
    settings), or a number of bytes."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value > 0:
            return int(value)
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(value).lower())
        if match and float(match.group(1)) > 0:
            return int(float(match.group(1)) * _MEMORY[match.group(2)])
    raise ConfigError(f"{name}={value!r}: give a size such as '4g', '512m' or a number of bytes")
