"""Whether a process has formed a torch process group, seen from outside
without touching it: the threads its backend started, by the names torch
and Gloo give them (``/proc/<pid>/task/<tid>/comm``).

What a Gloo job shows (torch 2.13, ``mp.spawn`` and Lightning's own
launcher, read on a running job): every rank ``pt_gloo_runloop`` (the
group's work loop, one or more a group) and ``gloo_tcp_loop`` (the TCP
transport's loop, its pairs to the other ranks); rank 0 ``pt_tcpstore_uv``
besides; the ``mp.spawn`` parent, which only waits, nothing but ``python``.
An NCCL group starts ``pt_nccl_watchdg`` and ``pt_nccl_heartbt`` (its
watchdog and heartbeat monitor; ``pt_xccl_*``, ``pt_hccl_*`` the same for
Intel's and Ascend's backends).

What proves nothing, so is not taken:

* libtorch in ``/proc/<pid>/maps``: any ``import torch``;
* a TCPStore's thread (``pt_tcpstore``, ``pt_tcpstore_uv``): torchrun's
  elastic agent serves its job's store and is no rank;
* a TCP connection to the rendezvous port: from outside it is any client's
  connection unless the other end is known to be the store, and on every
  node but the store's it is a remote address.

A process that forms its group later (Lightning's rank 0 starts its ranks
first) shows its threads from then: the agent looks again at each scan.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from probing import proc

# a thread a torch process group's backend starts: torch's c10d names them
# ``pt_<backend>_<role>`` (``c10::setThreadName``; 15 characters at most,
# the kernel's limit), Gloo's transport its loop
GROUP_THREAD = re.compile(r"^(pt_(gloo|[a-z]ccl\d?)_\w+|gloo_tcp_loop)$")


def group_thread(names: Iterable[str]) -> str:
    """The first of the thread ``names`` that a process group's backend
    starts (``GROUP_THREAD``); "" where none is."""
    return next((n for n in names if GROUP_THREAD.match(n)), "")


def thread_names(pid: int) -> Iterator[str]:
    """The names of the threads of ``pid`` now, in thread order, each read
    when it is asked for; a thread that ended meanwhile is left out, a
    process that is gone has none."""
    try:
        tids = proc.tasks(pid)
    except OSError:
        return
    for tid in tids:
        try:
            yield proc.read(pid, f"task/{tid}/comm").strip()
        except OSError:
            continue


def formed(pid: int) -> str:
    """What shows that ``pid`` has formed a torch process group
    (``"torch process group (thread pt_gloo_runloop)"``); "" where nothing
    does. The threads are read until the first that shows it."""
    name = group_thread(thread_names(pid))
    return f"torch process group (thread {name})" if name else ""
