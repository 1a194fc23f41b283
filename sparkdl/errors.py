"""Exceptions that sparkdl raises on the driver.

Every failure inside a Spark task is turned into a :class:`RankFailure` record on the task side,
sent to the driver over the progress channel and raised there as one :class:`TrainingError` that
names the failing rank and carries the rank's original traceback. The records are plain data (no
exception objects) because they cross a process boundary as JSON.
"""

from __future__ import annotations

import dataclasses
import re
import traceback
from typing import Dict, List, Sequence, Tuple


class SparkdlError(Exception):
    """Base class of every error sparkdl raises."""


class ConfigError(SparkdlError, ValueError):
    """An argument or setting is invalid; the message names it and what would be valid."""


class DataError(SparkdlError, ValueError):
    """The training data cannot be used as given (missing path or column, bad type, empty...)."""


class InsufficientSlotsError(SparkdlError):
    """The cluster has fewer free task slots than ``num_workers``."""


class NonFiniteLossError(SparkdlError, FloatingPointError):
    """The loss became NaN or infinite on some rank."""


class PeerLostError(SparkdlError):
    """Raised by a rank when a peer it depends on is gone (its process died, its connection
    broke, or it stopped answering).

    The error is a consequence, not a cause: the launcher reports the lost peer (when it sees
    that peer vanish) before the ranks that complained about it.
    """


class HostDrained(SparkdlError):
    """Raised by every rank when the run drains (a host is being decommissioned): each rank
    stored the checkpoint of the same step and stopped; the launcher resumes from it."""


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """What one rank reported about its failure (or what the driver observed about it)."""

    rank: int
    exc_type: str
    message: str
    traceback: str
    phase: str = ""
    #: The exception was a :class:`PeerLostError`: this rank lost a peer, which is the likelier cause.
    peer_loss: bool = False
    #: Where the rank ran: the machine's name and its executor's address ("" when unknown).
    host: str = ""
    #: ``"ConfigError"`` or ``"DataError"`` when the exception was one (a subclass included):
    #: the driver raises it as that class (:func:`raised_from`) and does not retry it.
    category: str = ""

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException, phase: str = "", host: str = "") -> "RankFailure":
        return cls(
            rank=rank,
            exc_type=type(exc).__name__,
            message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            phase=phase,
            peer_loss=isinstance(exc, PeerLostError),
            host=host,
            category="ConfigError"
            if isinstance(exc, ConfigError)
            else "DataError"
            if isinstance(exc, DataError)
            else "",
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "RankFailure":
        return cls(
            rank=int(data["rank"]),
            exc_type=str(data.get("exc_type", "Exception")),
            message=str(data.get("message", "")),
            traceback=str(data.get("traceback", "")),
            phase=str(data.get("phase", "")),
            peer_loss=bool(data.get("peer_loss", False)),
            host=str(data.get("host", "")),
            category=str(data.get("category", "")),
        )


class TrainingError(SparkdlError):
    """Training failed on at least one rank.

    Attributes:
        rank: the first rank that failed (by arrival at the driver).
        failures: every failure record that reached the driver, first one first.
        remote_traceback: the first failing rank's original traceback.
    """

    def __init__(self, failures: Sequence[RankFailure], hint: str = "") -> None:
        self.failures = tuple(failures)
        self.hint = hint
        super().__init__(format_failures(self.failures, hint))

    @property
    def rank(self) -> int:
        return self.failures[0].rank

    @property
    def exc_type(self) -> str:
        return self.failures[0].exc_type

    @property
    def remote_traceback(self) -> str:
        return self.failures[0].traceback

    def __reduce__(self):
        # Keeps the exception picklable (Spark, multiprocessing and notebooks copy exceptions).
        return (type(self), (self.failures, self.hint))


class RankConfigError(TrainingError, ConfigError):
    """A setting the ranks found invalid (an interface variable naming an interface a host
    lacks, ``ShardedDataParallel.shard_modules`` naming no submodule, a checkpoint the strategy
    cannot resume on this many workers...): a :class:`TrainingError` (which rank, which host,
    ``remote_traceback``) that is also a :class:`ConfigError` (fix the setting; retrying cannot
    help, so it is not retried)."""


class RankDataError(TrainingError, DataError):
    """Data the ranks found unusable (a NaN or null feature beyond the rows the driver checked,
    ...): a :class:`TrainingError` that is also a :class:`DataError`; not retried."""


#: torch/gloo's own messages for a connection to a peer that went away. sparkdl's strategies
#: raise :class:`PeerLostError` instead (``RankFailure.peer_loss``).
_PEER_LOSS = re.compile(
    r"connection (closed|reset|refused|lost)|broken pipe|closed by peer|lost (rank|peer|worker)|peer rank", re.I
)

#: Subclasses of ConfigError / DataError whose records predate ``RankFailure.category``, or come
#: from a launched child (which reports its exception's type by name only).
_CATEGORY_BY_NAME = {
    "ConfigError": "ConfigError",
    "RankConfigError": "ConfigError",
    "ProcessSpawnError": "ConfigError",
    "DataError": "DataError",
    "RankDataError": "DataError",
    "EmptyDatasetError": "DataError",
}


def is_peer_loss(failure: RankFailure) -> bool:
    """Whether a rank's error reads like the consequence of another rank's death or failure."""
    return failure.peer_loss or bool(_PEER_LOSS.search(f"{failure.exc_type}: {failure.message}"))


def category(failure: RankFailure) -> str:
    """``"ConfigError"``, ``"DataError"`` or ``""``: the public class a rank's error belongs to."""
    return failure.category or _CATEGORY_BY_NAME.get(failure.exc_type, "")


def raised_from(error: TrainingError) -> TrainingError:
    """``error`` as the driver raises it: a :class:`RankConfigError` (:class:`RankDataError`)
    when every rank that failed on its own failed on a setting (on the data); the ranks that
    only lost a peer to that failure (their collective broke) do not count."""
    causes = [f for f in error.failures if not is_peer_loss(f)] or list(error.failures)
    kinds = {category(f) for f in causes}
    if kinds == {"ConfigError"}:
        return RankConfigError(error.failures, error.hint)
    if kinds == {"DataError"}:
        return RankDataError(error.failures, error.hint)
    return error


#: Failures whose message says all there is to say (what happened, where, which setting to
#: change): their traceback, only sparkdl's internals, stays out of the message (it is still in
#: ``TrainingError.remote_traceback``). Errors raised by user code keep their traceback.
SELF_EXPLAINED = frozenset(
    {
        "ConfigError",
        "DataError",
        "NonFiniteLossError",
        "InsufficientSlotsError",
        "PeerLostError",
        "ParameterServerError",
        "WatchdogTimeout",
        "WorkerLost",
        "HostLost",
        "HostDrained",
    }
)


_RANK = "\x00rank\x00"


def _host_names(host: str) -> List[str]:
    """The ways a message may name ``host`` ("name (address)"): whole, the address, the name."""
    match = re.fullmatch(r"(.*?) \((.*)\)", host)
    names = [host, *(match.groups() if match else ())]
    return sorted({n for n in names if n}, key=len, reverse=True)


def _headline_key(failure: RankFailure) -> Tuple[str, str]:
    """What identical failures of different ranks share: the message with this rank's number and
    host masked in its first line (messages such as "... exited with status 3 on rank 1 (host
    h2); its last lines:" name them); the lines after it (output, details) must match exactly."""
    head, sep, rest = failure.message.partition("\n")
    for name in _host_names(failure.host):
        head = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", "\x00host\x00", head)
    head = re.sub(rf"\brank {failure.rank}\b", _RANK, head)
    return failure.exc_type, head + sep + rest


def _group(failures: Sequence[RankFailure]) -> List[List[RankFailure]]:
    """Failures grouped by :func:`_headline_key`, in order of first appearance."""
    groups: Dict[Tuple[str, str], List[RankFailure]] = {}
    for failure in failures:
        groups.setdefault(_headline_key(failure), []).append(failure)
    return list(groups.values())


def _ranks(group: Sequence[RankFailure]) -> str:
    ranks = sorted({f.rank for f in group})
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _message(group: Sequence[RankFailure]) -> str:
    """The group's first message, naming every rank of the group where it named its own."""
    first = group[0]
    head, sep, rest = first.message.partition("\n")
    if len({f.rank for f in group}) > 1:
        head = re.sub(rf"\brank {first.rank}\b", _ranks(group), head)
    return head + sep + rest


def format_failures(failures: Sequence[RankFailure], hint: str = "") -> str:
    """One readable message: the first failure in full, identical ones from other ranks grouped
    into it ("ranks 0, 1"), each different one in a line."""
    if not failures:
        return "training failed, but no rank reported an error" + (f"\n{hint}" if hint else "")
    groups = _group(failures)
    same, others = groups[0], groups[1:]
    first = same[0]
    if first.rank >= 0:
        where = _ranks(same)
    elif first.phase == "launching":
        where = "the Spark job, before any rank started"
    else:
        where = "the Spark job"
    phase = f" while {first.phase}" if first.phase else ""
    lines = [f"training failed on {where}{phase}: {first.exc_type}: {_message(same)}"]
    if hint:
        lines.append(hint)
    hosts = sorted({f.host for f in same if f.host})
    if len(hosts) == 1:
        lines.append(f"({_ranks(same)} ran on host {hosts[0]})")
    elif hosts:
        lines.append("(" + ", ".join(f"rank {f.rank} on host {f.host}" for f in same if f.host) + ")")
    for group in others:
        other = group[0]
        group_hosts = sorted({f.host for f in group if f.host})
        on = f" on host {group_hosts[0]}" if len(group_hosts) == 1 else ""
        head, _, rest = _message(group).partition("\n")
        more = " (the rest: TrainingError.failures)" if rest.strip() else ""
        lines.append(f"  also {_ranks(group)}{on}: {other.exc_type}: {head}{more}")
    if first.traceback and first.exc_type in SELF_EXPLAINED:
        lines.append("(the rank's traceback: TrainingError.remote_traceback)")
    elif first.traceback:
        source = f"rank {first.rank}" if first.rank >= 0 else "the executor"
        lines.append(f"\nTraceback from {source}:\n{first.traceback.rstrip()}")
    return "\n".join(lines)
