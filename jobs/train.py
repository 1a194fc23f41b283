"""spark-submit entry point: train a PyTorch model with sparkdl.

    spark-submit --py-files models.py jobs/train.py --data URL --model models:make_model \
        --features features --label label --strategy allreduce --num-workers 2 --epochs 3 \
        --batch-size 32 --output DIR

Named model inputs instead of ``--features`` (images as bytes, token ids, ids, dense columns):
``--input image=image:jpeg_bytes:224x224x3 --input tokens=sequence:token_ids:128 --input dense=dense:age,income``.

Run ``jobs/train.py --help`` for every option. Same code as the ``sparkdl-train`` command and as
the application that ships in the package (``sparkdl/cli/jobs/train.py``), which a pip install
submits with ``sparkdl submit train [spark-submit options] -- ARGS`` (docs/deploy.md).
"""

import sys

from sparkdl.cli import main

if __name__ == "__main__":
    sys.exit(main())
