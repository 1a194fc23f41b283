"""``sparkdl package``: zip sparkdl (and the old ``connectors`` import path) for ``spark-submit --py-files``; no Spark needed."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional


def build_package_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkdl package",
        description="Zip the installed sparkdl (and connectors) for spark-submit --py-files, so executors without sparkdl installed can import it.",
    )
    parser.add_argument("--output", default="sparkdl.zip", help="zip file to write (default sparkdl.zip)")
    parser.add_argument(
        "--no-connectors",
        dest="connectors",
        action="store_false",
        help="leave out the top-level connectors package (the old import path of sparkdl.connectors)",
    )
    return parser


def package(output: str, connectors: bool = True) -> Dict[str, Any]:
    """Writes a reproducible zip (sorted entries, fixed timestamps, no bytecode) of the pure-Python
    packages; third-party packages (torch, pyspark, petastorm...) must be on the executors."""
    import importlib.util
    import zipfile

    import sparkdl

    roots = [os.path.dirname(os.path.abspath(sparkdl.__file__))]
    if connectors:
        spec = importlib.util.find_spec("connectors")
        if spec is not None and spec.submodule_search_locations:
            roots.append(list(spec.submodule_search_locations)[0])
    entries = []
    for root in roots:
        base = os.path.dirname(root)
        for folder, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(names):
                if name.endswith(".py") or name.endswith(".json") or name == "py.typed":
                    full = os.path.join(folder, name)
                    entries.append((os.path.relpath(full, base).replace(os.sep, "/"), full))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    tmp = output + ".tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, full in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            with open(full, "rb") as handle:
                archive.writestr(info, handle.read())
    os.replace(tmp, output)
    return {
        "output": os.path.abspath(output),
        "files": len(entries),
        "packages": [os.path.basename(r) for r in roots],
        "bytes": os.path.getsize(output),
    }


def package_main(argv: Optional[List[str]] = None) -> int:
    args = build_package_parser().parse_args(argv)
    result = package(args.output, connectors=args.connectors)
    print(result["output"])
    print(
        f"sparkdl package: {result['files']} files of {', '.join(result['packages'])}, {result['bytes']} bytes; "
        f"ship with spark-submit --py-files {args.output},models.py (sparkdl submit ships it for you)",
        file=sys.stderr,
    )
    return 0
