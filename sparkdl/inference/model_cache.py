"""Executor side: the models a Python worker has built, kept for the worker's later tasks.

Spark reuses a Python worker for the tasks it runs one after another
(``spark.python.worker.reuse``, on by default), so a model built by one task can serve the
next: a transform over 200 partitions on 8 workers builds it 8 times, not 200. A model is kept
by its key (:attr:`~sparkdl.inference.model_source.ModelRef.key`: the hash of its factory and
weights) and device, so other weights are never served from the cache; least recently used
models go first once their parameters exceed the budget (``SPARKDL_INFERENCE_CACHE_MB`` in the
executors' environment, default 2048; the model in use is always kept).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable, Tuple

import torch

from sparkdl.inference import frozen

_DEFAULT_BUDGET_MB = 2048

_models: "OrderedDict[Tuple[str, str], Tuple[torch.nn.Module, int]]" = OrderedDict()


def cached_model(key: str, device: torch.device, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The model for ``key`` on ``device``: from this worker's cache, else built (``build``),
    moved to ``device`` and kept."""
    slot = (key, str(device))
    found = _models.get(slot)
    if found is not None:
        _models.move_to_end(slot)
        return found[0]
    module = build().to(device)
    size = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    _models[slot] = (module, size)
    _evict(budget_bytes())
    frozen.forget(lambda key, device: (key, device) in _models)  # their graphs go with them
    return module


def budget_bytes() -> int:
    """The cache's budget for parameters and buffers, in bytes."""
    text = os.environ.get("SPARKDL_INFERENCE_CACHE_MB", "")
    try:
        megabytes = float(text) if text else _DEFAULT_BUDGET_MB
    except ValueError:
        megabytes = _DEFAULT_BUDGET_MB
    return int(max(0.0, megabytes) * 2**20)


def cached_keys() -> Tuple[Tuple[str, str], ...]:
    """(key, device) of the models kept, least recently used first."""
    return tuple(_models)


def _evict(budget: int) -> None:
    # The newest entry is the model about to run: it stays even when it alone exceeds the budget.
    while len(_models) > 1 and sum(size for _, size in _models.values()) > budget:
        _models.popitem(last=False)
