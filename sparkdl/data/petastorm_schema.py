"""Petastorm datasets on the driver: their Unischema (how fields are encoded) and whether
Petastorm can run here. Plain Parquet never imports Petastorm."""

from __future__ import annotations

import warnings

import pyarrow as pa
import pyarrow.fs as pafs

from sparkdl.data.columns import ColumnInfo
from sparkdl.errors import DataError


def petastorm_schema(url: str, fs: pafs.FileSystem, path: str):
    """The dataset's Unischema, or None for plain Parquet.

    Petastorm's ``materialize_dataset`` stores the Unischema in ``_common_metadata``; checking
    for that key first keeps plain datasets off Petastorm's slower legacy-pyarrow path.
    """
    import pyarrow.parquet as pq

    marker = f"{path.rstrip('/')}/_common_metadata"
    if fs.get_file_info(marker).type != pafs.FileType.File:
        return None
    with fs.open_input_file(marker) as handle:
        metadata = pq.read_schema(handle).metadata or {}
    if not any(key.startswith(b"dataset-toolkit.unischema") for key in metadata):
        return None
    problem = petastorm_problem()
    if problem:
        raise DataError(
            f"dataset {url!r} is a Petastorm dataset (its Unischema says how fields are encoded), and reading it needs "
            f"Petastorm, but {problem}: pip install 'sparkdl-torch[petastorm]' (PySpark 3.5 or 4.0 with pyarrow 14)"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Petastorm's legacy pyarrow calls warn on every use
        from petastorm.etl.dataset_metadata import get_schema_from_dataset_url

        return get_schema_from_dataset_url(url)


def petastorm_problem() -> str:
    """Why Petastorm cannot run in this environment, or "" when it can."""
    import importlib.util

    if importlib.util.find_spec("petastorm") is None:
        return "petastorm is not installed"
    major = int(pa.__version__.split(".")[0])
    if major >= 15:
        return f"pyarrow {pa.__version__} has no legacy ParquetDataset, which Petastorm 0.12 calls"
    return ""


def unischema_column(unischema, name: str, role: str) -> ColumnInfo:
    import numpy as np

    field = unischema.fields.get(name)
    if field is None:
        raise DataError(
            f"{role} column {name!r} is not in the Petastorm schema {unischema._name!r}; "
            f"its fields are: {', '.join(unischema.fields)}"
        )
    dtype = np.dtype(field.numpy_dtype)
    kind = {"f": "float", "i": "int", "u": "int", "b": "int", "S": "binary", "U": "string", "O": "string"}.get(
        dtype.kind, "other"
    )
    from petastorm.codecs import ScalarCodec

    # Scalar fields are stored as plain Parquet values; other codecs store bytes to decode.
    encoded = field.codec is not None and not isinstance(field.codec, ScalarCodec)
    type_name = f"{dtype} {tuple(field.shape)}" + (f" ({type(field.codec).__name__})" if encoded else "")
    return ColumnInfo(name, kind, tuple(field.shape), codec_field=field if encoded else None, type_name=type_name)
