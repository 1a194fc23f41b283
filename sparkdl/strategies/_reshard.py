"""Strategy state on a new number of ranks (elastic resume): the averaging strategies' merge.

:meth:`StrategyRuntime.reshard_state <sparkdl.strategies.base.StrategyRuntime.reshard_state>`
maps the old ranks' (user state, strategy state) pairs to a new rank's. Here: the model a new
rank starts from when the replicas differ, as model averaging's next synchronization would have
made it.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import torch

#: The user-state key that holds the model's ``state_dict`` (``TorchEstimator``'s loop, and the
#: convention for custom loops that want their replicas averaged on an elastic resume).
MODEL_KEY = "model"


def average_states(states: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The mean of several ``state_dict``\\ s of one model: floating-point tensors averaged
    (in float64, cast back), every other entry (integer buffers, step counters) the first's."""
    out: Dict[str, Any] = {}
    for key, first in states[0].items():
        if isinstance(first, torch.Tensor) and (first.is_floating_point() or first.is_complex()):
            total = torch.zeros_like(first, dtype=torch.complex128 if first.is_complex() else torch.float64)
            for state in states:
                total += state[key].to(total.dtype)
            out[key] = (total / len(states)).to(first.dtype)
        else:
            out[key] = first
    return out


def averaged_reshard(
    old: Sequence[Tuple[Dict[str, Any], Dict[str, Any]]], rank: int
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Old rank ``rank % N``'s pair, its ``"model"`` replaced by the average of every old
    replica (optimizer state stays per rank, as between synchronizations)."""
    user, strategy = old[rank % len(old)]
    models = [pair[0].get(MODEL_KEY) for pair in old]
    if all(isinstance(model, dict) for model in models):
        user = {**user, MODEL_KEY: average_states(models)}
    return user, strategy
