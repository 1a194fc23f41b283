"""Child side of ``sparkdl.launch``: ``python -m sparkdl._task.runner DIR`` in every task.

Before the user's code runs it (1) dies with its task (``PR_SET_PDEATHSIG``, then checks the
parent is still the task that started it), (2) reads the job's secret from the pipe the task
left open for it (``SPARKDL_SECRET_FD``; never argv, never a file) and closes it, and (3)
replaces torch's ``env://`` rendezvous handler: ``dist.init_process_group()`` with its default
``init_method="env://"`` (or ``tcp://$MASTER_ADDR:$MASTER_PORT``) then joins the launch's authenticated store (a
:class:`~sparkdl._net.rendezvous_client.StoreClient` with the secret, keys under ``sparkdl/launch/``) instead of
building an unauthenticated torch ``TCPStore`` client. A script that changes ``MASTER_ADDR`` or
``MASTER_PORT`` gets torch's own handler for its own store; a ``TCPStore`` the script builds itself
on sparkdl's store fails its handshake (torch's client retries until its timeout, then raises).
(4) It raises glibc's allocator thresholds as a fit's task does (:mod:`sparkdl._task.allocator`;
left alone when the user's environment tunes or replaces the allocator).

Then it runs the target: a script as ``python script.py args`` would (``runpy``, ``__main__``,
``sys.argv``, the script's directory first on ``sys.path``), exiting with its status; or a
callable from ``DIR/target.pkl``, writing rank 0's return value to ``DIR/result.pkl`` and an
exception to ``DIR/error.json`` (type, message, traceback) for the task to report.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import traceback
from typing import Any, Dict, List, Tuple
from urllib.parse import urlparse

#: The store keys of a launched job's process groups (sparkdl's own rounds use ``sparkdl/gather/``).
STORE_PREFIX = "sparkdl/launch/"
#: Clients handed to torch: it keeps only their C++ half, so the Python objects live here.
_clients: List[Any] = []


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the kernel kills us when the task's thread ends
    parent = os.environ.pop("SPARKDL_PARENT_PID", None)
    if parent is not None and os.getppid() != int(parent):
        os._exit(70)  # the task ended before the signal was armed


def _read_secret() -> bytes:
    fd = int(os.environ.pop("SPARKDL_SECRET_FD"))
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def install_env_handler(address: Tuple[str, int], secret: bytes, encrypt: bool) -> None:
    """Makes torch's ``env://`` rendezvous join sparkdl's store at ``address`` (when
    ``MASTER_ADDR``/``MASTER_PORT`` still name it) with the job's secret."""
    import importlib

    import torch.distributed as dist

    # The module, not torch.distributed.rendezvous, the function it re-exports under that name.
    rendezvous = importlib.import_module("torch.distributed.rendezvous")

    from sparkdl._net.rendezvous_client import StoreClient

    original = rendezvous._rendezvous_handlers["env"]
    ours = (str(address[0]), str(int(address[1])))

    def env_handler(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30), **kwargs: Any):
        master = (os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""))
        if master != ours:  # the script chose its own store: torch's handler, as under torchrun
            yield from original(url, timeout=timeout, **kwargs)
            return
        query = dict(pair.split("=", 1) for pair in urlparse(url).query.split("&") if "=" in pair)
        rank = int(query.get("rank", os.environ.get("RANK", "-1")))
        world_size = int(query.get("world_size", os.environ.get("WORLD_SIZE", "-1")))
        client = StoreClient((ours[0], int(ours[1])), secret, rank, timeout, encrypt=encrypt, served_by="the driver")
        _clients.append(client)
        yield (dist.PrefixStore(STORE_PREFIX, client), rank, world_size)
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    original_tcp = rendezvous._rendezvous_handlers["tcp"]

    def tcp_handler(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30), **kwargs: Any):
        parsed = urlparse(url)
        if (parsed.hostname, str(parsed.port)) != ours:  # another store than sparkdl's: torch's handler
            yield from original_tcp(url, timeout=timeout, **kwargs)
            return
        query = dict(pair.split("=", 1) for pair in parsed.query.split("&") if "=" in pair)
        rank, world_size = int(query.get("rank", "-1")), int(query.get("world_size", "-1"))
        client = StoreClient((ours[0], int(ours[1])), secret, rank, timeout, encrypt=encrypt, served_by="the driver")
        _clients.append(client)
        yield (dist.PrefixStore(STORE_PREFIX, client), rank, world_size)
        raise RuntimeError("Unable to perform re-rendezvous using tcp:// method")

    rendezvous._rendezvous_handlers["env"] = env_handler
    rendezvous._rendezvous_handlers["tcp"] = tcp_handler  # tcp://MASTER_ADDR:MASTER_PORT names the same store


def _run_script(spec: Dict[str, Any]) -> int:
    import runpy

    script = spec["script"]
    sys.argv = [script, *spec["args"]]
    sys.path[0] = os.path.dirname(script)  # as `python script.py` (under -m it is the cwd)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - printed as Python would, from the script's frames on
        _print_from(_explained(exc), script)
        return 1
    return 0


def _explained(exc: BaseException) -> BaseException:
    """A framework's complaint about more than one process per task, in sparkdl's terms."""
    from sparkdl._task.frameworks import explain

    return explain(exc, int(os.environ.get("RANK", "-1")))


def _print_from(exc: BaseException, filename: str) -> None:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__)


def _run_callable(workdir: str, spec: Dict[str, Any]) -> int:
    import cloudpickle

    name, rank = spec["name"], spec["rank"]
    try:
        # Written by this child's own task, in its 0700 directory: a local file, never the network.
        with open(os.path.join(workdir, "target.pkl"), "rb") as handle:
            function, args = cloudpickle.load(handle)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        message = (
            f"the launched function {name} cannot be unpickled in its child process on rank {rank}: "
            f"{type(exc).__name__}: {exc} (the executors' Python must import what it refers to: ship modules with "
            f"--py-files, or define it in the driver's script or notebook so it is pickled by value)"
        )
        return _error(workdir, type(exc).__name__, message, exc)
    try:
        value = function(*args)
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
        value = None
    except BaseException as exc:  # noqa: BLE001 - reported to the driver with its traceback
        traceback.print_exc()
        exc = _explained(exc)
        return _error(workdir, type(exc).__name__, str(exc), exc)
    if rank == 0:  # only rank 0's value comes back
        try:
            payload = cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001
            return _error(
                workdir, type(exc).__name__, f"the return value of {name} on rank 0 cannot be pickled: {exc}", exc
            )
        path = os.path.join(workdir, "result.pkl")
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        os.replace(path + ".tmp", path)
    return 0


def _error(workdir: str, exc_type: str, message: str, exc: BaseException) -> int:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    fd = os.open(os.path.join(workdir, "error.json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"exc_type": exc_type, "message": message, "traceback": text}, handle)
    return 1


def main(argv: List[str]) -> int:
    _die_with_parent()
    workdir = argv[1]
    secret = _read_secret()
    with open(os.path.join(workdir, "spec.json"), "rb") as handle:
        spec = json.loads(handle.read().decode("utf-8"))
    install_env_handler(tuple(spec["store"]), secret, bool(spec["encrypt"]))
    del secret
    from sparkdl._task.allocator import keep_step_memory

    # A fresh process, as a fit's task is: its steps' memory stays in the heap from the first step.
    keep_step_memory()
    from sparkdl._task.frameworks import one_process_per_task

    # The child is this rank's one process: a framework starting more fails at once, naming the rank.
    with one_process_per_task(int(os.environ["RANK"])):
        if spec["kind"] == "script":
            return _run_script(spec)
        return _run_callable(workdir, spec)


if __name__ == "__main__":
    try:
        code = main(sys.argv)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream at exit
                pass
    sys.exit(code)
