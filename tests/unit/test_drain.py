"""The drain agreement (sparkdl._runtime.drain) on a real two-rank gloo group: the ranks agree
about every DRAIN_CHECK_SECONDS, at the same calls, and drain at the same step."""

from __future__ import annotations

import time

from sparkdl._runtime.drain import (
    DRAIN_CHECK_SECONDS,
    FIRST_CHECK_AFTER,
    MAX_STEPS_BETWEEN_CHECKS,
    steps_between_checks,
)
from tests.gloo import join_group, save_results, spawn_ranks

#: A step's time in the slow part of the test (rank 1's; rank 0's steps take no time).
SLOW_STEP_S = 0.02


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch

    from sparkdl._runtime.drain import DrainAgreement, DrainNotice

    join_group(rank, port, 2)
    results = {}
    # Fast steps (no work at all): after the first agreement, the most steps allowed between two.
    agreement = DrainAgreement(DrainNotice(), torch.device("cpu"))
    agreed_at = [call for call in range(1, 2 * MAX_STEPS_BETWEEN_CHECKS) if _agreed(agreement, call)]
    results["fast"] = agreed_at
    # Slow steps on rank 1 only: both ranks pace their agreements on the slower one.
    agreement = DrainAgreement(DrainNotice(), torch.device("cpu"))
    agreed_at = []
    for call in range(1, 80):
        if rank == 1:
            time.sleep(SLOW_STEP_S)  # the step's work
        if _agreed(agreement, call):
            agreed_at.append(call)
    results["slow"] = agreed_at
    # Rank 1 hears of the drain at its 100th step: both drain at the same, later step.
    notice = DrainNotice()
    agreement = DrainAgreement(notice, torch.device("cpu"))
    call = 0
    while True:
        call += 1
        if rank == 1 and call == 100:
            notice.request("its host is being decommissioned")
        if agreement.check():
            results["drained_at"] = call
            break
    save_results(results, out_dir, rank)


def _agreed(agreement, call: int) -> bool:
    before = agreement.agreements
    agreement.check()
    return agreement.agreements > before


def test_the_ranks_agree_on_drains_about_every_half_second_at_the_same_steps(tmp_path):
    results = spawn_ranks(_worker, 2, tmp_path)
    for part in ("fast", "slow", "drained_at"):
        assert results[0][part] == results[1][part], part  # else they would have hung in the allreduce
    fast = results[0]["fast"]
    assert fast == [FIRST_CHECK_AFTER, FIRST_CHECK_AFTER + MAX_STEPS_BETWEEN_CHECKS], fast
    slow = results[0]["slow"]
    gaps = [b - a for a, b in zip(slow, slow[1:])]
    # The slower rank's steps take at least SLOW_STEP_S, so at most this many fit between agreements.
    assert (
        slow[0] == FIRST_CHECK_AFTER and gaps and all(1 <= gap <= DRAIN_CHECK_SECONDS / SLOW_STEP_S for gap in gaps)
    ), slow
    assert results[0]["drained_at"] > 100


def test_steps_between_checks_are_half_a_second_of_steps_within_bounds():
    assert steps_between_checks(0.01) == int(DRAIN_CHECK_SECONDS / 0.01)
    assert steps_between_checks(10.0) == 1
    assert steps_between_checks(1e-9) == MAX_STEPS_BETWEEN_CHECKS
    assert steps_between_checks(0.0) == MAX_STEPS_BETWEEN_CHECKS
    assert steps_between_checks(float("nan")) == MAX_STEPS_BETWEEN_CHECKS
