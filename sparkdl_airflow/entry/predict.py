"""spark-submit application of SparkdlPredictOperator: ``sparkdl predict`` on the Spark driver."""

import sys

from sparkdl.cli import predict_main

if __name__ == "__main__":
    sys.exit(predict_main())
