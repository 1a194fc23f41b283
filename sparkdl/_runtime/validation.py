"""The per-epoch validation pass: ``val_loss`` and ``val_<metric>`` in ``model.history``.

Every rank reads its shard of the validation rows once per call — the rows
``DataSpec.holdout`` holds out of the training data, or a separate validation dataset — in file
order, unshuffled, in batches of ``batch_size`` (the last one smaller), finished like training
batches but never augmented (:func:`sparkdl.data.batching.validation_batches`), with
``transform_fn`` applied. The model runs in eval mode under ``torch.no_grad``; sums of loss and metrics weighted
by rows, and the row count, are summed over ranks with one allreduce, so the result is the mean
over all validation rows whatever their spread over ranks. Ranks need no equal step counts here:
the forward passes run on the strategy's evaluation module (the unwrapped module, never DDP's,
whose forward may synchronize buffers; a gathered copy of a sharded model), so no collective
happens until that one allreduce.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from sparkdl._runtime.device_feed import move_batch
from sparkdl._runtime.rank import Rank
from sparkdl.data.batching import batch_rows, call_model, to_tensors
from sparkdl.data.batching import validation_batches as finished_batches
from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.spec import DataSpec, MetricFn
from sparkdl.errors import ConfigError


def validation_source(dataset: DatasetInfo, spec: DataSpec) -> Tuple[DatasetInfo, DataSpec]:
    """The dataset and spec of the validation pass of a run on ``dataset`` with ``spec``."""
    if spec.validation is None:
        raise ConfigError("this run has no validation data: pass validation=<fraction, URL, DataFrame or source>")
    if spec.validation.dataset is not None:
        return spec.validation.dataset, dataclasses.replace(spec, shuffle=False, holdout=0.0, part="train")
    return dataset, dataclasses.replace(spec, shuffle=False, part="holdout")


def validation_batches(rank: Rank) -> Iterator[Tuple[Any, Any]]:
    """One pass over the rank's validation rows, on its device (``ctx.validation_batches()``)."""
    if rank.dataset is None:
        raise RuntimeError("this run has no dataset: pass data=... to sparkdl.run")
    dataset, spec = validation_source(rank.dataset, rank.data_spec)
    for batch in finished_batches(rank.reader, dataset, spec, rank.rank, rank.world_size):
        yield move_batch(to_tensors(batch), rank.device, False)


def evaluate(
    rank: Rank,
    model: torch.nn.Module,
    loss: Optional[Any],
    metrics: Optional[Mapping[str, MetricFn]] = None,
) -> Dict[str, float]:
    """Mean loss and metrics over every rank's validation rows. Collective: call on every rank.

    Args:
        rank: the rank's state (:class:`~sparkdl._runtime.rank.Rank`).
        model: the model being trained (DDP-wrapped or not).
        loss: ``(output, label) -> scalar`` batch mean, or None to report only metrics.
        metrics: ``name -> fn(output, label)`` batch means; default the run's ``metrics=``.

    Returns:
        ``{"val_loss": ..., "val_<name>": ..., "val_samples": rows}``.
    """
    if metrics is None:
        spec = rank.data_spec
        metrics = dict(spec.validation.metrics) if spec is not None and spec.validation is not None else {}
    names = sorted(metrics)
    # The strategy's module without collectives in its forward (a sharded model's is a gathered copy).
    module = rank.strategy.evaluation_module(model)
    was_training = module.training
    module.eval()
    sums = torch.zeros(2 + len(names), dtype=torch.float64)
    try:
        with torch.no_grad():
            for step, (features, labels) in enumerate(validation_batches(rank)):
                if step % 50 == 0:
                    rank.liveness.advance(f"validation (batch {step + 1})")
                output = call_model(module, features)
                rows = batch_rows(features)
                sums[0] += rows
                if loss is not None:
                    sums[1] += _scalar(loss(output, labels), "loss") * rows
                for i, name in enumerate(names):
                    sums[2 + i] += _scalar(metrics[name](output, labels), f"metric {name!r}") * rows
    finally:
        module.train(was_training)
    sums = sums.to(rank.device)
    dist.all_reduce(sums)
    totals = sums.cpu().tolist()
    count = totals[0]
    if count == 0:
        raise ConfigError("the validation data holds no rows on any rank")
    result = {"val_samples": int(count)}
    if loss is not None:
        result["val_loss"] = totals[1] / count
    for i, name in enumerate(names):
        result[f"val_{name}"] = totals[2 + i] / count
    return result


def squeezed(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fn`` on a [B, 1] output and a [B] label, the output squeezed (not broadcast to [B, B],
    which would compute silently the wrong figure) and the label cast to the output's dtype."""

    def regression_loss(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        if output.dim() == label.dim() + 1 and output.shape[-1] == 1:
            output = output.squeeze(-1)
        return fn(output, label.to(output.dtype))

    return regression_loss


def accuracy(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Share of rows whose predicted class is the label: the argmax of the outputs, or for one
    output (a binary logit) whether it is positive."""
    if output.dim() == label.dim() + 1 and output.shape[-1] == 1:
        predicted = (output.squeeze(-1) > 0).to(label.dtype)
    else:
        predicted = output.argmax(dim=-1)
    return (predicted == label).float().mean()


#: The metrics known by name: ``metrics=["accuracy"]`` and ``--metric accuracy`` (one vocabulary).
METRICS: Dict[str, MetricFn] = {
    "accuracy": accuracy,
    "mae": squeezed(torch.nn.functional.l1_loss),
    "mse": squeezed(torch.nn.functional.mse_loss),
}


def named_metrics(metrics: Any) -> Any:
    """``metrics=`` with names resolved: a name or a list of names (``["accuracy"]``) from
    :data:`METRICS`, or a mapping whose values are functions or such names, becomes
    ``{name: fn}``; anything else is returned as it is (for the settings to check).

    Raises:
        ConfigError: a name :data:`METRICS` does not know.
    """
    given = metrics
    if isinstance(metrics, str):
        metrics = [metrics]
    if isinstance(metrics, (list, tuple)) and all(isinstance(name, str) for name in metrics):
        metrics = {name: name for name in metrics}
    if not isinstance(metrics, Mapping):
        return metrics
    unknown = [f for f in metrics.values() if isinstance(f, str) and f not in METRICS]
    if unknown:
        raise ConfigError(
            f"metrics={given!r}: unknown metric {unknown[0]!r}; named metrics are {', '.join(sorted(METRICS))} "
            f"(or pass {{name: fn(output, label) -> batch mean}})"
        )
    return {name: METRICS[f] if isinstance(f, str) else f for name, f in metrics.items()}


def _scalar(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"the {what} must return a scalar (the batch mean), got a tensor of shape {tuple(value.shape)}"
            )
        return float(value.detach().double().item())
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"the {what} must return a number or a scalar tensor, got {type(value).__name__}") from exc
