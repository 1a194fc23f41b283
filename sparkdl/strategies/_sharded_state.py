"""State of a ``fully_shard``-ed model as plain tensors: each rank's shards for checkpoints, and
the full module gathered at the end (:mod:`sparkdl.strategies.sharded`).

Checkpoint parts are read back with ``torch.load(weights_only=True)``, which cannot rebuild a
``DTensor``; so a part holds each shard's local tensor, and loading copies it into the live
``DTensor`` that the same rank of the same world size holds (its mesh and placement are the
ones it was saved from).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from sparkdl.errors import ConfigError

FORMAT = "sparkdl-sharded-1"


def _local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.to_local() if isinstance(value, DTensor) else value


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int) -> Dict[str, Any]:
    """This rank's shards of the parameters (and its buffers) and of the optimizer state, as
    plain tensors (views: the checkpoint's capture copies them)."""
    model_state = {name: _local(value) for name, value in model.state_dict().items()}
    from torch.distributed.tensor import DTensor

    optimizer_state = optimizer.state_dict()
    # Which optimizer-state tensors are shards (Adam's moments), not plain (Adam's step).
    sharded = [
        [index, key]
        for index, entry in optimizer_state["state"].items()
        for key, value in entry.items()
        if isinstance(value, DTensor)
    ]
    state = {
        index: {key: _local(value) for key, value in entry.items()} for index, entry in optimizer_state["state"].items()
    }
    return {
        "model": model_state,
        "optimizer": {"state": state, "param_groups": optimizer_state["param_groups"]},
        "sharded": {"format": FORMAT, "rank": rank, "world_size": world_size, "optimizer_shards": sharded},
    }


def load_local_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: Dict[str, Any], rank: int, world_size: int
) -> None:
    """Copies what :func:`local_state` saved on this rank back into the sharded model and
    optimizer. ConfigError when it was saved by another world size or is not sharded state."""
    meta = saved.get("sharded")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ConfigError(
            f"rank {rank}: the checkpoint holds no ShardedDataParallel state (it was written by another strategy); "
            f"resume with the strategy that wrote it or use a new checkpoint_dir"
        )
    if meta["world_size"] != world_size or meta["rank"] != rank:
        raise ConfigError(
            f"rank {rank}: the ShardedDataParallel checkpoint holds the shards of {meta['world_size']} workers but this "
            f"run has num_workers={world_size}; sharded checkpoints resume on the same num_workers only "
            f"(use num_workers={meta['world_size']} or a new checkpoint_dir)"
        )
    live = model.state_dict()
    if sorted(live) != sorted(saved["model"]):
        missing, extra = sorted(set(live) - set(saved["model"])), sorted(set(saved["model"]) - set(live))
        raise ConfigError(
            f"rank {rank}: the checkpoint's model does not match this model: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    with torch.no_grad():
        for name, target in live.items():
            _copy_into(target, saved["model"][name], f"model {name!r}", rank)
    # A fresh optimizer has no state yet: build it as DTensors shaped like the live parameters,
    # then let load_state_dict cast them (and the param_groups) as it always does.
    params: List[torch.nn.Parameter] = [p for group in optimizer.param_groups for p in group["params"]]
    shards = {(index, key) for index, key in meta.get("optimizer_shards", [])}
    state: Dict[Any, Dict[str, Any]] = {}
    for index, entry in saved["optimizer"]["state"].items():
        param = params[int(index)]
        state[index] = {
            key: _like(param, value, f"optimizer state {key!r} of parameter {index}", rank)
            if (index, key) in shards
            else value
            for key, value in entry.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": saved["optimizer"]["param_groups"]})


def _like(param: torch.Tensor, value: torch.Tensor, what: str, rank: int) -> torch.Tensor:
    """``value`` (a saved local shard) as a DTensor sharded like ``param``."""
    from torch.distributed.tensor import DTensor

    local = _local(param)
    if not isinstance(param, DTensor) or tuple(value.shape) != tuple(local.shape):
        raise ConfigError(
            f"rank {rank}: the checkpoint's {what} has shape {tuple(value.shape)}, this rank's shard {tuple(local.shape)}"
        )
    return DTensor.from_local(
        value.to(param.device),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _copy_into(target: torch.Tensor, value: torch.Tensor, what: str, rank: int) -> None:
    local = _local(target)
    if tuple(local.shape) != tuple(value.shape):
        raise ConfigError(
            f"rank {rank}: the checkpoint's {what} shard has shape {tuple(value.shape)}, this model's {tuple(local.shape)}"
        )
    local.copy_(value)


def gather_full(model: torch.nn.Module, skeleton: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``skeleton`` (the user's module on ``meta``) filled with the full parameters all-gathered
    from ``model``'s shards and rank 0's buffers. Collective: every rank calls it and gets the
    same module."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    live = dict(model.named_parameters())
    full: Dict[int, torch.nn.Parameter] = {}
    for name, meta in skeleton.named_parameters():
        value = live[name]
        with torch.no_grad():
            tensor = value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
        full[id(meta)] = torch.nn.Parameter(tensor.to(device), requires_grad=meta.requires_grad)
    buffers = dict(model.named_buffers())
    filled: Dict[int, torch.Tensor] = {}
    for name, meta in skeleton.named_buffers():
        tensor = buffers[name].detach().clone()
        dist.broadcast(tensor, src=0)  # each rank's running statistics saw its own batches
        filled[id(meta)] = tensor
    # Module by module, so tied parameters stay tied (same meta tensor, same full one).
    for sub in skeleton.modules():
        for key, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[key] = full[id(param)]
        for key, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[key] = filled[id(buffer)]
    return skeleton
