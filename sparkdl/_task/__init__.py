"""What runs inside a barrier task.

* :mod:`.entry` — ``_task_main``, what each barrier task runs: the progress channel, rank-prefixed
  output, threads, device, rendezvous, the user's function, the report. The stage's pickled
  closure refers to it, so the executors import it; it imports nothing of the driver side.
* :mod:`.heartbeat` — the rank's progress to the driver's watchdog at a fixed rate, and the
  driver's drain notice read on each beat;
* :mod:`.allocator` — glibc's mmap and trim thresholds raised before training, so a fresh worker
  does not fault every step's memory in again;
* :mod:`.config` — :class:`~sparkdl._task.config.LaunchConfig`, how the stage runs (it travels in
  the task's payload);
* :mod:`.fit_loop` — the loop ``TorchEstimator.fit`` runs on every rank;
* :mod:`.script`, :mod:`.runner`, :mod:`.environment` — ``sparkdl.launch``: the child process on
  the task's side, the child's own side, and the ``torchrun`` environment it gets;
* :mod:`.frameworks` — keeps Lightning, Accelerate and plain DDP code to one process per task.
"""
