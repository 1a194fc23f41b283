"""The data path. Driver side: :mod:`.prepare` (checks before launch), :mod:`.dataset` (what a
Parquet dataset holds, from its footers), :mod:`.cache` (DataFrames materialized once). Task side:
:mod:`.readers` (the reader plug-in point: Arrow, Petastorm), :mod:`.inputs` (how model inputs
are built from columns) and :mod:`.batching` (shuffle, batches, decoding, tensors)."""
