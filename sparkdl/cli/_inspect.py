"""``sparkdl inspect``: describe a Parquet dataset (schema, rows, row groups, first rows), a saved
model's metadata, or a run's metrics.json; several runs side by side, and their loss curves as a
PNG (``--plot``); no Spark needed. Every path is a local path or a URL (sparkdl.filesystem)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

from sparkdl._driver.progress import validation_figures
from sparkdl.cli._common import UsageError, rank_rates


def build_inspect_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkdl inspect",
        description="Describe a Parquet dataset (schema, rows, row groups, first rows), a saved model, or a run's metrics.json; "
        "several runs (or models) side by side.",
    )
    parser.add_argument(
        "path",
        nargs="+",
        help="dataset, model directory, run directory or metrics.json, each a path or URL (several runs to compare)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="write loss (and validation metrics) per epoch of the run(s) here (a path or URL); needs matplotlib",
    )
    parser.add_argument("--rows", type=int, default=3, help="rows of a dataset to show (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    return parser


def describe(path: str, rows: int = 3) -> Dict[str, Any]:
    """What ``sparkdl inspect`` prints, as a dict with ``kind`` = metrics, model or dataset."""
    import pyarrow.fs as pafs

    from sparkdl.errors import ConfigError
    from sparkdl.filesystem import open_url, url_join

    try:
        url, fs, root = open_url(path, "path")
    except ConfigError as exc:  # a scheme with no filesystem here: what to install
        raise UsageError(str(exc)) from exc
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise UsageError(f"{path!r} does not exist")

    def read_json(file_path: str) -> Dict[str, Any]:
        with fs.open_input_stream(file_path) as stream:
            return json.loads(stream.read())

    def exists(file_path: str) -> bool:
        return fs.get_file_info(file_path).type == pafs.FileType.File

    if info.type == pafs.FileType.File and root.endswith(".json"):
        return {"kind": "metrics", "path": url, **read_json(root)}
    if info.type == pafs.FileType.Directory and exists(f"{root}/metadata.json"):
        return {"kind": "model", "path": url, **read_json(f"{root}/metadata.json")}
    if info.type == pafs.FileType.Directory and exists(f"{root}/metrics.json"):
        return {"kind": "metrics", "path": url_join(url, "metrics.json"), **read_json(f"{root}/metrics.json")}
    return _describe_dataset(fs, root, url, info, rows)


def _describe_dataset(fs: Any, root: str, url: str, info: Any, rows: int) -> Dict[str, Any]:
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    if info.type == pafs.FileType.File:
        paths = [root]
    else:
        found = fs.get_file_info(pafs.FileSelector(root, recursive=True))
        paths = sorted(
            f.path
            for f in found
            if f.type == pafs.FileType.File
            and not any(part.startswith(("_", ".")) for part in f.path[len(root) :].split("/") if part)
        )
    if not paths:
        raise UsageError(f"{url!r} holds no Parquet files")
    files, schema, head, total_rows = [], None, [], 0
    for file_path in paths:
        try:
            with fs.open_input_file(file_path) as handle:
                parquet = pq.ParquetFile(handle)
                metadata = parquet.metadata
                if schema is None:
                    schema = parquet.schema_arrow
                if len(head) < rows and metadata.num_row_groups:
                    table = parquet.read_row_group(0)
                    head.extend(table.slice(0, rows - len(head)).to_pylist())
        except Exception as exc:  # noqa: BLE001 - name the file that is not Parquet
            raise UsageError(f"{file_path!r} is not a readable Parquet file: {exc}") from exc
        groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        total_rows += metadata.num_rows
        files.append(
            {
                "path": file_path[len(root) :].lstrip("/") or os.path.basename(file_path),
                "rows": metadata.num_rows,
                "row_groups": groups,
            }
        )
    return {
        "kind": "dataset",
        "path": url,
        "rows": total_rows,
        "row_groups": sum(len(f["row_groups"]) for f in files),
        "schema": {field.name: str(field.type) for field in schema},
        "files": files,
        "head": [{k: _short(v) for k, v in row.items()} for row in head],
    }


def _short(value: Any, limit: int = 8) -> Any:
    if isinstance(value, list) and len(value) > limit:
        return [_short(v) for v in value[:limit]] + [f"... ({len(value)} values)"]
    if isinstance(value, float):
        return round(value, 4)
    return value


def format_description(doc: Dict[str, Any]) -> str:
    kind = doc["kind"]
    lines: List[str] = []
    if kind == "dataset":
        lines.append(
            f"dataset {doc['path']}: {doc['rows']} rows in {len(doc['files'])} file(s), {doc['row_groups']} row group(s)"
        )
        lines.append("schema:")
        lines += [f"  {name}: {dtype}" for name, dtype in doc["schema"].items()]
        lines.append("row groups (rows):")
        lines += [f"  {f['path']}: {', '.join(str(n) for n in f['row_groups']) or 'none'}" for f in doc["files"][:20]]
        if len(doc["files"]) > 20:
            lines.append(f"  ... {len(doc['files']) - 20} more file(s)")
        lines.append(f"first {len(doc['head'])} row(s):")
        lines += [f"  {json.dumps(row, default=str)}" for row in doc["head"]]
    elif kind == "model":
        lines.append(f"model {doc['path']}: sparkdl {doc.get('sparkdl_version')}, torch {doc.get('torch_version')}")
        plan = doc.get("inputs") or {}
        if plan and not plan.get("positional"):
            named = ", ".join(
                f"{key}={spec.get('type')}({', '.join(f'{k}={v}' for k, v in spec.items() if k != 'type' and v not in (None, 0, False))})"
                for key, spec in plan["inputs"]
            )
            lines.append(f"  inputs: {named} -> {doc.get('prediction_col')} (output shape {doc.get('output_shape')})")
        else:
            lines.append(
                f"  features: {', '.join(doc.get('feature_cols', []))} -> {doc.get('prediction_col')} (output shape {doc.get('output_shape')})"
            )
        run = doc.get("run_info") or {}
        if run:
            lines.append(
                f"  trained: {run.get('num_workers')} worker(s), {run.get('epochs')} epoch(s), strategy {(run.get('strategy') or {}).get('name')}"
            )
        lines += _history_lines(doc.get("history") or [])
    else:
        status = doc.get("status", "?")
        wall = doc.get("wall_seconds")
        lines.append(
            f"run {doc['path']}: {status}"
            + (f" in {wall:.1f}s" if isinstance(wall, (int, float)) else "")
            + f" (exit {doc.get('exit_code', '?')})"
        )
        if doc.get("error"):
            lines.append(f"  error: {doc['error']}")
        run = doc.get("run") or {}
        if run:
            lines.append(
                f"  {run.get('num_workers')} worker(s), strategy {(run.get('strategy') or {}).get('name')}, "
                f"{(run.get('dataset') or {}).get('rows')} rows, {len(run.get('attempts') or [])} attempt(s), "
                f"resumed at step {(run.get('steps') or {}).get('resumed_at')}"
            )
        lines += _history_lines(doc.get("history") or [])
        versions = doc.get("versions") or {}
        if versions:
            lines.append("  versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return "\n".join(lines)


def _history_lines(history: List[Dict[str, Any]]) -> List[str]:
    if not history:
        return []
    validation = validation_figures(history)
    lines = [
        "  epoch  loss        "
        + "".join(key.ljust(_width(key)) for key in validation)
        + "samples/s   seconds   per-rank samples/s"
    ]
    for r in history:
        ranks = ", ".join(f"{x:.0f}" for x in rank_rates(r))
        measured = "".join(_number(r.get(key)).ljust(_width(key)) for key in validation)
        lines.append(
            f"  {r.get('epoch', '?'):<6} {r.get('loss', float('nan')):<11.4f} {measured}{r.get('samples_per_sec', 0):<11.0f} {r.get('seconds', 0):<9.3f} {ranks}"
        )
    return lines


def _width(key: str) -> int:
    return max(12, len(key) + 2)


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def run_label(doc: Dict[str, Any]) -> str:
    """A run's strategy and directory, e.g. ``allreduce (runs/a)``: what tables and plots call it."""
    run = doc.get("run") or doc.get("run_info") or {}
    strategy = (run.get("strategy") or {}).get("name") or "?"
    from sparkdl.filesystem import basename, parent

    where = doc["path"]
    if basename(where) == "metrics.json":  # a run is named by its directory
        where = parent(where)
    return f"{strategy} ({basename(where) or where})"


def comparison_lines(docs: List[Dict[str, Any]]) -> List[str]:
    """One line per run: the last epoch's loss and validation metrics, mean samples/s, wall time."""
    validation = validation_figures([record for doc in docs for record in doc.get("history") or []])
    labels = [run_label(doc) for doc in docs]
    width = max(len("run"), *(len(label) for label in labels)) + 2
    lines = [
        "run".ljust(width)
        + "epochs  final loss  "
        + "".join(key.ljust(_width(key)) for key in validation)
        + "samples/s   wall s"
    ]
    for label, doc in zip(labels, docs):
        history = doc.get("history") or []
        last = history[-1] if history else {}
        rates = [r["samples_per_sec"] for r in history if isinstance(r.get("samples_per_sec"), (int, float))]
        wall = doc.get("wall_seconds")
        lines.append(
            label.ljust(width)
            + f"{len(history):<8}{_number(last.get('loss')):<12}"
            + "".join(_number(last.get(key)).ljust(_width(key)) for key in validation)
            + f"{(sum(rates) / len(rates)) if rates else float('nan'):<12.0f}"
            + (f"{wall:.1f}" if isinstance(wall, (int, float)) else "-")
        )
    return lines


def _plot(docs: List[Dict[str, Any]], path: str) -> None:
    from sparkdl.errors import ConfigError
    from sparkdl.plotting import plot_history

    labelled: Dict[str, Any] = {}
    for index, doc in enumerate(docs, 1):
        label = run_label(doc)
        labelled[label if label not in labelled else f"{label} #{index}"] = (
            doc.get("history") or []
        )  # same strategy and dir name
    try:
        plot_history(labelled if len(labelled) > 1 else next(iter(labelled.values())), path=path)
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def inspect_main(argv: Optional[List[str]] = None) -> int:
    args = build_inspect_parser().parse_args(argv)
    try:
        docs = [describe(path, rows=args.rows) for path in args.path]
        if (len(docs) > 1 or args.plot) and any(doc["kind"] == "dataset" for doc in docs):
            dataset = next(doc["path"] for doc in docs if doc["kind"] == "dataset")
            raise UsageError(
                f"{dataset!r} is a dataset: several paths and --plot take runs (metrics.json) or saved models"
            )
        if args.plot:
            _plot(docs, args.plot)
    except UsageError as exc:
        print(f"sparkdl inspect: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2, default=str))
    else:
        print("\n\n".join(format_description(doc) for doc in docs))
        if len(docs) > 1:
            print("\nruns compared (last epoch):\n" + "\n".join(comparison_lines(docs)))
    if args.plot:
        print(f"sparkdl inspect: wrote {args.plot}")
    return 0
