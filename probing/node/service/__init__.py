"""The engine: probing's half beside the job, one process per node, user and
set of ``PROBING_*`` settings (the ranks of a job share one).

Guests (``probing.guest``) hand it their processes (``POST /attach`` on
``<runtime>/probing-<uid>/engine-<key>.sock``, ``guest.place.engine_key``);
the engine runs with the job's settings. For each process it builds a probe
(``ProbeContext`` over a ``probing.target.GuestProcess``) that serves the pid's
own socket, ``<pid>.sock``: the BPF programs (compiled here, never in the
job), the store, SQL, NVML and the cluster node live here, in probing's own
Python and its numpy, pyarrow and datafusion. One engine serves every rank
of the node: the libraries load once, the BPF programs compile once, at
its start, before a trace needs them (``warm``).

A process that dies keeps its probe: its tracing stops, and what it left is
answered for ``PROBING_KEEP_DEAD_S`` (600 s) before it is retired. An engine
with no process left exits ``PROBING_ENGINE_IDLE_S`` (60 s) later.
"""

from probing.node.service.engine import Service, main

__all__ = ["Service", "main"]
