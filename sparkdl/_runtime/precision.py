"""Mixed precision: ``precision="32" | "bf16-mixed" | "16-mixed"``.

* ``"32"``: everything in float32 (the default).
* ``"bf16-mixed"``: forward and loss under ``torch.autocast(dtype=torch.bfloat16)``; weights,
  gradients and optimizer state stay float32. bfloat16 has float32's range, so no loss scaling
  is needed. Works on CPUs and on GPUs with native bfloat16 (Ampere and newer).
* ``"16-mixed"``: autocast to float16 plus a ``torch.amp.GradScaler`` that scales the loss so
  small gradients do not flush to zero, and skips the optimizer step (halving the scale) when a
  gradient overflowed. GPUs only (for V100/T4-class GPUs without bfloat16).

The skip must be the same on every rank. Under :class:`~sparkdl.AllReduce` it is: gradients are
averaged before the scaler looks at them. Under the averaging strategies and the parameter
server they are local, so one rank could overflow alone and skip a ``step()`` the others take —
and those strategies count ``step()`` calls to schedule their collectives, so the ranks would
desynchronize (a hang, or a parameter server waiting for a clock that never comes). sparkdl
therefore agrees on the skip: each step, one 1-element all-reduce (MAX) of "some gradient is not
finite"; a rank that is finite while another is not marks one of its own gradients infinite, so
its scaler skips too and every scale stays identical. The skip is made here, after
``scaler.unscale_``, not by ``scaler.step``: see :meth:`PrecisionRuntime.backward_and_step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Any, Callable, ContextManager, Dict, Optional, Union

import torch

from sparkdl.errors import ConfigError

logger = logging.getLogger("sparkdl.precision")

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
#: Spellings people try, and what they most likely meant.
_ALIASES = {32: "32", "32-true": "32", "fp32": "32", "float32": "32"}
_SUGGEST = {
    "bf16": "bf16-mixed",
    "bfloat16": "bf16-mixed",
    "16": "16-mixed",
    16: "16-mixed",
    "fp16": "16-mixed",
    "float16": "16-mixed",
}


@dataclasses.dataclass(frozen=True)
class Precision:
    """A validated ``precision`` setting.

    Args:
        value: ``"32"`` (also ``32``, ``"32-true"``), ``"bf16-mixed"`` or ``"16-mixed"``.

    Raises:
        ConfigError: any other value; the message lists the valid ones.
    """

    value: Union[str, int] = "32"

    def __post_init__(self) -> None:
        value = self.value
        if isinstance(value, bool):
            value = str(value)
        value = _ALIASES.get(value, value)
        if value not in PRECISIONS:
            hint = (
                f" (did you mean {_SUGGEST[value]!r}?)" if isinstance(value, (str, int)) and value in _SUGGEST else ""
            )
            raise ConfigError(f"precision={self.value!r} is not one of {', '.join(map(repr, PRECISIONS))}{hint}")
        object.__setattr__(self, "value", value)

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        """The dtype autocast computes in, or None for plain float32."""
        return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(self.value))

    @property
    def needs_grad_scaler(self) -> bool:
        """float16 gradients underflow without loss scaling; bfloat16 and float32 do not."""
        return self.value == "16-mixed"

    def check_device(self, device: torch.device) -> None:
        """Raises :class:`ConfigError` for a precision the device cannot train in."""
        if self.value == "16-mixed" and device.type != "cuda":
            raise ConfigError(
                f"precision='16-mixed' needs a GPU, but this task trains on {device.type}: float16 autocast with loss "
                f"scaling is a CUDA feature; use precision='bf16-mixed' on CPUs (or give the tasks GPUs)"
            )


def _all_reduce_max(flag: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


class PrecisionRuntime:
    """A task's precision machinery: autocast and, for ``16-mixed``, the grad scaler.

    Args:
        precision: the run's setting.
        device: the task's device.
        world_size: ranks in the job; with more than one, skipped steps are agreed on.
        all_reduce_max: ``tensor -> tensor``, the MAX over ranks (default: torch.distributed).
        scaler: a ready grad scaler (tests pass a CPU one); default one for ``16-mixed``.

    Raises:
        ConfigError: the precision does not work on the device.
    """

    def __init__(
        self,
        precision: Precision,
        device: torch.device,
        world_size: int = 1,
        all_reduce_max: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        scaler: Optional["torch.amp.GradScaler"] = None,
    ) -> None:
        if scaler is None:
            precision.check_device(device)
        self.precision = precision
        self.device = device
        self.dtype = precision.autocast_dtype
        self.scaler = (
            scaler
            if scaler is not None
            else (torch.amp.GradScaler(device.type) if precision.needs_grad_scaler else None)
        )
        self._all_reduce_max = (all_reduce_max or _all_reduce_max) if world_size > 1 else None
        if (
            self.dtype is torch.bfloat16
            and device.type == "cuda"
            and not torch.cuda.is_bf16_supported(including_emulation=False)
        ):
            logger.warning(
                "%s has no native bfloat16: precision='bf16-mixed' runs emulated and slowly there; use '16-mixed'",
                torch.cuda.get_device_name(device),
            )

    def autocast(self) -> ContextManager[Any]:
        """Autocast for the forward pass and the loss; a no-op for ``"32"``."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` alone, through the grad scaler for ``16-mixed``: a micro-batch of an
        accumulated step whose last micro-batch goes through :meth:`backward_and_step`."""
        (self.scaler.scale(loss) if self.scaler is not None and self.scaler.is_enabled() else loss).backward()

    def backward_and_step(
        self, loss: torch.Tensor, optimizer: torch.optim.Optimizer, max_grad_norm: Optional[float] = None
    ) -> bool:
        """``loss.backward(); optimizer.step()``, through the grad scaler for ``16-mixed``.

        Args:
            loss: the scalar loss.
            optimizer: the (prepared) optimizer.
            max_grad_norm: clip the gradients' total 2-norm to this before stepping (after
                unscaling them under ``16-mixed``, so the bound is on the true gradients).

        Returns:
            Whether the optimizer stepped (False: a gradient overflowed on some rank and every
            rank skipped this step).
        """
        if self.scaler is None or not self.scaler.is_enabled():
            loss.backward()
            self._clip(optimizer, max_grad_norm)
            optimizer.step()
            return True
        self.scaler.scale(loss).backward()
        overflow = self._overflow(optimizer)
        # unscale_ records the overflow for update() (which lowers the scale after one) and
        # leaves the true gradients for clipping and the step. The step itself is skipped here
        # rather than by scaler.step(): the strategies' optimizer wrappers would otherwise route
        # a fused optimizer's in-kernel unscale and skip (grad_scale/found_inf attributes) to
        # the wrapper instead of the real optimizer, which would then step on scaled or
        # infinite gradients.
        self.scaler.unscale_(optimizer)
        if not overflow:
            self._clip(optimizer, max_grad_norm)
            optimizer.step()
        self.scaler.update()
        return not overflow

    @staticmethod
    def _clip(optimizer: torch.optim.Optimizer, max_grad_norm: Optional[float]) -> None:
        if max_grad_norm is not None:
            params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)

    def _overflow(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether any rank's (scaled) gradients hold an inf or nan; the same answer on every rank."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # Sharded gradients (DTensors): this rank checks its own shard; the max over ranks below
        # covers the others'.
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        dense = [g for g in grads if not g.is_sparse]
        grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
        if grads:
            # The largest |value|: inf or nan exactly when some gradient is not finite (a 2-norm
            # could overflow on large but finite scaled gradients).
            peak = torch.nn.utils.get_total_norm(grads, norm_type=math.inf)
            local = (~torch.isfinite(peak)).to(torch.float32).reshape(1)
        else:
            local = torch.zeros(1, device=self.device)
        if self._all_reduce_max is None:
            return bool(local.item())
        found = bool(self._all_reduce_max(local.clone()).item())
        if found and not bool(local.item()) and dense:
            # Another rank overflowed: make this rank's scaler see an overflow too, so that every
            # rank lowers its scale alike. The gradient is discarded with the skipped step.
            dense[0][(0,) * dense[0].dim()] = math.inf
        return found

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """The scaler's state (its scale and growth tracker) for checkpoints; None without one."""
        return self.scaler.state_dict() if self.scaler is not None and self.scaler.is_enabled() else None

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        if state and self.scaler is not None and self.scaler.is_enabled():
            self.scaler.load_state_dict(state)
