"""``probing agent``: the node's watcher, run as a service in the foreground.

Every ``every_s`` it looks at the node's Python processes and attaches to
the training processes its policy matches, with no ``PROBING=1`` and no
``probing inject`` typed: the same probe as ``inject`` (each process's
guest hands it to its user's engine), traced as the policy says (the
collectives by default), which turns the job's always-on watch on. A
process whose environment says ``PROBING=0`` is never touched, nor one the
policy does not match.

The policy (``Policy``): a process whose environment carries a launcher's
variables (torchrun's ``TORCHELASTIC_RUN_ID``, ``MASTER_PORT`` with
``RANK``, Slurm's ``SLURM_PROCID``, Open MPI's ``OMPI_COMM_WORLD_RANK``,
PMIx's ``PMIX_RANK``, MPICH's ``PMI_RANK``), or whose command line matches
a pattern, or which runs in a cgroup whose path holds a given text; never
a launcher itself (torchrun's agent, ``deepspeed``, ``accelerate``).

It serves ``GET /health`` (what it attached, what failed and why) and
``GET /metrics`` (OpenMetrics: its own counters, and every probe's metrics
on the node with ``pid`` and ``job`` labels) on ``127.0.0.1:<port>``,
read-only. It logs to stderr, one line an event. SIGTERM stops it; the
engines and their probes go on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psutil

from probing.guest import place, wire

DEFAULT_PORT = 9978  # outside the ephemeral range, away from torchrun's 29500
LAUNCHER_RANKS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
LAUNCHERS = re.compile(
    r"(^|/)(torchrun|deepspeed|accelerate|srun|mpirun|mpiexec)$|torch\.distributed\.(run|launch)"
    r"|deepspeed\.launcher"
)
RETRIES = 3  # attempts at a process before it is left alone (each said in /health)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which processes the agent attaches to, and what it traces in them."""

    launchers: bool = True  # a launcher's variables in the environment
    pattern: str = ""  # a regular expression the command line matches
    cgroup: str = ""  # a text the process's cgroup path holds
    families: tuple[str, ...] = ("gloo", "nccl")  # traced once attached
    attach: bool = True  # False: watch and serve, attach nothing
    require: tuple[tuple[str, str], ...] = ()  # variables a process must carry, with these values

    def why(self, environ: Mapping[str, str], argv: list[str], cgroup: str) -> str:
        """Why a process matches ("" where it does not, or opts out)."""
        if environ.get("PROBING", "").strip().lower() in ("0", "false", "no", "off"):
            return ""
        if any(environ.get(name) != value for name, value in self.require):
            return ""
        if any(LAUNCHERS.search(a) for a in argv[:3]):
            return ""  # the launcher: its ranks are the job
        if self.launchers:
            if environ.get("TORCHELASTIC_RUN_ID"):
                return "TORCHELASTIC_RUN_ID"
            if environ.get("MASTER_PORT") and environ.get("RANK"):
                return "MASTER_PORT and RANK"
            for name in LAUNCHER_RANKS:
                if environ.get(name):
                    return name
        if self.pattern and re.search(self.pattern, " ".join(argv)):
            return f"command line ~ {self.pattern}"
        if self.cgroup and self.cgroup in cgroup:
            return f"cgroup ~ {self.cgroup}"
        return ""


@dataclasses.dataclass
class Attached:
    pid: int
    why: str
    job: str  # what its launcher names the job by (run id, Slurm job, master port)
    started_s: float  # the process's age when the agent saw it
    attached_s: float  # seconds from seeing it to tracing
    state: str  # "tracing", or "failed: <reason>"
    tries: int = 1


class Agent:
    """The watcher: scan, attach, serve its health and the node's metrics."""

    def __init__(self, policy: Policy, every_s: float = 2.0) -> None:
        self.policy = policy
        self.every_s = every_s
        self.seen: dict[int, Attached] = {}
        self.scans = 0
        self.failures = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        while not self._stop.is_set():
            try:
                self.scan()
            except Exception as err:  # noqa: BLE001 - a service's loop: said, and on
                _say(f"scan failed: {type(err).__name__}: {err}")
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()

    def scan(self) -> list[Attached]:
        """One look at the node: attach to what matches and is new; what was attached."""
        self.scans += 1
        new = []
        for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
            pid = proc.info["pid"]
            with self._lock:
                known = self.seen.get(pid)
            if pid == os.getpid() or (known is not None and not _retry(known)):
                continue
            argv = proc.info.get("cmdline") or []
            if not argv or "python" not in os.path.basename(argv[0]):
                continue
            environ = _environ(pid)
            why = self.policy.why(environ, argv, _cgroup(pid)) if environ else ""
            if not why or not self.policy.attach:
                continue
            age = max(0.0, time.time() - (proc.info.get("create_time") or time.time()))
            got = self._attach(pid, why, _job(environ), age)
            if known is not None:
                got.tries = known.tries + 1
            with self._lock:
                self.seen[pid] = got
            new.append(got)
        with self._lock:  # processes gone: forgotten
            for pid in [p for p in self.seen if not psutil.pid_exists(p)]:
                del self.seen[pid]
        return new

    def _attach(self, pid: int, why: str, job: str, age: float) -> Attached:
        from probing.errors import ProbingError
        from probing.inject.injector import inject

        t0 = time.monotonic()
        try:
            result = inject(pid)
            traced = {"families": list(self.policy.families)}
            sock = result.socket or _socket(pid)
            answer = wire.request(sock, "POST", "/trace/start", traced, timeout=120)
            state = str(answer.get("state", "tracing"))
        except (ProbingError, wire.WireError, OSError) as err:
            self.failures += 1
            state = f"failed: {err}"
        took = time.monotonic() - t0
        _say(f"pid {pid} ({why}; job {job}): {state} in {took:.1f} s")
        return Attached(pid, why, job, round(age, 2), round(took, 2), state)

    # -- what it serves -----------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        with self._lock:
            seen = [dataclasses.asdict(a) for a in self.seen.values()]
        return {
            "ok": True,
            "pid": os.getpid(),
            "install": place.install(),
            "policy": dataclasses.asdict(self.policy),
            "scans": self.scans,
            "failures": self.failures,
            "processes": seen,
        }

    def metrics(self) -> str:
        """OpenMetrics: the agent's counters, then every attached probe's
        metrics, each sample labelled with its process and job."""
        with self._lock:
            seen = list(self.seen.values())
        families: dict[str, list[str]] = {}
        heads: dict[str, list[str]] = {}
        for a in seen:
            if a.state != "tracing":
                continue
            try:
                text = _probe_metrics(a.pid)
            except (OSError, wire.WireError):
                continue
            _merge(text, {"pid": str(a.pid), "job": a.job}, heads, families)
        tracing = sum(1 for a in seen if a.state == "tracing")
        out = [
            "# TYPE probing_agent_attached gauge",
            "# HELP probing_agent_attached processes this agent attached to and traces",
            f"probing_agent_attached {tracing}",
            "# TYPE probing_agent_attach_failures counter",
            "# HELP probing_agent_attach_failures attaches that failed (GET /health says why)",
            f"probing_agent_attach_failures_total {self.failures}",
        ]
        for name, lines in families.items():
            out += heads.get(name, []) + lines
        return "\n".join([*out, "# EOF"]) + "\n"


def _retry(known: Attached) -> bool:
    return known.state.startswith("failed") and known.tries < RETRIES


def _environ(pid: int) -> dict[str, str]:
    from probing.target import proc_environ

    return proc_environ(pid) or {}


def _cgroup(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f.read()
    except OSError:
        return ""


def _job(environ: Mapping[str, str]) -> str:
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE"):
        if environ.get(name):
            return f"{name.lower()}={environ[name]}"
    port = environ.get("MASTER_PORT")
    return f"master_port={port}" if port else "?"


def _socket(pid: int) -> str:
    from probing import paths

    found = paths.find_socket(pid)
    if found is None:
        raise wire.WireError(0, f"pid {pid} has no probe socket after its injection")
    return found


def _probe_metrics(pid: int) -> str:
    """One probe's ``GET /metrics`` over its unix socket (not JSON)."""
    import socket

    from probing.node.probe import http

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    try:
        sock.connect(_socket(pid))
        answer = http.exchange(sock, http.request_bytes("/metrics", b"", None, "GET"))
    finally:
        sock.close()
    if answer.status != 200:
        raise wire.WireError(answer.status, f"pid {pid}: /metrics answered {answer.status}")
    return answer.body.decode()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(.*)$")


def _merge(
    text: str, labels: dict[str, str], heads: dict[str, list[str]], out: dict[str, list[str]]
) -> None:
    """Add ``text``'s samples to ``out`` (by family), each with ``labels``."""
    family = ""
    extra = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("# TYPE ") or line.startswith("# HELP "):
            family = line.split()[2]
            heads.setdefault(family, [])
            if line not in heads[family]:
                heads[family].append(line)
            out.setdefault(family, [])
            continue
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        inner = f"{m.group(3)},{extra}" if m.group(3) else extra
        out.setdefault(family or m.group(1), []).append(f"{m.group(1)}{{{inner}}} {m.group(4)}")


def serve(agent: Agent, host: str, port: int) -> ThreadingHTTPServer:
    """``GET /health`` and ``GET /metrics``, read-only, in a thread of its own."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/health":
                body, ctype = json.dumps(agent.health()).encode(), "application/json"
            elif self.path == "/metrics":
                body = agent.metrics().encode()
                ctype = "application/openmetrics-text; version=1.0.0; charset=utf-8"
            else:
                self.send_error(404, "GET /health or GET /metrics")
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # scrapes are not events
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="probing-agent-http", daemon=True).start()
    return server


def main(policy: Policy, *, every_s: float, host: str, port: int) -> None:
    """Run the agent until SIGTERM or SIGINT."""
    agent = Agent(policy, every_s)
    server = serve(agent, host, port)
    what = f"{'on' if policy.attach else 'off'} ({', '.join(policy.families)})"
    _say(
        f"serving GET /health and /metrics on {host}:{server.server_address[1]}; attaching: {what}"
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop())
    try:
        agent.run()
    finally:
        server.shutdown()
        _say("stopped")


def _say(msg: str) -> None:
    print(f"probing agent {os.getpid()}: {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr,
          flush=True)  # fmt: skip
