"""DiLoCo's outer optimizer for :class:`~sparkdl.strategies.averaging.ModelAveraging`.

DiLoCo (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models") treats the replicas' averaged progress since the last synchronization as a gradient:
every rank keeps a *global* copy of the parameters (identical on every rank), and at each
synchronization, once the replicas have been averaged::

    pseudo_gradient = global - average          (minus the average change of the replicas)
    global          = outer_optimizer.step()    (e.g. SGD with Nesterov momentum, lr 0.7)
    every replica   = global

Every rank applies the same optimizer to the same inputs (the allreduce hands every rank the
same bits), so the global copies and the outer optimizer's state stay bit-identical without any
traffic beyond the averaging allreduce itself.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from sparkdl.errors import ConfigError

__all__ = ["OuterOptimizerFactory", "OuterSGD", "OuterStep", "check_outer_optimizer", "factory_name"]

#: ``params -> torch.optim.Optimizer``, called once per prepared module on every rank.
OuterOptimizerFactory = Callable[[List[torch.nn.Parameter]], torch.optim.Optimizer]

SETTING = "ModelAveraging.outer_optimizer"
EXAMPLE = "sparkdl.OuterSGD(lr=0.7, momentum=0.9, nesterov=True)"


@dataclasses.dataclass(frozen=True)
class OuterSGD:
    """A ready-made, picklable outer optimizer: ``torch.optim.SGD`` with these settings.

    The defaults are DiLoCo's (Nesterov momentum 0.9, outer learning rate 0.7). ``OuterSGD(lr=1,
    momentum=0)`` is plain model averaging. On the command line the same is
    ``--strategy model_averaging --strategy-arg 'outer_optimizer={"lr": 0.7}'`` (a JSON object
    of these fields).

    Args:
        lr: outer learning rate, the step along the averaged pseudo-gradient (1 replaces the
            global copy by the average).
        momentum: outer momentum, in [0, 1).
        nesterov: Nesterov momentum (needs ``momentum > 0``).
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not _real(self.lr) or not self.lr > 0:
            raise ConfigError(
                f"OuterSGD.lr={self.lr!r} must be a finite number > 0 (DiLoCo uses 0.7; 1 without momentum is plain averaging)"
            )
        if not _real(self.momentum) or not 0 <= self.momentum < 1:
            raise ConfigError(
                f"OuterSGD.momentum={self.momentum!r} must be a number with 0 <= momentum < 1 (DiLoCo uses 0.9)"
            )
        if not isinstance(self.nesterov, bool):
            raise ConfigError(f"OuterSGD.nesterov={self.nesterov!r} must be True or False")
        if self.nesterov and self.momentum == 0:
            raise ConfigError("OuterSGD.nesterov=True needs momentum > 0; set momentum (e.g. 0.9) or nesterov=False")

    def __call__(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=float(self.lr), momentum=float(self.momentum), nesterov=self.nesterov)


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_outer_optimizer(value: Any) -> Optional[OuterOptimizerFactory]:
    """The validated setting: None, a callable, or a mapping of :class:`OuterSGD` fields (what
    ``--strategy-arg outer_optimizer={...}`` parses to), which becomes an ``OuterSGD``."""
    if value is None or callable(value):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(OuterSGD)})
        if unknown:
            raise ConfigError(
                f"{SETTING}={value!r}: unknown OuterSGD field(s) {unknown}; valid: lr, momentum, nesterov"
            )
        return OuterSGD(**value)
    raise ConfigError(
        f"{SETTING}={value!r} must be None (plain averaging), a function params -> torch.optim.Optimizer "
        f"(e.g. {EXAMPLE}, or lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)), "
        f"or a dict of OuterSGD fields"
    )


def factory_name(factory: Any) -> Any:
    """How run metadata shows the setting: OuterSGD's fields, else the callable's name."""
    if factory is None:
        return None
    if isinstance(factory, OuterSGD):
        return {"name": "OuterSGD", **dataclasses.asdict(factory)}
    module = getattr(factory, "__module__", None)
    name = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    return f"{module}:{name}" if module else str(name)


class OuterStep:
    """One prepared module's global copy and outer optimizer, on one rank.

    The global copy covers the module's parameters that require gradients (in
    ``module.parameters()`` order); frozen parameters and floating-point buffers (BatchNorm
    statistics) are plainly averaged. The global copy lives on the parameters' device: one
    extra copy of the parameters, plus the outer optimizer's state (one more for momentum SGD).

    Every rank holds bit-identical global copies and outer-optimizer state at all times (same
    start from the broadcast weights, same averaged inputs, same deterministic update), so
    :meth:`state_dict` is the same on every rank, and any one rank's copy (rank 0's) is a valid
    state for a run with a different number of workers.
    """

    def __init__(self, module: torch.nn.Module, factory: OuterOptimizerFactory) -> None:
        self.params: List[torch.nn.Parameter] = [p for p in module.parameters() if p.requires_grad]
        # Called right after the initial broadcast: the module holds rank 0's weights everywhere.
        self.globals: List[torch.nn.Parameter] = [torch.nn.Parameter(p.detach().clone()) for p in self.params]
        self.optimizer = _build(factory, self.globals)

    def follow(self) -> None:
        """Warm-up: the global copy becomes the (just averaged) replicas; no outer step."""
        with torch.no_grad():
            for held, param in zip(self.globals, self.params):
                held.copy_(param)

    def step(self) -> None:
        """The outer step, once the module's replicas hold the average; they then hold the new
        global copy."""
        with torch.no_grad():
            for held, param in zip(self.globals, self.params):
                held.grad = held.detach() - param.detach()  # minus the replicas' mean progress
            self.optimizer.step()
            for held, param in zip(self.globals, self.params):
                held.grad = None  # no third copy between synchronizations
                param.copy_(held)

    def state_dict(self) -> Dict[str, Any]:
        """The global copy and the outer optimizer's state (identical on every rank)."""
        return {"global": [held.detach() for held in self.globals], "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = state["global"]
        if [tuple(t.shape) for t in saved] != [tuple(p.shape) for p in self.globals]:
            raise RuntimeError(
                f"{SETTING}: the checkpoint's global copy does not match the prepared model's parameters (shapes differ)"
            )
        with torch.no_grad():
            for held, value in zip(self.globals, saved):
                held.copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])


def _build(factory: OuterOptimizerFactory, params: List[torch.nn.Parameter]) -> torch.optim.Optimizer:
    name = factory_name(factory)
    try:
        built = factory(params)
    except Exception as exc:  # whatever it raised, it raises on every rank: name the setting
        raise ConfigError(
            f"{SETTING}={name}: calling it on the global copy's parameters raised {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigError(
            f"{SETTING}={name} returned {type(built).__name__}, not a torch.optim.Optimizer: pass a function "
            f"params -> optimizer, e.g. {EXAMPLE}"
        )
    held = {id(p) for group in built.param_groups for p in group["params"]}
    if held != {id(p) for p in params}:
        # An optimizer over other tensors would step nothing of the global copy: the run would
        # silently be plain averaging (or worse).
        raise ConfigError(
            f"{SETTING}={name} built an optimizer over other parameters than the {len(params)} it was given; "
            f"build it over its argument, e.g. lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)"
        )
    return built
