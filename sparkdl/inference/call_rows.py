"""Executor side: how many rows one call of the model takes on a CPU (``optimize="auto"``).

A batch's rows are read, decoded and written together (``batch_size``), but a CPU may score
them faster in smaller calls: a convolution's activations for a whole batch overflow the
caches, and the model then runs at memory speed. A small CNN on 64x64 images, one thread:
about 370 µs an image in one call of 1,024, about 100 µs in calls of 32; an MLP's matrix
products gain nothing from smaller calls, and keep the whole batch. So on the first batch of
each model and input shape the worker times the model on a sample of the batch in one call
and in calls of each of :data:`_CANDIDATES` rows, and keeps the fastest when it takes at most
:data:`_FASTER` of the one call's time *and* gives the same outputs (a model whose rows
depend on each other, e.g. a batch statistic in ``forward``, keeps whole calls).

The timing costs a few calls on at most :data:`_SAMPLE_ROWS` rows; a model so slow that they
would take more than :data:`_BUDGET_SECONDS` is not tuned (its own compute dwarfs any cache
effect worth the wait).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

import torch

from sparkdl.data.batching import batch_rows, call_model, slice_rows
from sparkdl.inference.outputs import same_outputs

#: Rows per call tried against one call on the whole sample.
_CANDIDATES = (64, 32, 16)
#: The most rows the timing runs on.
_SAMPLE_ROWS = 128
#: Smaller calls must take at most this share of the one call's time to be used.
_FASTER = 0.8
#: The most the timing may take, estimated from a first call, in seconds.
_BUDGET_SECONDS = 2.0
#: Timed calls per candidate (and for the one call), after one untimed.
_REPEATS = 3


def fastest_call_rows(model: Callable[..., Any], inputs: Any) -> Optional[int]:
    """The rows per call under which ``model`` scores rows of ``inputs`` fastest, or None for
    whole batches (see the module docstring)."""
    rows = min(batch_rows(inputs), _SAMPLE_ROWS)
    candidates = [size for size in _CANDIDATES if size <= rows // 2]
    if not candidates:
        return None
    sample = slice_rows(inputs, 0, rows)
    with torch.inference_mode():
        expected = call_model(model, sample)  # untimed: a first call pays for one-off set-ups
        started = time.perf_counter()
        call_model(model, sample)
        one_call = time.perf_counter() - started
        if one_call * (1 + _REPEATS) * (1 + len(candidates)) > _BUDGET_SECONDS:
            return None
        calls = {0: lambda: call_model(model, sample)}
        calls.update({size: lambda size=size: _chunked(model, sample, size) for size in candidates})
        timed = _best_seconds(calls)
        whole = timed.pop(0)
        best = min(timed, key=timed.__getitem__)
        if timed[best] > _FASTER * whole or not same_outputs(expected, _chunked(model, sample, best)):
            return None
    return best


def chunked_call(model: Callable[..., Any], inputs: Any, call_rows: Optional[int]) -> Any:
    """``model`` on ``inputs`` in calls of at most ``call_rows`` rows, its outputs joined back
    (the structure of one call's: a tensor, or a dict / sequence of tensors for several heads)."""
    rows = batch_rows(inputs)
    if call_rows is None or rows <= call_rows:
        return call_model(model, inputs)
    return _chunked(model, inputs, call_rows)


def _chunked(model: Callable[..., Any], inputs: Any, size: int) -> Any:
    parts = [call_model(model, slice_rows(inputs, start, start + size)) for start in range(0, batch_rows(inputs), size)]
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, dict):
        return {name: torch.cat([part[name] for part in parts]) for name in first}
    return type(first)(torch.cat([part[i] for part in parts]) for i in range(len(first)))


def _best_seconds(calls: Dict[int, Callable[[], Any]]) -> Dict[int, float]:
    """Each call's best time of :data:`_REPEATS` rounds after an untimed one, the calls taking
    turns in each round: a burst of load from elsewhere on the machine slows one round of all
    of them rather than every round of one."""
    for call in calls.values():
        call()
    best = {key: float("inf") for key in calls}
    for _ in range(_REPEATS):
        for key, call in calls.items():
            started = time.perf_counter()
            call()
            best[key] = min(best[key], time.perf_counter() - started)
    return best
