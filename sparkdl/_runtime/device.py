"""Which device a task trains on: exactly the GPUs Spark assigned it, or the CPU.

Spark assigns GPUs to tasks (``spark.task.resource.gpu.amount`` with executors that discovered
GPUs through ``spark.executor.resource.gpu.discoveryScript``) and tells each task which ones in
``BarrierTaskContext.resources()["gpu"].addresses``. This module turns that assignment into a
``torch.device``, checks it, selects it for the task, and puts everything back afterwards.

How a GPU is selected — ``torch.cuda.set_device``, not ``CUDA_VISIBLE_DEVICES``
    sparkdl trains inside the Spark Python worker itself, and Spark reuses Python workers across
    tasks (``spark.python.worker.reuse``, on by default). The CUDA runtime reads
    ``CUDA_VISIBLE_DEVICES`` once, at its first use in the process (even
    ``torch.cuda.is_available()`` counts); setting it later has no effect. Narrowing it to the
    task's GPU, as TorchDistributor does for the *fresh* torchrun processes it starts, would
    therefore only work in the first task of a worker and would then pin that worker to that GPU
    for good: a later task of the same worker that Spark gives another GPU could not reach it.
    It would also break torch's NVML helpers (``torch.cuda.utilization`` and friends), which
    re-read the variable on every call to map device indices. So sparkdl leaves the executor's
    ``CUDA_VISIBLE_DEVICES`` alone (the process sees what the executor sees, in every task),
    selects the task's GPU with ``torch.cuda.set_device`` (as torchrun's ``LOCAL_RANK`` recipe
    does), and restores the previous current device when the task ends. ``ctx.device``,
    ``torch.device("cuda")`` and ``tensor.cuda()`` all mean the task's GPU; a hard-coded
    ``"cuda:0"`` does not.

Addresses
    Spark's addresses are what the discovery script printed. Like TorchDistributor, sparkdl
    reads them as ordinals among the GPUs the executor can see: with the executor's
    ``CUDA_VISIBLE_DEVICES`` unset, address ``"1"`` is GPU 1; with it set to ``"4,6"``, address
    ``"1"`` is physical GPU 6, which this process (seeing GPUs 4 and 6) calls ``cuda:1``. Either
    way the torch index is the address itself; :attr:`DeviceAssignment.physical_ids` names the
    GPUs as a child process's ``CUDA_VISIBLE_DEVICES`` would.

Keeping the chosen GPU busy (the copy-ahead of batches) is :mod:`sparkdl._runtime.device_feed`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from typing import Any, Callable, Dict, Iterator, Mapping, MutableMapping, Optional, Protocol, Sequence, Tuple

import torch

from sparkdl.errors import ConfigError

logger = logging.getLogger("sparkdl.device")

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: The Spark settings a GPU job needs; every "no GPU" error names them.
GPU_SETTINGS = (
    "spark.executor.resource.gpu.amount (GPUs per executor), "
    "spark.task.resource.gpu.amount=1 (GPUs per task) and "
    "spark.executor.resource.gpu.discoveryScript (a script that prints the executor's GPUs as "
    '{"name": "gpu", "addresses": ["0", "1"]}; on standalone workers spark.worker.resource.gpu.amount '
    "and spark.worker.resource.gpu.discoveryScript)"
)
_ORDINAL = re.compile(r"^(0|[1-9][0-9]*)$")


@dataclasses.dataclass(frozen=True)
class DeviceAssignment:
    """The device one task trains on, and how it was chosen.

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"``.
        index: torch's index of the task's GPU in this process (None on the CPU).
        spark_addresses: the task's ``gpu`` resource addresses, as Spark gave them (possibly
            several, possibly unused: see ``note``).
        physical_ids: the same GPUs as ``CUDA_VISIBLE_DEVICES`` names them (through the
            executor's own ``CUDA_VISIBLE_DEVICES``): what a child process that should see
            exactly the task's GPUs needs in its environment.
        note: one line for logs and run metadata: what was chosen and why.
        warning: set when the choice deserves the user's attention (a fallback to the CPU,
            GPUs left unused); sent to the driver as a warning.
    """

    device_type: str
    index: Optional[int]
    spark_addresses: Tuple[str, ...]
    physical_ids: Tuple[str, ...]
    note: str
    warning: Optional[str] = None

    @property
    def device(self) -> torch.device:
        """The ``torch.device`` to train on."""
        return torch.device("cuda", self.index) if self.device_type == "cuda" else torch.device("cpu")

    @property
    def visible_devices(self) -> str:
        """``CUDA_VISIBLE_DEVICES`` for a child process that should see exactly the task's GPUs."""
        return ",".join(self.physical_ids)


def no_gpu_message() -> str:
    """The error for ``use_gpu=True`` when Spark gave the task no GPU."""
    return f"use_gpu=True but Spark assigned no GPU to this task: set {GPU_SETTINGS}"


def physical_ids(addresses: Sequence[str], visible_devices: Optional[str]) -> Tuple[str, ...]:
    """Spark's GPU addresses as ``CUDA_VISIBLE_DEVICES`` entries.

    Args:
        addresses: the task's ``gpu`` addresses (ordinals among the executor's visible GPUs).
        visible_devices: the executor's ``CUDA_VISIBLE_DEVICES``, or None when unset.

    Raises:
        ConfigError: an address is not an ordinal, or points past the executor's visible GPUs.
    """
    bad = [a for a in addresses if not _ORDINAL.match(str(a))]
    if bad:
        raise ConfigError(
            f"Spark assigned GPU address(es) {bad} to this task; sparkdl needs GPU ordinals without zero "
            f"padding (0, 1, ...), as `nvidia-smi --query-gpu=index --format=csv,noheader` prints them: "
            f"fix the discovery script (spark.executor.resource.gpu.discoveryScript)"
        )
    if visible_devices is None:
        return tuple(str(a) for a in addresses)
    visible = [entry.strip() for entry in visible_devices.split(",") if entry.strip()]
    out = []
    for address in addresses:
        position = int(address)
        if position >= len(visible):
            raise ConfigError(
                f"Spark assigned GPU {address} to this task, but the executor's CUDA_VISIBLE_DEVICES="
                f"{visible_devices!r} makes only {len(visible)} GPU(s) visible; the discovery script must "
                f"number the GPUs the executor can see (0..{max(0, len(visible) - 1)})"
            )
        out.append(visible[position])
    return tuple(out)


def select_device(
    resources: Mapping[str, Sequence[str]],
    use_gpu: Optional[bool],
    cuda_available: bool,
    device_count: int,
    *,
    visible_devices: Optional[str] = None,
    cuda_build: Optional[str] = None,
) -> DeviceAssignment:
    """Chooses a task's device from its Spark resources. Pure: everything it reads is an argument.

    Rules:

    * ``use_gpu=False``: the CPU, whatever Spark assigned.
    * No ``gpu`` resource: the CPU for ``use_gpu=None``; :class:`ConfigError` naming the Spark
      settings for ``use_gpu=True``. GPUs torch can see but Spark did not assign are never used
      (another task may own them).
    * A ``gpu`` resource but no usable CUDA in torch: :class:`ConfigError` for ``use_gpu=True``;
      the CPU with a warning for ``use_gpu=None`` (auto means "GPUs when usable").
    * A ``gpu`` resource and CUDA: the first assigned GPU (one replica per task; extra GPUs are
      reported in ``warning``). An address torch cannot see is a :class:`ConfigError`.

    Args:
        resources: resource name -> addresses, as ``BarrierTaskContext.resources()`` gives them.
        use_gpu: True requires a GPU, False never uses one, None uses one when Spark assigns it.
        cuda_available: ``torch.cuda.is_available()`` in this process.
        device_count: ``torch.cuda.device_count()`` in this process.
        visible_devices: the executor's ``CUDA_VISIBLE_DEVICES`` (None when unset).
        cuda_build: ``torch.version.cuda`` (None for a CPU-only build of torch), for messages.

    Raises:
        ConfigError: see the rules above.
    """
    if use_gpu is not None and not isinstance(use_gpu, bool):  # 0/1 would compare equal to bools
        raise ConfigError(f"use_gpu={use_gpu!r} must be True, False or None (use GPUs when Spark assigns them)")
    addresses = tuple(str(a) for a in resources.get("gpu", ()))
    if use_gpu is False:
        unused = f"; the GPU(s) {', '.join(addresses)} Spark assigned stay unused" if addresses else ""
        return DeviceAssignment("cpu", None, addresses, (), f"cpu (use_gpu=False{unused})")
    if not addresses:
        if use_gpu:
            raise ConfigError(no_gpu_message())
        warning = None
        if cuda_available and device_count > 0:
            warning = (
                f"torch sees {device_count} CUDA device(s) but Spark assigned no GPU to this task, so it trains on the "
                f"CPU (sparkdl only uses GPUs Spark assigns); to train on GPUs set {GPU_SETTINGS}, or pass "
                f"use_gpu=False to silence this"
            )
        return DeviceAssignment("cpu", None, (), (), "cpu (Spark assigned no GPU)", warning)
    physical = physical_ids(addresses, visible_devices)
    named = _describe(addresses, physical)
    if not cuda_available:
        why = (
            f"torch {torch.__version__} is a CPU-only build; install a CUDA build of torch on the executors"
            if cuda_build is None
            else f"torch (CUDA {cuda_build}) finds no usable CUDA device: check the NVIDIA driver and the executor's "
            f"CUDA_VISIBLE_DEVICES"
        )
        message = f"Spark assigned {named} to this task, but torch has no CUDA: {why}"
        if use_gpu:
            raise ConfigError(message)
        return DeviceAssignment(
            "cpu",
            None,
            addresses,
            physical,
            f"cpu (Spark assigned {named}, torch has no CUDA)",
            f"{message}. Training on the CPU instead (use_gpu=None falls back; use_gpu=True makes this an error)",
        )
    index = int(addresses[0])
    if index >= device_count:
        where = f" with CUDA_VISIBLE_DEVICES={visible_devices!r}" if visible_devices is not None else ""
        raise ConfigError(
            f"Spark assigned {named} to this task, but torch sees only {device_count} CUDA device(s) in this "
            f"process{where}: the discovery script numbers GPUs differently from CUDA; it must print ordinals "
            f"0..{device_count - 1} of the GPUs the executor can see"
        )
    warning = None
    if len(addresses) > 1:
        warning = (
            f"Spark assigned {len(addresses)} GPUs ({', '.join(addresses)}) to this task; sparkdl trains one replica "
            f"per task, on the first ({addresses[0]}), so the others stay idle: use spark.task.resource.gpu.amount=1 "
            f"and one task per GPU (num_workers = number of GPUs)"
        )
    return DeviceAssignment(
        "cuda", index, addresses, physical, f"cuda:{index} (Spark {_describe(addresses[:1], physical[:1])})", warning
    )


def _describe(addresses: Sequence[str], physical: Sequence[str]) -> str:
    noun = "GPU" if len(addresses) == 1 else "GPUs"
    text = f"{noun} {','.join(addresses)}"
    if tuple(physical) != tuple(addresses):
        text += f" (physical {','.join(physical)} through the executor's CUDA_VISIBLE_DEVICES)"
    return text


def check_gpu_request(
    conf_get: Callable[[str], Optional[str]], use_gpu: Optional[bool], stage_gpus: Optional[int] = None
) -> None:
    """Driver-side check before launching: ``use_gpu=True`` needs Spark to assign GPUs to tasks.

    Fails in milliseconds instead of after the executors start. Only the obvious case is checked
    (no ``spark.task.resource.gpu.amount``, or a training stage profile without GPUs); each task
    checks what it really got.

    Args:
        conf_get: ``SparkConf.get``-like: setting name -> value or None.
        use_gpu: the run's ``use_gpu``.
        stage_gpus: GPUs per task of the training stage's own resource profile (``resources=``),
            which replaces the application's ``spark.task.resource.gpu.amount``; None: no profile.

    Raises:
        ConfigError: ``use_gpu=True`` and tasks request no GPU.
    """
    if use_gpu is not True:
        return
    if stage_gpus is not None:
        if stage_gpus <= 0:
            raise ConfigError(
                "use_gpu=True but the training stage's resources= ask for no GPUs per task: set "
                "sparkdl.Resources(gpus=1), with spark.executor.resource.gpu.amount and a discovery script"
            )
        return
    amount = conf_get("spark.task.resource.gpu.amount")
    try:
        requested = float(amount) if amount is not None else 0.0
    except ValueError:
        requested = 0.0
    if requested <= 0:
        raise ConfigError(
            f"use_gpu=True but this Spark application assigns no GPUs to tasks "
            f"(spark.task.resource.gpu.amount is {amount!r}): set {GPU_SETTINGS}"
        )


def check_assignments(ranks: Sequence[Mapping[str, Any]]) -> None:
    """Cross-rank check, on every rank, of what :func:`describe_for_peers` gathered.

    Raises:
        ConfigError: some ranks train on a GPU and others on the CPU (NCCL and gloo cannot mix
            in one process group), or two ranks were given the same GPU (NCCL cannot run two
            ranks of one group on one GPU: fractional ``spark.task.resource.gpu.amount``, or
            two workers on one host that discovered the same GPUs).
    """
    kinds = {str(r["type"]) for r in ranks}
    if len(kinds) > 1:
        listing = ", ".join(f"rank {i}: {r['type']}" for i, r in enumerate(ranks))
        raise ConfigError(
            f"ranks disagree on the device ({listing}): all ranks must train on GPUs or all on CPUs. With "
            f"use_gpu=None this happens when only some executors have GPUs or a CUDA build of torch; make the "
            f"executors alike, or pass use_gpu=False"
        )
    seen: Dict[str, int] = {}
    for rank, info in enumerate(ranks):
        uuid = info.get("uuid")
        if info["type"] != "cuda" or not uuid:
            continue
        if uuid in seen:
            other = seen[uuid]
            raise ConfigError(
                f"ranks {other} and {rank} were both given the same GPU ({uuid}; Spark address "
                f"{ranks[other].get('address')} on {ranks[other].get('host')}, address {info.get('address')} on "
                f"{info.get('host')}); NCCL needs one GPU per rank: use a whole GPU per task "
                f"(spark.task.resource.gpu.amount=1), and give workers that share a host distinct GPUs"
            )
        seen[uuid] = rank


def describe_for_peers(assignment: DeviceAssignment, host: str, uuid: Optional[str]) -> str:
    """This rank's entry for :func:`check_assignments`, as the string ``allGather`` carries."""
    return json.dumps(
        {
            "type": assignment.device_type,
            "address": assignment.spark_addresses[0] if assignment.spark_addresses else None,
            "host": host,
            "uuid": uuid,
        }
    )


class CudaControl(Protocol):
    """The two calls :func:`selected` makes (a fake in unit tests; torch.cuda otherwise)."""

    def current_device(self) -> int: ...

    def set_device(self, index: int) -> None: ...


@contextlib.contextmanager
def selected(
    assignment: DeviceAssignment,
    environ: Optional[MutableMapping[str, str]] = None,
    cuda: Optional[CudaControl] = None,
) -> Iterator[torch.device]:
    """Makes the assignment current for the block, and puts the process back afterwards.

    On CUDA: ``set_device(index)``, and the previous current device again at the end. Always:
    ``CUDA_VISIBLE_DEVICES`` is restored to its value at entry — sparkdl never changes it (see the
    module docstring), but user code in the task might, and the next task in this reused Python
    worker must read the executor's value to map its addresses.

    Args:
        assignment: what :func:`select_device` chose.
        environ: the environment to guard (``os.environ``).
        cuda: the CUDA calls (``torch.cuda``).
    """
    environ = os.environ if environ is None else environ
    saved_visible = environ.get(CUDA_VISIBLE_DEVICES)
    previous: Optional[int] = None
    if assignment.device_type == "cuda":
        cuda = cuda or torch.cuda
        previous = cuda.current_device()
        cuda.set_device(assignment.index)
    try:
        yield assignment.device
    finally:
        if previous is not None:
            cuda.set_device(previous)
        if saved_visible is None:
            environ.pop(CUDA_VISIBLE_DEVICES, None)
        else:
            environ[CUDA_VISIBLE_DEVICES] = saved_visible


def task_resources(barrier: Any) -> Dict[str, Sequence[str]]:
    """``BarrierTaskContext.resources()`` as plain ``name -> [addresses]``."""
    return {name: [str(a) for a in info.addresses] for name, info in barrier.resources().items()}


@contextlib.contextmanager
def task_device(
    barrier: Any, use_gpu: Optional[bool], all_gather: Optional[Callable[[str], Sequence[str]]] = None
) -> Iterator[DeviceAssignment]:
    """Task side: select this task's device from its Spark resources, check it against the other
    ranks, make it current, and restore the process afterwards. Collective: one ``all_gather``
    (the rendezvous store's, else the barrier's ``allGather``).

    Raises:
        ConfigError: see :func:`select_device` and :func:`check_assignments`.
    """
    resources = task_resources(barrier)
    available, count = False, 0
    if use_gpu is not False:
        # Reads CUDA_VISIBLE_DEVICES as the executor set it: sparkdl never changes it, and
        # selected() restores it after every task, so every task of a reused worker agrees.
        available = torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    assignment = select_device(
        resources,
        use_gpu,
        available,
        count,
        visible_devices=os.environ.get(CUDA_VISIBLE_DEVICES),
        cuda_build=torch.version.cuda,
    )
    if assignment.warning:
        logger.warning(assignment.warning)
    logger.info("device: %s", assignment.note)
    uuid = str(torch.cuda.get_device_properties(assignment.index).uuid) if assignment.device_type == "cuda" else None
    rank = barrier.partitionId()
    host = barrier.getTaskInfos()[rank].address.rsplit(":", 1)[0]
    gather = all_gather or barrier.allGather
    peers = [json.loads(entry) for entry in gather(describe_for_peers(assignment, host, uuid))]
    check_assignments(peers)
    with selected(assignment):
        yield assignment
