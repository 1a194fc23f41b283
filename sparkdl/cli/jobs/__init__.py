"""The spark-submit applications that ship inside the package, so a ``pip install sparkdl-torch``
has something to submit: ``train.py`` (``sparkdl train``) and ``predict.py`` (``sparkdl predict``).

``sparkdl submit train|predict`` runs spark-submit on them (:mod:`sparkdl.cli._submit`);
``spark-submit $(python -c 'import sparkdl.cli.jobs as j; print(j.TRAIN)') ...`` works too. A
checkout's ``jobs/train.py`` and ``jobs/predict.py`` run the same code.
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))

#: The training application: ``sparkdl train`` under spark-submit.
TRAIN = os.path.join(_HERE, "train.py")
#: The prediction application: ``sparkdl predict`` under spark-submit.
PREDICT = os.path.join(_HERE, "predict.py")
#: Job name -> its application file, as ``sparkdl submit`` names them.
JOBS = {"train": TRAIN, "predict": PREDICT}
