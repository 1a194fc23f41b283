"""Executor side: running the model on a scoring task's device.

The device is the one Spark assigned the task, chosen by the same rules as training
(:func:`sparkdl._runtime.device.select_device`: ``use_gpu`` True, False or None), so an
inference stage with ``resources=sparkdl.Resources(gpus=1)`` scores on its GPU. On a GPU the
host batch is pinned and copied without blocking the host, and a batch that runs out of GPU
memory is split in halves and retried (the task then goes on with the size that fitted) instead
of failing the task; ``precision`` autocasts the forward pass.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch

from sparkdl._runtime.device import CUDA_VISIBLE_DEVICES, DeviceAssignment, select_device, selected
from sparkdl.data.batching import batch_rows, slice_rows
from sparkdl.errors import ConfigError
from sparkdl.inference.call_rows import chunked_call
from sparkdl.inference.frozen import call_rows_for, model_for
from sparkdl.inference.outputs import named_outputs

logger = logging.getLogger("sparkdl.inference")

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def current_task() -> Any:
    """The Spark task this runs in; None outside one, or where pyspark is not installed (the
    device check, ``benchmarks/gpu_check.py``, runs the scorer on a GPU host without Spark)."""
    try:
        from pyspark import TaskContext
    except ImportError:
        return None
    return TaskContext.get()


@contextlib.contextmanager
def task_device(use_gpu: Optional[bool]) -> Iterator[DeviceAssignment]:
    """The scoring task's device, made current for the block. Outside a Spark task nothing is
    assigned: the current CUDA device counts as the task's when there is one and ``use_gpu`` is
    not False (a local check), else the CPU."""
    context = current_task()
    available = use_gpu is not False and torch.cuda.is_available()
    if context is not None:
        resources = {name: [str(a) for a in info.addresses] for name, info in context.resources().items()}
    else:
        resources = {"gpu": [str(torch.cuda.current_device())]} if available else {}
    assignment = select_device(
        resources,
        use_gpu,
        available,
        torch.cuda.device_count() if available else 0,
        visible_devices=os.environ.get(CUDA_VISIBLE_DEVICES),
        cuda_build=torch.version.cuda,
    )
    if assignment.warning:
        logger.warning(assignment.warning)
    with selected(assignment):
        yield assignment


class ModelRunner:
    """Calls the model on host batches: ``{head: float32 [rows, values]}`` per call.

    Args:
        module: the model, already on ``device``.
        device: where it runs.
        precision: None, ``bf16`` or ``fp16`` (autocast).
        batch_size: the most rows one call may take; lowered for good when a batch runs out
            of GPU memory.
        key: the model's identity (its cache key), under which a frozen graph of it is kept.
        optimize: "auto": a frozen graph of the model where it is the same and faster
            (:mod:`sparkdl.inference.frozen`; on a CPU without ``precision``); "off": the module.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        device: torch.device,
        precision: Optional[str],
        batch_size: int,
        key: Optional[str] = None,
        optimize: str = "auto",
    ):
        self.module, self.device, self.precision = module, device, precision
        self.batch_size = batch_size
        self.key = key
        self.may_freeze = optimize == "auto" and key is not None and precision is None and device.type == "cpu"

    def __call__(self, inputs: Any) -> Dict[str, np.ndarray]:
        rows = batch_rows(inputs)
        size = self.batch_size  # a split below may lower it: these slices keep theirs
        if rows > size:
            return _joined([self(slice_rows(inputs, start, start + size)) for start in range(0, rows, size)])
        try:
            return self._forward(inputs)
        except torch.OutOfMemoryError as exc:
            if rows <= 1:
                raise ConfigError(
                    f"one row does not fit in the memory of {self.device} ({exc}): score on a larger device or with "
                    f"precision='bf16', or use_gpu=False"
                ) from exc
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.batch_size = max(1, rows // 2)
            logger.warning(
                "a batch of %d rows ran out of memory on %s; scoring in batches of %d from now on",
                rows,
                self.device,
                self.batch_size,
            )
            return self(inputs)

    def _forward(self, inputs: Any) -> Dict[str, np.ndarray]:
        tensors = _to_device(inputs, self.device)
        autocast = (
            torch.autocast(self.device.type, dtype=_AUTOCAST[self.precision])
            if self.precision
            else contextlib.nullcontext()
        )
        model, call_rows = self.module, None
        if self.may_freeze:
            model = model_for(self.module, self.key, self.device, tensors)
            call_rows = call_rows_for(self.key, self.device, tensors)
        with torch.inference_mode(), autocast:
            out = chunked_call(model, tensors, call_rows)
        rows = batch_rows(inputs)
        return {
            name: value.detach().reshape(rows, -1).to("cpu", torch.float32).numpy()
            for name, value in named_outputs(out).items()
        }


def _to_device(inputs: Any, device: torch.device) -> Any:
    def one(array: np.ndarray) -> torch.Tensor:
        with warnings.catch_warnings():
            # Arrow's buffers are read-only; inference mode never writes its inputs.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            tensor = torch.from_numpy(array)
        if device.type != "cuda":
            return tensor
        # Pinned, so the copy runs without holding the host (and overlaps the next batch's decode).
        return tensor.pin_memory().to(device, non_blocking=True)

    return {k: one(v) for k, v in inputs.items()} if isinstance(inputs, dict) else one(inputs)


def _joined(parts: list) -> Dict[str, np.ndarray]:
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
