"""A 4-rank Gloo training job on CPU that records its own truth (``make accuracy``).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 train.py --shape ddp_buckets \\
        --fault loader --fault-rank 2 --onset-step 20 --truth /tmp/t.jsonl

Each rank appends to ``--truth PATH`` + ``.rank{r}`` (or ``$ACCURACY_TRUTH``):

- once at start: ``{"fault", "rank", "onset_step", "ms", "pid", "tid", "shape"}``
  (``rank``: the rank the fault is injected on; ``pid``: this rank's);
- on the faulty rank, when the fault first fires: ``{"fault", "rank",
  "onset": time.time(), "ms", "step"}``;
- one line per optimizer step: ``{"rank", "step", "t0", "t1", "t_arrive",
  "t_collective", "t_last_collective", "injected_ms", "runq_ms"}``: wall-clock
  ``time.time()`` at the step's start and end, just before its first
  collective (the synchronised backward for DDP, the last forward for FSDP2),
  and when DDP launched the step's first bucket and its last (a comm hook:
  ``allreduce_hook``, stamped; None for FSDP2, whose first all-gather starts
  with the forward), the time this rank spent in
  the injected fault during the step (measured, not the nominal figure), and
  the time the training thread waited for a CPU
  (``/proc/thread-self/schedstat``).

Shapes: ``ddp_buckets`` (DDP, an MLP of ~2.4 MB: 2 gradient buckets, so 2
all-reduces a step), ``grad_accum`` (the same, 4 micro-batches a step, the
first 3 under ``no_sync``), ``thread_loop`` (``ddp_buckets`` run in a
``threading.Thread(name="trainer")`` the main thread joins), ``fsdp2``
(``fully_shard`` on a 4-layer MLP).

Faults, from ``--onset-step`` on ``--fault-rank``: ``loader`` (+40 ms asleep
in ``load_batch``), ``python_work`` (+30 ms of pure-Python busy loop in
``extra_work``), ``every_10th`` (+60 ms asleep in ``load_batch`` on every
10th step), ``hang`` (``load_batch`` never returns), ``cpu_contention`` (the
rank pins itself to the last CPU and starts a busy process pinned there with
``taskset``), ``gc`` (``make_garbage``: a big object graph and
``gc.collect()`` each step), ``killed`` (the rank kills itself with
SIGKILL in ``load_batch``, a forked child holding its connections open, as
NCCL's peers see a dead rank: they wait; started without torchrun, which
would stop the job), ``slow_link`` (nothing here: the runner puts the rank behind a slow link;
its onset is said at ``--onset-step``), ``healthy`` (nothing).

This file imports nothing from probing: it is the job, not the tool.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

LOAD_MS = 20.0  # the data loader's normal latency
FAULT_MS = {
    "loader": 40.0,
    "python_work": 30.0,
    "every_10th": 60.0,
    "hang": 0.0,
    "cpu_contention": 0.0,
    "gc": 0.0,
    "healthy": 0.0,
    "killed": 0.0,
    "slow_link": 0.0,  # the runner slows this rank's link; the job only says when it counts
}
GC_OBJECTS = 40_000  # the gc fault's object graph (dicts in one cycle)
ACCUM = 4  # grad_accum: micro-batches per optimizer step


class Truth:
    """This rank's truth file, one JSON object a line, flushed each line."""

    def __init__(self, path: str, rank: int) -> None:
        self.f = open(f"{path}.rank{rank}", "a", buffering=1)
        self.lock = threading.Lock()

    def write(self, obj: dict) -> None:  # type: ignore[type-arg]
        with self.lock:
            self.f.write(json.dumps(obj) + "\n")
            self.f.flush()


class Fault:
    """The fault this rank injects (if it is the faulty rank), and the time
    it spent in it during the current step."""

    def __init__(self, args: argparse.Namespace, rank: int, truth: Truth) -> None:
        self.kind = args.fault
        self.mine = rank == args.fault_rank and self.kind != "healthy"
        self.onset = args.onset_step
        self.ms = FAULT_MS[self.kind]
        self.truth = truth
        self.rank = rank
        self.fired = False
        self.step = 0
        self.injected_ms = 0.0  # this step's
        self.hog: subprocess.Popen | None = None  # type: ignore[type-arg]
        # grad_accum: a loader call, and each fault, per micro-batch of 1/micro
        # the batch, so that a step gets the same figures as in the other shapes
        self.scale = 1.0

    def active(self) -> bool:
        return self.mine and self.step >= self.onset

    def fire(self) -> None:
        """Record the onset the first time the fault acts."""
        if not self.fired:
            self.fired = True
            self.truth.write(
                {
                    "fault": self.kind,
                    "rank": self.rank,
                    "onset": time.time(),
                    "ms": self.ms,
                    "step": self.step,
                }
            )
            if self.kind == "cpu_contention":  # a busy process on this rank's CPU
                cpu = str(max(os.sched_getaffinity(0)))
                self.hog = subprocess.Popen(
                    ["taskset", "-c", cpu, sys.executable, "-c", "while True: pass"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                )

    def add(self, t0: float) -> None:
        self.injected_ms += (time.perf_counter() - t0) * 1e3


def load_batch(
    step: int, fault: Fault, batch: int = 64, width: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read and decode one batch: storage latency, then a little CPU work.
    (The sleeps are here, not in a helper: the function that waits is this one.)"""
    if fault.active() and fault.kind in ("loader", "every_10th", "hang", "killed"):
        t0 = time.perf_counter()
        if fault.kind == "killed":  # kill -9 (the OOM killer, a node's watchdog)
            fault.fire()
            hold_connections()
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "hang":
            fault.fire()
            threading.Event().wait()  # a read that never returns
        elif fault.kind == "loader" or step % 10 == 0:
            fault.fire()
            time.sleep(fault.ms * fault.scale * random.uniform(0.95, 1.05) / 1000)
        fault.add(t0)
    time.sleep(LOAD_MS * fault.scale * random.uniform(0.95, 1.05) / 1000)
    x = torch.randn(batch, width)
    a = torch.randn(128, 128)
    for _ in range(3):  # decode / augment
        a = torch.tanh(a @ a * 0.01)
    return x + a.mean() * 0, torch.randint(0, 10, (batch,))


def hold_connections() -> None:
    """Keep this rank's connections to its peers open past its death, as
    NCCL's peers see a dead rank (they wait in their collective until its
    timeout; Gloo's would see the connection closed and fail at once): a
    forked child gives those descriptors to ``sleep``, which holds them with
    no environment (no rank variable: it is no rank of the job) until the job
    is killed. The job's store, which rank 0 serves, goes with it as it
    would (its listening socket and the connections on its port closed)."""
    if os.fork() != 0:
        return
    store = int(os.environ.get("MASTER_PORT", "0"))
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            s = socket.socket(fileno=fd)
        except OSError:  # not a socket: kept, inheritable
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, True)
            continue
        try:
            listens = s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            port = s.getsockname()[1] if s.family in (socket.AF_INET, socket.AF_INET6) else 0
        except OSError:
            listens, port = 0, 0
        if listens or port == store:
            s.close()
        else:
            s.detach()
            os.set_inheritable(fd, True)
    os.execve("/bin/sleep", ["sleep", "3600"], {})


def extra_work(ms: float) -> int:
    """Pure-Python busy work for ``ms`` of wall time (the python_work fault)."""
    end = time.perf_counter() + ms / 1000
    n = 0
    while time.perf_counter() < end:
        for i in range(200):
            n += i * i % 7
    return n


def make_garbage(n: int) -> int:
    """A big cyclic object graph, then a full collection (the gc fault)."""
    nodes = [{"i": i} for i in range(n)]
    for i, d in enumerate(nodes):
        d["next"] = nodes[(i + 1) % n]
    del nodes
    return gc.collect()


def on_cpu_faults(fault: Fault) -> None:
    """The faults that run in the training loop rather than the loader."""
    if not fault.active():
        return
    if fault.kind == "python_work":
        fault.fire()
        t0 = time.perf_counter()
        extra_work(fault.ms * fault.scale)
        fault.add(t0)
    elif fault.kind == "gc":
        fault.fire()
        t0 = time.perf_counter()
        make_garbage(int(GC_OBJECTS * fault.scale))
        fault.add(t0)
    elif fault.kind in ("cpu_contention", "slow_link"):
        fault.fire()


def runq_ns() -> int:
    """The calling thread's time waiting for a CPU so far."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def build(shape: str) -> tuple[nn.Module, int]:
    """The model of ``shape`` and its input width."""
    if shape == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        net = mlp([64, 256, 256, 256, 10])
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net, 64
    # ~2.4 MB of parameters: DDP's first bucket is capped at 1 MiB, so 2 buckets
    net = mlp([64, 1024, 512, 10])
    ddp = nn.parallel.DistributedDataParallel(net)
    ddp.register_comm_hook(None, stamp_buckets)
    return ddp, 64


# when this rank launched each bucket of its last step (wall s), by bucket index
BUCKETS: dict[int, float] = {}


def stamp_buckets(state: object, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP's own all-reduce of ``bucket`` (``allreduce_hook``), each bucket's
    launch stamped: when this rank reached its first collective, and its last."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    BUCKETS[bucket.index()] = time.time()
    return default_hooks.allreduce_hook(None, bucket)


# torch checks a hook's annotations as objects (this file's are strings: __future__)
stamp_buckets.__annotations__.update(bucket=dist.GradBucket, state=object)
stamp_buckets.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def train(args: argparse.Namespace, rank: int, truth: Truth, fault: Fault) -> None:
    model, width = build(args.shape)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    micro = ACCUM if args.shape == "grad_accum" else 1
    fsdp = args.shape == "fsdp2"
    arrive = 0.0
    batch = 64 // micro  # accumulation splits the batch into micro-batches
    fault.scale = 1 / micro
    truth.write(
        {
            "fault": args.fault,
            "rank": args.fault_rank,
            "onset_step": args.onset_step,
            "ms": FAULT_MS[args.fault],
            "pid": os.getpid(),
            "tid": threading.get_native_id(),
            "shape": args.shape,
            "self": rank,
        }
    )
    gc.freeze()  # what is alive now stays (as big jobs do): a collection walks new objects only
    step = 0
    while args.steps <= 0 or step < args.steps:
        fault.step = step
        fault.injected_ms = 0.0
        q0 = runq_ns()
        BUCKETS.clear()
        t0 = time.time()
        for m in range(micro):
            x, y = load_batch(step, fault, batch, width)
            on_cpu_faults(fault)
            if micro > 1 and m < micro - 1:  # forward and backward without a collective
                with model.no_sync():  # type: ignore[operator]
                    (nn.functional.cross_entropy(model(x), y) / micro).backward()
                continue
            if fsdp:  # its first collective: the first layer's all-gather
                arrive = time.time()
            loss = nn.functional.cross_entropy(model(x), y) / micro
            if not fsdp:  # its first collective: the first bucket's all-reduce
                arrive = time.time()
            loss.backward()  # DDP all-reduces the gradients here (FSDP2: reduce-scatters)
        opt.step()
        opt.zero_grad()
        t1 = time.time()
        truth.write(
            {
                "rank": rank,
                "step": step,
                "t0": t0,
                "t1": t1,
                "t_arrive": arrive,
                "t_collective": BUCKETS.get(0),
                "t_last_collective": max(BUCKETS.values(), default=None),
                "injected_ms": round(fault.injected_ms, 3),
                "runq_ms": round((runq_ns() - q0) / 1e6, 3),
            }
        )
        step += 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--shape",
        default="ddp_buckets",
        choices=["ddp_buckets", "grad_accum", "thread_loop", "fsdp2"],
    )
    p.add_argument("--fault", default="healthy", choices=sorted(FAULT_MS))
    p.add_argument("--fault-rank", type=int, default=-1)
    p.add_argument("--onset-step", type=int, default=20)
    p.add_argument("--truth", default=os.environ.get("ACCURACY_TRUTH"))
    p.add_argument("--steps", type=int, default=0, help="0: until killed")
    args = p.parse_args()
    if not args.truth:
        p.error("--truth PATH (or $ACCURACY_TRUTH) is required")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.fault == "cpu_contention" and rank == args.fault_rank:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # alone with the busy process
    truth = Truth(args.truth, rank)
    fault = Fault(args, rank, truth)
    try:
        if args.shape == "thread_loop":
            t = threading.Thread(target=train, args=(args, rank, truth, fault), name="trainer")
            t.start()
            t.join()
        else:
            train(args, rank, truth, fault)
    finally:
        if fault.hog is not None:
            fault.hog.kill()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
