"""Checks on the driver, before any Spark job, of what would fail the same way on every rank.

A factory that returns the wrong thing, or a loss that does not fit the model's output, fails on
every rank at the first step and on every relaunch: it is worth one small batch on the driver
(CPU, no Spark job) to say so at once, naming the argument at fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from typing import Any, Callable, Iterator, Optional

import torch

from sparkdl.data.batching import DataSpec, batch_rows, call_model, to_tensors, validation_batches
from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.plan import InputPlan
from sparkdl.data.readers import reader_from_name
from sparkdl.data.readers.base import DEFAULT_READER, DataReader
from sparkdl.errors import ConfigError

logger = logging.getLogger("sparkdl.preflight")

#: Rows of the probe batch: enough for a label out of range to show, small enough for any model.
PROBE_ROWS = 32


def build_checked_model(model_fn: Callable[[], Any], plan: InputPlan) -> torch.nn.Module:
    """``model_fn()``, checked: a Module whose forward accepts the plan's named inputs."""
    import inspect

    module = model_fn()
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(f"model() must return a torch.nn.Module, got {type(module).__name__}")
    if plan.positional:
        return module
    try:
        parameters = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # a forward inspect cannot read (C++, some wrappers): trust it
        return module
    kinds = {p.kind for p in parameters.values()}
    names = plan.model_input_names()
    if inspect.Parameter.VAR_KEYWORD not in kinds:
        accepted = [n for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = [n for n in names if n not in accepted]
        if unknown:
            raise ConfigError(
                f"{type(module).__name__}.forward does not accept the input(s) {', '.join(map(repr, unknown))} of inputs= "
                f"(its parameters: {', '.join(accepted) or 'none'}); rename the inputs or the parameters of forward"
            )
    missing = [
        n
        for n, p in parameters.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in names
    ]
    if missing:
        raise ConfigError(
            f"{type(module).__name__}.forward needs {', '.join(map(repr, missing))}, which inputs= does not give "
            f"(inputs: {', '.join(names)}); add them to inputs= or give them defaults"
        )
    return module


def check_optimizer(optimizer_fn: Callable[[Any], Any], module: torch.nn.Module) -> None:
    """``optimizer_fn(module.parameters())`` must build a ``torch.optim.Optimizer``."""
    with _no_dynamo_import():
        built = optimizer_fn(module.parameters())
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer={_name(optimizer_fn)} returned {type(built).__name__}, not a torch.optim.Optimizer: "
            f"pass a function params -> optimizer, e.g. lambda params: torch.optim.Adam(params, lr=1e-3)"
        )


@contextlib.contextmanager
def _no_dynamo_import() -> Iterator[None]:
    """Building an optimizer without importing torch._dynamo, when nothing in this process has.

    ``Optimizer.add_param_group``, which every optimizer's constructor calls, is wrapped by
    ``torch._disable_dynamo``: its first call imports torch._dynamo (1-3 s of CPU, most of a
    first fit's ``prepare``) only to keep the method out of compiled graphs, and caches the
    result on the method. The check compiles nothing and steps nothing, so while it builds the
    optimizer the cache holds the plain method (what runs without compilation anyway); it is
    removed afterwards, and the next optimizer built in the process imports
    torch._dynamo as before. Where torch keeps no such cache, nothing is set and the check
    imports torch._dynamo as it did. The ranks still import it: every ``optimizer.step()`` does.
    """
    method = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
    if "torch._dynamo" in sys.modules or method is None or getattr(method, _DYNAMO_CACHE, None) is not None:
        yield
        return
    setattr(method, _DYNAMO_CACHE, method)
    try:
        yield
    finally:
        if getattr(method, _DYNAMO_CACHE, None) is method:
            delattr(method, _DYNAMO_CACHE)


#: Where ``torch._disable_dynamo``'s wrapper caches its disabled function (torch/_compile.py).
_DYNAMO_CACHE = "__dynamo_disable"


def check_loss(
    module: torch.nn.Module,
    loss_fn: Callable[..., Any],
    dataset: DatasetInfo,
    spec: DataSpec,
    reader: Optional[DataReader] = None,
) -> None:
    """Runs the model and ``loss_fn`` on the first rows of the data (read with the run's
    ``reader``, default the Arrow reader), on the driver's CPU.

    A forward pass that fails here may only run on the executors (a GPU-only model): that is
    logged and left to the run. A loss that fails on the model's own output, or that is not a
    scalar, would fail every rank the same way: that raises.
    """
    probe_spec = dataclasses.replace(
        spec, batch_size=min(PROBE_ROWS, spec.batch_size), shuffle=False, decode_threads=1, validation=None
    )
    stream = validation_batches(reader or reader_from_name(DEFAULT_READER), dataset, probe_spec, 0, 1)
    try:
        batch = next(stream, None)
    finally:
        stream.close()
    if batch is None:
        return
    inputs, labels = to_tensors(batch)
    # Train mode, as the loop runs it (some models return something else in eval mode); the
    # buffers it touches (batch-norm statistics) are replaced by the trained weights later.
    was_training = module.training
    module.train()
    try:
        with torch.no_grad():
            try:
                output = call_model(module, inputs)
            except Exception as exc:  # noqa: BLE001 - the executors' device may be what it needs
                logger.info(
                    "could not run the model on the driver's CPU to check the loss (%s: %s)", type(exc).__name__, exc
                )
                return
            try:
                loss = loss_fn(output, labels)
            except Exception as exc:  # noqa: BLE001 - whatever it raised, it raises on every rank
                raise ConfigError(
                    f"loss={_name(loss_fn)}: loss(output {_shape(output)}, label {_shape(labels)}) raised "
                    f"{type(exc).__name__}: {_first_line(exc)} — {_hint(exc)}"
                ) from exc
    finally:
        module.train(was_training)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(
            f"loss={_name(loss_fn)} returned {_shape(loss) if isinstance(loss, torch.Tensor) else type(loss).__name__} for a batch of "
            f"{batch_rows(inputs)} rows; it must return one number (a scalar tensor): reduce it, e.g. with .mean()"
        )


def _hint(exc: BaseException) -> str:
    text = str(exc)
    if "out of bounds" in text or isinstance(exc, IndexError):
        return "does the model's output size match the number of classes?"
    if "size" in text or "shape" in text:
        return "does the model's output shape match the label's (label_col)?"
    if "dtype" in text or "type" in text:
        return "does the label's type suit this loss (class ids for cross entropy, floats for regression)?"
    return "check that the loss fits the model's output and the label column"


def _shape(value: Optional[Any]) -> str:
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"[{', '.join(map(str, value.shape))}]"
    return type(value).__name__


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__
