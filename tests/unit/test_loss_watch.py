"""The training loop's NaN/inf watch: losses checked in groups, the first bad step named."""

from __future__ import annotations

import pytest
import torch

from sparkdl._task.fit_loop import LossWatch
from sparkdl.errors import NonFiniteLossError


class _Rank:
    """The part of TrainContext the watch uses: rank, phase, and the data search."""

    rank = 1

    def __init__(self) -> None:
        self.phase = "training epoch 1"
        self.searched = 0

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def describe_non_finite_data(self) -> str:
        self.searched += 1
        return "the float columns hold no NaN or infinity: the model or the optimizer diverged"


def test_losses_are_checked_every_k_steps_and_the_first_bad_step_is_named():
    rank = _Rank()
    watch = LossWatch(rank, every=4)
    for step in (1, 2, 3):
        watch.add(1, step, torch.tensor(0.5 if step != 2 else float("nan")))
    assert rank.searched == 0  # no check (no host sync) before the 4th loss
    with pytest.raises(NonFiniteLossError) as info:
        watch.add(1, 4, torch.tensor(float("inf")))
    assert str(info.value).startswith("loss is nan at epoch 1, step 2 on rank 1: ")
    assert "lower the learning rate" in str(info.value)
    assert rank.searched == 1 and rank.phase == "training step 2 (forward, backward, sync, optimizer)"


def test_check_flushes_what_is_pending_and_finite_losses_pass():
    rank = _Rank()
    watch = LossWatch(rank, every=100)
    for step in range(1, 10):
        watch.add(3, step, torch.tensor(float(step)))
    watch.check()  # finite: nothing raised
    watch.add(3, 10, torch.tensor([float("-inf")]))  # a one-element loss counts too
    with pytest.raises(NonFiniteLossError, match="loss is -inf at epoch 3, step 10"):
        watch.check()
    watch.check()  # nothing pending any more


def test_add_returns_the_loss_detached_and_mixed_dtypes_are_checked_together():
    rank = _Rank()
    watch = LossWatch(rank, every=3)
    loss = torch.tensor(2.0, requires_grad=True) * 1.5
    kept = watch.add(2, 1, loss)
    assert not kept.requires_grad and kept.item() == 3.0  # the value the loop sums
    watch.add(2, 2, torch.tensor(1.0, dtype=torch.bfloat16))  # a bf16-mixed loss beside float32 ones
    with pytest.raises(NonFiniteLossError, match="loss is nan at epoch 2, step 3 on rank 1"):
        watch.add(2, 3, torch.tensor(float("nan"), dtype=torch.float64))
