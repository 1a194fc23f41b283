"""spark-submit entry point: predict (and evaluate) with a saved sparkdl model.

    spark-submit --py-files models.py jobs/predict.py --model RUN/model --data URL \
        --output DIR [--label label]

Writes DIR/predictions (Parquet) and DIR/metrics.json. Same code as ``sparkdl predict`` and as
``sparkdl submit predict [spark-submit options] -- ARGS`` (the application in the package).
"""

import sys

from sparkdl.cli import predict_main

if __name__ == "__main__":
    sys.exit(predict_main())
