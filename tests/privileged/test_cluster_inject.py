"""A probe injected into a rank of a running job joins the cluster by itself.

The rank started without ``PROBING``: its environment (what torchrun, or
here the test, gave it) is read from its own ``os.environ`` after injection.
"""

from __future__ import annotations

import pytest

from probing.cli import doctor
from probing.cli.client import ProbeClient, cluster_query
from probing.inject import inject
from tests.conftest import IDLE_LOOP, require
from tests.test_cluster import GROUP_BY_RANK, TOKEN, free_ports, wait_ready

pytestmark = pytest.mark.privileged


def test_injected_rank_joins_the_cluster(spawn) -> None:
    require(doctor.check_ptrace().ok, "ptrace is not permitted here")
    addrs = [f"127.0.0.1:{p}" for p in free_ports(3)]
    env = {"PROBING_PEERS": ",".join(addrs), "PROBING_TOKEN": TOKEN}
    peers = [spawn(IDLE_LOOP, env={**env, "RANK": str(i)}) for i in range(2)]
    late = spawn(IDLE_LOOP, env={**env, "RANK": "2"}, probing=False)
    for t in peers:
        wait_ready(t.pid)
    before = cluster_query(GROUP_BY_RANK, pid=peers[0].pid, timeout=10.0)
    assert [(m.rank, m.reason) for m in before.missing] == [(2, "refused")]
    inject(late.pid)
    health = wait_ready(late.pid)
    assert health["cluster"]["rank"] == 2 and health["cluster"]["addr"] == addrs[2]
    after = cluster_query(GROUP_BY_RANK, pid=peers[0].pid)
    assert after.table.column("rank").to_pylist() == [0, 1, 2] and after.missing == []
    # and the injected probe can ask the others just as well
    mine = ProbeClient.for_pid(late.pid).cluster_query(GROUP_BY_RANK)
    assert mine.table.column("rank").to_pylist() == [0, 1, 2]
