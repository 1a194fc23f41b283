"""The input plan: a run's model inputs (name -> spec, :mod:`sparkdl.data.inputs`) and its label,
and the two steps every batch goes through, for every reader, validation and ``TorchModel.transform``:

1. :meth:`InputPlan.extract`: a chunk of named columns -> row-aligned numpy arrays (what the
   shuffle buffer mixes and cuts into batches, :mod:`sparkdl.data.batching`);
2. :meth:`InputPlan.finish`: one batch of those -> the model's inputs and labels (on the decode
   threads).

:meth:`InputPlan.keep` gives the form of a chunk the shard cache keeps between the two (images
decoded and resized), from which :meth:`~InputPlan.finish` makes the same batches.

``feature_cols=`` and ``inputs=`` both become a plan (:meth:`InputPlan.build`).
"""

from __future__ import annotations

import dataclasses
import typing as t

import numpy as np

from sparkdl.data.columns import ColumnData, ColumnInfo
from sparkdl.data.inputs import (
    LABEL_KEY,
    POSITION_KEY,
    POSITIONAL,
    Column,
    Dense,
    Image,
    InputSpec,
    RowError,
    Sequence,
    spec_from_json,
)
from sparkdl.errors import ConfigError, DataError


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
            raise ConfigError(
                f"inputs={inputs!r} must be a non-empty dict: model input name -> column, list of columns or input spec"
            )
        resolved = []
        for name, value in inputs.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(
                    f"inputs: {name!r} is not a valid model input name (a Python identifier, a parameter of forward)"
                )
            resolved.append((name, _spec(name, value)))
        plan = cls(tuple(resolved), _label_spec(label))
        names = plan.model_input_names()
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(
                f"inputs: model input name(s) {', '.join(map(repr, repeated))} given twice (check lengths_input / mask_input)"
            )
        plan.check_repeats()
        return plan

    @classmethod
    def build(
        cls, feature_cols: t.Optional[t.Sequence[str]], inputs: t.Optional[t.Mapping[str, t.Any]], label: t.Any
    ) -> "InputPlan":
        """The plan of ``feature_cols=`` or ``inputs=`` (exactly one of them)."""
        if inputs is not None and feature_cols:
            raise ConfigError(
                "give feature_cols= or inputs=, not both (inputs= names every model input, feature_cols= is one positional input)"
            )
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

    def extract(
        self,
        columns: t.Mapping[str, ColumnData],
        infos: t.Mapping[str, ColumnInfo],
        source: str,
        positions: t.Optional[np.ndarray] = None,
    ) -> t.Dict[str, np.ndarray]:
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

    def finish(
        self,
        arrays: t.Mapping[str, np.ndarray],
        rng: t.Optional[np.random.Generator],
        locate: t.Callable[[t.Optional[int]], str],
    ) -> t.Tuple[t.Any, t.Optional[np.ndarray]]:
        """Step 2: ``(inputs, labels)`` of one batch; ``inputs`` is a dict of model inputs, or
        the one array in positional mode. ``locate(position)`` names a row in errors."""
        try:
            inputs: t.Dict[str, np.ndarray] = {}
            for key, spec in self.inputs:
                inputs.update(spec.finish(key, self.role(key), arrays, rng))
            labels = self.label.finish(LABEL_KEY, "label", arrays, None)[LABEL_KEY] if self.label is not None else None
        except RowError as exc:
            where = locate(int(exc.positions[exc.row]) if exc.positions is not None else None)
            raise DataError(f"{exc.message}, in {where}") from exc.__cause__
        return (inputs[POSITIONAL] if self.positional else inputs), labels

    def keep(
        self, arrays: t.Mapping[str, np.ndarray], locate: t.Callable[[t.Optional[int]], str], threads: int
    ) -> t.Dict[str, np.ndarray]:
        """The form of a chunk's arrays the shard cache keeps (images decoded and resized, on
        up to ``threads`` threads; everything else as extracted): :meth:`finish` makes the same
        batches of it with less work. A row that cannot be decoded fails as in :meth:`finish`."""
        out = dict(arrays)
        try:
            for key, spec in self.inputs:
                out.update(spec.keep(key, self.role(key), arrays, threads))
        except RowError as exc:
            where = locate(int(exc.positions[exc.row]) if exc.positions is not None else None)
            raise DataError(f"{exc.message}, in {where}") from exc.__cause__
        return out

    @property
    def converts_kept(self) -> bool:
        """Whether :meth:`keep` changes anything (else a kept chunk is the extracted one)."""
        return any(spec.kept_row_bytes() is not None for _, spec in self.inputs)

    def kept_row_bytes(self) -> t.Tuple[t.Set[str], int]:
        """For the shard cache's estimate: the columns whose kept form is not about their Parquet
        bytes (read only by inputs that :meth:`keep` converts), and the bytes a row of those
        inputs takes kept."""
        converted = [(spec, size) for _, spec in self.inputs if (size := spec.kept_row_bytes()) is not None]
        others = [spec for _, spec in self.inputs if spec.kept_row_bytes() is None] + (
            [self.label] if self.label is not None else []
        )
        also_read = {column for spec in others for column in spec.source_columns()}
        columns = {column for spec, _ in converted for column in spec.source_columns()} - also_read
        return columns, sum(size for _, size in converted)

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
