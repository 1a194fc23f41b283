"""The driver's decisions as policy objects (sparkdl._driver.policy): on how many workers an
attempt runs. Pure functions of the free slots; launch() only asks Spark for them."""

from __future__ import annotations

import pytest

from sparkdl._driver.policy import ScalingPolicy


def test_without_min_workers_an_attempt_always_asks_for_num_workers():
    policy = ScalingPolicy(num_workers=4)
    for free in (0, 2, 4, 9):
        decision = policy.decide(free, attempt=2, has_checkpoints=True)
        assert decision.num_workers == 4 and decision.message is None


def test_enough_free_slots_run_on_num_workers_silently():
    assert ScalingPolicy(4, min_workers=2).decide(4, attempt=1, has_checkpoints=False).message is None


@pytest.mark.parametrize(
    "attempt, has_checkpoints, how",
    [
        (1, False, "starting there"),
        (1, True, "starting there"),
        (2, True, "resuming the newest checkpoint on that many"),
        (3, False, "from scratch (no checkpoint_dir)"),
    ],
)
def test_fewer_free_slots_shrink_the_attempt_and_say_how_it_continues(attempt, has_checkpoints, how):
    decision = ScalingPolicy(4, min_workers=2, slot_wait_s=7).decide(3, attempt, has_checkpoints)
    assert decision.num_workers == 3
    assert (
        f"attempt {attempt}: only 3 free task slot(s) for num_workers=4 within slot_wait_s=7s (min_workers=2)"
        in decision.message
    )
    assert how in decision.message
    # batch_size is per worker: a shrunk run that goes on says its global batch is smaller.
    assert ("global batch shrinks" in decision.message) == (attempt == 1 or has_checkpoints)


@pytest.mark.parametrize(
    "on_resize, says",
    [
        ("keep_global_batch", "each worker accumulates gradients, the global batch stays as planned"),
        ("scale_lr", "the global batch shrinks; on_resize=scale_lr scales the learning rate with it"),
        ("none", "batch_size is per worker: the global batch shrinks)"),
    ],
)
def test_the_shrink_message_says_what_on_resize_does_to_the_global_batch(on_resize, says):
    decision = ScalingPolicy(4, min_workers=2, on_resize=on_resize).decide(2, attempt=2, has_checkpoints=True)
    assert says in decision.message
