"""spark-submit application: ``sparkdl predict`` on the Spark driver (``sparkdl submit predict``)."""

import sys

from sparkdl.cli import predict_main

if __name__ == "__main__":
    sys.exit(predict_main())
