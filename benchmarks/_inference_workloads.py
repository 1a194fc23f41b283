"""The two workloads of ``benchmarks/inference.py``: their models, their Parquet data, and the
conversions every side but sparkdl writes by hand (rows to a tensor).

Imported on the executors too (the UDFs refer to these functions by module), so it imports
nothing but numpy, torch and Pillow at the top.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np
import torch

FEATURES = 64
CLASSES = 10
IMAGE_SIZE = 64
#: Files per dataset: Spark reads two files of about the same size as two partitions, one per
#: executor core (more, smaller files get packed into an odd number of partitions at some sizes,
#: which leaves a core idle at the end); the row groups let pyarrow and Spark read in pieces.
FILES = 2
ROW_GROUPS_PER_FILE = 8


class MLP(torch.nn.Module):
    """64-256-256-10, ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, CLASSES),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


class SmallCNN(torch.nn.Module):
    """conv 3->16, pool, conv 16->32, pool, linear to 10 (64x64 RGB in); ``forward(x)``, so that
    sparkdl's named input ``x`` reaches it as the peers' positional argument does."""

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(16, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        self.head = torch.nn.Linear(32 * (IMAGE_SIZE // 4) ** 2, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


# ---- the peers' conversions: what a user writes in a predict_batch_udf / pandas_udf -------------


def tabular_tensor(features: np.ndarray) -> torch.Tensor:
    """``[B, 64]`` float32 (predict_batch_udf hands the rows stacked already)."""
    return torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))


def tabular_series_tensor(series: Any) -> torch.Tensor:
    """A pandas Series of float32 arrays (a pandas_udf's batch) as ``[B, 64]``."""
    return tabular_tensor(np.vstack(series.to_numpy()))


def image_tensor(jpegs: Sequence[bytes]) -> torch.Tensor:
    """JPEG bytes decoded by Pillow, float32 in [0, 1], as the NCHW view of the decoded NHWC
    pixels (channels-last strides, no copy): what users of predict_batch_udf commonly write."""
    from PIL import Image

    pixels = np.stack([np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")) for jpeg in jpegs])
    return torch.from_numpy(pixels.astype(np.float32) / np.float32(255.0)).permute(0, 3, 1, 2)


def image_series_tensor(series: Any) -> torch.Tensor:
    return image_tensor(series.to_numpy())


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model on one column, and how each side turns that column into the model's input."""

    name: str
    unit: str
    column: str
    factory: Callable[[], torch.nn.Module]
    #: predict_batch_udf's input_tensor_shapes (None: the column's values as they are).
    tensor_shapes: Optional[Sequence[Sequence[int]]]
    #: predict_batch_udf's numpy batch -> tensor, a pandas_udf's Series -> tensor.
    numpy_tensor: Callable[[Any], torch.Tensor]
    series_tensor: Callable[[Any], torch.Tensor]

    def sparkdl_inputs(self) -> Dict[str, Any]:
        """``TorchModel.from_state``'s keyword arguments naming the input column(s)."""
        if self.name == "tabular":
            return {"feature_cols": [self.column]}
        from sparkdl import Image

        return {"inputs": {"x": Image(column=self.column, size=(IMAGE_SIZE, IMAGE_SIZE), channels=3)}}

    def arrow_tensor(self, column: Any) -> torch.Tensor:
        """A pyarrow column of a record batch as the model's input (the plain loop)."""
        if self.name == "tabular":
            # A copy: pyarrow's view is read-only, which torch warns about.
            return tabular_tensor(column.flatten().to_numpy().reshape(-1, FEATURES).copy())
        return image_tensor(column.to_pylist())

    def describe(self) -> str:
        if self.name == "tabular":
            return f"{FEATURES} float32 features (Parquet list<float>), MLP {FEATURES}-256-256-{CLASSES}"
        return (
            f"{IMAGE_SIZE}x{IMAGE_SIZE} RGB JPEG bytes (Parquet binary), CNN conv 3->16, pool, conv 16->32, "
            f"pool, linear to {CLASSES}"
        )


WORKLOADS = {
    "tabular": Workload("tabular", "rows", "features", MLP, [[FEATURES]], tabular_tensor, tabular_series_tensor),
    "images": Workload("images", "images", "image", SmallCNN, None, image_tensor, image_series_tensor),
}


# ---- the data ------------------------------------------------------------------------------------


def write_dataset(workload: Workload, path: str, rows: int, seed: int = 0) -> str:
    """``FILES`` snappy Parquet files of ``rows`` rows in all: the workload's column and an int64
    ``id`` (0..rows-1, which the correctness check sorts by)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(path, exist_ok=True)
    bounds = np.linspace(0, rows, FILES + 1).astype(int)
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        values = _tabular_column(start, stop, seed) if workload.name == "tabular" else _image_column(start, stop, seed)
        table = pa.table({"id": pa.array(np.arange(start, stop, dtype=np.int64)), workload.column: values})
        pq.write_table(
            table,
            os.path.join(path, f"part-{index:05d}.parquet"),
            row_group_size=max(1, -(-(stop - start) // ROW_GROUPS_PER_FILE)),
            compression="snappy",
        )
    return path


def _tabular_column(start: int, stop: int, seed: int) -> Any:
    import pyarrow as pa

    values = np.random.default_rng([seed, start]).standard_normal((stop - start, FEATURES), dtype=np.float32)
    offsets = pa.array(np.arange(0, values.size + 1, FEATURES, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.ravel()))


def _image_column(start: int, stop: int, seed: int) -> Any:
    import pyarrow as pa
    from make_images import draw, encode  # the image-pipeline benchmark's synthetic JPEGs

    return pa.array([encode(draw(index, IMAGE_SIZE, seed)[0]) for index in range(start, stop)], type=pa.binary())
