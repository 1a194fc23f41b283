"""Tensor helpers that every strategy shares: flat buffers per (device, dtype), the initial
broadcast, and the optimizer wrapper through which a strategy acts at each step.

A synchronization sends one flat buffer per (device, dtype) group, so it is one collective per
dtype (usually exactly one), whatever the number of tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "SyncingOptimizer",
    "broadcast_from_rank0",
    "by_device_and_dtype",
    "flatten",
    "model_tensors",
    "nbytes",
    "unflatten_into",
]


def model_tensors(module: torch.nn.Module, floating_only: bool) -> List[torch.Tensor]:
    """Parameters then buffers, in registration order, which is the same on every rank."""
    tensors = [p for p in module.parameters()]
    # Integer buffers (BatchNorm's num_batches_tracked) count steps, which every rank takes
    # equally; averaging them would be meaningless, so only the initial broadcast sends them.
    tensors += [b for b in module.buffers() if not floating_only or b.is_floating_point() or b.is_complex()]
    return tensors


def by_device_and_dtype(tensors: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """Groups in first-seen order: one flat buffer, so one collective, per group."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


def flatten(tensors: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(flat: torch.Tensor, tensors: List[torch.Tensor]) -> None:
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        tensor.detach().copy_(flat[offset : offset + count].view(tensor.shape))
        offset += count


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def broadcast_from_rank0(module: torch.nn.Module) -> int:
    """Overwrites the module's parameters and buffers with rank 0's, one broadcast per
    (device, dtype); returns the bytes this rank sent (only the root puts bytes on the wire)."""
    sent = 0
    with torch.no_grad():
        for group in by_device_and_dtype(model_tensors(module, floating_only=False)):
            flat = flatten(group)
            dist.broadcast(flat, src=0)
            if dist.get_rank() == 0:
                sent += nbytes(flat)
            unflatten_into(flat, group)
    return sent


class SyncingOptimizer(torch.optim.Optimizer):
    """Runs the wrapped optimizer's ``step()``, then the strategy's ``after_step`` callback.

    Everything else is the wrapped optimizer's: ``param_groups`` is the same list (LR schedulers
    change the real learning rate), ``state``, ``defaults``, ``state_dict`` and hooks registered
    through the wrapper (they run inside the wrapped step, so post-step hooks see the parameters
    before a synchronization). It subclasses ``Optimizer`` because LR schedulers and
    ``GradScaler`` check ``isinstance(optimizer, torch.optim.Optimizer)``.
    """

    # GradScaler.step would otherwise hand grad_scale/found_inf to this wrapper (not the fused
    # optimizer inside), which would then step on scaled gradients; unscale-then-step instead.
    _step_supports_amp_scaling = False

    def __init__(self, optimizer: torch.optim.Optimizer, after_step: Callable[[], None]) -> None:
        # Optimizer.__init__ is deliberately not called: the wrapper owns no parameters and no
        # state of its own; every missing attribute is looked up on the wrapped optimizer.
        self.__dict__["optimizer"] = optimizer
        self.__dict__["_after_step"] = after_step

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        loss = self.optimizer.step(*args, **kwargs)
        self._after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the wrapper lacks (hook registries, optimizer-specific
        # fields, flags such as _step_supports_amp_scaling).
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __getstate__(self) -> Dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"
