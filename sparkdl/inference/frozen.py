"""Executor side: the model as a frozen, inference-optimized graph, used instead of the eager
module where it computes the same outputs faster (``optimize="auto"``, the default).

``torch.jit.freeze`` + ``optimize_for_inference`` turn the weights into constants, fold batch
norms into convolutions, fuse convolution and ReLU, and prepack the weights in oneDNN's layout:
on one CPU thread a small CNN scores 64×64 images 2.3× as fast, with outputs within 1e-7 of the
eager module's; an MLP gains nothing (its matrix products are already all there is). Spark's
``predict_batch_udf`` and hand-written UDFs run the module as it is.

A trace records one path through ``forward``, so a model whose Python branches on its data would
be traced wrongly. The graph is used only when all of these hold, else the eager module (the
reason logged once per worker and model):

1. tracing raises no ``TracerWarning`` (torch warns whenever a tensor's value steers Python: a
   branch, a loop count, ``.item()``) and no error;
2. on the task's first batch, and on a slice of it of another size (a shape baked into the trace
   shows there), its outputs equal the eager module's (``allclose``, rtol 1e-4, atol 1e-5);
3. it is faster: at most :data:`_FASTER` of the eager time on that batch.

Only on a CPU and without autocast (``precision``): a GPU keeps the eager module (not measured
here yet). torch 2.13 marks ``torch.jit`` deprecated in favour of ``torch.compile``, whose
compilation takes tens of seconds per worker; where a later torch lacks these functions, the
eager module runs. The decision is made once per Python worker, model and input shape, and kept
with the model (:mod:`sparkdl.inference.model_cache`).
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from sparkdl.data.batching import batch_rows, call_model, slice_rows
from sparkdl.inference.call_rows import fastest_call_rows
from sparkdl.inference.outputs import same_outputs

logger = logging.getLogger("sparkdl.inference")

#: Rows of the first batch the checks run on: enough to time the model, little enough that the
#: checks cost a fraction of a second.
_CHECK_ROWS = 64
#: The graph must take at most this share of the eager module's time to be used.
_FASTER = 0.8

#: (model key, device, input signature) -> the graph, or None for the eager module.
_decisions: Dict[Tuple[str, str, Tuple], Optional[torch.nn.Module]] = {}
#: The same slots -> the rows per call that model scores fastest in (None: whole batches).
_call_rows: Dict[Tuple[str, str, Tuple], Optional[int]] = {}


def model_for(module: torch.nn.Module, key: str, device: torch.device, inputs: Any) -> Callable[[Any], Any]:
    """What to call on ``inputs`` (tensors on ``device``): the frozen graph when it passes the
    checks in the module docstring for this worker, model and input shape, else ``module``."""
    slot = (key, str(device), _signature(inputs))
    if slot not in _decisions:
        graph, reason = _checked_graph(module, inputs)
        if graph is None and reason is None:
            return module  # nothing to decide on in this batch: the next one decides
        if graph is None:
            logger.info("scoring with the eager module: %s", reason)
        _decisions[slot] = graph
        _call_rows[slot] = fastest_call_rows(graph or module, inputs)
        if _call_rows[slot] is not None:
            logger.info("scoring in calls of %d rows: faster than whole batches", _call_rows[slot])
    return _decisions[slot] or module


def call_rows_for(key: str, device: torch.device, inputs: Any) -> Optional[int]:
    """The rows per call decided with :func:`model_for`'s model for these inputs (None: whole
    batches, or not decided yet): :mod:`sparkdl.inference.call_rows`."""
    return _call_rows.get((key, str(device), _signature(inputs)))


def forget(keep: Callable[[str, str], bool]) -> None:
    """Drops the decisions of models the worker's cache no longer holds (``keep(key, device)``)."""
    for slot in [slot for slot in _decisions if not keep(slot[0], slot[1])]:
        del _decisions[slot]
        _call_rows.pop(slot, None)


def _signature(inputs: Any) -> Tuple:
    """The inputs' names, dtypes and shapes after the batch dimension."""
    named = inputs.items() if isinstance(inputs, dict) else [("", inputs)]
    return tuple((name, str(t.dtype), tuple(t.shape[1:])) for name, t in named)


def _checked_graph(module: torch.nn.Module, inputs: Any) -> Tuple[Optional[torch.nn.Module], Optional[str]]:
    """``(graph, None)`` when the graph passes every check, ``(None, why not)`` when it fails
    one, ``(None, None)`` when these rows cannot tell (one row; rows the module itself rejects)."""
    rows = batch_rows(inputs)
    if rows < 2:
        return None, None
    sample = slice_rows(inputs, 0, min(rows, _CHECK_ROWS))
    other = slice_rows(inputs, 0, batch_rows(sample) // 2 + 1)
    with torch.inference_mode():
        try:
            expected = [call_model(module, piece) for piece in (sample, other)]
        except Exception:  # noqa: BLE001 - a bad row: the runner bisects it; a later batch decides
            return None, None
    try:
        graph = _frozen(module, sample)
    except Exception as exc:  # noqa: BLE001 - any model torch cannot trace or freeze stays eager
        return None, f"torch could not trace it ({type(exc).__name__}: {str(exc).strip()[:200]})"
    if graph is None:
        return None, "its forward depends on its data in Python (torch's tracer warned)"
    with torch.inference_mode():
        for piece, want in zip((sample, other), expected):
            try:
                same = same_outputs(want, call_model(graph, piece))
            except Exception as exc:  # noqa: BLE001 - rows the module scores must score in the graph
                return None, f"the traced graph fails on {batch_rows(piece)} rows ({type(exc).__name__})"
            if not same:
                return None, f"the traced graph's outputs differ from the module's on {batch_rows(piece)} rows"
        eager, frozen = _seconds(module, sample), _seconds(graph, sample)
    if frozen > _FASTER * eager:
        return None, f"the graph is not faster ({frozen * 1e3:.1f} ms against {eager * 1e3:.1f} ms)"
    logger.info("scoring with a frozen graph of the model: %.1f ms against %.1f ms eager", frozen * 1e3, eager * 1e3)
    return graph, None


def _frozen(module: torch.nn.Module, sample: Any) -> Optional[torch.nn.Module]:
    """The traced, frozen, optimized module; None when tracing warned that it depends on data."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        # strict=False admits dict and list outputs (several heads); _same checks their structure.
        if isinstance(sample, dict):
            traced = torch.jit.trace(module, example_kwarg_inputs=sample, check_trace=False, strict=False)
        else:
            traced = torch.jit.trace(module, sample, check_trace=False, strict=False)
        if any(issubclass(w.category, torch.jit.TracerWarning) for w in caught):
            return None
        return torch.jit.optimize_for_inference(torch.jit.freeze(traced))


def _seconds(model: Callable[..., Any], inputs: Any) -> float:
    """The best of two timed calls after two untimed ones (TorchScript's profiling executor
    optimizes a graph on its first calls)."""
    for _ in range(2):
        call_model(model, inputs)
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        call_model(model, inputs)
        best = min(best, time.perf_counter() - started)
    return best
