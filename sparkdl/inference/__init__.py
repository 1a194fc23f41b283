"""Scoring with a trained :class:`~sparkdl.TorchModel`: what ``TorchModel.transform``,
:func:`sparkdl.predict` and ``sparkdl predict`` run (docs/inference.md).

Driver side: :mod:`~sparkdl.inference.api` (the options, validated in one place),
:mod:`~sparkdl.inference.transform` (a DataFrame's predictions as one ``mapInArrow`` stage),
:mod:`~sparkdl.inference.predict_job` (a Parquet dataset's predictions, committed per part and
resumable). Executor side: :mod:`~sparkdl.inference.scorer` (Arrow batches in, prediction
columns out, bad rows bisected) and the modules it uses.
"""
