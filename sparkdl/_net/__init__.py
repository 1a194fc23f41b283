"""sparkdl's own network: every socket sparkdl opens goes through this package.

* :mod:`.server` — the connection lifecycle shared by sparkdl's servers (accept, handshake
  deadline, flood resistance, shutdown);
* :mod:`.frames` — per-connection frame protection: the per-job secret's handshake, MACs,
  optional encryption;
* :mod:`.policy` — what the traffic must do, from Spark's security settings;
* :mod:`.channel` — the tasks' progress and failure messages to the driver;
* :mod:`.rendezvous_store` and :mod:`.rendezvous_wire` — the key-value store ``torch.distributed``
  rendezvouses through, and its wire protocol;
* :mod:`.interfaces` — which network interface a rank's collectives use.

The parameter server's transport (:mod:`sparkdl.strategies.parameter_server.transport`) builds
on :mod:`.server` and :mod:`.frames`.
"""
