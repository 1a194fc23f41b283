"""A dataset's Parquet files, opened once each, read row group by row group.

The readers, the driver's shard counts and elastic resume read through :class:`OpenFiles`: a
table's files (:mod:`sparkdl.data.table_layout`) through its layout, so renamed and partition
columns come back under the table's names, and a filter on partition columns skips files.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from sparkdl.data.dataset import DatasetInfo
from sparkdl.errors import DataError
from sparkdl.filesystem import file_paths, filesystem_and_path


class OpenFiles:
    """A dataset's files, each opened once with its footer kept: a task reads many row groups
    per file, and re-parsing a footer per row group would cost more than small row groups."""

    def __init__(self, dataset: DatasetInfo, use_threads: bool = True) -> None:
        self.dataset = dataset
        # False: one row group is decoded in the calling thread, for callers that read several
        # at once on threads of their own (pyarrow's pool would only add handovers to it).
        self.use_threads = use_threads
        self.urls = [f.url for f in dataset.files]
        self.fs, _ = filesystem_and_path(self.urls[0])
        self.paths = file_paths(self.fs, self.urls)
        self._files: Dict[int, pq.ParquetFile] = {}
        self._matching: Dict[int, Optional[set]] = {}

    def parquet(self, index: int) -> pq.ParquetFile:
        handle = self._files.get(index)
        if handle is None:
            try:
                handle = pq.ParquetFile(self.fs.open_input_file(self.paths[index]), pre_buffer=True)
            except (pa.ArrowInvalid, OSError) as exc:
                raise DataError(f"cannot open Parquet file {self.urls[index]!r}: {exc}") from exc
            self._files[index] = handle
        return handle

    def read(self, index: int, row_group: int, columns: Sequence[str]) -> pa.Table:
        """Every row of a row group (a table's deleted ones too: the selection leaves them out)."""
        try:
            if self.dataset.layout is not None:
                return self.dataset.layout.read(self.parquet(index), index, row_group, columns, self.use_threads)
            return self.parquet(index).read_row_group(row_group, columns=list(columns), use_threads=self.use_threads)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"cannot read row group {row_group} of Parquet file {self.urls[index]!r}: {exc}") from exc

    def may_match(self, index: int, row_group: int, expression) -> bool:
        """False when the row group's statistics prove no row passes the filter (skip it)."""
        if index not in self._matching:
            import pyarrow.dataset as pads

            try:
                self._matching[index] = self._matching_row_groups(index, expression, pads)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError):
                self._matching[index] = None  # statistics unusable: read every row group
        matching = self._matching[index]
        return matching is None or row_group in matching

    def _matching_row_groups(self, index: int, expression, pads) -> Optional[set]:
        layout = self.dataset.layout
        if layout is None:
            fragment = pads.ParquetFileFormat().make_fragment(self.paths[index], filesystem=self.fs)
            return {rg.id for rg in fragment.subset(filter=expression).row_groups}
        # A table's file: its partition values (from the log) can rule the filter out too.
        pushdown = layout.pushdown(index, self.parquet(index).schema_arrow)
        if pushdown is None:
            return None
        partition, schema = pushdown
        fragment = pads.ParquetFileFormat().make_fragment(
            self.paths[index], filesystem=self.fs, partition_expression=partition
        )
        return {rg.id for rg in fragment.subset(filter=expression, schema=schema).row_groups}

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()
