"""The data path. Driver side: :mod:`.prepare` (checks before launch), :mod:`.dataset` (what a
Parquet dataset holds, from its footers), :mod:`.cache` (DataFrames materialized once). Task side:
:mod:`.selection` (which rows a rank reads), :mod:`.readers` (the reader plug-in point: Arrow,
Petastorm), :mod:`.inputs` (the input specs), :mod:`.plan` (a run's inputs and label, extract →
finish), :mod:`.columns` (column values as numpy arrays) and :mod:`.batching` (shuffle, batches,
decoding, tensors)."""
