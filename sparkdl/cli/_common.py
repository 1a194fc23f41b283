"""What two or more ``sparkdl`` commands share: the usage error, the Spark session, ``--model``-style
factory loading, metrics.json (configuration, versions, writing: to ``--output``, a path or any URL
sparkdl.filesystem opens, also for a usage error argparse finds) and per-rank rates of an epoch record."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

if TYPE_CHECKING:
    import torch


class UsageError(Exception):
    """A command-line argument is wrong; exit code 2."""


def spark_session(app_name: str, master: Optional[str]) -> Any:
    """The command's SparkSession: spark-submit's when it started the command (its master and
    ``--conf`` settings stand), else a new one on ``--master`` with Spark's console progress bar
    off: sparkdl prints its own progress lines, and the bar would cut into them."""
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(app_name)
    if not _under_spark_submit():
        builder = builder.config("spark.ui.showConsoleProgress", "false")
    if master:
        builder = builder.master(master)
    return builder.getOrCreate()


def session_running() -> bool:
    """Whether a Spark session runs in this process already (a notebook's, a test's): a command
    that finds one uses it and leaves it running; one it started itself it stops at its end
    (stopping lets executors shut down in order instead of racing the JVM's exit)."""
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession() is not None


def check_output(output: str) -> None:
    """``--output`` checked before anything starts: a scheme with no filesystem here, or a
    directory that cannot be written, is a :class:`UsageError` (exit 2) in one line."""
    from sparkdl.errors import ConfigError
    from sparkdl.filesystem import check_output as check

    try:
        check(output, "--output")
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def check_input(path: str, option: str) -> None:
    """An input (``--model``, ``--data``) whose scheme has no filesystem here is a :class:`UsageError`."""
    from sparkdl.errors import ConfigError
    from sparkdl.filesystem import check_input as check

    try:
        check(path, option)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def add_slot_wait_argument(parser: argparse.ArgumentParser) -> None:
    """``--slot-wait``, for every command that launches ranks."""
    parser.add_argument(
        "--slot-wait",
        type=float,
        default=30.0,
        dest="slot_wait_s",
        metavar="SECONDS",
        help="how long to wait for --num-workers free task slots (executors still starting) before failing (default 30)",
    )


def load_factory(spec: str) -> Callable[[], torch.nn.Module]:
    """The ``--model module:factory`` callable. ``module`` is imported as Python would, or else
    from the current directory (a console script's ``sys.path`` does not hold it: ``sparkdl train``
    and ``sparkdl compare`` run where ``models.py`` is). A module from the current directory is
    pickled by value: the executors have no copy of that directory."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--model {spec!r} must look like module:factory (e.g. models:make_model)")
    try:
        module = _import_model_module(module_name)
    except ImportError as exc:
        top = module_name.split(".")[0]
        if not _is_missing(exc, module_name):
            raise UsageError(
                f"--model {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        ship = f"; under spark-submit, ship it with --py-files {top}.py" if _under_spark_submit() else ""
        raise UsageError(
            f"--model {spec!r}: cannot import {module_name!r}: it is neither importable nor in the current directory "
            f"({os.getcwd()}); run the command where {top}.py is, or add its directory to PYTHONPATH{ship}"
        ) from exc
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise UsageError(f"--model {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(factory):
        raise UsageError(f"--model {spec!r} is not callable")
    return factory


def _import_model_module(name: str) -> Any:
    cwd = os.getcwd()
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = name.split(".")[0]
        if not _is_missing(exc, name):
            raise  # the module was found; something it imports is missing
        if not (os.path.isfile(os.path.join(cwd, top + ".py")) or os.path.isdir(os.path.join(cwd, top))):
            raise
        sys.path.append(cwd)  # last: the current directory never shadows an installed module
        module = importlib.import_module(name)
    if _from_directory(name.split(".")[0], cwd):
        _pickle_by_value(module)
    return module


def _is_missing(exc: ImportError, name: str) -> bool:
    """Whether ``exc`` says the module ``name`` (or a package on its path) is not there, rather
    than that something it imports is missing."""
    missing = getattr(exc, "name", None) or ""
    return isinstance(exc, ModuleNotFoundError) and (name == missing or name.startswith(missing + "."))


def _from_directory(top: str, directory: str) -> bool:
    """Whether the top-level module ``top`` was imported from ``directory`` itself (``top.py`` or
    the package ``top/`` there), not from somewhere below it such as a virtualenv."""
    path = getattr(sys.modules.get(top), "__file__", None)
    if not path:
        return False
    path = os.path.realpath(path)
    parent = (
        os.path.dirname(os.path.dirname(path)) if os.path.basename(path) == "__init__.py" else os.path.dirname(path)
    )
    return parent == os.path.realpath(directory)


def _pickle_by_value(module: Any) -> None:
    """Ships ``module``'s code with the pickled factory (both cloudpickles: the launch's, through
    Spark, and the one ``TorchModel.save`` writes ``model_fn.pkl`` with)."""
    import cloudpickle
    from pyspark import cloudpickle as spark_cloudpickle

    for pickler in (cloudpickle, spark_cloudpickle):
        try:
            pickler.register_pickle_by_value(module)
        except ValueError:  # already registered
            pass


def _under_spark_submit() -> bool:
    return "PYSPARK_GATEWAY_PORT" in os.environ  # set when spark-submit started this driver


def rank_rates(record: Dict[str, Any]) -> List[float]:
    """``[rank0_samples_per_sec, rank1_samples_per_sec, ...]`` of an epoch record."""
    rates = []
    while f"rank{len(rates)}_samples_per_sec" in record:
        rates.append(record[f"rank{len(rates)}_samples_per_sec"])
    return rates


def _config(args: argparse.Namespace) -> Dict[str, Any]:
    return {k: v for k, v in vars(args).items()}


def _write_metrics(output: str, document: Dict[str, Any]) -> None:
    """``output``/metrics.json (a path or URL), written whole: a reader sees the old document or the new."""
    from sparkdl.filesystem import url_join, write_json

    write_json(url_join(output, "metrics.json"), document)


def parse_arguments(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """``parser.parse_args(argv)``; a usage error argparse finds (exit 2, before the command could
    write anything) still leaves ``--output``/metrics.json when ``--output`` can be read from
    ``argv``: ``{"status": "failed", "error_kind": "usage", "exit_code": 2, "error": reason}``, so
    a scheduler reading it fails the task without retrying and shows the reason."""
    argv = list(sys.argv[1:] if argv is None else argv)
    started = time.time()
    reasons: List[str] = []
    report = parser.error

    def error(message: str) -> None:  # argparse's own: prints the usage and the message, exits 2
        reasons.append(message)
        report(message)

    parser.error = error  # type: ignore[method-assign]
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        output = output_in(parser, argv)
        if exc.code == 2 and reasons and output:
            _record_usage_error(parser.prog, output, reasons[0], started)
        raise
    finally:
        del parser.error


def output_in(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Optional[str]:
    """The ``--output`` value of ``argv`` as argparse would read it (``--output X``, ``--output=X``
    or an abbreviation no other option shares), without parsing the rest; None when absent."""
    options = [option for option in parser._option_string_actions if option.startswith("--")]
    found = None
    for index, token in enumerate(argv):
        if token == "--":
            break
        name, equals, value = token.partition("=")
        if (
            len(name) < 3
            or not "--output".startswith(name)
            or [o for o in options if o.startswith(name)] != ["--output"]
        ):
            continue
        if equals:
            found = value
        elif index + 1 < len(argv) and not argv[index + 1].startswith("-"):
            found = argv[index + 1]
    return found or None


def _record_usage_error(program: str, output: str, reason: str, started: float) -> None:
    document = {
        "status": "failed",
        "error": f"{program}: {reason}",
        "error_kind": "usage",
        "exit_code": 2,
        "wall_seconds": time.time() - started,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
    }
    try:
        _write_metrics(output, document)
    except Exception as exc:  # noqa: BLE001 - the usage error is the message; this is a note under it
        print(
            f"{program}: could not write metrics.json to --output {output!r}: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )


def error_kind(exc: BaseException) -> str:
    """What metrics.json's ``error_kind`` calls a failure: ``"usage"`` (a bad argument, exit 2),
    ``"input"`` (settings or data sparkdl refused: a ConfigError or DataError, exit 1; a retry
    fails the same way) or ``"runtime"`` (anything else, exit 1: a lost executor, a timeout...)."""
    from sparkdl.errors import ConfigError, DataError

    if isinstance(exc, UsageError):
        return "usage"
    return "input" if isinstance(exc, (ConfigError, DataError)) else "runtime"
