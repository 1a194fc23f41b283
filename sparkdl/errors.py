"""Exceptions that sparkdl raises on the driver.

Every failure inside a Spark task is turned into a :class:`RankFailure` record on the task side,
sent to the driver over the progress channel and raised there as one :class:`TrainingError` that
names the failing rank and carries the rank's original traceback. The records are plain data (no
exception objects) because they cross a process boundary as JSON.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Sequence


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
    """A setting the ranks found invalid on their hosts before training (for example an
    interface variable naming an interface a host lacks): a :class:`TrainingError` (which rank,
    which host) that is also a :class:`ConfigError` (fix the setting; retrying cannot help)."""


def raised_from(error: TrainingError) -> TrainingError:
    """``error`` as the driver raises it: a :class:`RankConfigError` when every rank that failed
    failed on a setting."""
    if error.failures and all(failure.exc_type == "ConfigError" for failure in error.failures):
        return RankConfigError(error.failures, error.hint)
    return error


#: Failures whose message says all there is to say (what happened, where, which setting to
#: change): their traceback, only sparkdl's internals, stays out of the message (it is still in
#: ``TrainingError.remote_traceback``). Errors raised by user code keep their traceback.
SELF_EXPLAINED = frozenset(
    {"ConfigError", "DataError", "NonFiniteLossError", "InsufficientSlotsError", "PeerLostError",
     "ParameterServerError", "WatchdogTimeout", "WorkerLost", "HostLost", "HostDrained"}
)


def format_failures(failures: Sequence[RankFailure], hint: str = "") -> str:
    """One readable message: the first failure in full, identical ones from other ranks grouped."""
    if not failures:
        return "training failed, but no rank reported an error" + (f"\n{hint}" if hint else "")
    first = failures[0]
    same = sorted({f.rank for f in failures if (f.exc_type, f.message) == (first.exc_type, first.message)})
    others = [f for f in failures if (f.exc_type, f.message) != (first.exc_type, first.message)]
    if first.rank < 0:
        where = "the Spark job, before any rank started"
    else:
        where = f"rank {first.rank}" if len(same) == 1 else f"ranks {', '.join(map(str, same))}"
    phase = f" while {first.phase}" if first.phase else ""
    lines = [f"training failed on {where}{phase}: {first.exc_type}: {first.message}"]
    if hint:
        lines.append(hint)
    if first.host:
        lines.append(f"(rank {first.rank} ran on host {first.host})")
    for other in others:
        on = f" on host {other.host}" if other.host else ""
        lines.append(f"  also rank {other.rank}{on}: {other.exc_type}: {other.message}")
    if first.traceback and first.exc_type in SELF_EXPLAINED:
        lines.append("(the rank's traceback: TrainingError.remote_traceback)")
    elif first.traceback:
        source = f"rank {first.rank}" if first.rank >= 0 else "the executor"
        lines.append(f"\nTraceback from {source}:\n{first.traceback.rstrip()}")
    return "\n".join(lines)
