"""What one synchronization of each strategy costs a rank beyond the link model's transfer (γ),
timed in the calibration stage with the strategy's own code over the probed link.

The α–β model charges a synchronization its bytes and messages. A fit pays more on each one,
on the rank's own CPU and memory: the copies the strategy makes (DDP's buckets, averaging's
flatten, divide and copy back, DiLoCo's outer step with its global copy), the steps after it
running from caches the exchange evicted, and the wait for the slower rank. On the namespace
cluster those added 2 ms to each AllReduce step of a 5.3 MB model and 8-12 ms to each
averaging round (docs/planning.md), 10-20 % of the step, in every strategy that synchronizes.

Each measured strategy runs its runtime on a fresh copy of the model, on the batches the
calibration kept in memory, for a few of its synchronization cycles on both tasks at once;
γ is what one cycle took beyond the model's prediction for it with the compute-only step::

    γ = τ · (measured step − model's step)        (τ = steps per synchronization)

so that the model plus γ/τ per step reproduces the measured cycle on two workers. γ is then
taken to be the same on N workers (the copies are per rank; the wait for the slowest of N ranks
grows with N, which this leaves out).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from sparkdl.errors import ConfigError
from sparkdl.planning.models import Measured, StrategyShape, predict

#: The cost models whose synchronization is timed (a parameter server's is measured as modelled).
TIMED_KINDS = ("allreduce", "averaging", "elastic", "sharded")
#: Seconds of cycles timed per strategy (at the model's rate), and the fewest cycles timed.
SYNC_PART_S = 1.5
MIN_CYCLES = 3
#: The most cycles timed (a tiny model's cycles are short: enough of them).
MAX_CYCLES = 200


def sync_overheads(
    ctx: Any,
    strategies: Sequence[Tuple[StrategyShape, Any]],
    build: Callable[[], Tuple[torch.nn.Module, Callable]],
    step: Callable[[torch.nn.Module, Any, Any, Any], None],
    kept: List[Any],
    measured: Measured,
    part_s: float = SYNC_PART_S,
) -> Dict[str, float]:
    """γ in seconds per synchronization, by strategy label, on this rank (collective: every rank
    calls it with the same strategies). ``build()`` gives a fresh model and optimizer factory;
    ``step(model, optimizer, features, labels)`` is one training step; ``measured`` holds the
    compute-only step (``local_step_s``) and the probed link the model predicts with; each
    strategy's cycles run about ``part_s`` at the model's rate."""
    import torch.distributed as dist

    overheads: Dict[str, float] = {}
    for shape, strategy in strategies:
        if shape.kind not in TIMED_KINDS or not kept:
            continue
        tau = max(1, shape.sync_every)
        planned = predict(measured, shape, ctx.world_size).step_s * tau
        # Every rank runs the same number of cycles (a collective each): rank 0's count.
        count = torch.tensor([min(MAX_CYCLES, max(MIN_CYCLES, math.ceil(part_s / planned)))])
        dist.broadcast(count, src=0)
        seconds = _timed_cycles(ctx, strategy, build, step, kept, tau, int(count.item()))
        if seconds is not None:
            overheads[shape.label] = max(0.0, seconds / int(count.item()) - planned)
    return overheads


def _timed_cycles(
    ctx: Any, strategy: Any, build: Callable, step: Callable, kept: List[Any], tau: int, cycles: int
) -> Any:
    """Seconds of ``cycles`` synchronization cycles of ``strategy`` after one cycle of warm-up;
    None when the strategy refuses the model (as a fit would: the plan still predicts it)."""
    import torch.distributed as dist

    runtime = strategy.create_runtime(ctx.dist_env)
    try:
        module, optimizer_fn = build()
        try:
            model = runtime.prepare_model(module)
        except ConfigError as exc:  # raised on every rank alike, before any collective
            ctx.logger.warning("plan: %s not timed: %s", type(strategy).__name__, exc)
            return None
        optimizer = runtime.prepare_optimizer(optimizer_fn(model.parameters()))
        done = 0

        def run(steps: int) -> None:
            nonlocal done
            for _ in range(steps):
                features, labels = kept[done % len(kept)]
                step(model, optimizer, features, labels)
                done += 1

        # Warm-up (buffers, the optimizer's state, the first exchanges) ending on a synchronization.
        run(tau + int(getattr(strategy, "warmup_steps", 0) or 0))
        dist.barrier()
        began = time.perf_counter()
        run(tau * cycles)
        return time.perf_counter() - began
    finally:
        runtime.close()
