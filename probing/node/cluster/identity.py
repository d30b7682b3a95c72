"""Who this probe is in the job: from the environment torchrun sets, then
from the job's own default process group once it has one (``learned``).

Everything here is pure (an ``environ`` mapping in, dataclasses out), so it
is tested on canned environments. A probe injected into a running job reads
the process's own ``os.environ``, which holds what torchrun gave it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from probing import config
from probing.errors import ProbingError

DEFAULT_PORT = 0  # any free port: the address is published, not guessed


@dataclass(frozen=True)
class Identity:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    node: str
    group_rank: int | None
    master: tuple[str, int] | None  # the rendezvous store (MASTER_ADDR, MASTER_PORT)
    run_id: str
    peers: tuple[str, ...]  # the explicit PROBING_PEERS list, "host:port" each
    port: int  # TCP port to listen on (0: any)

    @property
    def source(self) -> str:
        return "peers" if self.peers else "torchrun"


def split_addr(addr: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) into its parts; ProbingError when malformed."""
    host, sep, port = addr.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ProbingError(f"bad peer address {addr!r}", hint="use host:port, e.g. 10.0.0.2:7070")
    return host, int(port)


def parse_peers(value: str) -> tuple[str, ...]:
    """``PROBING_PEERS``: ``host:port,host:port`` or ``@file`` (one a line, ``#`` comments)."""
    value = value.strip()
    if value.startswith("@") or (value and os.path.isfile(value)):
        path = value.removeprefix("@")
        try:
            with open(path) as f:
                text = f.read()
        except OSError as err:
            raise ProbingError(f"cannot read the peer list {path}: {err.strerror}") from err
        items = [line.split("#", 1)[0] for line in text.splitlines()]
    else:
        items = value.split(",")
    peers = tuple(item.strip() for item in items if item.strip())
    for addr in peers:
        split_addr(addr)
    return peers


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError as err:
        raise ProbingError(f"{name}={raw!r} is not an integer") from err


# where ``RANK`` is absent, the launchers that name a process's rank and the
# job's size otherwise, first found first: Open MPI's ``mpirun``, a PMIx
# server (``srun --mpi=pmix``, prrte), MPICH's and Intel MPI's Hydra (PMI),
# then Slurm's ``srun`` (Megatron's ranks read ``SLURM_PROCID``: last, as an
# ``mpirun`` inside an allocation inherits the batch step's ``SLURM_PROCID=0``)
LAUNCHERS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMIX_RANK", None, None),  # PMIx names no size: its launcher's (srun's, mpirun's)
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def pod_index(environ: Mapping[str, str]) -> bool:
    """Whether ``RANK`` is a pod's index, not this process's rank: a Kubeflow
    PyTorchJob sets it with ``PET_NPROC_PER_NODE`` for torchrun in the pod,
    which gives each process it starts its own ``RANK`` (and
    ``TORCHELASTIC_RUN_ID``); the process without one is the launcher."""
    nproc = environ.get("PET_NPROC_PER_NODE", "").strip()
    return nproc not in ("", "1") and not environ.get("TORCHELASTIC_RUN_ID")


def launcher_rank(environ: Mapping[str, str]) -> tuple[int | None, int | None, int | None]:
    """(rank, size, local rank) from the first launcher of ``LAUNCHERS`` that
    names a rank, its size and local rank where it names them, else the
    other launchers'; Nones where none names a rank."""
    for i, (name, _, _) in enumerate(LAUNCHERS):
        rank = _int(environ, name)
        if rank is None:
            continue
        order = [LAUNCHERS[i], *LAUNCHERS[:i], *LAUNCHERS[i + 1 :]]
        size, local = (
            next((n for v in order if (n := _int(environ, v[k] or "")) is not None), None)
            for k in (1, 2)
        )
        return rank, size, local
    return None, None, None


def from_env(environ: Mapping[str, str] = os.environ) -> Identity:
    """This process's identity. With ``PROBING_PEERS``, a process that sets no
    ``RANK`` takes the index of the first listed address it can bind. Without
    ``RANK``, the rank and size an MPI launcher or Slurm's ``srun`` gives
    (``LAUNCHERS``); a pod's index (``pod_index``) is no process's rank."""
    env = config.from_env(environ, strict=True)
    peers = parse_peers(env.peers) if env.peers else ()
    rank = env.rank
    world = _int(environ, "WORLD_SIZE")
    local = _int(environ, "LOCAL_RANK")
    if rank is None and environ.get("RANK", "").strip():
        rank = None if pod_index(environ) else _int(environ, "RANK")
    elif rank is None and not peers:
        rank, size, local_of = launcher_rank(environ)
        world = world or size
        local = local if local is not None else local_of
    world = world or (len(peers) or 1)
    if peers:
        world = len(peers)
    master = None
    if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT") and not peers:
        master = (environ["MASTER_ADDR"], _int(environ, "MASTER_PORT") or 0)
    port = env.port
    return Identity(
        rank=-1 if rank is None else rank,
        world_size=world,
        local_rank=local or 0,
        node=env.node or socket.gethostname(),
        group_rank=_int(environ, "GROUP_RANK"),
        master=master,
        run_id=environ.get("TORCHELASTIC_RUN_ID") or "none",
        peers=peers,
        port=DEFAULT_PORT if port is None else port,
    )


# torchrun's run id where its user gave none (``--rdzv-id``, ``--standalone``):
# every plain torchrun job of a node has it, so it names no job
DEFAULT_RUN_ID = "none"
# where no run id names the job, what its launcher names it by, first found
# first: a Slurm job, an Open MPI ``mpirun``, a PMIx namespace (srun --mpi=pmix, prrte)
LAUNCHER_JOBS = ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE")


def job_label(environ: Mapping[str, str]) -> str:
    """The ``job`` label of a process (the agent's ``/metrics``, findings,
    webhook): unique on the node and the same on every node of the job, from
    what every rank's launcher gave it. The launcher's run id where its user
    set one (torchrun's ``TORCHELASTIC_RUN_ID``, not its default ``none``),
    else the launcher's job (``LAUNCHER_JOBS``), else the job's rendezvous,
    ``MASTER_ADDR:MASTER_PORT``: two jobs at once cannot share one (its store
    listens there), and every node of a job reaches the same. Nothing else
    every node shares tells a job from one started later on the same
    address (each node's launcher starts at its own time); ``"?"`` for a
    process no launcher describes."""
    run_id = environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id != DEFAULT_RUN_ID:
        return f"torchelastic_run_id={run_id}"
    for name in LAUNCHER_JOBS:
        if environ.get(name, "").strip():
            return f"{name.lower()}={environ[name].strip()}"
    addr, port = environ.get("MASTER_ADDR", "").strip(), environ.get("MASTER_PORT", "").strip()
    if port and addr:
        return f"rendezvous={addr}:{port}"
    return f"master_port={port}" if port else "?"


def known(ident: Identity) -> bool:
    """Whether the environment said enough to join: a rank of a job of
    several with its store, or an explicit peer list."""
    return bool(ident.peers) or (
        ident.rank >= 0 and ident.world_size > 1 and ident.master is not None
    )


def learned(ident: Identity, dist: Mapping[str, Any]) -> Identity:
    """``ident`` corrected by the job's default process group (``inside.distributed``):
    its rank, size and store are what the job runs on, whatever the
    environment said (Lightning's rank 0 has no ``RANK`` nor ``WORLD_SIZE``)."""
    store = dist.get("store")
    master = (str(store[0]), int(store[1])) if store else ident.master
    return replace(ident, rank=int(dist["rank"]), world_size=int(dist["world"]), master=master)


def job_address(master: tuple[str, int] | None) -> str:
    """The local address this host uses to reach the job's rendezvous.

    A UDP ``connect`` sends nothing; it only asks the kernel for the route,
    so this is the interface the job's own traffic goes through.
    """
    if master is None:
        return "127.0.0.1"
    host, port = master
    try:
        infos = socket.getaddrinfo(host, port or 1, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)
            addr: str = s.getsockname()[0]
            return addr
    except OSError:
        return "127.0.0.1"


def token_from_env(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """``PROBING_TOKEN``, or the first line of ``PROBING_TOKEN_FILE``."""
    env = config.from_env(environ)
    if env.token.strip():
        return env.token.strip().encode()
    path = env.token_file
    if path:
        try:
            with open(path) as f:
                return f.readline().strip().encode() or None
        except OSError as err:
            raise ProbingError(f"cannot read PROBING_TOKEN_FILE {path}: {err.strerror}") from err
    return None
