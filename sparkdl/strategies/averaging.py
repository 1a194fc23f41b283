"""Model averaging: each rank trains its replica alone for a while, then the replicas are merged.

Two strategies share one mechanism:

* :class:`ModelAveraging` — local SGD / SparkNet-style consolidation (Moritz et al., ICLR 2016;
  post-local SGD warm-up from Lin et al., ICLR 2020): every ``sync_every`` local optimizer steps
  the ranks replace their parameters by the mean over ranks and carry on from there. With an
  ``outer_optimizer`` it is DiLoCo (Douillard et al., 2023; :mod:`sparkdl.strategies._outer`).
* :class:`ElasticAveraging` — synchronous EASGD (Zhang et al., NeurIPS 2015): every rank keeps an
  identical copy of a *center* variable; every ``sync_every`` steps each replica is pulled toward
  the center and the center toward the replicas, both from one allreduce.

Both act when the optimizer steps: ``prepare_optimizer`` returns a thin wrapper whose ``step()``
runs the real step and then, every so often, synchronizes. The model itself is not wrapped, so a
custom loop in ``sparkdl.run`` works unchanged. Tensors travel as one flat buffer per
(device, dtype) so a synchronization is one collective per dtype (usually exactly one).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from sparkdl.errors import ConfigError
from sparkdl.strategies._outer import OuterOptimizerFactory, OuterStep, check_outer_optimizer, factory_name
from sparkdl.strategies._tensors import (
    SyncingOptimizer,
    broadcast_from_rank0,
    by_device_and_dtype,
    flatten,
    model_tensors,
    nbytes,
    unflatten_into,
)
from sparkdl.strategies.base import Strategy, StrategyRuntime, allreduce_bytes_sent, broadcast_bytes_sent

if TYPE_CHECKING:  # pragma: no cover
    from sparkdl.strategies.base import DistEnv

#: EASGD's recommended moving rate of the center, β = p·α (Zhang et al. 2015, section 5).
DEFAULT_EASGD_BETA = 0.9


def _check_int(owner: str, field: str, value: Any, minimum: int, meaning: str) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"{owner}.{field}={value!r} must be {kind} ({meaning})")


#: Why the averaging strategies take only on_resize="none" (docs/recovery.md).
_AVERAGING_RESIZE = (
    "each replica steps on its own batch_size rows with its own learning rate, and a resize changes only how "
    "many replicas are averaged, so there is no global batch to keep and no batch growth for the linear "
    "scaling rule to follow (DiLoCo's outer learning rate does not scale with the replicas either)"
)


@dataclasses.dataclass(frozen=True)
class ModelAveraging(Strategy):
    """Local SGD: ranks train independently and average their parameters every ``sync_every`` steps.

    Nothing is exchanged while a rank computes gradients; after every ``sync_every``-th call of
    the prepared optimizer's ``step()``, all ranks average their parameters and floating-point
    buffers (e.g. BatchNorm running statistics) with one allreduce and continue from the average.
    At ``prepare_model`` rank 0's parameters and buffers are broadcast, so every replica starts
    identical even when a custom loop does not seed. ``final_module`` averages once more if steps
    were taken since the last average, so the returned model is the average on every rank.

    Optimizer state (momentum, Adam's moment estimates) stays local and is *not* averaged or
    reset, like ``torch.distributed.optim.PostLocalSGDOptimizer``. Right after an average the
    replicas are equal and close to where each rank's state was accumulated, so the local
    statistics remain a good description of the local gradient stream; averaging them would
    multiply the traffic (Adam keeps two extra tensors per parameter), and resetting them would
    restart Adam's bias correction and discard momentum every ``sync_every`` steps. Consequently
    ``optimizer.state_dict()`` differs between ranks; only the parameters are kept in sync.

    ``sync_every`` counts ``step()`` calls on every optimizer prepared on the rank; every rank
    must make the same number of calls (a ``GradScaler`` that skips ``step()`` on one rank only
    would desynchronize the ranks' collectives).

    Args:
        sync_every: local optimizer steps between averages (τ). 1 averages after every step (for
            SGD without momentum that is synchronous data parallelism); larger values cut
            communication by that factor at some cost in statistical efficiency.
        warmup_steps: the first ``warmup_steps`` steps average after every step (post-local SGD:
            synchronous training while the loss drops fast, local steps afterwards); averaging
            then happens after steps ``warmup_steps + k * sync_every``. With an outer optimizer
            the warm-up averages are plain averages (the global copy follows them, the outer
            optimizer does not step), so DiLoCo starts from a warmed-up model, as in the paper.
        outer_optimizer: None for plain averaging, or DiLoCo's outer optimizer: a function
            ``params -> torch.optim.Optimizer`` (it must pickle: a lambda is fine, or
            :class:`~sparkdl.OuterSGD`; a dict of ``OuterSGD`` fields becomes one). Each rank
            keeps a global copy of the parameters (identical on every rank, starting from the
            broadcast weights); at every synchronization after the warm-up, ``global -
            average`` is the gradient of one outer step on it, and every replica continues from
            the new global copy. Floating-point buffers are plainly averaged. Outer SGD with lr 1
            and no momentum is plain averaging. The traffic is the same as plain averaging's.

    Example::

        model = sparkdl.TorchEstimator(model=make_net, strategy=sparkdl.ModelAveraging(sync_every=8)).fit(df)
        diloco = sparkdl.ModelAveraging(sync_every=64, outer_optimizer=sparkdl.OuterSGD(lr=0.7, momentum=0.9, nesterov=True))
    """

    name = "model_averaging"
    cost_model = "averaging"
    on_resize_choices = ("none",)
    on_resize_reason = _AVERAGING_RESIZE
    identical_final_weights = True

    sync_every: int = 8
    warmup_steps: int = 0
    outer_optimizer: Optional[OuterOptimizerFactory] = None

    def __post_init__(self) -> None:
        _check_int("ModelAveraging", "sync_every", self.sync_every, 1, "local optimizer steps between averages, e.g. 8")
        _check_int(
            "ModelAveraging",
            "warmup_steps",
            self.warmup_steps,
            0,
            "steps that average after every step first; 0 for none",
        )
        # A dict (what --strategy-arg outer_optimizer={...} parses to) becomes an OuterSGD.
        object.__setattr__(self, "outer_optimizer", check_outer_optimizer(self.outer_optimizer))

    def create_runtime(self, env: "DistEnv") -> StrategyRuntime:
        return _ModelAveragingRuntime(env, int(self.sync_every), int(self.warmup_steps), self.outer_optimizer)

    def describe(self) -> Dict[str, Any]:
        return {**super().describe(), "outer_optimizer": factory_name(self.outer_optimizer)}


@dataclasses.dataclass(frozen=True)
class ElasticAveraging(Strategy):
    """Elastic averaging SGD (EASGD), synchronous and decentralized.

    Every rank holds an identical copy of a center variable ``c``, initialized to the (broadcast)
    starting weights. After every ``sync_every``-th optimizer step, with ``d_i = x_i - c``::

        x_i <- x_i - alpha * d_i              (each replica is pulled toward the center)
        c   <- c + alpha * sum_i d_i          (the center moves toward the replicas)

    ``sum_i d_i`` comes from one allreduce, and every rank applies the same update to identical
    inputs, so the center copies stay bit-identical without a parameter server. The replicas
    stay apart (that is the point: exploration around the center), and the trained model
    ``final_module`` returns is the center, identical on every rank; one last elastic round runs
    first if steps were taken since the previous one. ``final_module`` writes the center into the
    module it is given.

    Floating-point buffers follow the same rule as parameters. Optimizer state stays local, as in
    the paper's momentum variant (EAMSGD) and for the reasons given in :class:`ModelAveraging`.

    Args:
        sync_every: local optimizer steps between elastic updates (τ, the paper's communication
            period).
        alpha: the elastic pull strength (moving rate). None picks ``0.9 / num_workers`` at run
            time, the paper's guidance of β = num_workers·alpha ≈ 0.9. The center update is only
            stable for ``alpha * num_workers < 1``, which is checked when training starts.
    """

    name = "elastic_averaging"
    cost_model = "elastic"
    on_resize_choices = ("none",)
    on_resize_reason = _AVERAGING_RESIZE
    identical_final_weights = True

    sync_every: int = 4
    alpha: Optional[float] = None

    def __post_init__(self) -> None:
        _check_int(
            "ElasticAveraging",
            "sync_every",
            self.sync_every,
            1,
            "local optimizer steps between elastic updates, e.g. 4",
        )
        if self.alpha is not None:
            ok = isinstance(self.alpha, numbers.Real) and not isinstance(self.alpha, bool) and math.isfinite(self.alpha)
            if not (ok and 0 < self.alpha < 1):
                raise ConfigError(
                    f"ElasticAveraging.alpha={self.alpha!r} must be None (which means "
                    f"{DEFAULT_EASGD_BETA} / num_workers) or a number with 0 < alpha < 1; "
                    f"alpha * num_workers must also stay below 1"
                )

    def create_runtime(self, env: "DistEnv") -> StrategyRuntime:
        return _ElasticAveragingRuntime(env, int(self.sync_every), self.resolved_alpha(env.world_size))

    def resolved_alpha(self, world_size: int) -> float:
        """The alpha used with ``world_size`` ranks.

        Raises:
            ConfigError: ``alpha * world_size >= 1``, for which the center update diverges.
        """
        alpha = DEFAULT_EASGD_BETA / world_size if self.alpha is None else float(self.alpha)
        if not alpha * world_size < 1:
            raise ConfigError(
                f"ElasticAveraging.alpha={self.alpha!r} is too large for {world_size} workers: the "
                f"center update c += alpha * sum_i(x_i - c) is only stable for alpha * num_workers < 1 "
                f"(here {alpha * world_size:.3g}); use alpha < {1 / world_size:.4g}, or alpha=None for "
                f"{DEFAULT_EASGD_BETA} / num_workers"
            )
        return alpha


# --------------------------------------------------------------------------------------------
# Task side
# --------------------------------------------------------------------------------------------


class _PeriodicSyncRuntime(StrategyRuntime):
    """Shared task side: initial broadcast, step counting, the wrapper, the final sync.

    Subclasses implement ``_sync`` (one synchronization of every prepared module) and may
    override ``_result`` (what ``final_module`` leaves in the module).
    """

    strategy_name = ""

    def __init__(self, env: "DistEnv", sync_every: int, warmup_steps: int) -> None:
        super().__init__(env)
        self.sync_every = sync_every
        self.warmup_steps = warmup_steps
        #: Modules returned by prepare_model, in preparation order (the same on every rank).
        self.modules: List[torch.nn.Module] = []
        #: Optimizer steps taken on this rank, over all prepared optimizers.
        self.steps = 0
        #: Synchronizations done, the final one included.
        self.syncs = 0
        self._steps_since_sync = 0
        self._optimizer_prepared = False

    def prepare_model(self, module: torch.nn.Module) -> torch.nn.Module:
        if any(m is module for m in self.modules):
            return module
        # Custom loops need not seed: start every replica from rank 0's weights, like DDP does.
        self.comm_bytes += broadcast_bytes_sent(broadcast_from_rank0(module), self.env.world_size, is_root=True)
        self.modules.append(module)
        self._module_prepared(module)
        return module

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not self.modules:
            raise RuntimeError(
                f"{self.strategy_name}: call ctx.prepare_model(module) before ctx.prepare_optimizer(...), "
                f"and build the optimizer over the prepared module's parameters"
            )
        if isinstance(optimizer, SyncingOptimizer) and optimizer._after_step == self._after_step:
            return optimizer
        synced = {id(p) for m in self.modules for p in m.parameters()}
        stray = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in synced)
        if stray:
            # Those parameters would be stepped but never synchronized: the ranks would drift
            # apart silently and the "final average" would not be one.
            raise RuntimeError(
                f"{self.strategy_name}: the optimizer updates {stray} parameter(s) that belong to no module "
                f"passed to ctx.prepare_model; build the optimizer over the prepared model's parameters"
            )
        self._optimizer_prepared = True
        return SyncingOptimizer(optimizer, self._after_step)

    def final_module(self, model: torch.nn.Module) -> torch.nn.Module:
        if not any(m is model for m in self.modules):
            raise RuntimeError(f"{self.strategy_name}: final_module got a module that ctx.prepare_model did not return")
        if not self._optimizer_prepared:
            # Without the wrapped optimizer nothing was ever synchronized; returning one rank's
            # replica (or an untouched center) as "the result" would be silently wrong.
            raise RuntimeError(
                f"{self.strategy_name} synchronizes at optimizer steps, but no optimizer was prepared: "
                f"use optimizer = ctx.prepare_optimizer(optimizer) and call its step()"
            )
        if self._steps_since_sync:
            self._sync_now()
        return self._result(model)

    def close(self) -> None:
        self.modules = []

    def state_dict(self) -> Dict[str, Any]:
        # The sync schedule: a resumed run must average at the same steps as the original.
        return {"steps": self.steps, "syncs": self.syncs, "steps_since_sync": self._steps_since_sync}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.syncs = int(state["syncs"])
        self._steps_since_sync = int(state["steps_since_sync"])

    def _after_step(self) -> None:
        self.steps += 1
        self._steps_since_sync += 1
        if self.steps <= self.warmup_steps or (self.steps - self.warmup_steps) % self.sync_every == 0:
            self._sync_now()

    def _sync_now(self) -> None:
        with torch.no_grad():
            self._sync()
        self.syncs += 1
        self._steps_since_sync = 0

    def _module_prepared(self, module: torch.nn.Module) -> None:
        """Called once per module, right after the initial broadcast."""

    def _sync(self) -> None:
        raise NotImplementedError

    def _result(self, model: torch.nn.Module) -> torch.nn.Module:
        return model


class _ModelAveragingRuntime(_PeriodicSyncRuntime):
    """Plain averaging, or DiLoCo with an outer optimizer: its state (the global copies and the
    outer optimizer's state, one :class:`OuterStep` per module) is identical on every rank, so
    rank 0's ``state_dict()["outer"]`` is a valid state for any number of workers."""

    strategy_name = "ModelAveraging"

    def __init__(
        self,
        env: "DistEnv",
        sync_every: int,
        warmup_steps: int,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
    ) -> None:
        super().__init__(env, sync_every, warmup_steps)
        self.outer_factory = outer_optimizer
        #: One global copy and outer optimizer per prepared module (empty without outer_optimizer).
        self.outer: List[OuterStep] = []

    def _module_prepared(self, module: torch.nn.Module) -> None:
        if self.outer_factory is not None:
            self.outer.append(OuterStep(module, self.outer_factory))

    def _sync(self) -> None:
        world_size = self.env.world_size
        for index, module in enumerate(self.modules):
            for group in by_device_and_dtype(model_tensors(module, floating_only=True)):
                flat = flatten(group)
                # Divide before summing, as DDP's default hook does: no overflow in half
                # precision. Every rank receives the same reduced bits, so replicas are equal.
                flat.div_(world_size)
                dist.all_reduce(flat)
                self.comm_bytes += allreduce_bytes_sent(nbytes(flat), world_size)
                unflatten_into(flat, group)
            if self.outer:
                # No traffic: every rank steps the same global copy with the same average.
                if self.steps <= self.warmup_steps:
                    self.outer[index].follow()
                else:
                    self.outer[index].step()

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        if self.outer:
            state["outer"] = [outer.state_dict() for outer in self.outer]
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = state.get("outer")
        if (saved is None) != (not self.outer):
            written, now = ("without", "set") if saved is None else ("with", "None")
            raise ConfigError(
                f"ModelAveraging.outer_optimizer is {now} in this run, but the checkpoint was written {written} it: "
                f"resume with the setting the checkpoint was written with, or start fresh (resume=False)"
            )
        if saved is not None and len(saved) != len(self.outer):
            raise RuntimeError(
                f"ModelAveraging: the checkpoint holds outer state for {len(saved)} module(s), this run prepared {len(self.outer)}"
            )
        super().load_state_dict(state)
        for outer, part in zip(self.outer, saved or []):
            outer.load_state_dict(part)

    def close(self) -> None:
        super().close()
        self.outer = []

    def reshard_state(self, old, old_world_size):  # type: ignore[no-untyped-def]
        """Elastic resume: every new rank starts from the average of the old replicas (what the
        next synchronization would have made); the sync schedule and the outer state, identical
        on every rank, carry over as they are."""
        from sparkdl.strategies._reshard import averaged_reshard

        return averaged_reshard(old, self.env.rank)


class _ElasticAveragingRuntime(_PeriodicSyncRuntime):
    strategy_name = "ElasticAveraging"

    def __init__(self, env: "DistEnv", sync_every: int, alpha: float) -> None:
        super().__init__(env, sync_every, warmup_steps=0)
        self.alpha = alpha
        #: One flat center buffer per (device, dtype) group of each prepared module.
        self.centers: List[List[torch.Tensor]] = []

    def _module_prepared(self, module: torch.nn.Module) -> None:
        groups = by_device_and_dtype(model_tensors(module, floating_only=True))
        self.centers.append([flatten(group) for group in groups])

    def _groups(self, index: int) -> List[Tuple[List[torch.Tensor], torch.Tensor]]:
        groups = by_device_and_dtype(model_tensors(self.modules[index], floating_only=True))
        centers = self.centers[index]
        if [sum(t.numel() for t in g) for g in groups] != [c.numel() for c in centers]:
            raise RuntimeError(
                "ElasticAveraging keeps a center copy of the model's parameters and floating-point buffers, "
                "but they changed (added, removed or resized) after ctx.prepare_model"
            )
        return list(zip(groups, centers))

    def _sync(self) -> None:
        for index in range(len(self.modules)):
            for group, center in self._groups(index):
                local = flatten(group)
                diff = local - center
                local.sub_(diff, alpha=self.alpha)
                unflatten_into(local, group)
                dist.all_reduce(diff)  # sum over ranks of (x_i - c)
                self.comm_bytes += allreduce_bytes_sent(nbytes(diff), self.env.world_size)
                # Same center and same sum on every rank: the center copies stay identical.
                center.add_(diff, alpha=self.alpha)

    def state_dict(self) -> Dict[str, Any]:
        return {**super().state_dict(), "centers": [[c.detach().cpu() for c in centers] for centers in self.centers]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state["centers"]
        if [[c.numel() for c in cs] for cs in saved] != [[c.numel() for c in cs] for cs in self.centers]:
            raise RuntimeError("ElasticAveraging: the checkpoint's center does not match the prepared model's size")
        with torch.no_grad():
            for centers, saved_centers in zip(self.centers, saved):
                for center, value in zip(centers, saved_centers):
                    center.copy_(value)

    def _result(self, model: torch.nn.Module) -> torch.nn.Module:
        index = next(i for i, m in enumerate(self.modules) if m is model)
        with torch.no_grad():
            for group, center in self._groups(index):
                unflatten_into(center, group)
        return model

    def close(self) -> None:
        super().close()
        self.centers = []
