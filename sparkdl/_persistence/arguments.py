"""A ``TorchEstimator`` saved as its constructor arguments, from which it is rebuilt.

A saved estimator's directory: ``estimator.pkl`` (the arguments), ``estimator.json`` (the same,
readable; nothing reads it back) and Spark ML's ``metadata/`` line (:mod:`.stage`). The model
factory, optimizer, loss, strategy and every other setting are not Spark ML Params (Spark ML
saves Params as JSON); they are pickled with cloudpickle, as ``TorchModel.save`` pickles the model
factory, so a factory or lambda defined in a notebook survives. Loading them unpickles: load only
what you trust.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Mapping

import cloudpickle
import torch

from sparkdl import filesystem
from sparkdl._persistence.stage import read_stage_metadata, readable_path, restore_params, write_stage_metadata
from sparkdl._version import __version__
from sparkdl.errors import ConfigError

#: The pickled arguments, beside ``estimator.json`` (the same, as text, for reading) and Spark
#: ML's ``metadata/`` line.
ARGUMENTS_FILE = "estimator.pkl"


def write_arguments(path: str, instance: Any, arguments: Mapping[str, Any]) -> None:
    """Saves a stage made by ``type(instance)(**arguments)`` into directory ``path``."""
    owner = f"the {type(instance).__name__}"
    data = dump_arguments(arguments, owner)
    metadata = {"format": 1, "sparkdl_version": __version__, "torch_version": torch.__version__}
    metadata["arguments"] = {name: repr(value)[:500] for name, value in arguments.items()}
    _, fs, root = filesystem.open_url(path, "estimator path")
    fs.create_dir(root, recursive=True)
    filesystem.write_atomically(fs, filesystem.join(root, ARGUMENTS_FILE), data)
    filesystem.write_atomically(fs, filesystem.join(root, "estimator.json"), json.dumps(metadata, indent=2).encode())
    write_stage_metadata(fs, root, instance)  # last: Spark ML finds a stage only once it is whole


def read_arguments(cls: Any, path: str) -> Any:
    """The stage :func:`write_arguments` saved at ``path``: ``cls(**arguments)`` with the saved
    uid and Params."""
    _, fs, root = filesystem.open_url(readable_path(path, ARGUMENTS_FILE), "estimator path")
    if not filesystem.is_file(fs, filesystem.join(root, ARGUMENTS_FILE)):
        raise FileNotFoundError(f"no saved {cls.__name__} at {path!r} ({ARGUMENTS_FILE} is missing)")
    arguments = load_arguments(filesystem.read_bytes(fs, filesystem.join(root, ARGUMENTS_FILE)), path)
    return restore_params(cls(**arguments), read_stage_metadata(fs, root))


def dump_arguments(arguments: Mapping[str, Any], owner: str) -> bytes:
    """cloudpickle of ``arguments``; an argument that cannot be pickled is named in a
    ``ConfigError`` (``owner`` names the stage in it)."""
    try:
        return cloudpickle.dumps(dict(arguments))
    except Exception as exc:  # noqa: BLE001 - pickling raises many types; the culprit is named below
        for name, value in arguments.items():
            try:
                cloudpickle.dumps(value)
            except Exception as inner:  # noqa: BLE001
                raise ConfigError(
                    f"{owner} cannot be saved: its argument {name}= ({type(value).__name__}) cannot be pickled "
                    f"({type(inner).__name__}: {inner}). Pass a value that pickles: data as a URL or a table "
                    f"connector instead of a DataFrame, functions instead of objects holding sessions or files"
                ) from inner
        raise ConfigError(f"{owner} cannot be saved: its arguments cannot be pickled ({exc})") from exc


def load_arguments(data: bytes, where: str) -> Dict[str, Any]:
    """The arguments :func:`dump_arguments` wrote; code they refer to must be importable."""
    try:
        arguments = cloudpickle.loads(data)
    except ImportError as exc:
        raise ImportError(
            f"the estimator saved in {where!r} refers to code that is not importable here ({exc}); "
            f"make the module that defines its model, optimizer or loss importable"
        ) from exc
    if not isinstance(arguments, dict):
        raise ConfigError(f"{where!r} does not hold a saved estimator's arguments (found {type(arguments).__name__})")
    return arguments
