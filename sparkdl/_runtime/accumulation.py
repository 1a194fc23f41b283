"""The part of :class:`~sparkdl.context.TrainContext` that honours ``on_resize=`` on fewer
workers than ``num_workers`` (:mod:`sparkdl._runtime.resize` has the arithmetic): gradient
accumulation for ``"keep_global_batch"``, the learning-rate factor for ``"scale_lr"``.

A custom loop that honours every choice::

    restored = ctx.load_checkpoint()
    ...                                             # load the model's and optimizer's state
    ctx.apply_resize_lr(optimizer)                  # "scale_lr": lr *= M/N; else nothing
    for inputs, labels, scale, last in ctx.micro_batches():
        with ctx.gradient_sync(model, last):        # no sync before a step's last micro-batch
            with ctx.autocast():
                loss = loss_fn(model(inputs), labels)
            ctx.backward(loss * scale)              # scale: 1/(micro-batches in this step)
        if last:
            optimizer.step()
            optimizer.zero_grad()

With ``accumulation_steps == 1`` (the usual case) every batch is ``last`` with ``scale`` 1.0.
"""

from __future__ import annotations

from typing import Any, ContextManager, Iterator, Optional, Tuple

import torch

from sparkdl._runtime.rank import Rank
from sparkdl._runtime.resize import accumulation_windows, scale_learning_rate


class ResizeMethods:
    """Mixed into :class:`~sparkdl.context.TrainContext`; works on its :class:`Rank`."""

    _rank: Rank

    @property
    def on_resize(self) -> str:
        """The run's ``on_resize`` choice: ``"keep_global_batch"``, ``"scale_lr"`` or ``"none"``."""
        return self._rank.resize.on_resize

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step on this rank: ⌈num_workers / world_size⌉ when the run
        trains on fewer workers than ``num_workers`` with ``on_resize="keep_global_batch"``, else 1."""
        return self._rank.resize.accumulation_steps

    @property
    def global_batch_size(self) -> Optional[int]:
        """Rows per optimizer step over all ranks: ``batch_size * world_size * accumulation_steps``
        (None without data)."""
        return self._rank.resize.global_batch_size

    def micro_batches(self, skip: int = 0) -> Iterator[Tuple[Any, Any, float, bool]]:
        """This epoch's batches as ``(inputs, labels, loss_scale, last)``: ``ctx.epoch_batches(skip)``
        grouped ``accumulation_steps`` at a time. Multiply each loss by ``loss_scale`` (1/(the
        micro-batches of its step), so the accumulated gradient is their mean) and step the
        optimizer after each ``last``; an epoch's last step may take fewer micro-batches."""
        if self.accumulation_steps == 1:  # every batch its own step: no windows to count (one generator less per step)
            for inputs, labels in self.epoch_batches(skip):  # type: ignore[attr-defined]
                yield inputs, labels, 1.0, True
            return
        position = self._rank.position
        remainder = position.remainder
        count = remainder.steps - remainder.taken if remainder is not None else (self._rank.steps_per_epoch or 0) - skip
        for (inputs, labels), scale, last in accumulation_windows(
            self.epoch_batches(skip),  # type: ignore[attr-defined]
            count,
            self.accumulation_steps,
        ):
            yield inputs, labels, scale, last

    def gradient_sync(self, model: torch.nn.Module, enabled: bool) -> ContextManager[None]:
        """Context for a backward pass: ``enabled=False`` keeps the gradients local (DDP's
        ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``) for a micro-batch that is not
        its step's last; the last one's backward synchronizes the sum."""
        return self._rank.strategy.gradient_sync(model, enabled)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` under the run's precision (through the grad scaler for ``16-mixed``),
        without a step: for the micro-batches before ``ctx.backward_and_step``'s last one."""
        self._rank.amp.backward(loss)

    @property
    def lr_scale_factor(self) -> float:
        """What ``on_resize="scale_lr"`` multiplies ``lr`` by: world_size / the workers the
        optimizer's ``lr`` was meant for — the checkpoint's after ``load_checkpoint()`` restored
        one, ``num_workers`` otherwise. 1.0 for the other choices and on as many workers."""
        resize = self._rank.resize
        return resize.lr_factor(self._rank.checkpoint_workers or resize.planned_workers)

    def apply_resize_lr(self, optimizer: torch.optim.Optimizer) -> float:
        """Multiplies every param group's ``lr`` (and ``initial_lr``) by :attr:`lr_scale_factor`;
        returns it. Call once, after ``load_checkpoint()`` and loading the optimizer's state. An LR
        scheduler built before the call keeps its ``base_lrs`` and a scheduler that sets ``lr``
        absolutely overwrites the scaled one at its next step: multiply its ``base_lrs`` by the
        factor too, or build it after this call."""
        factor = self.lr_scale_factor
        scale_learning_rate(optimizer, factor)
        if factor != 1.0 and self._rank.rank == 0:
            self._rank.logger.warning(
                "on_resize='scale_lr': learning rates multiplied by %g for %d worker(s)", factor, self._rank.world_size
            )
        return factor

    def report_resize(self) -> dict:
        """What ``run_info["resize"]`` records of this attempt; rank 0 also logs (at warning level:
        it reaches the driver's output) when the global batch is not the planned one."""
        resize = self._rank.resize
        warning = resize.warning()
        if warning and self._rank.rank == 0:
            self._rank.logger.warning("%s", warning)
        return {**resize.describe(), "lr_scale_factor": self.lr_scale_factor}
