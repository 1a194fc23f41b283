"""spark-submit application: ``sparkdl train`` on the Spark driver (``sparkdl submit train``)."""

import sys

from sparkdl.cli import main

if __name__ == "__main__":
    sys.exit(main())
