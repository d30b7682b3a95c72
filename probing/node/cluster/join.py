"""Joining the job in the background, however late it says who this process is.

One short-lived thread per probe (``run``), two waits, each with backoff:

1. *Learning the rank* (``learn_rank``): a process whose environment does
   not name its rank (Lightning's rank 0, ``mp.spawn``, DeepSpeed) asks its
   guest for the job's default process group until ``init_process_group``
   made one; a group of one process has no peers.
2. *Joining* (``keep_trying``): in an srun/mpirun-style job the store
   appears only when rank 0 calls ``init_process_group``, seconds or minutes
   after this probe started: cluster mode waits for it instead of turning
   off. What cannot work (no token, no address to bind) ends it at once.

Then the thread ends: an idle probe uses no CPU; each cluster query
re-reads the store. Each step itself is the node's (``Joiner``); a bug
here is logged and leaves the probe on its local socket.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from logging import INFO
from typing import Any, Protocol

from probing.errors import ProbingError, log_unexpected, tell
from probing.node.cluster.discovery import STORE_TIMEOUT_S

# waiting for the job's store: first retry after 50 ms, then doubling up to
# 0.5 s, so a probe joins within half a second of the store appearing
JOIN_BACKOFF_S = (0.05, 0.5)
# waiting for the job's default process group (a rank the environment does
# not name): asked after 50 ms, then doubling up to 2 s; one small request
# to the guest each time, nothing while the answer is known
LEARN_BACKOFF_S = (0.05, 2.0)
WAITING = "waiting for the job's default process group (torch's init_process_group)"


class Joiner(Protocol):
    """What joining needs of the cluster node (``probing.node.cluster.node.ClusterNode``)."""

    learn: Callable[[], Mapping[str, Any] | None] | None  # None once the rank is known
    error: str | None
    ready: threading.Event  # set once the first attempt to join is over
    pid: int
    rank: int
    addr: str | None

    def take_rank(self, dist: Mapping[str, Any]) -> None: ...

    def try_join(self, budget: float) -> bool: ...


def run(node: Joiner) -> None:
    """The background thread: learn the rank if need be, then join."""
    try:
        rank_known = learn_rank(node)
    except Exception as err:  # the top of a probe thread: a bug is logged
        node.error = f"{type(err).__name__}: {err}"
        log_unexpected("cluster mode off (local socket only)", err)
        rank_known = False
    if not rank_known:
        node.ready.set()
        return
    keep_trying(node)


def learn_rank(node: Joiner) -> bool:
    """Ask the process for its default process group until it has one
    (backoff ``LEARN_BACKOFF_S``); then this node is that rank. False
    when it never will be a peer: a job of one process, or gone."""
    delay = LEARN_BACKOFF_S[0]
    while node.learn is not None:
        try:
            dist = node.learn()
        except ProbingError as err:  # the process exited while we waited
            node.error = f"{WAITING}: {err}"
            return False
        if dist is not None:
            if int(dist["world"]) <= 1:
                node.error = "the job's default process group has one process: no peers"
                return False
            node.take_rank(dist)
            return True
        node.ready.set()  # queries meanwhile say that this probe is waiting
        time.sleep(delay)
        delay = min(delay * 2, LEARN_BACKOFF_S[1])
    return True


def keep_trying(node: Joiner) -> None:
    """Try to join until it works, with backoff (``JOIN_BACKOFF_S``), then end;
    say on the job's stderr that it waits, and when it joined."""
    delay, said = JOIN_BACKOFF_S[0], False
    while True:
        try:
            if node.try_join(STORE_TIMEOUT_S):
                if said:
                    tell(
                        f"cluster: joined the job as rank {node.rank} at {node.addr}",
                        node.pid,
                        INFO,
                    )
                return
        except (ProbingError, ValueError, OSError) as err:  # no token, no address to bind
            node.error = str(err)
            tell(f"cluster mode off: {err}; this probe answers on its local socket only", node.pid)
            return
        except Exception as err:  # the top of a probe thread: a bug is logged
            node.error = f"{type(err).__name__}: {err}"
            log_unexpected("cluster mode off (local socket only)", err)
            return
        finally:
            node.ready.set()  # the first attempt is over, whatever it gave
        if not said:
            said = True
            tell(
                f"cluster: {node.error}; this probe keeps trying in the background "
                "and joins when the job's store answers (local queries work meanwhile)",
                node.pid,
            )
        time.sleep(delay)
        delay = min(delay * 2, JOIN_BACKOFF_S[1])
