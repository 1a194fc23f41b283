"""The training loop ``TorchEstimator.fit`` runs on every rank (custom loops use ``sparkdl.run``)."""

from __future__ import annotations

import dataclasses
import io
import math
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from sparkdl.context import TrainContext
from sparkdl.errors import NonFiniteLossError

ModelFactory = Callable[[], torch.nn.Module]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    """Adam with lr=1e-3 when the user names no optimizer."""
    return torch.optim.Adam(params, lr=1e-3)


@dataclasses.dataclass(frozen=True)
class FitLoop:
    """Epochs of forward/backward/step over the rank's batches; picklable so it travels by value."""

    model: ModelFactory
    optimizer: OptimizerFactory
    loss: LossFn
    epochs: int
    seed: int

    def __call__(self, ctx: TrainContext) -> Optional[Dict[str, Any]]:
        # Same seed everywhere: every rank builds the same initial weights (DDP would broadcast
        # rank 0's anyway; the averaging strategies rely on it).
        torch.manual_seed(self.seed)
        module = self.model()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"model() must return a torch.nn.Module, got {type(module).__name__}")
        model = ctx.prepare_model(module)
        optimizer = ctx.prepare_optimizer(self.optimizer(model.parameters()))
        history: List[Dict[str, Any]] = []
        output_shape: Optional[List[int]] = None
        comm_before = ctx.comm_bytes
        start = time.time()
        for epoch in range(1, self.epochs + 1):
            ctx.set_phase(f"training epoch {epoch}")
            model.train()
            epoch_start = time.time()
            loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
            samples = 0
            for step, (features, labels) in enumerate(ctx.epoch_batches()):
                optimizer.zero_grad(set_to_none=True)
                output = model(features)
                loss = self.loss(output, labels)
                if not torch.isfinite(loss):
                    raise NonFiniteLossError(
                        f"loss is {loss.item()} at epoch {epoch}, step {step + 1} on rank {ctx.rank}: "
                        f"lower the learning rate, clip gradients, or check the data for extreme values"
                    )
                loss.backward()
                optimizer.step()
                loss_sum += loss.detach().double() * len(features)
                samples += len(features)
                if output_shape is None:
                    output_shape = list(output.shape[1:])
            seconds = time.time() - epoch_start
            # One small allreduce per epoch for metrics; not counted in comm_bytes (that is the
            # strategy's model-sync traffic).
            totals = torch.stack(
                [loss_sum, torch.tensor(float(samples), dtype=torch.float64, device=ctx.device),
                 torch.tensor(float(ctx.comm_bytes - comm_before), dtype=torch.float64, device=ctx.device)]
            )
            dist.all_reduce(totals)
            comm_before = ctx.comm_bytes
            total_samples = int(totals[1].item())
            record = {
                "epoch": epoch,
                "loss": totals[0].item() / max(1, total_samples),
                "samples": total_samples,
                "seconds": seconds,
                "samples_per_sec": total_samples / seconds if seconds > 0 else math.inf,
                "comm_bytes": int(totals[2].item() / ctx.world_size),
            }
            history.append(record)
            if ctx.rank == 0:
                ctx.report_epoch(record)
        ctx.set_phase("finishing")
        final = ctx.final_module(model)
        if ctx.rank != 0:
            return None
        buffer = io.BytesIO()
        torch.save({k: v.detach().cpu() for k, v in final.state_dict().items()}, buffer)
        return {
            "state_dict": buffer.getvalue(),
            "history": history,
            "output_shape": output_shape or [],
            "timing": {"start": start, "first_batch": ctx.first_batch_time, "end": time.time()},
        }
