"""The data path. Driver side: :mod:`.prepare` (checks before launch), :mod:`.dataset` (what a
Parquet dataset holds, from its footers), :mod:`.cache` (DataFrames materialized once). Task side:
:mod:`.selection` (which rows a rank reads), :mod:`.readers` (the reader plug-in point: Arrow,
Petastorm), :mod:`.inputs` (the input specs), :mod:`.plan` (a run's inputs and label, extract →
finish), :mod:`.columns` (column values as numpy arrays), :mod:`.tensor_bytes` (arrays stored as
float32 bytes), :mod:`.nonfinite` (NaN/inf found and named), :mod:`.batching` (shuffle, batches,
decoding, tensors), :mod:`.elastic` (an interrupted epoch finished on another number of ranks) and
:mod:`.torch_dataset` (a rank's shard as a torch ``IterableDataset``)."""
