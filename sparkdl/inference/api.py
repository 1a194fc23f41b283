"""What a scoring job is asked to do: :class:`InferenceOptions`, validated in one place.

``TorchModel.transform``, :func:`sparkdl.predict` and ``sparkdl predict`` all build their options
with :func:`inference_options`, so a bad value fails the same way, on the driver, before any task
runs, naming the argument to change.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Tuple, Union

from sparkdl.errors import ConfigError

#: What a prediction column holds:
#:
#: * ``raw``: the model's output for the row: ``float`` for one number, ``array<float>`` else.
#: * ``probabilities``: softmax over the row's outputs (logits in), ``array<float>``.
#: * ``label``: the index of the largest output, ``int`` (a classifier's predicted class).
#: * ``top_k``: the ``top_k`` largest outputs, ``struct<indices: array<int>, scores: array<float>>``,
#:   scores as softmax probabilities.
OUTPUT_KINDS: Tuple[str, ...] = ("raw", "probabilities", "label", "top_k")

#: What a row that cannot be scored does: ``fail`` the task (an error naming the row, which
#: Spark's retries cannot fix, so the job fails), or ``null`` its prediction, with the reason in
#: the error column.
ON_ERROR: Tuple[str, ...] = ("fail", "null")

#: ``optimize=``: "auto" scores with a frozen graph of the model where it is the same and
#: faster (sparkdl.inference.frozen), "off" runs the module as it is.
OPTIMIZE: Tuple[str, ...] = ("auto", "off")

#: Autocast dtypes for ``precision=``.
PRECISIONS: Tuple[str, ...] = ("bf16", "fp16")

#: Rows per model call unless ``batch_size=`` says otherwise: large enough that torch's per-call
#: cost vanishes on a CPU MLP, small enough that a CNN's activations stay in a few hundred MB.
DEFAULT_BATCH_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class InferenceOptions:
    """How rows are scored. Build with :func:`inference_options` (it validates).

    Attributes:
        batch_size: rows per model call; a GPU batch that runs out of memory is split in halves
            and retried, and the task goes on with the smaller size.
        output: one of :data:`OUTPUT_KINDS` for every head, or ``{head: kind}`` for models with
            several (heads not named keep ``raw``).
        top_k: how many classes ``top_k`` keeps.
        on_error: one of :data:`ON_ERROR`.
        error_col: the column of reasons with ``on_error="null"`` (None: ``<prediction>_error``).
        use_gpu: True requires a GPU per task, False never uses one, None uses the one Spark
            assigns (as in training).
        precision: ``bf16`` or ``fp16`` autocast of the forward pass; None runs in the model's
            own dtype.
        decode_threads: threads decoding images ahead of the model; None: the task's CPUs.
        optimize: "auto" scores with a frozen, optimized graph of the model where it computes
            the same outputs faster (on a CPU, without ``precision``:
            :mod:`sparkdl.inference.frozen`); "off" always runs the module as it is.
    """

    batch_size: int = DEFAULT_BATCH_SIZE
    output: Union[str, Mapping[str, str]] = "raw"
    top_k: int = 5
    on_error: str = "fail"
    error_col: Optional[str] = None
    use_gpu: Optional[bool] = None
    precision: Optional[str] = None
    decode_threads: Optional[int] = None
    optimize: str = "auto"

    def kind_of(self, head: str) -> str:
        """The output kind of one head (its name in the model's dict, or its position as a string)."""
        if isinstance(self.output, str):
            return self.output
        return self.output.get(head, "raw")

    def to_json(self) -> dict:
        """The options as JSON (what a predict job records to refuse resuming with other options)."""
        document = dataclasses.asdict(self)
        if not isinstance(self.output, str):
            document["output"] = dict(self.output)
        return document


def inference_options(**given: Any) -> InferenceOptions:
    """Validated :class:`InferenceOptions` from keyword arguments (unknown names are refused).

    Raises:
        ConfigError: naming the argument and what it accepts.
    """
    known = {field.name for field in dataclasses.fields(InferenceOptions)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(f"unknown scoring option(s) {unknown}; the options are: {sorted(known)}")
    options = InferenceOptions(**given)
    _check_positive_int("batch_size", options.batch_size)
    _check_positive_int("top_k", options.top_k)
    kinds = [options.output] if isinstance(options.output, str) else list(_mapping(options.output).values())
    for kind in kinds:
        if kind not in OUTPUT_KINDS:
            raise ConfigError(f"output={options.output!r}: each kind must be one of {list(OUTPUT_KINDS)}")
    if options.on_error not in ON_ERROR:
        raise ConfigError(f"on_error={options.on_error!r} must be one of {list(ON_ERROR)}")
    if options.error_col is not None and (not isinstance(options.error_col, str) or not options.error_col):
        raise ConfigError(f"error_col={options.error_col!r} must be a column name")
    if options.use_gpu is not None and not isinstance(options.use_gpu, bool):
        raise ConfigError(f"use_gpu={options.use_gpu!r} must be True, False or None (use the GPU Spark assigns)")
    if options.precision is not None and options.precision not in PRECISIONS:
        raise ConfigError(f"precision={options.precision!r} must be one of {list(PRECISIONS)} or None")
    if options.decode_threads is not None:
        _check_positive_int("decode_threads", options.decode_threads)
    if options.optimize not in OPTIMIZE:
        raise ConfigError(f"optimize={options.optimize!r} must be one of {list(OPTIMIZE)}")
    return options


def _mapping(value: Any) -> Mapping[str, str]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"output={value!r} must be a kind ({list(OUTPUT_KINDS)}) or a dict of head name -> kind")
    return value


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a whole number >= 1")
