"""Fully sharded data parallelism (FSDP2 ``fully_shard``): parameters, gradients and optimizer
state split across ranks.

Each rank keeps 1/N of every parameter (a ``DTensor`` shard on dim 0), of its gradient and of
the optimizer state built over those shards. A shard unit's full parameters exist only while it
runs: they are all-gathered before its forward (and again before its backward when
``reshard_after_forward``), and its gradients are reduce-scattered straight into the shards.

Checkpoints hold each rank's own shards as plain CPU tensors (``torch.load(weights_only=True)``
reads them back), so a resume needs the same number of workers. The result is gathered once, at
the end: ``final_module`` all-gathers every parameter into an unsharded copy of the user's module
(built at ``prepare_model`` on the ``meta`` device, so it costs no memory until then).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from sparkdl.errors import ConfigError
from sparkdl.strategies.base import Strategy, StrategyRuntime

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl.strategies.base import DistEnv

#: Containers with no forward of their own: FSDP's hooks never run on them, so they are never
#: shard units themselves (their children can be).
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.ParameterList, torch.nn.ParameterDict)


@dataclasses.dataclass(frozen=True)
class ShardedDataParallel(Strategy):
    """FSDP2: every rank holds 1/N of the parameters, gradients and optimizer state.

    Args:
        reshard_after_forward: free each unit's gathered parameters after its forward and gather
            them again for its backward (less memory, one more all-gather per unit per step).
            False keeps them from forward to backward (ZeRO-2-like: faster, more memory).
        shard_modules: which submodules become their own shard unit (gathered and freed on
            their own), by qualified name (``"encoder.layers.0"``) or class name
            (``"TransformerBlock"``); the root module is always a unit and takes every parameter
            left over. None: the automatic policy, see ``min_params``.
        min_params: for ``shard_modules=None``: walking the module tree bottom-up, a submodule
            becomes a unit once the parameters under it not yet in a unit number at least this
            many (containers such as ``ModuleList`` never do; their children may).
    """

    name = "sharded"
    cost_model = "sharded"
    #: On fewer workers, accumulate to the planned global batch (docs/recovery.md).
    on_resize_choices = ("keep_global_batch", "scale_lr", "none")

    reshard_after_forward: bool = True
    shard_modules: Optional[Tuple[str, ...]] = None
    min_params: int = 1_000_000

    def __post_init__(self) -> None:
        if not isinstance(self.reshard_after_forward, bool):
            raise ConfigError(
                f"ShardedDataParallel.reshard_after_forward={self.reshard_after_forward!r} must be True or False"
            )
        if self.shard_modules is not None:
            names = (self.shard_modules,) if isinstance(self.shard_modules, str) else self.shard_modules
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
                raise ConfigError(
                    f"ShardedDataParallel.shard_modules={self.shard_modules!r} must be None or a sequence of submodule "
                    f"names or class names (non-empty strings)"
                )
            object.__setattr__(self, "shard_modules", tuple(names))
        if not isinstance(self.min_params, int) or isinstance(self.min_params, bool) or self.min_params < 1:
            raise ConfigError(f"ShardedDataParallel.min_params={self.min_params!r} must be a positive integer")

    def create_runtime(self, env: "DistEnv") -> "StrategyRuntime":
        return _ShardedRuntime(self, env)

    def check_model(self, module: torch.nn.Module) -> None:
        """On the driver, before launch: what every rank's ``prepare_model`` would refuse the same
        way (no parameters, sparse embeddings, a ``shard_modules`` entry naming no submodule)."""
        check_shardable(module, self)
        shard_units(module, self)


def check_shardable(module: torch.nn.Module, config: ShardedDataParallel) -> None:
    """Raises ConfigError for a model ``fully_shard`` cannot take as it is."""
    params = list(module.parameters())
    if not params:
        raise ConfigError(
            f"ShardedDataParallel needs a model with parameters; {type(module).__name__} has none (use AllReduce)"
        )
    sparse = [
        name
        for name, sub in module.named_modules()
        if getattr(sub, "sparse", False) and isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag))
    ]
    if sparse:
        raise ConfigError(
            f"ShardedDataParallel cannot shard sparse gradients, but {', '.join(map(repr, sparse[:5]))} of "
            f"{type(module).__name__} use sparse=True; build them with sparse=False or use AllReduce"
        )


def shard_units(module: torch.nn.Module, config: ShardedDataParallel) -> List[Tuple[str, torch.nn.Module]]:
    """The submodules (name, module) that get their own ``fully_shard``, children before parents
    (FSDP's order), not counting the root. Raises ConfigError for a ``shard_modules`` entry that
    matches no submodule."""
    named = [(name, sub) for name, sub in module.named_modules() if name]
    if config.shard_modules is not None:
        chosen: List[Tuple[str, torch.nn.Module]] = []
        for entry in config.shard_modules:
            found = [(n, m) for n, m in named if entry in (n, type(m).__name__)]
            if not found:
                available = (
                    ", ".join(sorted({n for n, _ in named} | {type(m).__name__ for _, m in named})[:20]) or "none"
                )
                raise ConfigError(
                    f"ShardedDataParallel.shard_modules entry {entry!r} names no submodule of {type(module).__name__} "
                    f"(by qualified name or class name); available: {available}"
                )
            chosen.extend(item for item in found if item not in chosen)
        for n, m in chosen:
            if isinstance(m, _CONTAINERS):
                raise ConfigError(
                    f"ShardedDataParallel.shard_modules entry {n!r} is a {type(m).__name__}, which has no forward of its "
                    f"own, so FSDP cannot gather its parameters; name its children instead"
                )
        # Deepest first: FSDP shards a child before the parent that contains it.
        return sorted(chosen, key=lambda item: -item[0].count("."))
    units: List[Tuple[str, torch.nn.Module]] = []
    seen: Set[int] = set()

    def visit(name: str, sub: torch.nn.Module) -> int:
        pending = 0
        for child_name, child in sub.named_children():
            pending += visit(f"{name}.{child_name}" if name else child_name, child)
        for param in sub.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                pending += param.numel()
        if name and pending >= config.min_params and not isinstance(sub, _CONTAINERS):
            units.append((name, sub))
            return 0
        return pending

    visit("", module)
    return units


def _meta_skeleton(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose parameters and buffers sit on the ``meta`` device: the same
    classes and tying, no memory. (``deepcopy`` with the tensors pre-mapped in its memo.)"""
    memo: Dict[int, Any] = {}
    for param in module.parameters():
        memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
    for buffer in module.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(module, memo)


class _ShardedRuntime(StrategyRuntime):
    # Each rank holds different shards: checkpoints keep every rank's part.
    replicas_identical = False

    def __init__(self, config: ShardedDataParallel, env: "DistEnv") -> None:
        super().__init__(env)
        self.config = config
        self._skeleton: Optional[torch.nn.Module] = None
        self._step_bytes = 0
        self._final: Optional[torch.nn.Module] = None

    def _fail(self, message: str) -> ConfigError:
        return ConfigError(f"rank {self.env.rank}: {message}")

    def prepare_model(self, module: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        try:
            check_shardable(module, self.config)
        except ConfigError as exc:
            raise self._fail(str(exc)) from None
        params = list(module.parameters())
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in params):
            raise self._fail(
                f"{type(module).__name__} is sharded already (its parameters are DTensors: fully_shard or another "
                f"parallel API ran on it); return the plain module from model() and let ShardedDataParallel shard it"
            )
        devices = sorted({str(t.device) for t in params} | {str(t.device) for t in module.buffers()})
        if len(devices) > 1:
            raise self._fail(
                f"ShardedDataParallel shards one device's parameters, but {type(module).__name__} has parameters or "
                f"buffers on {', '.join(devices)}; keep the whole model on one device (the task's {self.env.device})"
            )
        try:
            units = shard_units(module, self.config)
        except ConfigError as exc:
            raise self._fail(str(exc)) from None
        # Like DDP: every rank starts from rank 0's weights, even in a loop that does not seed.
        with torch.no_grad():
            for tensor in [*params, *module.buffers()]:
                dist.broadcast(tensor, src=0)
        self._skeleton = _meta_skeleton(module)
        mesh = init_device_mesh(self.env.device.type, (self.env.world_size,))
        what = "the root module"
        try:
            for name, unit in units:
                what = f"submodule {name!r} ({type(unit).__name__})"
                fully_shard(unit, mesh=mesh, reshard_after_forward=self.config.reshard_after_forward)
            what = f"the root module ({type(module).__name__})"
            fully_shard(module, mesh=mesh, reshard_after_forward=self.config.reshard_after_forward)
        except Exception as exc:  # noqa: BLE001 - re-raised with the setting to change
            setting = "shard_modules" if self.config.shard_modules is not None else "min_params (or name shard_modules)"
            raise self._fail(
                f"FSDP's fully_shard rejected {what}: {type(exc).__name__}: {exc}; change ShardedDataParallel.{setting} "
                f"so that this module is not a shard unit, or fix the model"
            ) from exc
        self._step_bytes = self._bytes_per_step(module, units)
        return module

    @contextlib.contextmanager
    def gradient_sync(self, model: torch.nn.Module, enabled: bool) -> Iterator[None]:
        # FSDP2's counterpart of DDP's no_sync(): the backward keeps the unsharded gradients
        # and skips the reduce-scatter until a backward with the sync back on.
        if enabled or not hasattr(model, "set_requires_gradient_sync"):
            yield
            return
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def _bytes_per_step(self, root: torch.nn.Module, units: Sequence[Tuple[str, torch.nn.Module]]) -> int:
        """Bytes this rank sends in one training step's collectives: each unit is all-gathered
        for its forward, again for its backward when resharded after forward (the root never
        is: FSDP keeps it), and its gradients reduce-scattered; in each a rank sends the
        (n-1)/n of the unit's full bytes the others hold (nothing on a lone rank)."""
        done: Set[int] = set()
        total = 0
        for _, unit in [*units, ("", root)]:
            size = 0
            for param in unit.parameters():
                if id(param) not in done:
                    done.add(id(param))
                    size += param.numel() * param.element_size()
            gathers = 2 if self.config.reshard_after_forward and unit is not root else 1
            total += size * (gathers + 1)
        world_size = self.env.world_size
        return total * (world_size - 1) // world_size

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer.register_step_post_hook(self._count_step)
        return optimizer

    def _count_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.comm_bytes += self._step_bytes

    def model_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        from sparkdl.strategies._sharded_state import local_state

        return local_state(model, optimizer, self.env.rank, self.env.world_size)

    def load_model_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
        from sparkdl.strategies._sharded_state import load_local_state

        load_local_state(model, optimizer, state, self.env.rank, self.env.world_size)

    def reshard_state(
        self, old: Sequence[Tuple[Dict[str, Any], Dict[str, Any]]], old_world_size: int
    ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        # Elastic resume re-lays out other strategies' state; FSDP shards are bound to their
        # world size here (each part holds one rank's dim-0 slices, padded for that world size).
        raise self._fail(
            f"ShardedDataParallel checkpoints resume on the same num_workers only: the checkpoint was written by "
            f"{old_world_size} workers and this run has num_workers={self.env.world_size}; use "
            f"num_workers={old_world_size} or a new checkpoint_dir"
        )

    def evaluation_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """A plain full copy of the model now (collective, every rank): its forward passes run no
        collectives, so ranks may evaluate different numbers of batches on it (a sharded
        forward all-gathers, and would block on a rank that has stopped)."""
        if self._skeleton is None:
            raise RuntimeError("evaluation_module before prepare_model")
        from sparkdl.strategies._sharded_state import gather_full

        return gather_full(model, copy.deepcopy(self._skeleton), self.env.device)

    def final_module(self, model: torch.nn.Module) -> torch.nn.Module:
        if self._final is None:
            self._final = self.evaluation_module(model)
        return self._final
