"""How sparkdl's estimator and model are saved where Spark ML and MLflow look for them.

One concern per module:

* :mod:`.stage` — a sparkdl stage as Spark ML saves and loads it inside a ``Pipeline``,
  ``PipelineModel`` or ``CrossValidatorModel``: the ``metadata/`` line Spark's readers parse,
  the writer and reader that ``write()`` / ``read()`` return (files through
  :mod:`sparkdl.filesystem`, no Spark job), and where Spark puts a path without a scheme.
* :mod:`.arguments` — a ``TorchEstimator`` saved as its constructor arguments (model factory,
  optimizer, loss, strategy, every setting) pickled, with the argument that cannot be saved named.
* :mod:`.input_columns` — what a model's input columns hold (kind, shape), recorded from its
  training data or an example: the MLflow signature and the pyfunc's reading of pandas rows.
* :mod:`.mlflow_flavor` — a ``TorchModel`` as an MLflow model: the pyfunc flavor (predictions
  through the same code as ``transform``), its signature, logging and registration.

The estimator and model import :mod:`.stage`, :mod:`.arguments` and :mod:`.input_columns`;
:mod:`.mlflow_flavor` imports the model, and :mod:`sparkdl.tracking` imports it.
"""
