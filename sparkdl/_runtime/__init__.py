"""What one rank holds while it trains, under :class:`sparkdl.context.TrainContext`.

* :mod:`.rendezvous` — a barrier task becomes one rank of a process group;
* :mod:`.stream` — the rank's position in its data stream (epoch, step, what a checkpoint records);
* :mod:`.resume` — a checkpoint that does not fit the run as it is: N ranks' loaded on M, or indexing other data;
* :mod:`.validation` — the per-epoch validation pass;
* :mod:`.device`, :mod:`.device_feed`, :mod:`.host_batches`, :mod:`.pinned_ring`,
  :mod:`.precision` — where the rank trains and how batches reach it;
* :mod:`.checkpoint_writer` — a rank's checkpoint part, written in the background;
* :mod:`.drain` — the just-in-time checkpoint of a host that is about to go away;
* :mod:`.resize`, :mod:`.accumulation` — ``on_resize``: gradient accumulation or a scaled
  learning rate on fewer workers than ``num_workers``.
"""
