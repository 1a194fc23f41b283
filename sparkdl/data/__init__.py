"""The data path. Driver side: :mod:`.dataset` (what a Parquet dataset holds, from its footers;
:mod:`.petastorm_schema` for Petastorm's), :mod:`.cache` (DataFrames materialized once) and
:mod:`.nonfinite` (NaN/inf found and named).
Task side: :mod:`.spec` (what a task reads and how it batches it: ``DataSpec``),
:mod:`.selection` (which rows a rank reads, the shuffle buffer; :mod:`.shuffled_rows` gathers its
batches), :mod:`.readers` (the reader plug-in point: Arrow,
Petastorm), :mod:`.inputs` (the input specs), :mod:`.plan` (a run's inputs and label, extract →
finish), :mod:`.columns` (what a column holds, and its values as numpy arrays), :mod:`.pixels`
(images decoded and resized, random crops),
:mod:`.tensor_bytes` (arrays stored as float32 bytes), :mod:`.batching` (shuffle, batches,
decoding, tensors), :mod:`.shard_cache` (a rank's decoded row groups kept in memory after its first
pass) and :mod:`.reshard` (an interrupted epoch finished on another number of ranks).

Layers, each importing only the ones before it (nothing here imports a module that imports it,
not even inside a function or under ``TYPE_CHECKING``)::

    tensor_bytes < columns, pixels < petastorm_schema, inputs < plan < dataset < shuffled_rows < selection, shard_cache
        < spec < readers.base < readers.arrow, readers.petastorm < readers (the registry's lookup)
        < batching < reshard;    nonfinite sits on dataset, cache on tensor_bytes only

A reader's base module owns its contract (``DataReader``, with ``DataSpec`` below it in
:mod:`.spec`) and imports no reader; the package :mod:`.readers` imports the built-in ones and
looks readers up by name.
"""
