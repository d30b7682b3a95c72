"""The node's BPF programs compiled before the first trace needs them, and a
wait for a compile said as such.

BCC compiles each family's program at run time: 3-5 s of clang per program
on an idle node, about 30 s under load, where the first ``probing trace`` of
a node timed out ("did not answer in 30 s") while tracing did start. So an
engine, when it starts, and the agent, when it starts, compile and load-test
the programs a trace loads (``warm_up``), in a child process of their own
(``python -m probing.node.service.warm``): it starts a trace of itself with
the tracer a job's trace uses (the families, their Python stacks for this
Python, the sampler: the same flags, so the same entries of the node's
compile cache), which loads each program into the kernel, then stops. The
child, not a thread: that trace hooks its process's threads, and the engine
serves jobs meanwhile. A marker beside the compiled programs (``marker``)
says it was done for these sources, flags, kernel, BCC and Python: the
next engine starts no child at all.

A job of another Python version than probing's still compiles at its first
trace (its stacks' offsets are other flags). A command that meets a compile
then says so and waits for it (``wait_out``), however long it takes:
``compiling`` sees the engine (or its warm-up child) holding one of the
compile cache's lock files open (``probing.node.bpf.loader.obtain`` holds
one for as long as it compiles, and a process waiting for another's
compile holds it open too).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import psutil

from probing import config, proc

# what a first ``probing trace`` loads by default (its --nccl, --cuda, --gloo);
# the agent warms what it traces (PROBING_AGENT_FAMILIES)
FAMILIES = ("nccl", "cuda", "gloo")
# a compile cache's lock file, held open while its program compiles: <name>-<key>.json.lock
LOCK_FILE = re.compile(r"/[A-Za-z0-9_]+-[0-9a-f]{32}\.json\.lock$")
# the one program of a family that is no uprobe handler (bpf/preamble.c): a raw
# tracepoint that sends staged events at a CPU switch (drain.Live.flush_on_switch)
FLUSH_PROGRAM = "probing_flush"
POLL_S = 0.5  # how often a waiting command looks whether the compile goes on
WAITING = "probing: waiting for the BPF programs to compile (first trace on this node) ..."

T = TypeVar("T")


# -- compiling ahead ----------------------------------------------------------------------


def marker(families: Sequence[str]) -> str:
    """The file that says this warm-up was done: in the compile cache, named
    after what the compiled programs depend on (``loader.cache_key``: every
    BPF source and header, the kernel, BCC) with the families, this Python,
    the sampling rate and this install (whose code sets the flags)."""
    from probing.guest import place
    from probing.node.bpf import loader

    flags = [
        f"python={sys.version_info[0]}.{sys.version_info[1]}",
        f"sample_hz={config.load().sample_hz}",
        place.install(),
    ]
    key = loader.cache_key("warm", ",".join(families), flags)
    return os.path.join(loader.cache_dir(), f"warm-{key}")


class WarmUp:
    """The warm-up child of an engine or the agent, waited for by a thread;
    ``stop`` ends it with its parent (what it compiled is kept: each program
    goes into the cache whole, and an unfinished one is compiled again)."""

    def __init__(self, families: Sequence[str], say: Callable[[str], None]) -> None:
        self.families = list(families)
        self.say = say
        self.child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self.thread = threading.Thread(target=self._run, name="probing-bpf-warm", daemon=True)

    def _run(self) -> None:
        env = dict(os.environ, PROBING="0")  # the child is no job's process: no probe in it
        cmd = [sys.executable, "-m", "probing.node.service.warm", ",".join(self.families)]
        with self._lock:
            if self._stopped:
                return
            try:
                self.child = subprocess.Popen(
                    cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
                )
            except OSError as err:
                self.say(f"BPF programs not compiled ahead: {err}")
                return
        code = self.child.wait()
        if code and not self._stopped:  # it says why itself; a crash's traceback is above
            self.say(f"the BPF warm-up (pid {self.child.pid}) exited with status {code}")

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            child = self.child
        if child is not None and child.poll() is None:
            child.terminate()


def warm_up(families: Sequence[str], say: Callable[[str], None]) -> WarmUp | None:
    """Compile and load-test ``families``' programs in a child process, waited
    for by a thread (None where there is nothing to do: no BPF for this
    process, or done already). The child's lines go to our stderr."""
    from probing import checks
    from probing.errors import ProbingError

    if not checks.check_bpf_caps().ok:
        return None  # no trace can load a program here either
    try:
        done = marker(families)
    except (ProbingError, OSError):  # no BCC: `probing doctor` says what to install
        return None
    if os.path.exists(done):
        return None
    warming = WarmUp(families, say)
    warming.thread.start()
    return warming


def warm(families: Sequence[str]) -> str:
    """In the child: trace this process with ``families`` (compiled, or read
    from the cache; loaded into the kernel), stop, leave the marker; what
    happened, in words."""
    from probing.node.bpf.tracer import Tracer
    from probing.node.store import Store

    t0 = time.monotonic()
    tracer = Tracer(list(families), store=Store())
    tracer.start()
    try:
        cached = dict(tracer.load_info.get("cached", {}))
        sampler = getattr(tracer, "sampler", None)
        problem = tracer.last_error or _load_all(tracer._drainer.programs())
    finally:
        tracer.stop()
    compiled = sorted(name for name, hit in cached.items() if not hit)
    if sampler is not None and not sampler.cached:
        compiled.append("sampler")
    took = time.monotonic() - t0
    if problem:  # a part the first trace would miss too (sampling, stacks): said, no marker
        return f"BPF programs loaded in {took:.1f} s, but: {problem}"
    path = marker(families)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "w"):
        pass
    what = f"compiled {', '.join(compiled)}" if compiled else "all from the node's cache"
    return f"BPF programs ready for {', '.join(families)} in {took:.1f} s ({what}; load-tested)"


def _load_all(programs: Sequence[Any]) -> str | None:
    """Every handler of each family loaded into the kernel (the verifier's
    word on each), not only those a library of this process gave a place
    to attach (none: the child maps no NCCL, CUDA nor torch); what failed."""
    from probing.errors import ProbingError

    for program in programs:
        for name in program.compiled.programs:
            if name == FLUSH_PROGRAM:  # a raw tracepoint, loaded as one by the tracer already
                continue
            try:
                program.prog_fd(name)  # a uprobe handler: the loader's default type
            except (ProbingError, OSError) as err:  # kernel.BPFError is an OSError
                return f"the kernel refused {name}: {err}"
    return None


# -- a command that meets a compile ------------------------------------------------------


def compiling(pid: int | None) -> bool:
    """Whether ``pid`` (an engine) or a process it started (its warm-up)
    holds a compile lock of the BPF cache open: it compiles a program, or
    waits for another process's compile of it."""
    if pid is None:
        return False
    try:
        family = [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:  # gone
        return False
    for p in family:
        try:
            fds = os.listdir(proc.path(p, "fd"))
        except OSError:
            continue
        for fd in fds:
            try:
                if LOCK_FILE.search(proc.readlink(p, f"fd/{fd}")):
                    return True
            except OSError:
                continue
    return False


def wait_out(
    call: Callable[[], T], engine: int | None, quiet_s: float, say: Callable[[str], None]
) -> T:
    """``call()``'s answer (it runs in a thread: give it no timeout of its
    own), waited for as long as ``engine`` compiles BPF programs (said once,
    with ``WAITING``), and ``quiet_s`` more: a wait of ``quiet_s`` with no
    compile in it raises ``TimeoutError``."""
    got: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            got.append(call())
        except BaseException as err:  # raised again on the caller's thread
            failed.append(err)

    thread = threading.Thread(target=run, name="probing-answer", daemon=True)
    thread.start()
    t0 = last = time.monotonic()
    said = False
    while thread.is_alive():
        thread.join(POLL_S)
        if not thread.is_alive():
            break
        if compiling(engine):
            if not said:
                say(WAITING)
                said = True
            last = time.monotonic()
        elif time.monotonic() - last > quiet_s:
            raise TimeoutError(f"no answer in {quiet_s:g} s")
    if said:
        say(f"probing: the BPF programs are compiled ({time.monotonic() - t0:.0f} s)")
    if failed:
        raise failed[0]
    return got[0]


def main(argv: list[str] | None = None) -> None:
    """``python -m probing.node.service.warm [families]``: ``warm``, its line on stderr."""
    from probing.errors import ProbingError

    args = sys.argv[1:] if argv is None else argv
    families = [f for f in (args[0] if args else ",".join(FAMILIES)).split(",") if f]
    try:
        said = warm(families)
    except ProbingError as err:  # no BPF, BCC missing, a compile refused: the trace says it too
        said = f"BPF programs not compiled ahead: {err}"
    print(f"probing warm-up {os.getpid()}: {time.strftime('%H:%M:%S')} {said}", file=sys.stderr,
          flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
