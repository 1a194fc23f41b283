"""Batches: a rank's shard as an endless stream of fixed-size batches, and the one place where
rows become model inputs (for training, validation and ``TorchModel.transform`` alike).

Pipeline of a task (readers: :mod:`sparkdl.data.readers`; inputs: :mod:`sparkdl.data.inputs`; what
to read and how: :class:`~sparkdl.data.spec.DataSpec`)::

    reader thread        row groups -> named columns -> InputPlan.extract -> chunk (row-aligned arrays)
    training thread      chunks -> shuffle buffer -> batches of batch_size rows
    decode threads       batch -> InputPlan.finish (decode images, pad sequences) -> transform_fn
    training thread      -> tensors; on CUDA a prefetch thread does this and the cutting
                         above, pinned, into a bounded queue (sparkdl._runtime.host_batches says why)

Sharding and balance rules (the same for every reader):

* The shard unit is the Parquet row group: rank ``r`` of ``n`` reads row groups ``r, r+n, ...``
  (Petastorm's ``cur_shard``/``shard_count``). A dataset with fewer row groups than ranks falls
  back to row striding: every rank reads every row group and keeps rows ``r, r+n, ...``.
* Each rank's reader cycles over its shard forever (a fresh reader pass per pass, seeded
  ``seed + pass``); an epoch is a fixed number of steps computed
  on the driver (:func:`steps_per_epoch`), identical on every rank, so no rank runs out first and
  blocks the others in a collective. Rows past the last full step of an epoch are not dropped:
  the stream simply goes on, and they open the next epoch. A rank with a smaller shard wraps
  around sooner, so its rows may appear once more per epoch than a larger shard's.
* An epoch is one pass, that remainder rule aside: with ``epoch_rows = steps * batch_size`` and
  a shard of ``S`` rows, an epoch takes ``min(S, epoch_rows)`` distinct rows, and when ``S <
  epoch_rows`` each row ``epoch_rows // S`` or one more times (the order without shuffling
  gives this by itself; with it, :func:`cut_stream` and :class:`~sparkdl.data.selection.EpochPasses`).
* With ``shuffle`` on, row-group order is shuffled each pass and rows are mixed in a bounded
  in-memory buffer (``shuffle_buffer_batches`` batches), seeded per rank: reproducible, never the
  whole dataset in memory. The buffer mixes rows of one pass only: it is emptied at a pass's end.
* Which row groups and rows a rank reads (order, filters, the validation hold-out) is decided in
  :mod:`sparkdl.data.selection`, identically for every reader: the Petastorm and Arrow readers
  give the same batches for the same seed.
* Decoding runs on ``decode_threads`` threads (Pillow and numpy release the GIL while they
  work) with at most ``2 * decode_threads`` batches in flight, in stream order; random
  augmentations are seeded by (seed, rank, batch index), so they do not depend on which thread
  ran a batch, and a resumed run that skips ``n`` batches skips them undecoded.
* A checkpoint of N ranks resumed on M finishes the interrupted epoch with exactly the rows the
  N ranks had left (found by replaying their streams, positions only), then continues as an
  M-rank stream: :mod:`sparkdl.data.reshard`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from typing import Any, Callable, Deque, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from sparkdl.data.dataset import DatasetInfo
from sparkdl.data.inputs import InputSpec
from sparkdl.data.plan import InputPlan
from sparkdl.data.readers.base import Chunk, DataReader, chunk_rows
from sparkdl.data.selection import EpochPasses, shard_rows, shuffled_batches
from sparkdl.data.shuffled_rows import GatherInto
from sparkdl.data.spec import DataSpec, Inputs, TransformFn
from sparkdl.errors import ConfigError, DataError

#: A finished batch: (inputs, labels).
Batch = Tuple[Inputs, Optional[np.ndarray]]


#: The version of the stream's order (:func:`batches`). A checkpoint records it; its positions
#: index the rows of the order they were taken in, so a resume under another order ends the
#: interrupted epoch instead of replaying them (sparkdl._runtime.resume). 2: an epoch is one pass.
STREAM_ORDER = 2


def steps_per_epoch(num_rows: int, batch_size: int, world_size: int) -> int:
    """Steps every rank runs per epoch: one pass over the rows, split evenly, full batches only."""
    steps = num_rows // (batch_size * world_size)
    if steps < 1:
        raise ConfigError(
            f"the dataset has {num_rows} rows, fewer than num_workers * batch_size = "
            f"{world_size} * {batch_size} = {world_size * batch_size}: lower batch_size or num_workers"
        )
    return steps


def batches(
    reader: DataReader,
    dataset: DatasetInfo,
    spec: DataSpec,
    rank: int,
    world_size: int,
    skip: int = 0,
    epoch_steps: Optional[int] = None,
    gather_into: Optional[GatherInto] = None,
) -> Iterator[Batch]:
    """Endless finished batches of exactly ``spec.batch_size`` rows from this rank's shard.

    The first ``skip`` batches are cut but not finished (a resumed run's replay to its
    checkpoint's position costs reading, not decoding). ``epoch_steps``: steps per epoch, when
    the caller knows them (else counted from the footers as the driver does: :func:`epoch_rows`).
    ``gather_into``: where the shuffle buffer may gather a batch's rows (a pinned ring's
    buffers, :meth:`~sparkdl._runtime.pinned_ring.BatchRing.gather_arrays`); used only when
    finishing a batch hands those arrays on as they are, inline (dense inputs and plain
    columns, no ``transform_fn``), so the finished batch is the gathered arrays themselves.
    """
    plan = dataset.plan
    augments = plan.augments  # asked once, not per batch
    rows = epoch_rows(dataset, spec, world_size, epoch_steps) if spec.shuffle else None
    source = reader.chunks(
        dataset, dataclasses.replace(spec, pass_marks=True) if spec.shuffle else spec, rank, world_size
    )

    def finish(index: int, arrays: Chunk) -> Batch:
        # Augmented training batches are seeded by their place in the stream; plans without
        # augmentation build no generator per step.
        augment = np.random.default_rng([spec.seed, rank, index]) if augments else None
        return finish_batch(plan, arrays, augment, spec.transform_fn, dataset.locate)

    threads = _threads_for(plan, spec)
    passes_through = threads == 0 and _finish_hands_on(plan)
    cuts = cut_stream(source, spec, rank, rows, gather_into if passes_through else None)
    try:
        for _ in range(skip):
            next(cuts)
        yield from finish_in_order(cuts, finish, skip, threads)
    finally:
        cuts.close()
        source.close()


def epoch_rows(dataset: DatasetInfo, spec: DataSpec, world_size: int, steps: Optional[int] = None) -> Optional[int]:
    """Rows of an epoch on each rank: ``steps`` (else :func:`steps_per_epoch` of the training
    rows, as the driver counts them) times ``batch_size``; None when the footers hold too few."""
    if steps is None:
        total = sum(shard_rows(dataset, world_size, spec.holdout, "train", spec.filters))
        if total < spec.batch_size * world_size:
            return None
        steps = steps_per_epoch(total, spec.batch_size, world_size)
    return steps * spec.batch_size


def cut_stream(
    source: Iterator[Chunk],
    spec: DataSpec,
    rank: int,
    epoch_rows: Optional[int] = None,
    gather_into: Optional[GatherInto] = None,
) -> Iterator[Chunk]:
    """The training stream's unfinished batches cut from ``source``'s chunks: shuffled in a
    buffer seeded ``spec.seed + rank``. The shuffle depends only on the chunks' row counts and
    positions, so a source of position-only chunks gives each batch's positions
    (:mod:`sparkdl.data.reshard`). ``gather_into``: where shuffled batches may be gathered.

    ``PASS_END`` in ``source`` ends a pass. With shuffling, rows of two passes never mix, and
    with ``epoch_rows`` an epoch is one pass, remainder rule aside
    (:func:`~sparkdl.data.selection.shuffled_batches`). Without, passes follow each other in
    order, and an epoch, a window of that cycle, is one pass already.
    """
    if spec.shuffle:
        passes = EpochPasses(epoch_rows) if epoch_rows else None
        rng = np.random.default_rng(spec.seed + rank)
        rows = spec.batch_size * spec.shuffle_buffer_batches
        return shuffled_batches(source, spec.batch_size, rows, rng, passes, gather_into)
    # Also copies a lone chunk: readers may hand out read-only views of Arrow buffers.
    return _cut_batches(
        (chunk for chunk in source if chunk), spec.batch_size, spec.batch_size, _concatenate, keep_rest=False
    )


def validation_batches(
    reader: DataReader, dataset: DatasetInfo, spec: DataSpec, rank: int, world_size: int
) -> Iterator[Batch]:
    """One pass over this rank's validation rows in batches of ``spec.batch_size`` (the last
    one may be smaller), finished without augmentation, ``spec.transform_fn`` applied."""
    plan = dataset.plan
    source = reader.read_pass(dataset, spec, rank, world_size, 0)

    def finish(index: int, arrays: Chunk) -> Batch:
        return finish_batch(plan, arrays, None, spec.transform_fn, dataset.locate)

    cuts = _cut_batches(source, spec.batch_size, spec.batch_size, _concatenate, keep_rest=True)
    try:
        yield from finish_in_order(cuts, finish, 0, _threads_for(plan, spec))
    finally:
        cuts.close()
        source.close()


def _cut_batches(
    source: Iterator[Chunk], batch_size: int, gather_rows: int, merge: Callable[[List[Chunk]], Chunk], keep_rest: bool
) -> Iterator[Chunk]:
    """Batches of ``batch_size`` rows cut from ``source``'s chunks: whenever at least
    ``gather_rows`` rows are pending, ``merge`` makes one chunk of them (a copy), its full batches
    are handed out and the rest stays pending; ``keep_rest`` hands out the rows left when
    ``source`` ends as one smaller batch."""
    pending: List[Chunk] = []
    pending_rows = 0
    for chunk in source:
        pending.append(chunk)
        pending_rows += chunk_rows(chunk)
        if pending_rows < gather_rows:
            continue
        merged = merge(pending)
        full = (pending_rows // batch_size) * batch_size
        for start in range(0, full, batch_size):
            yield {key: values[start : start + batch_size] for key, values in merged.items()}
        pending = [{key: values[full:] for key, values in merged.items()}] if full < pending_rows else []
        pending_rows -= full
    if keep_rest and pending_rows:
        yield _concatenate(pending)


def finish_batch(
    plan: InputPlan,
    arrays: Chunk,
    augment: Optional[np.random.Generator],
    transform_fn: Optional[TransformFn],
    locate: Callable[[int], str],
) -> Batch:
    """One batch's model inputs and labels: the plan's second step, then ``transform_fn``."""
    inputs, labels = plan.finish(arrays, augment, locate)
    if transform_fn is not None:
        inputs, labels = apply_transform(transform_fn, inputs, labels, plan)
    check_tensorable(inputs, plan)
    return inputs, labels


def _finish_hands_on(plan: InputPlan) -> bool:
    """Whether finishing a batch hands its arrays on as they are (no spec makes new ones)."""
    specs = [spec for _, spec in plan.inputs] + ([plan.label] if plan.label is not None else [])
    return all(type(spec).finish is InputSpec.finish for spec in specs)


def _threads_for(plan: InputPlan, spec: DataSpec) -> int:
    """0 finishes inline: dense-only batches without a transform have nothing worth a thread."""
    if not plan.expensive and spec.transform_fn is None:
        return 0
    return spec.decode_thread_count()


def finish_in_order(
    cuts: Iterator[Chunk], finish: Callable[[int, Chunk], Batch], first_index: int, threads: int
) -> Iterator[Batch]:
    """``finish`` over the cut batches, in order, on ``threads`` threads (0: inline) with at most
    ``2 * threads`` batches in flight, so memory stays bounded."""
    if threads == 0:
        for index, arrays in enumerate(cuts, start=first_index):
            yield finish(index, arrays)
        return
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sparkdl-decode")
    in_flight: Deque[concurrent.futures.Future] = collections.deque()
    index = first_index
    try:
        for arrays in cuts:
            in_flight.append(pool.submit(finish, index, arrays))
            index += 1
            if len(in_flight) >= 2 * threads:
                yield in_flight.popleft().result()
        while in_flight:
            yield in_flight.popleft().result()
    finally:
        for future in in_flight:
            future.cancel()
        pool.shutdown(wait=True)


def _concatenate(chunks: List[Chunk]) -> Chunk:
    if len(chunks) == 1:
        return {key: values.copy() for key, values in chunks[0].items()}
    return {key: np.concatenate([c[key] for c in chunks]) for key in chunks[0]}


def apply_transform(
    transform_fn: TransformFn, features: Inputs, labels: Optional[np.ndarray], plan: Optional[InputPlan] = None
) -> Batch:
    """Runs the user's per-batch transform and checks what it returns."""
    named = isinstance(features, dict)
    rows = len(next(iter(features.values()))) if named else len(features)
    result = transform_fn(features, labels)
    what = "(inputs dict, labels)" if named else "(features, labels)"
    if not isinstance(result, tuple) or len(result) != 2:
        raise ConfigError(f"transform_fn must return a {what} tuple of numpy arrays, got {type(result).__name__}")
    new_features, new_labels = result
    if new_labels is not None and not isinstance(new_labels, np.ndarray):
        raise ConfigError(f"transform_fn must return numpy labels, got {type(new_labels).__name__}")
    if named:
        if not isinstance(new_features, dict) or not all(isinstance(v, np.ndarray) for v in new_features.values()):
            raise ConfigError(
                f"with inputs=, transform_fn must return a dict of named numpy arrays, got {type(new_features).__name__}"
            )
        sizes = {name: len(v) for name, v in new_features.items()}
        wrong = {name: n for name, n in sizes.items() if n != rows}
        if wrong or (new_labels is not None and len(new_labels) != rows):
            raise ConfigError(
                f"transform_fn must keep the batch's {rows} rows, returned {wrong or sizes}"
                + (f" and {len(new_labels)} labels" if new_labels is not None else "")
                + "; use filters= to drop rows"
            )
        out = {name: np.ascontiguousarray(v) if v.dtype != object else v for name, v in new_features.items()}
    else:
        if not isinstance(new_features, np.ndarray):
            raise ConfigError(
                f"transform_fn must return numpy arrays, got ({type(new_features).__name__}, {type(new_labels).__name__})"
            )
        if len(new_features) != rows or (new_labels is not None and len(new_labels) != rows):
            raise ConfigError(
                f"transform_fn must keep the batch's {rows} rows, returned {len(new_features)} features"
                + (f" and {len(new_labels)} labels" if new_labels is not None else "")
                + "; use filters= to drop rows"
            )
        out = np.ascontiguousarray(new_features)
    return out, (np.ascontiguousarray(new_labels) if new_labels is not None else None)


def check_tensorable(inputs: Inputs, plan: InputPlan) -> None:
    """Strings and bytes cannot become tensors: name the input that still holds them."""
    items = inputs.items() if isinstance(inputs, dict) else [("features", inputs)]
    for name, values in items:
        if values.dtype == object or values.dtype.kind in "SU":
            sample = values.flat[0] if values.size else None
            what = (
                "strings or bytes"
                if values.dtype.kind in "SU" or isinstance(sample, (str, bytes))
                else "Python objects"
            )
            raise DataError(
                f"model input {name!r} holds {what} "
                f"(column {_column_of(plan, name)!r}); turn it into numbers in transform_fn (e.g. tokenize it)"
            )


def _column_of(plan: InputPlan, name: str) -> str:
    for key, spec in plan.inputs:
        if key == name:
            return ", ".join(spec.source_columns())
    return name


def to_tensors(batch: Batch, pin: bool = False) -> Tuple[Any, Any]:
    """A finished batch as torch tensors (pinned for a CUDA copy when ``pin``)."""
    import torch

    def tensor(array: np.ndarray) -> "torch.Tensor":
        out = torch.from_numpy(array)
        return out.pin_memory() if pin else out

    inputs, labels = batch
    converted = {name: tensor(v) for name, v in inputs.items()} if isinstance(inputs, dict) else tensor(inputs)
    return converted, (tensor(labels) if labels is not None else None)


def batch_rows(inputs: Inputs) -> int:
    """Rows of a batch's inputs (an array or a dict of arrays/tensors)."""
    return len(next(iter(inputs.values()))) if isinstance(inputs, dict) else len(inputs)


def slice_rows(inputs: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a batch's inputs (an array or a dict of arrays/tensors), as views."""
    return {k: v[start:stop] for k, v in inputs.items()} if isinstance(inputs, dict) else inputs[start:stop]


def call_model(model: Any, inputs: Any) -> Any:
    """``model(**inputs)`` for named inputs, ``model(inputs)`` for ``feature_cols``."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def frame_batch(plan: InputPlan, columns: Mapping[str, Any], infos: Mapping[str, Any], source: str) -> Inputs:
    """Model inputs of rows given as named columns (``TorchModel.transform``'s pandas batches):
    both steps, no augmentation, no label."""
    unlabeled = plan.without_label()
    arrays = unlabeled.extract(columns, infos, source)
    inputs, _ = unlabeled.finish(
        arrays, None, lambda position: source if position is None else f"row {position} of {source}"
    )
    check_tensorable(inputs, unlabeled)
    return inputs
