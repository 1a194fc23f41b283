"""spark-submit application of SparkdlTrainOperator: ``sparkdl train`` on the Spark driver."""

import sys

from sparkdl.cli import main

if __name__ == "__main__":
    sys.exit(main())
