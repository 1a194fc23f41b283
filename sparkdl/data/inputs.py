"""Input specs: how each model input is built from Parquet columns.

``TorchEstimator(inputs={...})`` maps every model input name to one of:

* a column name — the column as it is (``"user_id"``: an integer id stays int64 for an
  ``Embedding``; floats become float32; a fixed-length array becomes a matrix);
* a list of columns — numeric and array columns concatenated into one float32 matrix
  (what ``feature_cols`` does);
* :class:`Image` — encoded images (PNG/JPEG/WebP bytes, Spark's ``format("image")`` struct,
  or a Petastorm image/ndarray codec field) decoded to float ``[B, C, H, W]`` in [0, 1];
* :class:`Sequence` — variable-length integer arrays padded into one int64 ``[B, L]`` tensor.

The model is called as ``model(**inputs)``. ``feature_cols`` is the one-positional-input case
of the same machinery (:meth:`InputPlan.from_feature_cols <sparkdl.data.plan.InputPlan.from_feature_cols>`).

Every batch goes through two steps, both run by :class:`~sparkdl.data.plan.InputPlan`
(:mod:`sparkdl.data.plan`) for every reader, validation and ``TorchModel.transform``, spec by
spec as defined here (the column conversions are :mod:`sparkdl.data.columns`):

1. :meth:`InputSpec.extract` turns a chunk of named columns (pyarrow or numpy, as the reader
   has them) into cheap row-aligned numpy arrays — dense matrices, id vectors, sequences padded
   to ``max_length`` with their lengths, images still encoded. These are what the shuffle
   buffer mixes and cuts into batches (:mod:`sparkdl.data.batching`).
2. :meth:`InputSpec.finish` turns one batch of those into the model's inputs — images decoded,
   resized, augmented and normalized, sequences trimmed to the batch's longest row — on the
   decode threads, ahead of the training step.

Between the two, the shard cache (:mod:`sparkdl.data.shard_cache`) may keep a chunk for the
passes after the first: :meth:`InputSpec.keep` gives the form it keeps — for images the decoded
and resized pixels, so a later pass decodes nothing, while :meth:`~InputSpec.finish` still crops,
flips and normalizes them per batch (identical batches either way).
"""

from __future__ import annotations

import dataclasses
import typing as t

import numpy as np

from sparkdl.data.columns import (
    ColumnData,
    ColumnInfo,
    binary_values,
    codec_images,
    numeric_values,
    object_values,
    padded_sequences,
    spark_image_structs,
)
from sparkdl.data.pixels import ImageDecodeError, decoded_pixels, random_crops
from sparkdl.errors import ConfigError, DataError

#: Keys of the row-aligned arrays that are not model inputs.
LABEL_KEY = "\x00label"
POSITION_KEY = "\x00position"
#: The input name of the one positional input of ``feature_cols`` mode.
POSITIONAL = "features"


class InputSpec:
    """Base of the input specs: what one model input is built from and how."""

    #: True when :meth:`finish` is costly per row (decoding): batches then finish on the
    #: decode threads.
    expensive: t.ClassVar[bool] = False

    def source_columns(self) -> t.Tuple[str, ...]:
        raise NotImplementedError

    def check(self, role: str, infos: t.Mapping[str, ColumnInfo], where: str) -> None:
        """Raises ConfigError/DataError when the columns cannot feed this input (driver side)."""
        raise NotImplementedError

    def extract(
        self, key: str, role: str, columns: t.Mapping[str, ColumnData], infos: t.Mapping[str, ColumnInfo], source: str
    ) -> t.Dict[str, np.ndarray]:
        """Row-aligned numpy arrays of a chunk (step 1), under ``key`` and ``key + suffix``."""
        raise NotImplementedError

    def finish(
        self, key: str, role: str, arrays: t.Mapping[str, np.ndarray], rng: t.Optional[np.random.Generator]
    ) -> t.Dict[str, np.ndarray]:
        """The model inputs of one batch (step 2); ``rng`` is set for training batches only."""
        return {key: arrays[key]}

    def keep(self, key: str, role: str, arrays: t.Mapping[str, np.ndarray], threads: int) -> t.Dict[str, np.ndarray]:
        """The arrays of a chunk's step-1 output the shard cache keeps in another form, one that
        :meth:`finish` turns into the same model inputs with less work (none here: a chunk is
        kept as extracted). ``threads``: how many threads the conversion may use."""
        return {}

    def kept_row_bytes(self) -> t.Optional[int]:
        """Bytes a row of this input takes in the form :meth:`keep` gives, when that is not its
        Parquet bytes (the shard cache's estimate); None: about its Parquet bytes."""
        return None

    def output_names(self, key: str) -> t.Tuple[str, ...]:
        return (key,)

    def to_json(self) -> t.Dict[str, t.Any]:
        return {"type": type(self).__name__, **dataclasses.asdict(self)}


# ---- the public specs --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Image(InputSpec):
    """Encoded images, decoded on the executors to float ``[B, C, H, W]`` in [0, 1].

    Args:
        column: a binary column of PNG/JPEG/WebP/BMP/GIF/TIFF bytes (any size; the ``content``
            column of ``spark.read.format("binaryFile")``), the struct column of
            ``spark.read.format("image")``, or a Petastorm field stored with an image or
            ndarray codec.
        size: ``(height, width)`` every image is resized to (bilinear; no resize when it already
            has that size).
        channels: 1 (grayscale) or 3 (RGB); images are converted (RGBA drops alpha, grayscale is
            repeated for 3).
        mean, std: per-channel normalization ``(x - mean) / std`` after scaling to [0, 1]
            (e.g. ImageNet's ``(0.485, 0.456, 0.406)``, ``(0.229, 0.224, 0.225)``).
        random_crop: training only: pad every side by this many pixels (zeros) and crop a random
            ``size`` window (CIFAR-style); 0 turns it off.
        random_flip: training only: flip each image horizontally with probability 0.5.

    Augmentations are seeded by the run's seed, the rank and the batch's place in the stream, so
    a resumed run sees the same augmented batches; validation and ``transform`` never augment.
    """

    column: str
    size: t.Tuple[int, int]
    channels: int = 3
    mean: t.Optional[t.Tuple[float, ...]] = None
    std: t.Optional[t.Tuple[float, ...]] = None
    random_crop: int = 0
    random_flip: bool = False

    expensive: t.ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_column_name(self.column, "Image")
        size = tuple(self.size) if isinstance(self.size, (tuple, list)) else self.size
        if not (isinstance(size, tuple) and len(size) == 2 and all(_positive_int(v) for v in size)):
            raise ConfigError(f"Image({self.column!r}): size={self.size!r} must be (height, width) in pixels")
        object.__setattr__(self, "size", size)
        if self.channels not in (1, 3):
            raise ConfigError(f"Image({self.column!r}): channels={self.channels!r} must be 1 (grayscale) or 3 (RGB)")
        for name in ("mean", "std"):
            value = getattr(self, name)
            if value is None:
                continue
            value = tuple(float(v) for v in value) if isinstance(value, (tuple, list)) else (float(value),)
            if len(value) == 1:
                value = value * self.channels
            if len(value) != self.channels:
                raise ConfigError(
                    f"Image({self.column!r}): {name}={getattr(self, name)!r} needs one value per channel ({self.channels})"
                )
            object.__setattr__(self, name, value)
        if self.std is not None and any(v <= 0 for v in self.std):
            raise ConfigError(f"Image({self.column!r}): std={self.std!r} must be positive")
        if not isinstance(self.random_crop, int) or self.random_crop < 0:
            raise ConfigError(
                f"Image({self.column!r}): random_crop={self.random_crop!r} must be a padding in pixels >= 0"
            )

    def source_columns(self) -> t.Tuple[str, ...]:
        return (self.column,)

    def check(self, role: str, infos: t.Mapping[str, ColumnInfo], where: str) -> None:
        info = infos[self.column]
        if info.kind in ("binary", "image_struct"):
            return
        if info.codec_field is not None and info.kind == "int" and len(info.shape) in (2, 3):
            return  # a Petastorm image (CompressedImageCodec) or uint8 ndarray field
        raise DataError(
            f"{role} column {self.column!r} in {where} has type {info.type_name}; sparkdl.Image needs a binary column "
            f"of encoded images, a spark.read.format('image') struct, or a Petastorm image field"
        )

    def extract(self, key, role, columns, infos, source):
        info = infos[self.column]
        values = columns[self.column]
        if info.kind == "image_struct":
            items = spark_image_structs(values, role, self.column, source)
        elif info.codec_field is not None:
            items = codec_images(values, info, role, self.column, source)
        else:
            items = binary_values(values, role, self.column, source)
        return {key: items}

    def finish(self, key, role, arrays, rng):
        pixels = self._pixels(arrays[key], role, arrays.get(POSITION_KEY), threads=1)
        fresh = pixels is not arrays[key]  # decoded here, not handed in (kept pixels are the shard cache's)
        images = pixels.transpose(0, 3, 1, 2)  # NHWC -> NCHW
        if rng is not None and self.random_crop:
            images, fresh = random_crops(images, self.random_crop, rng), True
        if rng is not None and self.random_flip:
            flip = rng.random(len(images)) < 0.5
            images = images if fresh else images.copy()  # never flips what came in
            images[flip] = images[flip, :, :, ::-1]
        result = images.astype(np.float32) * np.float32(1.0 / 255.0)
        if self.mean is not None:
            result -= np.asarray(self.mean, dtype=np.float32).reshape(1, -1, 1, 1)
        if self.std is not None:
            result /= np.asarray(self.std, dtype=np.float32).reshape(1, -1, 1, 1)
        # NCHW indexing over NHWC memory (what the transpose and astype leave): torch reads it
        # as channels_last, the layout its CPU convolutions run fastest on (1.8x on a small CNN,
        # docs/performance.md); a contiguous NCHW copy would also cost a pass over the batch.
        return {key: result}

    def keep(self, key, role, arrays, threads):
        # Crops, flips and normalization come after the resize and depend on the batch's seed:
        # the resized pixels are the last thing every pass shares, so the cache keeps those.
        return {key: self._pixels(arrays[key], role, arrays.get(POSITION_KEY), threads)}

    def kept_row_bytes(self) -> int:
        height, width = self.size
        return height * width * self.channels

    def _pixels(self, items: t.Any, role: str, positions: t.Optional[np.ndarray], threads: int) -> np.ndarray:
        """The rows' decoded, resized pixels (:func:`~sparkdl.data.pixels.decoded_pixels`), a
        row that cannot be decoded named by its place in ``positions``."""
        try:
            return decoded_pixels(items, self.size, self.channels, threads)
        except ImageDecodeError as exc:
            raise RowError(
                exc.row, positions, f"{role} column {self.column!r}: cannot decode an image ({exc.reason})"
            ) from exc.__cause__


@dataclasses.dataclass(frozen=True)
class Sequence(InputSpec):
    """Variable-length integer arrays as one int64 tensor ``[B, L]``.

    Each batch is padded with ``pad_value`` to its longest row (at least 1 column), and never
    beyond ``max_length``: longer rows are truncated to their first ``max_length`` values.

    Args:
        column: an ``array<int>`` column (any length per row; empty arrays are allowed).
        max_length: the longest sequence the model sees.
        pad_value: the value padding takes (e.g. -100 for a token-tagging label, which
            ``cross_entropy`` ignores).
        lengths_input: also pass each row's length (after truncation) as an int64 ``[B]`` model
            input of this name (e.g. for ``pack_padded_sequence``).
        mask_input: also pass a bool ``[B, L]`` mask, True on real values, as a model input of
            this name (e.g. a transformer's ``src_key_padding_mask = ~mask``).
    """

    column: str
    max_length: int
    pad_value: int = 0
    lengths_input: t.Optional[str] = None
    mask_input: t.Optional[str] = None

    def __post_init__(self) -> None:
        _check_column_name(self.column, "Sequence")
        if not _positive_int(self.max_length):
            raise ConfigError(f"Sequence({self.column!r}): max_length={self.max_length!r} must be a positive integer")
        if not isinstance(self.pad_value, (int, np.integer)) or isinstance(self.pad_value, bool):
            raise ConfigError(f"Sequence({self.column!r}): pad_value={self.pad_value!r} must be an integer")
        for name in ("lengths_input", "mask_input"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.isidentifier()):
                raise ConfigError(
                    f"Sequence({self.column!r}): {name}={value!r} must be a model input name (an identifier)"
                )

    def source_columns(self) -> t.Tuple[str, ...]:
        return (self.column,)

    def check(self, role, infos, where):
        info = infos[self.column]
        if info.kind == "int" and len(info.shape) == 1:
            return
        detail = "arrays of non-integers" if len(info.shape) == 1 else "not an array"
        raise DataError(
            f"{role} column {self.column!r} in {where} has type {info.type_name} ({detail}); sparkdl.Sequence needs "
            f"arrays of integers (token ids), e.g. array<int>; cast it or tokenize it first"
        )

    def extract(self, key, role, columns, infos, source):
        padded, lengths = padded_sequences(
            columns[self.column], self.max_length, self.pad_value, role, self.column, source
        )
        return {key: padded, key + "\x00lengths": lengths}

    def finish(self, key, role, arrays, rng):
        lengths = arrays[key + "\x00lengths"]
        longest = max(1, int(lengths.max()) if len(lengths) else 1)
        values = np.ascontiguousarray(arrays[key][:, :longest])
        out = {key: values}
        if self.lengths_input:
            out[self.lengths_input] = lengths.astype(np.int64)
        if self.mask_input:
            out[self.mask_input] = np.arange(longest)[None, :] < lengths[:, None]
        return out

    def output_names(self, key):
        return (key,) + tuple(n for n in (self.lengths_input, self.mask_input) if n)


# ---- the internal specs behind a column name and a list of columns -----------------------------


@dataclasses.dataclass(frozen=True)
class Dense(InputSpec):
    """Numeric and array columns concatenated into one float32 ``[B, features]`` matrix (one
    array column with a multi-dimensional value, e.g. a Petastorm tensor, keeps its shape)."""

    columns: t.Tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple(self.columns))
        if not self.columns:
            raise ConfigError("an input's list of columns is empty: name at least one column")
        for column in self.columns:
            _check_column_name(column, "a list of columns")

    def source_columns(self):
        return self.columns

    def check(self, role, infos, where):
        for column in self.columns:
            info = infos[column]
            if info.kind not in ("float", "int"):
                raise DataError(
                    f"{role} column {column!r} has type {info.type_name}, which is not numeric; "
                    f"{_plural(role)} must be numbers or arrays of numbers"
                )

    def extract(self, key, role, columns, infos, source):
        arrays = [numeric_values(columns[c], infos[c], role, source) for c in self.columns]
        if len(arrays) == 1 and arrays[0].ndim > 2:
            features = arrays[0]
        else:
            features = (
                np.concatenate([a.reshape(len(a), -1) for a in arrays], axis=1)
                if len(arrays) > 1
                else arrays[0].reshape(len(arrays[0]), -1)
            )
        features = np.ascontiguousarray(features, dtype=np.float32)
        # min() propagates NaN: one pass, without isnan's boolean copy (measured: two thirds of the time).
        if features.size and np.isnan(features.min()):
            bad = [c for c, a in zip(self.columns, arrays) if np.isnan(a.astype(np.float32)).any()]
            raise DataError(f"{role} column(s) {', '.join(bad)} contain NaN or null values in {source}")
        return {key: features}


@dataclasses.dataclass(frozen=True)
class Column(InputSpec):
    """One column as it is: integers as int64, floats as float32, booleans as bool, a
    fixed-length array as a matrix; strings and bytes stay Python objects, for ``transform_fn``."""

    column: str

    def __post_init__(self) -> None:
        _check_column_name(self.column, "an input")

    def source_columns(self):
        return (self.column,)

    def check(self, role, infos, where):
        info = infos[self.column]
        if role == "label" and info.kind not in ("float", "int", "bool"):
            raise DataError(
                f"label column {self.column!r} has type {info.type_name}, which is not numeric; labels must be numbers "
                f"or arrays of numbers (sparkdl.Sequence for variable-length labels)"
            )
        if info.kind not in ("float", "int", "bool", "string", "binary"):
            raise DataError(
                f"{role} column {self.column!r} in {where} has type {info.type_name}, which sparkdl cannot read as a tensor"
            )

    def extract(self, key, role, columns, infos, source):
        info = infos[self.column]
        values = columns[self.column]
        if info.kind in ("string", "binary"):
            return {key: object_values(values, role, self.column, source)}
        array = numeric_values(values, info, role, source)
        if array.dtype.kind == "f":
            if np.isnan(array).any():
                raise DataError(f"{role} column {self.column} contains NaN or null values in {source}")
            array = array.astype(np.float32, copy=False)
        elif array.dtype.kind in "iub":
            array = array.astype(np.int64, copy=False)
        return {key: np.ascontiguousarray(array)}


_SPEC_TYPES = {cls.__name__: cls for cls in (Image, Sequence, Dense, Column)}


def spec_from_json(document: t.Mapping[str, t.Any]) -> InputSpec:
    document = dict(document)
    cls = _SPEC_TYPES.get(document.pop("type", None))
    if cls is None:
        raise ValueError(f"unknown input spec in saved metadata: {document!r}")
    for name in ("size", "mean", "std", "columns"):
        if document.get(name) is not None:
            document[name] = tuple(document[name])
    return cls(**document)


class RowError(Exception):
    """A row of a batch failed in step 2; :meth:`InputPlan.finish <sparkdl.data.plan.InputPlan.finish>`
    names its file and row group."""

    def __init__(self, row: int, positions: t.Optional[np.ndarray], message: str) -> None:
        super().__init__(message)
        self.row, self.positions, self.message = row, positions, message


def _check_column_name(column: t.Any, what: str) -> None:
    if not isinstance(column, str) or not column:
        raise ConfigError(f"{what}: column={column!r} must be a column name")


def _positive_int(value: t.Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0


def _plural(role: str) -> str:
    return "features" if role == "feature" else ("labels" if role == "label" else "inputs")
