"""Deletion vectors written per the Delta protocol, for the tests of tables that have them.

No tool this project can install writes deletion vectors: delta-rs (the ``deltalake``
package) reads them, but its ``DELETE`` rewrites files instead, and delta-spark's jars come
from Maven, which the build machine cannot reach. So the tests write a table with delta-rs
(deletion vectors enabled, partitioned, column-mapped as the test wants) and then commit a
``DELETE`` themselves, following the protocol's "Deletion Vectors" section
(https://github.com/delta-io/delta/blob/master/PROTOCOL.md#deletion-vectors): a 64-bit
RoaringBitmapArray of the deleted row indexes, in a ``deletion_vector_<uuid>.bin`` file
(storage type ``u``) or inline in the log (``i``, Z85-encoded), with ``remove`` and ``add``
actions that point the file at it.

That is only an honest test because the deletion vectors are read back by an independent
implementation: every test compares sparkdl's rows with what delta-rs (its DataFusion scan,
which parses the deletion vectors itself) says the table holds, and with the rows the test
meant to delete. The format was checked against a deletion vector Databricks Runtime wrote
(delta-rs's ``table-with-dv-small`` test table): this module serializes its rows {0, 9} to the
same 36 bytes and checksum.
"""

from __future__ import annotations

import json
import os
import struct
import time
import uuid
import zlib
from typing import Dict, Iterable, List, Optional, Sequence

#: RoaringBitmapArray's magic number (little-endian int32), then its bucket count (int64).
_MAGIC = 1681511377
#: Portable 32-bit roaring format without run containers.
_NO_RUN_COOKIE = 12346
#: Containers holding more values are bitmaps (8 KiB), fewer are sorted arrays of uint16.
_ARRAY_LIMIT = 4096
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def roaring_bitmap_array(rows: Iterable[int]) -> bytes:
    """The deletion vector of ``rows`` (row indexes within one file), as the protocol stores it."""
    buckets: Dict[int, List[int]] = {}
    for row in sorted(set(int(r) for r in rows)):
        buckets.setdefault(row >> 32, []).append(row & 0xFFFFFFFF)
    out = struct.pack("<iq", _MAGIC, len(buckets))
    for key, values in sorted(buckets.items()):
        out += struct.pack("<i", key) + _roaring32(values)
    return out


def _roaring32(values: Sequence[int]) -> bytes:
    containers: Dict[int, List[int]] = {}
    for value in values:
        containers.setdefault(value >> 16, []).append(value & 0xFFFF)
    header = struct.pack("<II", _NO_RUN_COOKIE, len(containers))
    bodies = []
    for key, lows in sorted(containers.items()):
        header += struct.pack("<HH", key, len(lows) - 1)
        if len(lows) <= _ARRAY_LIMIT:
            bodies.append(struct.pack(f"<{len(lows)}H", *lows))
        else:
            words = [0] * 1024
            for low in lows:
                words[low >> 6] |= 1 << (low & 63)
            bodies.append(struct.pack("<1024Q", *words))
    offset = len(header) + 4 * len(bodies)
    offsets = b""
    for body in bodies:
        offsets += struct.pack("<I", offset)
        offset += len(body)
    return header + offsets + b"".join(bodies)


def z85(data: bytes) -> str:
    """Z85 (ZeroMQ's base-85) of ``data``, zero-padded to a multiple of 4 bytes as Delta pads it."""
    data = data + b"\0" * (-len(data) % 4)
    out = []
    for (word,) in struct.iter_unpack(">I", data):
        chars = []
        for _ in range(5):
            word, digit = divmod(word, 85)
            chars.append(_Z85[digit])
        out.extend(reversed(chars))
    return "".join(out)


def _log(table: str) -> List[str]:
    directory = os.path.join(table, "_delta_log")
    return sorted(name for name in os.listdir(directory) if name.endswith(".json"))


def active_files(table: str) -> Dict[str, dict]:
    """The ``add`` action of every file of the latest version, by path (replays the JSON commits;
    the tests' tables have no checkpoints)."""
    files: Dict[str, dict] = {}
    for name in _log(table):
        with open(os.path.join(table, "_delta_log", name)) as handle:
            for line in handle:
                action = json.loads(line)
                if "add" in action:
                    files[action["add"]["path"]] = action["add"]
                elif "remove" in action:
                    files.pop(action["remove"]["path"], None)
    return files


def enable_deletion_vectors(table: str) -> int:
    """Commits the protocol upgrade that lets the table have deletion vectors (reader version
    3, writer version 7, the features the table already uses listed by name, as Delta Spark's
    ``ALTER TABLE ... SET TBLPROPERTIES ('delta.enableDeletionVectors' = true)`` does); returns
    the new version. delta-rs cannot make this upgrade on a column-mapped table, nor create a
    table with both (it drops the columnMapping feature)."""
    protocol, configuration = {}, {}
    for name in _log(table):
        with open(os.path.join(table, "_delta_log", name)) as handle:
            for line in handle:
                action = json.loads(line)
                protocol = action.get("protocol", protocol)
                configuration = action.get("metaData", {}).get("configuration", configuration)
    reader = set(protocol.get("readerFeatures") or ()) | {"deletionVectors"}
    writer = set(protocol.get("writerFeatures") or ()) | {"deletionVectors", "appendOnly", "invariants"}
    if configuration.get("delta.columnMapping.mode", "none") != "none" and protocol["minReaderVersion"] == 2:
        reader.add("columnMapping")
        writer.add("columnMapping")
    upgraded = {
        "minReaderVersion": 3,
        "minWriterVersion": 7,
        "readerFeatures": sorted(reader),
        "writerFeatures": sorted(writer),
    }
    return _commit(
        table,
        [
            {"commitInfo": {"timestamp": int(time.time() * 1000), "operation": "SET TBLPROPERTIES"}},
            {"protocol": upgraded},
        ],
    )


def _commit(table: str, actions: List[dict]) -> int:
    version = int(_log(table)[-1].split(".")[0]) + 1
    with open(os.path.join(table, "_delta_log", f"{version:020d}.json"), "x") as handle:
        handle.write("".join(json.dumps(action) + "\n" for action in actions))
    return version


def delete_rows(table: str, deleted: Dict[str, Iterable[int]], inline: bool = False, prefix: str = "") -> int:
    """Commits a DELETE of the rows ``deleted[path]`` (row indexes within each file, the file's
    whole deleted set, earlier deletions included) as deletion vectors; returns the new version.

    Args:
        table: the table's local directory (its protocol must have the deletionVectors feature:
            :func:`enable_deletion_vectors`).
        deleted: the files' paths as the log names them (``add.path``) and their deleted rows.
        inline: store the vectors in the log (storage type ``i``) instead of a file (``u``).
        prefix: the directory (under the table) of the vectors' file, as Spark spreads them.
    """
    files = active_files(table)
    payloads = {path: roaring_bitmap_array(rows) for path, rows in deleted.items()}
    stored = None if inline else _write_vector_file(table, payloads, prefix)
    now = int(time.time() * 1000)
    actions: List[dict] = [{"commitInfo": {"timestamp": now, "operation": "DELETE", "operationParameters": {}}}]
    for path, payload in payloads.items():
        add = dict(files[path])
        remove = {
            "path": path,
            "deletionTimestamp": now,
            "dataChange": True,
            "extendedFileMetadata": True,
            "partitionValues": add.get("partitionValues", {}),
            "size": add["size"],
        }
        if add.get("deletionVector"):
            remove["deletionVector"] = add["deletionVector"]
        cardinality = len(set(int(r) for r in deleted[path]))
        if stored is None:
            add["deletionVector"] = {
                "storageType": "i",
                "pathOrInlineDv": z85(payload),
                "sizeInBytes": len(payload),
                "cardinality": cardinality,
            }
        else:
            add["deletionVector"] = {**stored[path], "cardinality": cardinality}
        add["dataChange"] = True
        add["stats"] = _loose_stats(add.get("stats"))
        actions += [{"remove": remove}, {"add": add}]
    return _commit(table, actions)


def _write_vector_file(table: str, payloads: Dict[str, bytes], prefix: str) -> Dict[str, dict]:
    """One ``deletion_vector_<uuid>.bin``: a version byte, then per vector its big-endian size,
    its bytes and their big-endian CRC-32; each descriptor points at its size field."""
    file_id = uuid.uuid4()
    directory = os.path.join(table, prefix)
    os.makedirs(directory, exist_ok=True)
    content = b"\x01"
    descriptors = {}
    for path, payload in payloads.items():
        descriptors[path] = {
            "storageType": "u",
            "pathOrInlineDv": prefix + z85(file_id.bytes),
            "offset": len(content),
            "sizeInBytes": len(payload),
        }
        content += struct.pack(">i", len(payload)) + payload + struct.pack(">I", zlib.crc32(payload))
    with open(os.path.join(directory, f"deletion_vector_{file_id}.bin"), "wb") as handle:
        handle.write(content)
    return descriptors


def _loose_stats(stats: Optional[str]) -> Optional[str]:
    """A file's statistics after a deletion: the row count stays (it counts the file's rows),
    min/max may no longer be reached (``tightBounds`` false), as Spark writes them."""
    if not stats:
        return stats
    parsed = json.loads(stats)
    parsed["tightBounds"] = False
    return json.dumps(parsed)
