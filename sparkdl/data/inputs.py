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
of the same machinery (:meth:`InputPlan.from_feature_cols`).

Every batch goes through two steps, both defined here and used by every reader, validation and
``TorchModel.transform``:

1. :meth:`InputPlan.extract` turns a chunk of named columns (pyarrow or numpy, as the reader
   has them) into cheap row-aligned numpy arrays — dense matrices, id vectors, sequences padded
   to ``max_length`` with their lengths, images still encoded. These are what the shuffle
   buffer mixes and cuts into batches (:mod:`sparkdl.data.batching`).
2. :meth:`InputPlan.finish` turns one batch of those into the model's inputs — images decoded,
   resized, augmented and normalized, sequences trimmed to the batch's longest row — on the
   decode threads, ahead of the training step.
"""

from __future__ import annotations

import dataclasses
import io
import typing as t

import numpy as np
import pyarrow as pa

from sparkdl.data.dataset import ColumnInfo
from sparkdl.errors import ConfigError, DataError

#: Keys of the row-aligned arrays that are not model inputs.
LABEL_KEY = "\x00label"
POSITION_KEY = "\x00position"
#: The input name of the one positional input of ``feature_cols`` mode.
POSITIONAL = "features"

ColumnData = t.Any  # a pyarrow Array/ChunkedArray, a numpy array, or a pandas Series/DataFrame


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

    def extract(self, key: str, role: str, columns: t.Mapping[str, ColumnData], infos: t.Mapping[str, ColumnInfo], source: str) -> t.Dict[str, np.ndarray]:
        """Row-aligned numpy arrays of a chunk (step 1), under ``key`` and ``key + suffix``."""
        raise NotImplementedError

    def finish(self, key: str, role: str, arrays: t.Mapping[str, np.ndarray], rng: t.Optional[np.random.Generator]) -> t.Dict[str, np.ndarray]:
        """The model inputs of one batch (step 2); ``rng`` is set for training batches only."""
        return {key: arrays[key]}

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
                raise ConfigError(f"Image({self.column!r}): {name}={getattr(self, name)!r} needs one value per channel ({self.channels})")
            object.__setattr__(self, name, value)
        if self.std is not None and any(v <= 0 for v in self.std):
            raise ConfigError(f"Image({self.column!r}): std={self.std!r} must be positive")
        if not isinstance(self.random_crop, int) or self.random_crop < 0:
            raise ConfigError(f"Image({self.column!r}): random_crop={self.random_crop!r} must be a padding in pixels >= 0")

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
            items = _spark_image_structs(values, role, self.column, source)
        elif info.codec_field is not None:
            items = _codec_images(values, info, role, self.column, source)
        else:
            items = _binary_values(values, role, self.column, source)
        return {key: items}

    def finish(self, key, role, arrays, rng):
        items = arrays[key]
        positions = arrays.get(POSITION_KEY)
        height, width = self.size
        out = np.empty((len(items), height, width, self.channels), dtype=np.uint8)
        for i, item in enumerate(items):
            out[i] = self._decode(item, role, i, positions)
        images = out.transpose(0, 3, 1, 2)  # NHWC -> NCHW
        if rng is not None and self.random_crop:
            images = _random_crop(images, self.random_crop, rng)
        if rng is not None and self.random_flip:
            flip = rng.random(len(images)) < 0.5
            images = images.copy() if not images.flags.writeable else images
            images[flip] = images[flip, :, :, ::-1]
        result = images.astype(np.float32) * np.float32(1.0 / 255.0)
        if self.mean is not None:
            result -= np.asarray(self.mean, dtype=np.float32).reshape(1, -1, 1, 1)
        if self.std is not None:
            result /= np.asarray(self.std, dtype=np.float32).reshape(1, -1, 1, 1)
        return {key: np.ascontiguousarray(result)}

    def _decode(self, item: t.Any, role: str, row: int, positions: t.Optional[np.ndarray]) -> np.ndarray:
        from PIL import Image as PILImage

        height, width = self.size
        try:
            if isinstance(item, np.ndarray):
                array = item if item.ndim == 3 else item[:, :, None]
                if array.shape[2] not in (1, 3, 4):
                    raise ValueError(f"an image array of shape {item.shape} has {array.shape[2]} channels")
                if array.shape[:2] == (height, width) and array.dtype == np.uint8:
                    return _convert_channels(array, self.channels)
                picture = PILImage.fromarray(array[:, :, 0] if array.shape[2] == 1 else array)
            else:
                picture = PILImage.open(io.BytesIO(item))
                if picture.format == "JPEG" and (picture.width >= 2 * width and picture.height >= 2 * height):
                    # libjpeg decodes straight to a power-of-two smaller size: far less work.
                    picture.draft("L" if self.channels == 1 else "RGB", (width, height))
                picture.load()
            picture = picture.convert("L" if self.channels == 1 else "RGB")
            if picture.size != (width, height):
                picture = picture.resize((width, height), PILImage.BILINEAR)
            array = np.asarray(picture)
            return array[:, :, None] if array.ndim == 2 else array
        except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad images
            raise _RowError(row, positions, f"{role} column {self.column!r}: cannot decode an image ({type(exc).__name__}: {exc})") from exc


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
                raise ConfigError(f"Sequence({self.column!r}): {name}={value!r} must be a model input name (an identifier)")

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
        padded, lengths = _pad_sequences(columns[self.column], self.max_length, self.pad_value, role, self.column, source)
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
        arrays = [_numeric(columns[c], infos[c], role, source) for c in self.columns]
        if len(arrays) == 1 and arrays[0].ndim > 2:
            features = arrays[0]
        else:
            features = np.concatenate([a.reshape(len(a), -1) for a in arrays], axis=1) if len(arrays) > 1 else arrays[0].reshape(len(arrays[0]), -1)
        features = np.ascontiguousarray(features, dtype=np.float32)
        if np.isnan(features).any():
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
            raise DataError(f"{role} column {self.column!r} in {where} has type {info.type_name}, which sparkdl cannot read as a tensor")

    def extract(self, key, role, columns, infos, source):
        info = infos[self.column]
        values = columns[self.column]
        if info.kind in ("string", "binary"):
            return {key: _object_values(values, role, self.column, source)}
        array = _numeric(values, info, role, source)
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


# ---- the plan: every input, the label, and the two steps ----------------------------------------


@dataclasses.dataclass(frozen=True)
class InputPlan:
    """How a run builds its batches: the model inputs (name -> spec) and the label.

    ``positional`` is ``feature_cols`` mode: one input, passed to the model positionally, and a
    batch is ``(features, labels)`` with a plain array instead of a dict.
    """

    inputs: t.Tuple[t.Tuple[str, InputSpec], ...]
    label: t.Optional[InputSpec] = None
    positional: bool = False

    @classmethod
    def from_feature_cols(cls, feature_cols: t.Sequence[str], label_col: t.Optional[str]) -> "InputPlan":
        if isinstance(feature_cols, str):
            raise ConfigError(f"feature_cols={feature_cols!r} must be a list of column names, e.g. [{feature_cols!r}]")
        if not feature_cols:
            raise ConfigError("feature_cols is empty: name at least one feature column")
        plan = cls(((POSITIONAL, Dense(tuple(feature_cols))),), _label_spec(label_col), positional=True)
        plan.check_repeats()
        return plan

    @classmethod
    def from_inputs(cls, inputs: t.Mapping[str, t.Any], label: t.Any) -> "InputPlan":
        if not isinstance(inputs, t.Mapping) or not inputs:
            raise ConfigError(f"inputs={inputs!r} must be a non-empty dict: model input name -> column, list of columns or input spec")
        resolved = []
        for name, value in inputs.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(f"inputs: {name!r} is not a valid model input name (a Python identifier, a parameter of forward)")
            resolved.append((name, _spec(name, value)))
        plan = cls(tuple(resolved), _label_spec(label))
        names = plan.model_input_names()
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(f"inputs: model input name(s) {', '.join(map(repr, repeated))} given twice (check lengths_input / mask_input)")
        plan.check_repeats()
        return plan

    @classmethod
    def build(cls, feature_cols: t.Optional[t.Sequence[str]], inputs: t.Optional[t.Mapping[str, t.Any]], label: t.Any) -> "InputPlan":
        """The plan of ``feature_cols=`` or ``inputs=`` (exactly one of them)."""
        if inputs is not None and feature_cols:
            raise ConfigError("give feature_cols= or inputs=, not both (inputs= names every model input, feature_cols= is one positional input)")
        if inputs is not None:
            return cls.from_inputs(inputs, label)
        return cls.from_feature_cols(feature_cols if feature_cols is not None else (), label)

    def check_repeats(self) -> None:
        columns = [c for _, spec in self.inputs for c in spec.source_columns()]
        label_columns = list(self.label.source_columns()) if self.label else []
        if self.positional and len(set(columns + label_columns)) != len(columns + label_columns):
            raise ConfigError(f"feature_cols and label_col repeat a column: {columns + label_columns}")
        clash = [c for c in label_columns if c in columns]
        if clash:
            raise ConfigError(f"the label column {clash[0]!r} is also a model input: the model would see its own label")

    @property
    def columns(self) -> t.List[str]:
        """Every column to read, inputs first, without repeats."""
        out: t.List[str] = []
        for _, spec in self.inputs:
            out += [c for c in spec.source_columns() if c not in out]
        if self.label is not None:
            out += [c for c in self.label.source_columns() if c not in out]
        return out

    @property
    def label_column(self) -> t.Optional[str]:
        return self.label.source_columns()[0] if self.label is not None else None

    @property
    def expensive(self) -> bool:
        return any(spec.expensive for _, spec in self.inputs) or bool(self.label and self.label.expensive)

    @property
    def augments(self) -> bool:
        """Whether training batches draw random augmentations (and so need a seeded generator)."""
        return any(isinstance(spec, Image) and (spec.random_crop or spec.random_flip) for _, spec in self.inputs)

    def model_input_names(self) -> t.List[str]:
        return [n for key, spec in self.inputs for n in spec.output_names(key)]

    def role(self, key: str) -> str:
        return "feature" if self.positional else f"input {key!r}"

    def check(self, infos: t.Mapping[str, ColumnInfo], where: str) -> None:
        """Driver-side: each spec against its columns' types (names are already checked)."""
        for key, spec in self.inputs:
            spec.check(self.role(key), infos, where)
        if self.label is not None:
            self.label.check("label", infos, where)

    def null_roles(self) -> t.Dict[str, str]:
        """Column -> role for the footer null check (sequences may hold empty arrays, which
        footers cannot tell from nulls: they are checked when read)."""
        roles: t.Dict[str, str] = {}
        for key, spec in self.inputs:
            if not isinstance(spec, Sequence):
                for column in spec.source_columns():
                    roles.setdefault(column, self.role(key))
        if self.label is not None and not isinstance(self.label, Sequence):
            roles.setdefault(self.label.source_columns()[0], "label")
        return roles

    def extract(self, columns: t.Mapping[str, ColumnData], infos: t.Mapping[str, ColumnInfo], source: str, positions: t.Optional[np.ndarray] = None) -> t.Dict[str, np.ndarray]:
        """Step 1: row-aligned arrays of a chunk of named columns."""
        out: t.Dict[str, np.ndarray] = {}
        for key, spec in self.inputs:
            out.update(spec.extract(key, self.role(key), columns, infos, source))
        if self.label is not None:
            out.update(self.label.extract(LABEL_KEY, "label", columns, infos, source))
        if positions is not None and self.expensive:
            # Only a decoding step can fail on one row after the shuffle: it names the row from this.
            out[POSITION_KEY] = positions
        return out

    def finish(self, arrays: t.Mapping[str, np.ndarray], rng: t.Optional[np.random.Generator], locate: t.Callable[[t.Optional[int]], str]) -> t.Tuple[t.Any, t.Optional[np.ndarray]]:
        """Step 2: ``(inputs, labels)`` of one batch; ``inputs`` is a dict of model inputs, or
        the one array in positional mode. ``locate(position)`` names a row in errors."""
        try:
            inputs: t.Dict[str, np.ndarray] = {}
            for key, spec in self.inputs:
                inputs.update(spec.finish(key, self.role(key), arrays, rng))
            labels = self.label.finish(LABEL_KEY, "label", arrays, None)[LABEL_KEY] if self.label is not None else None
        except _RowError as exc:
            where = locate(int(exc.positions[exc.row]) if exc.positions is not None else None)
            raise DataError(f"{exc.message}, in {where}") from exc.__cause__
        return (inputs[POSITIONAL] if self.positional else inputs), labels

    def to_json(self) -> t.Dict[str, t.Any]:
        return {
            "inputs": [[key, spec.to_json()] for key, spec in self.inputs],
            "label": self.label.to_json() if self.label is not None else None,
            "positional": self.positional,
        }

    @classmethod
    def from_json(cls, document: t.Mapping[str, t.Any]) -> "InputPlan":
        label = document.get("label")
        return cls(
            tuple((key, spec_from_json(spec)) for key, spec in document["inputs"]),
            spec_from_json(label) if label is not None else None,
            bool(document.get("positional")),
        )

    def without_label(self) -> "InputPlan":
        return dataclasses.replace(self, label=None)


def _spec(name: str, value: t.Any) -> InputSpec:
    if isinstance(value, InputSpec):
        return value
    if isinstance(value, str):
        return Column(value)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return Dense(tuple(value))
    raise ConfigError(
        f"inputs[{name!r}]={value!r} must be a column name, a list of column names, sparkdl.Image(...) or sparkdl.Sequence(...)"
    )


def _label_spec(label: t.Any) -> t.Optional[InputSpec]:
    if label is None:
        return None
    if isinstance(label, str):
        return Column(label)
    if isinstance(label, (Sequence, Column)):
        return label
    raise ConfigError(f"label_col={label!r} must be a column name or sparkdl.Sequence(...) (token tagging)")


class _RowError(Exception):
    """A row of a batch failed in step 2; :meth:`InputPlan.finish` names its file and row group."""

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


# ---- column conversions (pyarrow from the Arrow reader, numpy from Petastorm, pandas from
# ---- TorchModel.transform) ---------------------------------------------------------------------


def _arrow(values: ColumnData) -> t.Optional[pa.Array]:
    if isinstance(values, pa.ChunkedArray):
        return values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    if isinstance(values, pa.Array):
        return values
    return None


def _to_numpy(values: ColumnData) -> np.ndarray:
    if hasattr(values, "to_numpy") and not isinstance(values, (pa.Array, pa.ChunkedArray, np.ndarray)):
        return values.to_numpy()  # pandas
    return np.asarray(values)


def _numeric(values: ColumnData, info: ColumnInfo, role: str, source: str) -> np.ndarray:
    """A numeric column as one array: scalars as a vector, equal-length lists as a matrix (a view
    of the Arrow values buffer when possible), codec fields decoded with their codec."""
    array = _arrow(values)
    if array is not None:
        if array.null_count:
            raise DataError(f"{role} column {info.name!r} has {array.null_count} null values in {source}")
        if info.codec_field is not None:
            field = info.codec_field
            return np.stack([field.codec.decode(field, value) for value in array.to_pylist()])
        if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
            return _list_matrix(array, info, role, source)
        if pa.types.is_fixed_size_list(array.type):
            return array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), array.type.list_size)
        column = array.to_numpy(zero_copy_only=False)
    else:
        column = _to_numpy(values)
    if column.dtype == object:
        try:
            column = np.stack(column)
        except (ValueError, TypeError) as exc:
            raise DataError(
                f"{role} column {info.name!r} holds arrays of different lengths or null values in {source}; every row "
                f"must have the same number of elements ({exc})"
            ) from exc
        if column.dtype == object:
            try:
                column = column.astype(np.float64)
            except (ValueError, TypeError) as exc:
                raise DataError(f"{role} column {info.name!r} holds null or non-numeric values in {source}") from exc
    if column.dtype.kind not in "fiub":
        raise DataError(f"{role} column {info.name!r} has non-numeric values (dtype {column.dtype}) in {source}")
    return column


def _list_matrix(array: pa.Array, info: ColumnInfo, role: str, source: str) -> np.ndarray:
    rows = len(array)
    offsets = array.offsets.to_numpy()
    lengths = np.diff(offsets)
    width = int(lengths[0]) if rows else 0
    if rows and (lengths != width).any():
        raise DataError(
            f"{role} column {info.name!r} holds arrays of different lengths in {source} "
            f"(from {int(lengths.min())} to {int(lengths.max())}); every row must have the same number of elements"
            f" (use sparkdl.Sequence for variable-length token ids)"
        )
    if rows and width == 0:
        raise DataError(f"{role} column {info.name!r} holds empty arrays in {source}")
    values = array.flatten()
    if values.null_count:
        raise DataError(f"{role} column {info.name!r} has {values.null_count} null elements in {source}")
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        raise DataError(f"{role} column {info.name!r} holds nested arrays in {source}; store one flat array per row")
    return values.to_numpy(zero_copy_only=False).reshape(rows, width)


def _object_values(values: ColumnData, role: str, column: str, source: str) -> np.ndarray:
    array = _arrow(values)
    if array is not None:
        if array.null_count:
            raise DataError(f"{role} column {column!r} has {array.null_count} null values in {source}")
        return array.to_numpy(zero_copy_only=False)
    out = _to_numpy(values)
    if any(v is None for v in out):
        raise DataError(f"{role} column {column!r} has null values in {source}")
    return out


def _binary_values(values: ColumnData, role: str, column: str, source: str) -> np.ndarray:
    items = _object_values(values, role, column, source)
    if items.dtype != object:  # a 2-D uint8 stack (Petastorm's stacked ndarrays)
        items = object_rows(items)
    return items


def object_rows(items: t.Sequence[t.Any]) -> np.ndarray:
    """A 1-D object array of ``items`` (numpy would stack equal-shaped arrays into one)."""
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


def _codec_images(values: ColumnData, info: ColumnInfo, role: str, column: str, source: str) -> np.ndarray:
    """A Petastorm image field: compressed (PNG/JPEG) bytes are decoded like any image bytes;
    ndarray-codec bytes with the codec; the Petastorm reader hands decoded arrays already."""
    array = _arrow(values)
    if array is None:
        items = _to_numpy(values)
        return items if items.dtype == object else object_rows(items)
    if array.null_count:
        raise DataError(f"{role} column {column!r} has {array.null_count} null values in {source}")
    field = info.codec_field
    from petastorm.codecs import CompressedImageCodec

    raw = array.to_numpy(zero_copy_only=False)
    if isinstance(field.codec, CompressedImageCodec):
        return raw
    return object_rows([field.codec.decode(field, value) for value in raw])


def _spark_image_structs(values: ColumnData, role: str, column: str, source: str) -> np.ndarray:
    """Spark's image struct (OpenCV layout: rows of BGR(A) bytes, ``height x width x nChannels``)
    as RGB(A) uint8 arrays."""
    array = _arrow(values)
    if array is not None:
        if array.null_count:
            raise DataError(f"{role} column {column!r} has {array.null_count} null images in {source}")
        fields = {name: array.field(name).to_numpy(zero_copy_only=False) for name in ("height", "width", "nChannels", "data", "origin")}
    else:  # pandas: a struct column of a pandas UDF arrives as a DataFrame
        frame = values
        fields = {name: frame[name].to_numpy() for name in ("height", "width", "nChannels", "data", "origin")}
    out = np.empty(len(fields["data"]), dtype=object)
    for i in range(len(out)):
        height, width, channels = int(fields["height"][i]), int(fields["width"][i]), int(fields["nChannels"][i])
        data = fields["data"][i]
        if data is None or height <= 0 or width <= 0 or len(data) != height * width * channels:
            raise DataError(
                f"{role} column {column!r} holds an image Spark could not decode (origin {fields['origin'][i]!r}) in {source}; "
                f"drop such rows, e.g. spark.read.format('image').option('dropInvalid', True)"
            )
        image = np.frombuffer(data, dtype=np.uint8).reshape(height, width, channels)
        if channels >= 3:
            image = image[:, :, [2, 1, 0] + ([3] if channels == 4 else [])]
        out[i] = image
    return out


def _convert_channels(array: np.ndarray, channels: int) -> np.ndarray:
    have = array.shape[2]
    if have == channels:
        return array
    if channels == 3:
        return np.repeat(array, 3, axis=2) if have == 1 else array[:, :, :3]
    rgb = array[:, :, :3].astype(np.float32)
    # ITU-R 601-2 luma, as Pillow's convert("L").
    gray = rgb[:, :, 0] * 0.299 + rgb[:, :, 1] * 0.587 + rgb[:, :, 2] * 0.114
    return np.clip(np.rint(gray), 0, 255).astype(np.uint8)[:, :, None]


def _random_crop(images: np.ndarray, padding: int, rng: np.random.Generator) -> np.ndarray:
    batch, channels, height, width = images.shape
    padded = np.zeros((batch, channels, height + 2 * padding, width + 2 * padding), dtype=images.dtype)
    padded[:, :, padding:padding + height, padding:padding + width] = images
    tops = rng.integers(0, 2 * padding + 1, batch)
    lefts = rng.integers(0, 2 * padding + 1, batch)
    out = np.empty_like(images)
    for i in range(batch):
        out[i] = padded[i, :, tops[i]:tops[i] + height, lefts[i]:lefts[i] + width]
    return out


def _pad_sequences(values: ColumnData, max_length: int, pad_value: int, role: str, column: str, source: str) -> t.Tuple[np.ndarray, np.ndarray]:
    """``[rows, max_length]`` int64 padded with ``pad_value`` (rows truncated to max_length)
    and each row's length after truncation."""
    array = _arrow(values)
    if array is not None:
        if array.null_count:
            raise DataError(f"{role} column {column!r} has {array.null_count} null arrays in {source} (empty arrays are fine)")
        if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
            raise DataError(f"{role} column {column!r} has type {array.type} in {source}; sparkdl.Sequence needs arrays of integers")
        flat = array.flatten()
        if not pa.types.is_integer(flat.type):
            raise DataError(f"{role} column {column!r} holds {flat.type} values in {source}; sparkdl.Sequence needs integers (token ids)")
        if flat.null_count:
            raise DataError(f"{role} column {column!r} has {flat.null_count} null elements in {source}")
        offsets = array.offsets.to_numpy().astype(np.int64)
        starts = offsets[:-1] - offsets[0]
        lengths = np.minimum(np.diff(offsets), max_length)
        values_np = flat.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        rows = len(array)
        padded = np.full((rows, max_length), pad_value, dtype=np.int64)
        mask = np.arange(max_length)[None, :] < lengths[:, None]
        index = (starts[:, None] + np.arange(max_length)[None, :])[mask]
        padded[mask] = values_np[index]
        return padded, lengths.astype(np.int64)
    rows_data = _to_numpy(values)
    padded = np.full((len(rows_data), max_length), pad_value, dtype=np.int64)
    lengths = np.zeros(len(rows_data), dtype=np.int64)
    for i, row in enumerate(rows_data):
        if row is None:
            raise DataError(f"{role} column {column!r} has null arrays in {source} (empty arrays are fine)")
        row = np.asarray(row)
        if row.size and row.dtype.kind not in "iu":
            raise DataError(f"{role} column {column!r} holds {row.dtype} values in {source}; sparkdl.Sequence needs integers (token ids)")
        n = min(len(row), max_length)
        padded[i, :n] = row[:n]
        lengths[i] = n
    return padded, lengths
