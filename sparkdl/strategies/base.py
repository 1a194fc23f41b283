"""The strategy plug-in point: how model replicas on different ranks stay consistent.

A :class:`Strategy` is a small frozen dataclass that the user builds on the driver and that travels
to every task. On the task it creates a :class:`StrategyRuntime` bound to the live process group;
the runtime is the only thing the training loop talks to. A new strategy is one module that
subclasses both and sets ``name``; nothing in the loop or the launcher branches on strategy type.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import Any, Callable, ClassVar, ContextManager, Dict, Optional, Sequence, Tuple, Type

import torch


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Where this task sits in the job, and what strategies may use of the barrier stage.

    Attributes:
        peer_addresses: every task's ``host:port``, by rank (``BarrierTaskContext.getTaskInfos()``);
            empty outside a barrier task (tests build a DistEnv by hand).
        all_gather: one string from every rank, in rank order (every rank must call it at the
            same point), through the rendezvous store (:func:`sparkdl._runtime.rendezvous.store_all_gather`; the barrier's
            ``allGather`` for launchers without a driver's store); None outside a launch.
            Strategies use these two instead of importing pyspark.
        encrypt: whether servers and clients a strategy opens must encrypt their traffic
            (Spark's own RPC is encrypted: ``spark.network.crypto.enabled`` or ``spark.ssl``);
            every frame is integrity-checked either way. See :mod:`sparkdl._net.policy`.
    """

    rank: int
    world_size: int
    device: torch.device
    backend: str
    master_addr: str
    master_port: int
    peer_addresses: Tuple[str, ...] = ()
    all_gather: Optional[Callable[[str], Sequence[str]]] = dataclasses.field(default=None, compare=False, repr=False)
    encrypt: bool = False


_REGISTRY: Dict[str, Type["Strategy"]] = {}
#: Names of a registered strategy with some settings preset: alias -> (registered name, settings).
_ALIASES: Dict[str, Tuple[str, Dict[str, Any]]] = {}


def allreduce_bytes_sent(nbytes: int, world_size: int) -> int:
    """What one rank sends in an allreduce of ``nbytes``: ``2 (n-1)/n`` of them, as a ring
    allreduce does (reduce-scatter then all-gather, each ``(n-1)/n``; gloo's and NCCL's
    bandwidth-optimal algorithm). ``nbytes`` at two ranks, 0 for a lone rank, which sends nothing."""
    return 2 * (world_size - 1) * int(nbytes) // world_size if world_size > 1 else 0


def broadcast_bytes_sent(nbytes: int, world_size: int, is_root: bool) -> int:
    """What one rank sends in a broadcast of ``nbytes``: the root's bytes once; nothing on the
    other ranks, nor on a lone rank."""
    return int(nbytes) if is_root and world_size > 1 else 0


class Strategy(abc.ABC):
    """User-facing configuration of a distributed training strategy."""

    #: Name used on command lines (``--strategy allreduce``) and in run metadata.
    name: ClassVar[str] = ""
    #: The cost model ``sparkdl.plan`` predicts the strategy with (``sparkdl.planning.models.KINDS``):
    #: "allreduce" (gradients every step), "averaging" / "elastic" (parameters every
    #: ``sync_every`` steps), "parameter_server", "sharded"; "" for none (plan refuses it). A
    #: user's strategy that communicates like a built-in one names that one's model.
    cost_model: ClassVar[str] = ""
    #: Whether every rank ends training holding bit-identical parameters.
    identical_final_weights: ClassVar[bool] = True
    #: Whether a run is bit-reproducible for a fixed seed (and so a resumed run bit-identical to
    #: an uninterrupted one). Asynchronous strategies, whose update order depends on timing, are not.
    deterministic: ClassVar[bool] = True
    #: The ``on_resize=`` values the strategy accepts, its default first
    #: (:mod:`sparkdl._runtime.resize`); a strategy that knows nothing of it keeps today's
    #: behaviour by default and lets the user choose.
    on_resize_choices: ClassVar[Tuple[str, ...]] = ("none", "keep_global_batch", "scale_lr")
    #: Why the strategy refuses the other values (in the ConfigError).
    on_resize_reason: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.name:
            _REGISTRY[cls.name] = cls

    @abc.abstractmethod
    def create_runtime(self, env: "DistEnv") -> "StrategyRuntime":
        """Builds the task-side runtime once the process group exists."""

    def describe(self) -> Dict[str, Any]:
        """Settings for run metadata and logs."""
        fields = dataclasses.asdict(self) if dataclasses.is_dataclass(self) else {}
        return {"name": self.name, **fields}

    def steps_per_sync_cycle(self) -> int:
        """Optimizer steps over which this strategy's step times repeat: 1 when every step
        synchronizes alike (allreduce, sharded, parameter server); for a strategy with a
        ``sync_every`` setting (the averaging ones, a user's that follows them), the steps up to
        its first average after ``warmup_steps``. The watchdog's ``"auto"`` bound learns a run's
        pace over such cycles, so that the slow step that synchronizes is seen before any step
        is judged (sparkdl._driver.watchdog). Override it when neither describes the strategy."""
        return int(getattr(self, "warmup_steps", 0) or 0) + int(getattr(self, "sync_every", 1) or 1)


class StrategyRuntime(abc.ABC):
    """Task-side half of a strategy, bound to one rank of a live process group."""

    #: Model and optimizer state are bit-identical on every rank after every step (checkpoints
    #: then store one copy of them).
    replicas_identical: ClassVar[bool] = False

    def __init__(self, env: "DistEnv") -> None:
        self.env = env
        #: Bytes this rank sent in collectives to keep the replicas consistent (not metrics):
        #: count them with :func:`allreduce_bytes_sent` / :func:`broadcast_bytes_sent`, so a
        #: lone rank reports 0.
        self.comm_bytes = 0

    @abc.abstractmethod
    def prepare_model(self, module: torch.nn.Module) -> torch.nn.Module:
        """Wraps or hooks a module that already sits on the task's device."""

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Wraps the optimizer when the strategy acts at optimizer steps. Default: unchanged."""
        return optimizer

    @abc.abstractmethod
    def final_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The plain module holding the strategy's result (e.g. the final average), same on all
        ranks when ``identical_final_weights``. Called once, after the last step, on every rank."""

    def gradient_sync(self, model: torch.nn.Module, enabled: bool) -> ContextManager[None]:
        """Context for a backward pass whose gradients are (``enabled``) or are not yet
        synchronized: gradient accumulation (``on_resize="keep_global_batch"``) runs all but a
        step's last micro-batch with ``enabled=False``. Default: nothing to turn off."""
        return contextlib.nullcontext()

    def evaluation_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module whose forward the validation pass runs: it must run no collectives,
        because ranks may evaluate different numbers of batches. Called on every rank at the same
        point (an override may gather, collectively). Default: the module, unwrapped from DDP
        (whose forward may synchronize buffers)."""
        from torch.nn.parallel import DistributedDataParallel

        return model.module if isinstance(model, DistributedDataParallel) else model

    def epoch_metrics(self) -> Dict[str, float]:
        """Strategy-specific figures for this rank since the previous call (e.g. a parameter
        server's ``staleness``), added to each epoch's history record by the training loop.

        Called once per epoch on every rank; every rank must return the same keys. Keys ending
        in ``_per_sec`` are summed over ranks (rates add up); every other key takes the maximum
        over ranks. Default: none.
        """
        return {}

    def state_dict(self) -> Dict[str, Any]:
        """This rank's strategy state that a checkpoint must hold to resume exactly (averaging
        center, step counters, parameter-server shards with their optimizer state), beyond the
        model's and optimizer's own ``state_dict``. Tensors should be on the CPU. Called on every
        rank at the same step; the checkpoint keeps every rank's dict."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned on this rank, after ``prepare_model`` and
        ``prepare_optimizer`` and before the first step of the resumed run."""

    def model_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The model's and optimizer's state as a checkpoint stores it (plain containers of
        tensors: parts load with ``weights_only=True``). Default: their ``state_dict``\\ s under
        ``"model"`` and ``"optimizer"``; a sharding strategy returns this rank's shards."""
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_model_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
        """Restores what :meth:`model_state` returned (on this rank, or on every rank alike when
        ``replicas_identical``) into the prepared model and optimizer."""
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def reshard_state(
        self, old: Sequence[Tuple[Dict[str, Any], Dict[str, Any]]], old_world_size: int
    ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """This rank's (user state, strategy state) when a checkpoint of ``old_world_size`` ranks
        resumes on ``env.world_size`` (elastic resume). ``old[i]`` is old rank ``i``'s pair (the
        user state merged with the replicated state). Called on every rank, after
        ``prepare_optimizer``, before :meth:`load_state_dict` gets the strategy state returned.
        On a resume from a checkpoint store ``old[i][1]`` is read from storage each time it is
        taken and kept by nobody (:func:`sparkdl._runtime.resume.old_rank_states`): take each
        old part's strategy state once and drop it before the next, so that a rank never holds
        every old part at once.

        Default: old rank ``rank % old_world_size``'s pair — exact for state that is identical on
        every rank (AllReduce's), a plausible replica for per-rank state. The averaging strategies
        and the parameter server override it (an average; shards re-laid out).
        """
        return old[self.env.rank % old_world_size]

    def close(self) -> None:
        """Releases hooks, threads or servers. Must be safe to call after a failure."""


def registered_strategies() -> Dict[str, Type[Strategy]]:
    """Name → class of every strategy defined so far."""
    return dict(_REGISTRY)


def register_alias(alias: str, name: str, **settings: Any) -> None:
    """Makes ``alias`` name the registered strategy ``name`` with ``settings`` preset: ``"diloco"``
    is ``"model_averaging"`` with DiLoCo's outer optimizer. Settings given with the alias
    (``--strategy-arg``, ``diloco:sync_every=64``) override the preset ones."""
    _ALIASES[alias] = (name, dict(settings))


def strategy_names() -> Dict[str, str]:
    """Every name :func:`strategy_from_name` takes → what it builds: a registered name → its class
    name, an alias → its registered name and preset settings."""
    names = {name: cls.__name__ for name, cls in _REGISTRY.items()}
    for alias, (name, settings) in _ALIASES.items():
        preset = ", ".join(f"{key}={value!r}" for key, value in settings.items())
        names[alias] = f"{name} with {preset}" if preset else name
    return names


def strategy_class(name: str) -> Tuple[Type[Strategy], Dict[str, Any]]:
    """The class a strategy name builds and the settings its alias presets (``{}`` for a
    registered name). Names are matched ignoring case, ``-`` for ``_``.

    Raises:
        ConfigError: an unknown name; the message lists every valid one.
    """
    key = name.strip().lower().replace("-", "_")
    target, settings = _ALIASES.get(key, (key, {}))
    cls = _REGISTRY.get(target)
    if cls is None:
        from sparkdl.errors import ConfigError

        valid = ", ".join(sorted(_REGISTRY))
        aliases = "; ".join(f"{alias} = {described}" for alias, described in sorted(_alias_descriptions().items()))
        raise ConfigError(f"strategy={name!r} is unknown; valid: {valid}" + (f" (and {aliases})" if aliases else ""))
    return cls, dict(settings)


def strategy_from_name(name: str, **kwargs: Any) -> Strategy:
    """Builds a strategy by registered name or alias (used by ``jobs/train.py``, the CLI and
    ``sparkdl compare``/``plan``'s ``--strategies``); ``kwargs`` override an alias's preset
    settings.

    Raises:
        ConfigError: an unknown name (the message lists the valid ones).
        TypeError: a setting the strategy does not have.
    """
    cls, settings = strategy_class(name)
    return cls(**{**settings, **kwargs})


def _alias_descriptions() -> Dict[str, str]:
    names = strategy_names()
    return {alias: names[alias] for alias in _ALIASES}
