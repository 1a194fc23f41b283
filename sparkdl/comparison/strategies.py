"""Which strategies ``sparkdl.compare`` trains, what the table calls them, and the simulated
straggler: the default list, ``strategies=`` as objects, a mapping or a command-line text
(``"allreduce,model_averaging:sync_every=4,diloco:sync_every=64"``), labels such as
``ModelAveraging(sync_every=4)`` and ``DiLoCo(sync_every=64)``,
and the model-factory wrapper that slows one rank down."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, List, Mapping, Optional, Tuple

import torch

from sparkdl.errors import ConfigError
from sparkdl.strategies import (
    AllReduce,
    ElasticAveraging,
    ModelAveraging,
    OuterSGD,
    ParameterServer,
    strategy_class,
    strategy_from_name,
)
from sparkdl.strategies.base import Strategy

#: (label, strategy) pairs in table order.
Labelled = Tuple[Tuple[str, Strategy], ...]

#: The staleness bound of the default list's bounded parameter server.
DEFAULT_MAX_STALENESS = 2


def default_strategies() -> List[Strategy]:
    """The taxonomy's trade-offs, one each: synchronous gradients, local SGD at a short and a long
    period, elastic averaging, and the parameter server unbounded and bounded."""
    return [
        AllReduce(),
        ModelAveraging(sync_every=4),
        ModelAveraging(sync_every=16),
        ElasticAveraging(),
        ParameterServer(),
        ParameterServer(max_staleness=DEFAULT_MAX_STALENESS),
    ]


def strategy_label(strategy: Strategy) -> str:
    """``ClassName(field=value, ...)`` with only the fields that differ from their defaults; model
    averaging with an :class:`OuterSGD` outer optimizer is ``DiLoCo(sync_every=τ, ...)`` (its outer
    optimizer shown only when it is not DiLoCo's default), as ``sparkdl plan`` names it."""
    settings = []
    name = type(strategy).__name__
    diloco = isinstance(strategy, ModelAveraging) and isinstance(strategy.outer_optimizer, OuterSGD)
    if diloco:
        name = "DiLoCo"
    if dataclasses.is_dataclass(strategy):
        for field in dataclasses.fields(strategy):
            value = getattr(strategy, field.name)
            if diloco and field.name == "outer_optimizer" and value == OuterSGD():
                continue
            if diloco and field.name == "sync_every":  # DiLoCo is named by its period, default or not
                settings.append(f"sync_every={value!r}")
                continue
            if field.default is not dataclasses.MISSING and value == field.default:
                continue
            if field.default_factory is not dataclasses.MISSING and value == field.default_factory():  # type: ignore[misc]
                continue
            shown = getattr(value, "__qualname__", None) if callable(value) else None
            settings.append(f"{field.name}={shown or repr(value)}")
    return f"{name}({', '.join(settings)})"


def labelled_strategies(strategies: Any) -> Labelled:
    """``strategies=`` as (label, strategy) pairs.

    Args:
        strategies: None (the default list), a list of strategy objects (or of command-line
            texts), a mapping ``label -> strategy``, or one command-line text.

    Raises:
        ConfigError: an empty list, something that is not a strategy, or a bad text.
    """
    if strategies is None:
        return _unique([(strategy_label(s), s) for s in default_strategies()])
    if isinstance(strategies, str):
        return parse_strategies(strategies)
    if isinstance(strategies, Strategy):
        raise ConfigError(
            f"strategies={strategies!r} must be a list of strategies (e.g. [{strategy_label(strategies)}])"
        )
    if isinstance(strategies, Mapping):
        pairs = [(str(label), strategy) for label, strategy in strategies.items()]
    else:
        try:
            items = list(strategies)
        except TypeError:
            raise ConfigError(
                f"strategies={strategies!r} must be a list of strategies, a mapping label -> strategy, or a text"
            ) from None
        pairs = []
        for item in items:
            pairs.extend(parse_strategies(item) if isinstance(item, str) else [(None, item)])  # type: ignore[list-item]
    for label, strategy in pairs:
        if not isinstance(strategy, Strategy):
            raise ConfigError(
                f"strategies: {strategy!r}{f' (label {label!r})' if label else ''} is not a sparkdl strategy "
                f"(e.g. sparkdl.AllReduce(), sparkdl.ModelAveraging(sync_every=4))"
            )
    if not pairs:
        raise ConfigError("strategies= is empty: give at least one strategy (None compares the default list)")
    return _unique([(label or strategy_label(strategy), strategy) for label, strategy in pairs])


def parse_strategies(text: str) -> Labelled:
    """``"allreduce,model_averaging:sync_every=4,parameter_server:max_staleness=2"``: strategies
    by name, separated by commas, each with ``:KEY=VALUE`` settings (values parsed as JSON when
    they can be: ``4``, ``null``, ``0.1``; otherwise kept as text). The names are those of
    ``--strategy``: the registered ones and ``diloco`` (``model_averaging`` with DiLoCo's outer
    optimizer, :func:`sparkdl.strategies.strategy_names`)."""
    pairs = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise ConfigError(f"strategies={text!r} has an empty entry; separate strategies by single commas")
        name, *settings = [piece.strip() for piece in item.split(":")]
        try:
            cls, _ = strategy_class(name)
        except ConfigError as exc:
            raise ConfigError(f"strategies: unknown strategy {name!r} in {text!r}; {_valid_names(exc)}") from None
        kwargs = {}
        for setting in settings:
            key, sep, value = setting.partition("=")
            if not sep or not key.strip():
                raise ConfigError(
                    f"strategies: {item!r}: settings look like {name}:KEY=VALUE (e.g. model_averaging:sync_every=4)"
                )
            kwargs[key.strip()] = _value(value.strip())
        try:
            strategy = strategy_from_name(name, **kwargs)
        except TypeError as exc:  # an unknown setting name
            valid = [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
            raise ConfigError(f"strategies: {item!r}: {exc}; {name}'s settings: {', '.join(valid) or 'none'}") from None
        pairs.append((strategy_label(strategy), strategy))
    return _unique(pairs)


def _valid_names(error: ConfigError) -> str:
    """``valid names: ...`` from :func:`strategy_class`'s message (which lists them, aliases too)."""
    message = str(error)
    return "valid names: " + message.split("; valid: ", 1)[1] if "; valid: " in message else message


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _unique(pairs: List[Tuple[str, Strategy]]) -> Labelled:
    """Labels made unique (``... #2``), so every row and curve can be told apart."""
    seen: dict = {}
    out = []
    for label, strategy in pairs:
        seen[label] = seen.get(label, 0) + 1
        out.append((label if seen[label] == 1 else f"{label} #{seen[label]}", strategy))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class SlowedModel:
    """A model factory whose module makes rank ``rank`` sleep ``seconds`` before each training
    forward pass: a simulated straggler (a slower executor), to see what each strategy does when
    one worker lags. Picklable (executors import it by reference; ``model`` travels as the user's
    factory does). The hook adds no parameters or buffers, so ``state_dict`` keys are unchanged,
    and it does nothing in eval mode (validation, ``transform``) or outside a process group (the
    driver's checks)."""

    model: Callable[[], torch.nn.Module]
    rank: int
    seconds: float

    def __call__(self) -> torch.nn.Module:
        module = self.model()
        if isinstance(module, torch.nn.Module):  # anything else fails the estimator's own check
            module.register_forward_pre_hook(_Straggler(self.rank, self.seconds))
        return module


@dataclasses.dataclass(frozen=True)
class _Straggler:
    rank: int
    seconds: float

    def __call__(self, module: torch.nn.Module, args: Any) -> Optional[Any]:
        import torch.distributed as dist

        if module.training and dist.is_available() and dist.is_initialized() and dist.get_rank() == self.rank:
            # Deliberate: this sleep *is* the simulated slowness, not a wait for anything.
            time.sleep(self.seconds)
        return None
