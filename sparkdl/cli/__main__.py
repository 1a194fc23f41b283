"""``python -m sparkdl.cli ...``: ``sparkdl train`` (= ``sparkdl-train``), as when the CLI was one module."""

import sys

from sparkdl.cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
