"""sparkdl's MLflow flavor: a ``TorchModel`` as an MLflow model.

A logged model's directory::

    MLmodel            flavors: python_function (loader: this module) and sparkdl; the signature
    torch_model/       a TorchModel.save directory: TorchModel.load reads it
    requirements.txt   the packages the pyfunc imports (sparkdl-torch, torch, pyspark, ...)
    python_env.yaml

``mlflow.pyfunc.load_model(uri).predict(pandas_df)`` and ``mlflow.pyfunc.spark_udf(spark, uri)``
predict with the same code as ``TorchModel.transform`` (:func:`sparkdl.model.predict_frame`):
a ``double`` per row for a one-number output, else ``array<double>`` (the pyfunc returns a
float64 Series, or an ``[rows, outputs]`` float64 array, which the Spark UDF turns into arrays).

The import path of this module is written into every logged model's ``MLmodel`` as its pyfunc
loader: moving it breaks models already logged. Loading one unpickles its model factory
(``torch_model/model_fn.pkl``): load only models you trust.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import inspect
import os
import platform
import shutil
import sys
import tempfile
from typing import Any, Dict, List, Mapping, Optional

import pandas as pd

from sparkdl._persistence.input_columns import column_infos, describe_columns, model_columns
from sparkdl._version import __version__
from sparkdl.errors import ConfigError
from sparkdl.model import TorchModel, predict_frame
from sparkdl.strategies.parameter_server.table_files import SAVED_TABLES

FLAVOR_NAME = "sparkdl"
#: The TorchModel directory inside a logged model.
DATA_DIR = "torch_model"
#: Spark's image struct (``spark.read.format("image")``), as an MLflow object: its int fields as
#: ``long`` (Python's ints, and Spark's ints upcast, pass MLflow's schema check; ``integer`` refuses
#: Python's).
_IMAGE_PROPERTIES = (("origin", "string"), ("height", "long"), ("width", "long"))
_IMAGE_PROPERTIES += (("nChannels", "long"), ("mode", "long"), ("data", "binary"))
_SCALAR_TYPES = {"float": "double", "int": "long", "bool": "boolean", "binary": "binary", "string": "string"}


def signature(model: TorchModel) -> Any:
    """The MLflow ``ModelSignature``: each input column's type as training saw it, and the
    prediction column (``double``, or ``array<double>`` for several outputs)."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import Array, ColSpec, DataType, Schema

    if model.input_columns is None:
        raise ConfigError(
            "this TorchModel does not record its input columns' types (a model saved by an older sparkdl, or "
            "made by TorchModel.from_state without example=): pass example= (a few input rows) to log it"
        )
    inputs = [ColSpec(_column_type(name, column), name) for name, column in model.input_columns.items()]
    output = DataType.double if model.output_size == 1 else Array(DataType.double)
    return ModelSignature(inputs=Schema(inputs), outputs=Schema([ColSpec(output, model.getPredictionCol())]))


def _column_type(name: str, column: Mapping[str, Any]) -> Any:
    from mlflow.types.schema import Array, DataType, Object, Property

    kind = column["kind"]
    if kind == "image_struct":
        return Object([Property(field, DataType[dtype]) for field, dtype in _IMAGE_PROPERTIES])
    if kind not in _SCALAR_TYPES:
        raise ConfigError(
            f"input column {name!r} holds {column.get('type') or kind}, which an MLflow signature cannot describe"
        )
    spec = DataType[_SCALAR_TYPES[kind]]
    for _ in column["shape"]:
        spec = Array(spec)
    return spec


def save_model(path: str, torch_model: TorchModel, mlflow_model: Any = None, signature: Any = None, **_: Any) -> None:
    """Writes ``torch_model`` as an MLflow model into the new directory ``path`` (the flavor
    contract ``mlflow.models.Model.log`` calls)."""
    import mlflow.pyfunc
    from mlflow.models import Model

    os.makedirs(path)
    torch_model.save(os.path.join(path, DATA_DIR))
    mlflow_model = mlflow_model if mlflow_model is not None else Model()
    if signature is not None:
        mlflow_model.signature = signature
    with open(os.path.join(path, "requirements.txt"), "w") as out:
        out.write("".join(f"{requirement}\n" for requirement in _requirements()))
    with open(os.path.join(path, "python_env.yaml"), "w") as out:
        out.write(f"python: {platform.python_version()}\nbuild_dependencies:\n  - pip\ndependencies:\n")
        out.write("  - -r requirements.txt\n")
    mlflow.pyfunc.add_to_model(mlflow_model, loader_module=__name__, data=DATA_DIR, python_env="python_env.yaml")
    mlflow_model.add_flavor(FLAVOR_NAME, data=DATA_DIR, sparkdl_version=__version__)
    mlflow_model.save(os.path.join(path, "MLmodel"))


def _requirements() -> List[str]:
    """Pins of what the pyfunc imports, as installed here (local version labels such as ``+cpu``
    dropped: no index serves them under that name)."""
    from packaging.version import Version

    pins = []
    for distribution in ("sparkdl-torch", "torch", "pyspark", "cloudpickle", "numpy", "pandas", "pyarrow"):
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            version = __version__ if distribution == "sparkdl-torch" else None
        if version is not None:
            pins.append(f"{distribution}=={Version(version).public}")
    return pins


def log_model(
    model: TorchModel,
    name: str = "model",
    registered_model_name: Optional[str] = None,
    run_id: Optional[str] = None,
    example: Any = None,
) -> Any:
    """Logs ``model`` (see :func:`sparkdl.tracking.log_model`); returns MLflow's ``ModelInfo``."""
    from mlflow.models import Model

    if registered_model_name is not None and (not isinstance(registered_model_name, str) or not registered_model_name):
        raise ConfigError(f"registered_model_name={registered_model_name!r} must be a non-empty model name")
    if example is not None:
        model = model.copy()
        model.input_columns = describe_columns(example, model.input_plan)
    # MLflow 3 names a logged model with name=; MLflow 2 took artifact_path=.
    where = {"artifact_path": None, "name": name}
    if "name" not in inspect.signature(Model.log).parameters:
        where = {"artifact_path": name}
    return Model.log(
        **where,
        flavor=sys.modules[__name__],
        registered_model_name=registered_model_name,
        run_id=run_id,
        torch_model=model,
        signature=signature(model),
    )


def load_model(model_uri: str) -> TorchModel:
    """The ``TorchModel`` of a logged model (``models:/name/1``, ``runs:/id/model``, a path)."""
    import mlflow.artifacts

    tmp = tempfile.mkdtemp(prefix="sparkdl-mlflow-")
    local = mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=tmp)
    model = TorchModel.load(os.path.join(local, DATA_DIR))
    # A model with ShardedEmbedding table files looks its ids up in them, here: they stay (until
    # the process exits); anything else is read whole by now.
    if os.path.isdir(os.path.join(local, DATA_DIR, SAVED_TABLES)):
        atexit.register(shutil.rmtree, tmp, True)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return model


class PyfuncModel:
    """What ``mlflow.pyfunc.load_model`` wraps: ``predict`` of pandas rows."""

    def __init__(self, model: TorchModel) -> None:
        self.model = model
        self.module = model.module.eval()
        self.infos = column_infos(model.input_columns or {})

    def predict(self, model_input: Any, params: Optional[Dict[str, Any]] = None) -> Any:
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        plan = self.model.input_plan
        missing = [c for c in plan.columns if c not in frame.columns]
        if missing:
            raise ConfigError(
                f"column(s) {missing} not in the rows to predict; their columns are: {list(frame.columns)}"
            )
        columns = model_columns(frame, plan.columns, self.infos)
        values = predict_frame(self.module, plan, self.infos, columns, "the rows to predict")
        if self.model.output_size == 1:
            return pd.Series(values[:, 0], name=self.model.getPredictionCol(), index=frame.index)
        return values


def _load_pyfunc(path: str, model_config: Any = None) -> PyfuncModel:
    """MLflow's pyfunc loader hook: ``path`` is the model's ``torch_model`` directory."""
    return PyfuncModel(TorchModel.load(path))


__all__ = ["FLAVOR_NAME", "signature", "save_model", "log_model", "load_model", "PyfuncModel"]
