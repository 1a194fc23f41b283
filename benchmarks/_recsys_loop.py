"""The training loop every side of ``benchmarks/recsys.py`` runs on its ranks (``sparkdl.run``).

One epoch over the rank's shard of the click log, the same DLRM and Adagrad on every side; the
first ``warmup`` steps are not timed. Then rank 0 scores the held-out rows with its replica (the
sharded tables' rows pulled from their servers, which every rank keeps open until rank 0 is
done) and every rank reports what it measured:

* ``samples``/``seconds``: the rank's timed samples and wall time;
* ``comm_bytes``: ``ctx.comm_bytes`` over the timed steps: what the strategy counts as this
  rank's model-sync bytes (the parameter server: every frame it sent, sparse rows included;
  AllReduce: the dense gradient size DDP allreduces, which is wrong for sparse gradients, hence:)
* ``sparse_allreduce_bytes``: for ``nn.Embedding(sparse=True)`` under AllReduce, the bytes this
  rank sends in gloo's sparse allreduce, counted from each batch: each table's coalesced
  gradient (the batch's unique ids, int64, and their float32 rows) goes to each peer
  (allgather), plus the dense parameters' ring allreduce;
* ``peak_rss_mib``: the process's RSS high-water mark (``VmHWM``) after training, before
  scoring: the trainer's tables, optimizer state, buffers and Python worker together, reset to
  the current RSS (``start_rss_mib``) when the loop starts, because Spark reuses Python workers.
"""

from __future__ import annotations

import time
from typing import Any, Dict

import numpy as np
import torch


def status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def reset_peak_rss() -> None:
    """Sets ``VmHWM`` back to the current RSS (Linux >= 4.0): Spark reuses Python workers, so a
    side's peak would otherwise include the sides that ran in the same worker before it."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def make_loop(vocabularies, tables: str, dim: int, warmup: int, test_path: str, test_rows: int, max_steps: int = 0):
    """The ``train_fn`` of one side; ``max_steps`` > 0 ends the epoch after that many timed steps
    (for sides whose steps take seconds: their samples/s, not their AUC)."""

    def loop(ctx) -> Dict[str, Any]:
        import torch.distributed as dist

        from examples.recsys.data import ClickLog, auc, read_test
        from examples.recsys.model import DLRM, make_optimizer
        from examples.recsys.train import score

        reset_peak_rss()
        rss_start = status_mib("VmRSS")
        torch.manual_seed(0)
        model = ctx.prepare_model(DLRM(vocabularies, dim=dim, tables=tables))
        optimizer = ctx.prepare_optimizer(make_optimizer(model.parameters()))
        inner = getattr(model, "module", model)
        dense_bytes = sum(p.numel() * 4 for n, p in inner.named_parameters() if not n.startswith("embeddings."))
        world = ctx.world_size
        steps, samples, sparse_bytes, comm_start, started = 0, 0, 0, 0, time.time()
        for features, labels in ctx.epoch_batches():
            if steps == warmup:
                comm_start, started, samples, sparse_bytes = ctx.comm_bytes, time.time(), 0, 0
            optimizer.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(**features), labels.float())
            loss.backward()
            if tables == "sparse" and world > 1:
                # The local batch's unique ids (gloo coalesces each rank's gradient before the allgather).
                rows = sum(int(torch.unique(features[name]).numel()) for name in inner.names)
                sparse_bytes += (world - 1) * rows * (8 + 4 * dim) + 2 * (world - 1) * dense_bytes // world
            optimizer.step()
            steps += 1
            samples += len(labels)
            if max_steps and steps >= warmup + max_steps:
                break  # every rank stops at the same step: its peers wait in no collective
        seconds = time.time() - started
        measured = {
            "rank": ctx.rank,
            "steps": steps - warmup,
            "samples": samples,
            "seconds": seconds,
            "comm_bytes": ctx.comm_bytes - comm_start,
            "sparse_allreduce_bytes": sparse_bytes,
            "peak_rss_mib": status_mib("VmHWM"),
            "start_rss_mib": rss_start,
            "prefetched_lookups": _prefetched_lookups(inner),
            "lookups": steps * len(inner.names),  # warmup steps included, as in the prefetch's count
        }
        result: Dict[str, Any] = {}
        if ctx.rank == 0:
            test = read_test(ClickLog("", test_path, tuple(vocabularies), 0), limit=test_rows)
            result["auc"] = auc(test["label"], score(inner, test))
            result["test_rows"] = len(test["label"])
        gathered = [None] * world
        dist.all_gather_object(gathered, measured)  # also: no server closes before rank 0 has scored
        result["ranks"] = gathered
        return result

    return loop


def _prefetched_lookups(model) -> int:
    """Lookups that took rows pulled before their forward (``prefetch.py``), for the sharded
    tables; 0 for the others."""
    from sparkdl.strategies.parameter_server.embedding import sharded_embeddings

    tables = sharded_embeddings(model)
    prefetches = getattr(tables[0][1].source, "_prefetches", []) if tables else []
    return sum(prefetch.served_lookups for prefetch in prefetches)


def summarize(result: Dict[str, Any], tables: str) -> Dict[str, float]:
    """Both ranks' figures: samples/s (all samples over the slowest rank's time), bytes per step
    per rank (mean), the larger peak RSS."""
    ranks = result["ranks"]
    key = "sparse_allreduce_bytes" if tables == "sparse" else "comm_bytes"
    per_step = [r[key] / max(r["steps"], 1) for r in ranks]
    return {
        "samples_per_sec": sum(r["samples"] for r in ranks) / max(r["seconds"] for r in ranks),
        "bytes_per_step": float(np.mean(per_step)),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "start_rss_mib": max(r["start_rss_mib"] for r in ranks),
        "auc": result["auc"],
        "test_rows": result["test_rows"],
        "samples": sum(r["samples"] for r in ranks),
        "prefetched_share": sum(r["prefetched_lookups"] for r in ranks) / max(1, sum(r["lookups"] for r in ranks)),
    }
