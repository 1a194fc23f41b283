"""A recommendation workload for ``sparkdl.ShardedEmbedding``: a synthetic click log generated with
Spark (:mod:`examples.recsys.data`), a DLRM-style model (:mod:`examples.recsys.model`) and its
training with ``TorchEstimator`` under ``ParameterServer`` (:mod:`examples.recsys.train`).

    python -m examples.recsys DIR [--rows N] [--vocab-scale S]

``benchmarks/recsys.py`` trains the same model on the same data under the other strategies.
"""
