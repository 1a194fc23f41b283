"""Data readers (the plug-in point of :mod:`sparkdl.data.readers.base`): ``"arrow"`` (native
pyarrow, the default) and ``"petastorm"``."""

from sparkdl.data.readers.base import Chunk, DataReader, chunk_rows, reader_from_name, registered_readers

__all__ = ["Chunk", "DataReader", "chunk_rows", "reader_from_name", "registered_readers"]
