"""The scripts the operators hand to spark-submit (its driver runs them, with sparkdl installed);
files in the package, so the worker needs no checkout of sparkdl."""

import os

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
PREDICT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "predict.py")
