"""Data readers (the plug-in point of :mod:`sparkdl.data.readers.base`): ``"arrow"`` (native
pyarrow, the default) and ``"petastorm"``, and the lookup of a reader by name.

The registry's lookup lives here, above the readers, and not in ``base``: importing this package
(which any import of ``sparkdl.data.readers.base`` does first) imports the built-in readers, so
their names are registered before anything can look them up, and ``base`` never imports an
implementation. A reader defined outside sparkdl registers itself when its module is imported.
"""

from typing import List, Type

# Defining the classes registers "arrow" and "petastorm" (DataReader.__init_subclass__).
from sparkdl.data.readers import arrow, petastorm  # noqa: F401
from sparkdl.data.readers.base import _READERS, Chunk, DataReader, chunk_rows
from sparkdl.errors import ConfigError

__all__ = ["Chunk", "DataReader", "chunk_rows", "reader_class", "reader_from_name", "registered_readers"]


def registered_readers() -> List[str]:
    """Names of the readers ``reader=`` accepts."""
    return sorted(_READERS)


def reader_class(name: str) -> Type[DataReader]:
    """The reader class registered as ``name`` (its class attributes need no instance, which a
    reader whose package is missing refuses to build)."""
    try:
        return _READERS[name]
    except KeyError:
        raise ConfigError(f"reader={name!r} is unknown; valid: {', '.join(sorted(_READERS))}") from None


def reader_from_name(name: str) -> DataReader:
    return reader_class(name)()
