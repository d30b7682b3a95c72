"""The guest's life in the host: serve, hand the process to the engine, fork.

``start()`` opens ``<pid>.guest`` and hands the process to the node's engine
(``probing.node.service``, run by probing's own Python), starting the engine when
none answers: ``probing inject`` waits for its answer, a host starting up
(``PROBING=1``) does not. The engine then serves the pid's probe socket.
A guest injected from another mount namespace (a containerised agent,
``probing.inject.stage``) never starts an engine: probing's Python is a
path it cannot run; the injector starts it, and the guest waits for it.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import signal
import threading
import time

from . import flight, inside, outbox, place, wire

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

ENGINE_START_S = 20.0  # how long a guest waits for an engine it started
PR_SET_PTRACER = 0x59616D61
# what the engine takes from the host's environment: probing's settings
# (PROBING itself would start a guest in the engine), where to find things
KEEP_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "LOGNAME")


class Guest:
    """This process's guest: its socket (``serve``), its hand-over to the
    engine (``register``, waited for; ``announce``, not), its thread hook."""

    def __init__(
        self, engine_python: str, environ: dict[str, str] | None = None, spawn: bool = True
    ) -> None:
        self.engine_python = engine_python
        self.spawn = spawn  # False: the engine is started by whoever injected (elsewhere)
        self.environ = dict(os.environ if environ is None else environ)
        self.directory = place.user_dir(root=place.runtime_root(self.environ))
        # the engine of this environment's settings and of probing's Python
        self.key = place.engine_key(self.environ, engine_python)
        self.install = place.install(self.environ, engine_python)  # stated at the handshake
        self.pid = os.getpid()
        self.server: wire.Server | None = None
        self.engine: dict[str, Any] | None = None
        self.ptracer = 0  # the engine allowed to read this process (PR_SET_PTRACER)

    # -- serving ---------------------------------------------------------------------

    def routes(self) -> dict[str, Any]:
        return {
            "GET /info": lambda _: {**inside.info(), "threads": inside.threads()},
            "GET /threads": lambda _: inside.threads(),
            "GET /flight": lambda _: flight.flight(),
            "GET /distributed": lambda _: inside.distributed(),
            "POST /stacks": lambda a: inside.stacks(float(a.get("window_s", inside.WINDOW_S))),
            "POST /expr": lambda a: inside.expr(str(a["expr"])),
            "POST /eval": lambda a: inside.run(str(a["code"])),
            "POST /groups": lambda a: inside.groups([int(c) for c in a.get("comms", [])]),
            "POST /external": lambda _: outbox.take(),
            "POST /threads": self._hook_threads,
            "GET /engine": lambda _: {"key": self.key, "install": self.install},
        }

    def _hook_threads(self, args: dict[str, Any]) -> dict[str, Any]:
        """While traced: each new thread's state goes to the probe's socket
        (``POST /trace/thread``) as it starts; ``{"on": false}`` stops it."""
        if not args.get("on"):
            inside.unhook_threads()
            return {"hooked": False}
        probe = os.path.join(self.directory, f"{self.pid}.sock")

        def tell(tid: int, tstate: int) -> None:
            wire.request(probe, "POST", "/trace/thread", {"tid": tid, "tstate": tstate}, 5.0)

        inside.hook_threads(tell)
        return {"hooked": True}

    def serve(self) -> None:
        place.ensure_private_dir(self.directory)
        server = wire.Server(
            place.guest_path(self.pid, self.directory), self.routes(), self._caller
        )
        server.start()
        self.server = server

    def _caller(self, pid: int) -> None:
        """The engine asking (a ``probing.node.service`` process): let it read this
        process's memory where Yama allows only ancestors to, and watch it, so
        that a new one starts when it dies (once per engine). Only this
        guest's engine (the pid its lock names) is let in."""
        if pid != self.ptracer and pid > 0 and pid == place.engine_pid(self.directory, self.key):
            self.ptracer = pid
            _allow_ptrace(pid)
            self._watch(pid)

    def _watch(self, engine_pid: int) -> None:
        """A thread that waits (in ``poll``, not holding the GIL) for the engine
        to exit: then a new engine is started and this process handed to it
        again, unless the engine was stopped on purpose (``probing engine
        stop`` leaves ``engine-<key>.stopped``) or the host is exiting."""
        try:
            fd = os.pidfd_open(engine_pid)
        except OSError:  # gone already, or a kernel without pidfds: the next call tells
            return

        def wait() -> None:
            import select

            try:
                select.select([fd], [], [])
            finally:
                os.close(fd)
            if self.ptracer != engine_pid or self.server is None:
                return  # another engine serves us already, or the guest stopped
            stopped = place.engine_path(self.directory, self.key, "stopped")
            if os.path.exists(stopped) or not threading.main_thread().is_alive():
                return
            if not self.spawn:  # probing's Python is not ours to run: its agent attaches again
                _say(f"the node's engine (pid {engine_pid}) stopped; the agent that "
                     f"injected pid {self.pid} hands it to the next")  # fmt: skip
                return
            _say(f"the node's engine (pid {engine_pid}) stopped; starting a new one")
            try:
                self.register()
            except Exception as err:  # a daemon thread in the host: said, not raised
                _say(f"no new engine for pid {self.pid}: {err}")

        threading.Thread(target=wait, name="probing-guest-engine", daemon=True).start()

    def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.stop()

    # -- the engine ------------------------------------------------------------------

    def register(self, timeout: float = ENGINE_START_S) -> dict[str, Any]:
        """Hand this process to the node's engine, starting it if none answers;
        the engine's answer (its pid, the probe socket it serves)."""
        payload = self._payload()
        sock = place.engine_path(self.directory, self.key)
        try:
            answer = wire.request(sock, "POST", "/attach", payload, timeout=timeout)
        except wire.WireError as err:
            if err.status:
                raise
            if self.spawn:
                answer = self._start_engine(sock, payload, timeout)
            else:
                answer = self._wait_engine(sock, payload, timeout)
        self.engine = answer
        self._caller(int(answer.get("engine_pid", 0)))
        return answer

    def announce(self) -> None:
        """Hand this process to the engine without waiting for anything (a host
        starting up, which may never let go of the GIL again): the attach is
        sent to a running engine, else an engine is started, which finds this
        guest's socket itself (``Service.adopt``)."""
        payload = self._payload()
        try:
            wire.send(place.engine_path(self.directory, self.key), "POST", "/attach", payload)
            return
        except OSError:
            if not self.spawn:
                return  # the engine is started by whoever injected us, and finds our socket
        pid = self._spawn_engine()
        threading.Thread(target=os.waitpid, args=(pid, 0), name="probing-guest-reap",
                         daemon=True).start()  # fmt: skip

    def query(self, sql: str, timeout: float = 60.0) -> list[dict[str, Any]]:
        """``sql`` run by the engine over this process's tables, asked on the
        socket it serves for this pid (``POST /query``, as ``probing query
        --pid`` asks): the rows as a list of dicts, column name to value.
        The engine is handed this process first if it was only announced.
        WireError for the engine's refusal (its ``kind``: QueryError, ...)."""
        engine = self.engine if self.engine is not None else self.register()
        probe = str(engine.get("socket") or os.path.join(self.directory, f"{self.pid}.sock"))
        payload = {"sql": sql, "format": "json"}
        rows = wire.request(probe, "POST", "/query", payload, timeout=timeout)
        return list(rows)

    def _payload(self) -> dict[str, Any]:
        """The handshake: this pid, its guest's socket, this install of probing."""
        guest = place.guest_path(self.pid, self.directory)
        return {"pid": self.pid, "guest": guest, "install": self.install}

    def _spawn_engine(self) -> int:
        """The engine, started by probing's Python; it forks itself away and
        exits at once (reap the pid returned)."""
        # the engine starts with no signal blocked and the usual dispositions,
        # whatever the job's thread that starts it blocks or ignores (else
        # SIGTERM would never stop it)
        return os.posix_spawn(
            self.engine_python,
            [self.engine_python, "-m", "probing.node.service", "--daemon"],
            self._engine_env(),
            setsigmask=(),
            setsigdef=(signal.SIGTERM, signal.SIGINT, signal.SIGHUP),
        )

    def _start_engine(self, sock: str, payload: dict[str, Any], timeout: float) -> Any:
        # one guest of the node starts it; the others wait on the lock, then find
        # it. A POSIX record lock (lockf): a child forked meanwhile does not hold it
        deadline = time.monotonic() + timeout
        fd = os.open(
            place.engine_path(self.directory, self.key, "start"),
            os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
            0o600,
        )
        try:
            while True:
                try:
                    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise wire.WireError(0, "another guest is starting the engine") from None
                    time.sleep(0.02)
            try:
                return wire.request(sock, "POST", "/attach", payload, timeout=timeout)
            except wire.WireError as err:
                if err.status:
                    raise
            os.waitpid(self._spawn_engine(), 0)
            while True:
                try:
                    return wire.request(sock, "POST", "/attach", payload, timeout=timeout)
                except wire.WireError as err:
                    if err.status or time.monotonic() > deadline:
                        raise
                time.sleep(0.02)
        finally:
            os.close(fd)

    def _wait_engine(self, sock: str, payload: dict[str, Any], timeout: float) -> Any:
        """The engine's answer, once the injector that started it has it serve."""
        deadline = time.monotonic() + timeout
        while True:
            time.sleep(0.02)
            try:
                return wire.request(sock, "POST", "/attach", payload, timeout=timeout)
            except wire.WireError as err:
                if err.status or time.monotonic() > deadline:
                    raise

    def _engine_env(self) -> dict[str, str]:
        env = {k: v for k, v in self.environ.items() if k in KEEP_ENV}
        env.update(place.ENGINE_ALLOCATOR)
        env.update(place.engine_settings(self.environ))
        return env


def _allow_ptrace(engine_pid: int) -> None:
    """Let the engine read this process's memory where Yama allows only
    ancestors to (``ptrace_scope`` 1): it reads Python stacks from outside."""
    if engine_pid <= 0:
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(engine_pid), 0, 0, 0)
    except (OSError, AttributeError):
        pass


_guest: Guest | None = None
_lock = threading.Lock()


def current() -> Guest | None:
    return _guest


def start(engine_python: str, *, wait: bool = True, spawn: bool = True) -> Guest:
    """The guest of this process, serving (idempotent); registered with the
    engine now (``wait``: the engine's answer is in ``guest.engine``) or
    announced to it without waiting (a host starting up). ``spawn``: False
    where the engine is started by the injector (``Guest.spawn``)."""
    global _guest
    with _lock:
        guest = _guest
        fresh = guest is None or guest.server is None
        if fresh:
            guest = Guest(engine_python, spawn=spawn)
            guest.serve()
            _guest = guest
    assert guest is not None
    if fresh:
        atexit.register(guest.stop)
    if wait:  # an engine that went meanwhile is started again; attaching twice is a no-op
        guest.register()
    elif fresh:
        guest.announce()
    return guest


def _after_fork_in_child() -> None:
    """A forked child gets no probe (its parent's socket stays the parent's),
    or its own with ``PROBING_FORK=child``."""
    global _guest, _lock
    _lock = threading.Lock()
    parent, _guest = _guest, None
    if parent is None or parent.server is None:
        return
    parent.server.abandon()
    if os.environ.get("PROBING_FORK", "").strip().lower() == "child":
        try:
            start(parent.engine_python, wait=False, spawn=parent.spawn)
        except Exception as err:  # a fork handler in the host's child
            _say(f"no probe in forked child {os.getpid()}: {err}")


def _say(msg: str) -> None:
    import sys

    try:
        print(f"probing: {msg}", file=sys.stderr)
    except (OSError, ValueError, AttributeError):
        pass


os.register_at_fork(after_in_child=_after_fork_in_child)
